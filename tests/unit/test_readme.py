"""README.md, the front door, kept true: at most 200 lines, every link resolves, every code block
runs or parses as written, its layout names what is there, and its "Measured" table is the one
`make bench-readme` wrote (benchmarks/results/readme.md). docs/index.md's links and pages too."""

from __future__ import annotations

import pathlib
import re
import shlex
import socket

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _blocks(kind: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == kind]


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _broken_links(page: pathlib.Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+://", target):
            continue  # no network here: an absolute URL is not checked
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no such file or folder")
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", where.read_text(), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(f"{target}: {where.name} has no heading #{anchor}")
    return broken


def test_the_readme_is_at_most_200_lines():
    lines = README.read_text().count("\n")
    assert lines <= 200, f"README.md has {lines} lines; details belong in docs/"


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_every_link_resolves(page):
    broken = _broken_links(ROOT / page)
    assert not broken, f"{page}: " + "; ".join(broken)


def test_the_index_lists_every_page_of_docs():
    text = (ROOT / "docs" / "index.md").read_text()
    pages = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "index.md"]
    missing = [name for name in pages if f"({name})" not in text]
    assert not missing, f"docs/index.md does not list {missing}"


def _commands() -> list[str]:
    out = []
    for body in _blocks("bash"):
        for line in body.splitlines():
            command = line.split("  #")[0].split(" # ")[0].strip()
            if command:
                out.append(command)
    return out


def test_every_shell_command_parses_as_written():
    """`make X`: the Makefile has the target; `pip install -e .`: from the checkout; `thinwire
    ...`: the command line accepts the options, and every method spec in them resolves."""
    from thinwire.algorithms.methods import method_names, resolve_method
    from thinwire.cli import _parser
    from thinwire.lab.compare import split_methods

    makefile = (ROOT / "Makefile").read_text()
    seen = set()
    for command in _commands():
        words = shlex.split(command)
        seen.add(words[0])
        if words[0] == "make":
            for target in words[1:]:
                if "=" not in target:
                    assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"{command}: no make target {target}"
        elif words[:3] == ["pip", "install", "-e"]:
            assert words[3] == "." and (ROOT / "pyproject.toml").exists(), command
        else:
            assert words[0] == "thinwire", f"{command}: a command the README test does not know"
            args = _parser().parse_args(words[1:])
            for spec in [*(split_methods(args.methods) if getattr(args, "methods", None) else []),
                         *([args.method] if getattr(args, "method", None) else [])]:
                resolve_method(spec)
            for name in getattr(args, "names", []) or []:
                assert name in method_names(), f"{command}: no method {name}"
    assert {"make", "pip", "thinwire"} <= seen


def test_the_install_extras_exist():
    text = README.read_text()
    extras = set(re.findall(r"\.\[(\w+)\]", text))
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert extras and all(re.search(rf"^{e} = \[", pyproject, re.M) for e in extras), extras


@pytest.fixture
def one_rank_group(monkeypatch):
    """A real gloo group of one rank in this process, for the README's `init_process_group`."""
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _loader(steps: int = 40):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        yield x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def test_the_loop_block_runs_and_trains(one_rank_group):
    """The `thinwire.attach` block as written, with a small net and 40 batches of a learnable rule."""
    loop = next(b for b in _blocks("python") if "thinwire.attach" in b)
    scope: dict = {"MyNet": _net, "loader": _loader()}
    exec(compile(loop, "README.md", "exec"), scope)  # noqa: S102
    run = scope["run"]
    assert run.method.step == 40 and scope["loss"].item() < 1.0


def test_the_ddp_block_registers_the_hook(one_rank_group):
    import torch.distributed as dist

    import thinwire

    block = next(b for b in _blocks("python") if "thinwire.ddp.register" in b)
    dist.init_process_group("gloo")
    scope: dict = {"torch": torch, "thinwire": thinwire, "model": _net()}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102
    model = scope["model"]
    x, y = next(_loader())
    torch.nn.functional.cross_entropy(model(x), y).backward()
    hook = scope["hook"]
    assert hook.step == 1 and hook.aggregators  # the backward pass went through thinwire's PowerSGD buckets


def test_the_lightning_block_builds_the_strategy():
    import lightning

    import thinwire.lightning
    from thinwire.lightning import ThinwireStrategy

    block = next(b for b in _blocks("python") if "thinwire.lightning.strategy" in b)
    scope: dict = {"lightning": lightning, "thinwire": thinwire}
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102
    assert isinstance(scope["trainer"].strategy, ThinwireStrategy)


def test_the_layout_names_what_is_there():
    block = next(b for b in FENCE.findall(README.read_text()) if b[1].startswith("src/thinwire/"))[1]
    names = [line.split()[0] for line in block.splitlines()[1:] if line.strip()]
    missing = [n for n in names if not (ROOT / "src" / "thinwire" / n).exists()]
    assert names and not missing, f"README's layout names {missing}, which src/thinwire/ does not have"


def _table(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.startswith("|")]


def test_the_measured_table_is_what_bench_readme_wrote():
    text = README.read_text()
    start, end = "<!-- measured: benchmarks/results/readme.md -->", "<!-- end measured -->"
    shown = _table(text[text.index(start) + len(start) : text.index(end)])
    written = _table((ROOT / "benchmarks" / "results" / "readme.md").read_text())
    assert shown and shown == written, "README's Measured table differs from benchmarks/results/readme.md: copy it"

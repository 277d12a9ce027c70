"""The import layers of docs/design.md, checked on the source: every ``thinwire`` import (module
level or inside a function, absolute or relative, ``importlib.import_module`` of a literal
name too) goes to the importer's own layer or a lower one, every top-level module of the
package has a layer, and no module imports itself through others (no cycle, inside a layer
either; an import under ``if TYPE_CHECKING:`` counts too).

(That codecs never import ``torch.distributed`` is checked in tests/unit/test_aggregate.py.)
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "thinwire"

# Top to bottom: a module may import its own layer and the layers below it. The names are the
# top-level modules and packages of thinwire/ ("__init__" is the package root, `thinwire`).
LAYERS: list[set[str]] = [
    {"cli", "__main__"},
    {"lab"},  # the harness: races, predictions, benchmarks, suites; nothing below imports it
    {"__init__", "lightning", "accelerate"},
    {"run", "tasks"},
    {"algorithms", "integrations", "optim", "elastic", "peers"},
    {"aggregate", "hierarchical", "scatter", "policy", "nn"},
    {"buckets", "feedback", "codecs", "comm", "topology", "figures"},
    {"numerics"},
    {"payload", "knobs", "registry", "timing", "version", "jsonfile"},  # leaves: they import no thinwire module
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
NOT_MODULES = {"py.typed"}  # files under thinwire/ that are not Python modules


def _module_name(path: pathlib.Path) -> tuple[str, bool]:
    """(dotted name, is a package's __init__) of a source file."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _top(dotted: str) -> str:
    """The layer name of a ``thinwire...`` module: its first component under the package."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(dotted: str) -> bool:
    path = SRC.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: pathlib.Path, text: str | None = None) -> list[tuple[int, str, str]]:
    """(line, imported thinwire module, the statement as written) for every import in ``path``
    (or in ``text``, read as the module at ``path``)."""
    name, is_package = _module_name(path)
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "thinwire":
                    found.append((node.lineno, alias.name, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importer's package, one level up per extra dot
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "thinwire":
                continue
            text = f"from {'.' * node.level}{node.module or ''} import "
            for alias in node.names:  # `from thinwire import payload` imports thinwire.payload
                sub = f"{module}.{alias.name}"
                found.append((node.lineno, sub if _is_module(sub) else module, text + alias.name))
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            module = _literal_module(node.args[0])
            if module.split(".")[0] == "thinwire":
                found.append((node.lineno, module, f"{ast.unparse(node.func)}({ast.unparse(node.args[0])})"))
    return found


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))


def _literal_module(arg: ast.expr) -> str:
    """The module a string literal names; for an f-string, the complete components of its
    constant head (``f"thinwire.codecs.{name}"``: ``thinwire.codecs``), "" when that does not
    reach below the package; "" for anything else (a name computed at run time)."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value).rpartition(".")[0]
        return head if "." in head else ""
    return ""


def _sources() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_top_level_module_has_a_layer():
    missing = []
    for entry in sorted(PACKAGE.iterdir()):
        name = entry.name.removesuffix(".py")
        if entry.name in NOT_MODULES or entry.name == "__pycache__" or entry.name.startswith("."):
            continue
        if entry.is_dir() and not (entry / "__init__.py").exists() and not any(entry.rglob("*.py")):
            continue  # a folder without Python code (data, leftovers)
        if name not in LAYER:
            missing.append(f"module thinwire.{name} ({entry.relative_to(SRC.parent)}) has no layer in docs/design.md")
    assert not missing, "\n".join(missing)


def test_the_layers_are_the_ones_docs_design_states():
    """The docs' sentence names the same layers in the same order (knobs, registry, timing and
    version, leaves shared by every layer, sit at the bottom with payload; cli's layer holds
    the package root and __main__)."""
    text = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    start = text.index("Import layers (top may import below, never the reverse):")
    sentence = " ".join(text[start:text.index(".", text.index("`payload`", start))].split())
    stated = [{n.strip(" `,") for n in part.split(",") if n.strip(" `,")}
              for part in sentence.split(":", 1)[1].split("→")]
    extra = {"__main__", "__init__", "knobs", "registry", "timing", "version"}  # the docs may name these or not
    assert len(stated) == len(LAYERS), sentence
    for names, ours in zip(stated, LAYERS):
        assert ours - extra <= names <= ours, f"docs: {sorted(names)}, this test: {sorted(ours)}; {sentence}"


def test_imports_go_down_the_layers_only():
    violations, unknown = [], set()
    for path in _sources():
        importer, _ = _module_name(path)
        src = _top(importer)
        if src not in LAYER:
            unknown.add(src)
            continue
        for line, target, text in _imports(path):
            dst = _top(target)
            if dst not in LAYER:
                unknown.add(dst)
            elif LAYER[dst] < LAYER[src]:
                violations.append(f"{path.relative_to(SRC.parent)}:{line}: {importer} (layer {LAYER[src]}, {src}) "
                                  f"imports {target} (layer {LAYER[dst]}, {dst}): `{text}`")
    problems = [f"module thinwire.{u} has no layer in docs/design.md" for u in sorted(unknown)] + violations
    assert not problems, (f"{len(violations)} import(s) against the layers of docs/design.md, "
                          f"{len(unknown)} module(s) without a layer:\n" + "\n".join(problems))


def test_the_checker_sees_every_kind_of_import():
    """The parser on a made-up module: absolute, relative, function-level, `from thinwire import`
    of a submodule and of a name, and import_module of a literal and of an f-string."""
    code = (
        "import thinwire.run.trainer\n"
        "from thinwire import payload, __version__\n"
        "from ..aggregate import Aggregator\n"
        "from . import base\n"
        "def f(name):\n"
        "    from thinwire.cli import main\n"
        "    import importlib\n"
        "    importlib.import_module('thinwire.policy')\n"
        "    importlib.import_module(f'thinwire.codecs.{name}')\n"
        "    importlib.import_module(f'thinwire.{name}')\n"  # below the package: cannot tell, not counted
    )
    found = sorted((line, target) for line, target, _ in _imports(PACKAGE / "codecs" / "probe.py", code))
    assert found == [
        (1, "thinwire.run.trainer"), (2, "thinwire"), (2, "thinwire.payload"), (3, "thinwire.aggregate"),
        (4, "thinwire.codecs.base"), (6, "thinwire.cli"), (8, "thinwire.policy"), (9, "thinwire.codecs"),
    ]
    assert [_top(t) for _, t in found] == ["run", "__init__", "payload", "aggregate", "codecs", "cli", "policy",
                                           "codecs"]


def _graph() -> dict[str, set[str]]:
    """Module -> the thinwire modules it imports (itself left out)."""
    graph: dict[str, set[str]] = {}
    for path in _sources():
        name, _ = _module_name(path)
        graph.setdefault(name, set()).update(t for _, t, _ in _imports(path) if t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_through_others():
    graph = _graph()
    cycles = _cycles(graph)
    lines = [" <-> ".join(c) + ": " + "; ".join(f"{a} imports {', '.join(sorted(graph[a] & set(c)))}" for a in c)
             for c in cycles]
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(lines)


def test_the_cycle_finder_finds_cycles_and_only_them():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set(), "f": {"g"}, "g": {"f"}}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["f", "g"]]
    assert _cycles({"x": {"y"}, "y": set()}) == []


def test_the_lab_is_imported_by_the_command_line_only():
    """The library runs without its harness: only ``thinwire.cli`` (and the lab itself) imports
    ``thinwire.lab``."""
    outside = [f"{name} imports {t}" for name, targets in _graph().items() for t in sorted(targets)
               if _top(t) == "lab" and _top(name) not in ("lab", "cli")]
    assert not outside, "\n".join(outside)

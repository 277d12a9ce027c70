"""`thinwire train` end to end (spawned gloo ranks), bad input, and a killed rank."""

import csv
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from spawn import children
from thinwire.cli import main

SUMMARY_KEYS = {
    "task", "method", "workers", "steps", "final_loss", "final_accuracy", "bytes_sent_per_worker",
    "fp32_bytes_per_worker", "compression_ratio", "wall_seconds", "compute_seconds", "codec_seconds",
    "comm_seconds", "modeled_seconds", "config", "version",
}


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``thinwire ARGS`` in this process (its ranks start from this process's fork server, as a
    command's do from its own): the exit status and what the command printed."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's own exits (--help, --version, a parse error)
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["thinwire", *args], code, out.getvalue(), err.getvalue())


def _cli_process(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m thinwire ARGS`` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "thinwire", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
def test_train_writes_summary_and_metrics(tmp_path):
    out = tmp_path / "run"
    r = _cli("train", "--workers", "2", "--steps", "20", "--out", str(out), "--quiet", "--link", "1gbit,50us")
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary["workers"] == 2 and summary["steps"] == 20 and summary["method"].startswith("identity")
    assert 0.0 <= summary["final_accuracy"] <= 1.0
    # identity over 2 ranks sends exactly what the fp32 reference sends
    assert summary["bytes_sent_per_worker"] == summary["fp32_bytes_per_worker"] > 0
    assert summary["compression_ratio"] == 1.0
    assert summary["modeled_seconds"] > summary["compute_seconds"]
    assert summary["config"]["lr"] is not None and summary["config"]["batch_size"] is not None
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 20 and "test_accuracy" in lines[-1]
    # an existing run is not overwritten without --overwrite
    r = _cli("train", "--workers", "2", "--steps", "20", "--out", str(out), "--quiet")
    assert r.returncode == 2 and "--overwrite" in r.stderr and "Traceback" not in r.stderr
    assert json.loads((out / "summary.json").read_text()) == summary


@pytest.mark.timeout(300)
def test_train_with_compression_reports_ratio(tmp_path):
    out = tmp_path / "topk"
    r = _cli("train", "--workers", "2", "--steps", "10", "--method", "topk:ratio=0.01", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["compression_ratio"] > 10
    assert s["method"].startswith("topk:") and "ratio=0.01" in s["method"]


BAD = [
    (["--task", "imagenet"], "unknown task"),
    (["--method", "zip"], "unknown method"),
    (["--method", "topk:speed=3"], "unknown knob"),
    (["--method", "topk:ratio=0"], "ratio"),
    (["--method", "topk:ratio=1.5"], "ratio"),
    (["--method", "powersgd:rank=0"], "rank"),
    (["--workers", "0"], "workers"),
    (["--steps", "0"], "steps"),
    (["--lr", "-1"], "lr"),
    (["--link", "fast"], "link"),
    (["--emulate-link"], "--link"),
    (["--task", "cifar10", "--data-dir", "/nonexistent/cifar"], "cifar"),
    (["--steps", "many"], "invalid int"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --out"),
    (["--checkpoint-every", "-1", "--out", "/tmp/x"], "checkpoint-every must be >= 0"),
    (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: no such directory"),
    (["--on-nonfinite", "ignore"], "invalid choice: 'ignore'"),
    (["--method", "fft:theta=1"], "theta must be in [0, 1)"),
    (["--method", "fft:bits=8,exp_bits=3,man_bits=3"], "exp_bits + man_bits + 1 must equal bits"),
    (["--method", "fft:bits=12"], "bits must be in 3..8, 16 or 32"),
    (["--method", "fft:schedule=exp"], "schedule must be one of"),
    (["--method", "fft:positions=list"], "positions must be one of"),
    (["--method", "twobit:alpha=0"], "alpha must be > 0"),
    (["--method", "hylo:alpha=-1"], "alpha must be > 0"),
    (["--method", "hylo:r_min=0.5,r_max=0.2"], "r_min must be <= r_max"),
    (["--method", "kernels:r_max=2"], "r_max must be in (0, 1]"),
    (["--policy", "/nonexistent/policy.toml"], "cannot read policy file"),
    (["--method", "topk", "--policy", "/nonexistent/policy.toml"], "--policy and --method are exclusive"),
    (["--method", "dasgd:period=0"], "period must be >= 1"),
    (["--method", "dasgd:delay=5"], "delay must be <= period"),
    (["--method", "dasgd:delay=-1"], "delay must be >= 0"),
    (["--method", "dasgd:warmup=-1"], "warmup must be >= 0"),
    (["--method", "dasgd:codec=topk"], "codec must be a single-round SUM codec"),
    (["--method", "localsgd:period=0"], "period must be >= 1"),
    (["--method", "dpsgd:topology=torus", "--workers", "4"], "a torus needs workers = rows x cols"),
    (["--method", "dpsgd:topology=star"], "unknown topology 'star'"),
    (["--method", "powergossip:rank=0"], "rank must be >= 1"),
    (["--method", "powergossip:iters=0"], "iters must be >= 1"),
    (["--method", "powergossip:gamma=0"], "gamma must be > 0"),
    (["--method", "powergossip:topology=torus", "--workers", "7"], "7 has no such factorisation"),
    (["--method", "ab:cutoff=1"], "cutoff must be in (0, 1)"),
    (["--method", "ab:cycle=5,full_steps=5"], "cycle must be > full_steps"),
    (["--method", "ab:warmup=-1"], "warmup must be >= 0"),
    (["--method", "ab:sync=some"], "sync must be one of"),
    (["--method", "ab:group_size=2", "--workers", "2"], "needs at least one A group and one B group"),
    (["--method", "ab:group_size=3", "--workers", "4"], "group_size 3 must divide the 4 workers"),
    (["--method", "ab", "--workers", "3"], "needs an even number of workers"),
    (["--method", "ab:exclude=first;fc9"], "'fc9' matches no Linear or Conv layer"),
    (["--method", "diloco:period=0"], "period must be >= 1, got 0"),
    (["--method", "diloco:outer_lr=0"], "outer_lr must be > 0, got 0"),
    (["--method", "diloco:outer_momentum=1"], "outer_momentum must be in [0, 1), got 1"),
    (["--method", "diloco:outer=lamb"], "outer must be one of sgd, adam, got 'lamb'"),
    (["--method", "diloco:codec=rangefloat:bits=99"], "bits"),
    (["--method", "diloco:codec=nope"], "nope"),
    (["--method", "streaming-diloco:fragments=0"], "fragments must be >= 1, got 0"),
    (["--method", "streaming-diloco:period=100,fragments=99"], "fragments must be at most the model's"),
    (["--method", "streaming-diloco:alpha=2"], "alpha must be in [0, 1], got 2"),
    (["--method", "streaming-diloco:period=5,delay=6"], "delay must be <= period (a whole round): delay=6 > period=5"),
    (["--method", "streaming-diloco:outer_momentum=-0.5"], "outer_momentum must be in [0, 1), got -0.5"),
    (["--method", "demo", "--optimizer", "adamw"], "demo is an optimizer itself, so it replaces --optimizer adamw"),
    (["--method", "demo:chunk=48"], "chunk must be a power of two"),
    (["--method", "demo:chunk=1"], "chunk must be >= 2, got 1"),
    (["--method", "demo:topk=0"], "topk must be in 1..4096"),
    (["--method", "demo:chunk=8,topk=65"], "topk must be in 1..64"),
    (["--method", "demo:decay=1"], "decay must be in [0, 1), got 1"),
    (["--method", "demo:values=fp8"], "values must be one of fp32|bf16|rangefloat|sign"),
    (["--method", "dct:chunk=48"], "chunk must be a power of two"),
    (["--method", "torch-bf16"], "torch-bf16 is unavailable on CPU/gloo"),
    (["--method", "torch-powersgd:rank=0"], "rank must be >= 1"),
    (["--method", "torch-powersgd:start_iter=1"], "start_iter must be >= 2"),
    (["--method", "torch-postlocalsgd:period=0"], "period must be >= 1"),
    (["--method", "torch-ddp:rank=2"], "unknown knob"),
    (["--method", "torch-powersgd", "--on-nonfinite", "skip"], "--on-nonfinite skip cannot keep torch-powersgd clean"),
    (["--import", "no_such_codec_module"], "--import no_such_codec_module: ModuleNotFoundError"),
    (["--import", "/nonexistent/codecs.py"], "--import /nonexistent/codecs.py: ImportError: no such file"),
    (["--workers", "4", "--ranks-per-node", "3"], "--group-size 3 must divide the world of 4 ranks"),
    (["--workers", "4", "--ranks-per-node", "two"], "group-size must be a number of ranks or auto"),
    (["--workers", "4", "--ranks-per-node", "auto"], "--group-size auto takes the layout from torchrun"),
    (["--workers", "4", "--intra-link", "10gbit,1us"], "--intra-link needs --group-size"),
    (["--workers", "4", "--ranks-per-node", "2", "--intra-link", "fast"], "link must look like"),
    (["--workers", "4", "--intra-dtype", "bf16"], "--intra-dtype needs --group-size"),
    (["--workers", "4", "--ranks-per-node", "2", "--intra-dtype", "fp16"],
     "intra-dtype must be one of fp32, bf16, got 'fp16'"),
    (["--workers", "4", "--ranks-per-node", "1", "--intra-dtype", "bf16"],
     "--intra-dtype bf16 needs nodes of more than one rank"),
    (["--workers", "4", "--ranks-per-node", "2", "--method", "powergossip"],
     "powergossip cannot average in two levels: it exchanges with its graph neighbours by rank"),
    (["--workers", "4", "--ranks-per-node", "2", "--method", "demo"], "demo cannot average in two levels"),
    (["--workers", "4", "--ranks-per-node", "2", "--method", "torch-ddp"], "torch-ddp cannot average in two levels"),
    (["--workers", "4", "--shard"], "--shard needs --group-size"),
    (["--workers", "4", "--group-size", "1", "--shard"], "--shard needs --group-size of 2 or more ranks"),
    (["--workers", "4", "--group-size", "2", "--shard", "--method", "dpsgd"],
     "--shard: dpsgd cannot run between groups of sharded ranks: it exchanges whole models with its graph neighbours"),
    (["--workers", "4", "--group-size", "2", "--shard", "--method", "demo"],
     "--shard: demo cannot run between groups of sharded ranks"),
    (["--workers", "4", "--group-size", "2", "--shard", "--intra-dtype", "bf16"],
     "--intra-dtype applies to groups of replicas"),
    (["--method", "streaming-diloco:delay=auto"], "delay=auto needs a link to read"),
    (["--method", "streaming-diloco:delay=auto,link=fast"], "link must look like"),
    (["--method", "diloco:sync=soon"], "sync must be one of blocking, eager, delayed"),
]


@pytest.mark.parametrize("args,needle", BAD)
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle.lower() in err.lower(), err


def test_bad_input_from_the_shell_has_no_traceback():
    r = _cli("train", "--method", "topk:ratio=2")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "ratio" in r.stderr


def test_methods_lists_every_codec_and_knob(capsys):
    from thinwire.codecs.specs import available

    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    for name in available():
        assert name in text
    assert "ratio" in text and "rank" in text
    assert "hylo" in text and "t_fc" in text and "t_conv" in text  # the policy presets and their knobs
    assert "dasgd" in text and "localsgd" in text and "delay" in text  # the averaging algorithms


def test_methods_lists_only_the_names_given(capsys):
    from thinwire.algorithms.methods import markdown_table

    assert main(["methods", "topk", "dasgd:period=4"]) == 0  # a whole spec names its method
    text = capsys.readouterr().out
    headings = [line.split()[0] for line in text.splitlines() if line and not line.startswith(" ")
                and "  (" in line]
    assert headings == ["topk", "dasgd"]
    assert "powersgd" not in text and "policy presets" not in text and "PyTorch built-ins" not in text
    assert main(["methods", "--markdown", "hylo", "topk"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [row.split("|")[1].strip() for row in rows[2:]] == ["`topk`", "`hylo`"]  # the registry's order
    assert rows == [line for line in markdown_table().splitlines() if line.startswith(("| name", "|---", "| `topk`",
                                                                                       "| `hylo`"))]


def test_methods_refuses_an_unknown_name_in_one_line(capsys):
    from thinwire.algorithms.methods import method_names

    assert main(["methods", "topk", "zip"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1
    assert err == ("thinwire: error: methods: unknown name 'zip' (NAME must be a codec, policy preset or method); "
                   f"known: {', '.join(method_names())}")
    r = _cli("methods", "zip")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "unknown name 'zip'" in r.stderr


def test_version_prints_the_package_version(capsys):
    from thinwire.version import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"thinwire {__version__}\n"
    r = _cli_process("--version")
    assert r.returncode == 0 and r.stdout == f"thinwire {__version__}\n"


@pytest.mark.parametrize("command", ["train", "compare", "cost"])
def test_help_shows_every_tasks_defaults_and_options(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines between words
    assert ("batch size per worker (default: the task's: mnist1d 64, charlm 32, text 32, cifar10 64, "
            "synthetic 64)") in text
    assert ("task option, e.g. model=vgg (repeatable; on --resume, added to the run's own); " if command == "train"
            else "task option, e.g. model=vgg (repeatable); ") + (
        "keys: mnist1d: size; charlm: model, context, layers, d_model, heads, dropout; text: model, context, "
        "layers, d_model, heads, dropout, vocab, eval_windows, test_share, eval_split; cifar10: model, augment; "
        "synthetic: dim, hidden, depth, classes, samples, test_samples, data_seed") in text
    assert "--task TASK mnist1d | charlm | text | cifar10 | synthetic (default: mnist1d)" in text
    if command != "cost":
        assert "(default: the task's budget: mnist1d 800, charlm 600, text 600, cifar10 2000, synthetic 300)" in text
        assert ("learning rate (default: the task's: mnist1d 0.003, charlm 0.001, text 0.001, cifar10 0.1, "
                "synthetic 0.05)") in text
        assert "(default: the task's: mnist1d adam, charlm adam, text adam, cifar10 sgd, synthetic sgd)" in text
        assert "K steps (default: the task's: mnist1d 100, charlm 100, text 100, cifar10 500, synthetic 100)" in text
    assert "the task's)" not in text


def _rank_pids(pid: int) -> list[int]:
    """The launcher's ranks: the children of its fork server (or, where ranks are spawned, its own)."""
    out = []
    for kid, cmd in children(pid).items():
        if "spawn_main" in cmd:
            out.append(kid)
        elif "multiprocessing.forkserver" in cmd:
            out += children(kid)
    return sorted(out)


# Imported by the launcher and by every spawned rank (--import): a rank writes its pid to
# rank<RANK>.pid in $THINWIRE_TEST_PIDS (atomically), so the test knows which process is which rank.
_RANK_PIDS = """\
import os

if os.environ.get("RANK") is not None and os.environ.get("THINWIRE_TEST_PIDS"):
    _path = os.path.join(os.environ["THINWIRE_TEST_PIDS"], "rank" + os.environ["RANK"] + ".pid")
    with open(_path + ".tmp", "w") as _f:
        _f.write(str(os.getpid()))
    os.replace(_path + ".tmp", _path)
"""


def _wait_for(what: str, ready, proc: subprocess.Popen, timeout: float = 150):
    """Poll ``ready()`` until it returns something truthy (returned); fail if ``proc`` ends first
    or nothing comes within ``timeout`` seconds (generous: a loaded machine is slow to start ranks)."""
    deadline = time.monotonic() + timeout
    while True:
        got = ready()
        if got:
            return got
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}: {err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.2)


def _read_pids(folder, n: int) -> dict[int, int] | None:
    files = [folder / f"rank{r}.pid" for r in range(n)]
    if not all(f.exists() for f in files):
        return None
    return {r: int(f.read_text()) for r, f in enumerate(files)}


def _trained(metrics) -> bool:
    """rank 0 logged its first evaluation: every rank finished that step's collectives."""
    try:
        return bool(metrics.read_text().strip())
    except OSError:
        return False


@pytest.mark.timeout(300)
def test_killed_rank_ends_the_run_with_its_name_and_no_orphans(tmp_path):
    module, pids_dir, out = tmp_path / "rank_pids.py", tmp_path / "pids", tmp_path / "run"
    module.write_text(_RANK_PIDS)
    pids_dir.mkdir()
    # a collective timeout longer than this test: the run can only end in time by noticing the death
    env = dict(os.environ, THINWIRE_TEST_PIDS=str(pids_dir), THINWIRE_COLLECTIVE_TIMEOUT="3600")
    proc = subprocess.Popen(
        [sys.executable, "-m", "thinwire", "train", "--task", "synthetic", "--workers", "3", "--steps", "1000000",
         "--eval-every", "5", "--out", str(out), "--import", str(module), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        pids = _wait_for("a pid file from every rank", lambda: _read_pids(pids_dir, 3), proc)
        assert sorted(pids.values()) == _rank_pids(proc.pid), "the pid files name the launcher's rank processes"
        _wait_for("a first evaluation in metrics.jsonl", lambda: _trained(out / "metrics.jsonl"), proc)
        os.kill(pids[1], signal.SIGKILL)  # rank 1, by its own word
        _, err = proc.communicate(timeout=90)  # well before any collective could time out
        assert proc.returncode != 0
        assert "rank 1 died (SIGKILL)" in err, err
        for pid in pids.values():
            assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid), f"rank process {pid} left behind"
    finally:
        if proc.poll() is None:
            proc.kill()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.timeout(300)
def test_fft_run_logs_the_theta_it_used(tmp_path):
    out = tmp_path / "fft"
    r = _cli("train", "--workers", "2", "--steps", "24", "--eval-every", "8", "--method", "fft:horizon=24",
             "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    thetas = [x["theta"] for x in lines]
    assert len(thetas) == 3 and thetas[0] > thetas[1] > thetas[2] >= 0.5  # cosine from 0.9 toward 0.5
    assert lines[-1]["train_loss"] < lines[0]["train_loss"]  # training with fft learns
    s = json.loads((out / "summary.json").read_text())
    assert s["compression_ratio"] > 1


@pytest.mark.timeout(300)
def test_fft_recover_run_lowers_theta_at_each_stalled_window(tmp_path):
    """tolerance=0.9 asks every 4-step window to cut the best loss by 90%: none does, so theta
    halves at each window end from the second on, and every rank follows (or the run hangs)."""
    out = tmp_path / "recover"
    spec = "fft:schedule=recover,every=4,tolerance=0.9,factor=2,theta=0.8,theta_min=0.1"
    r = _cli("train", "--workers", "2", "--steps", "24", "--eval-every", "8", "--method", spec,
             "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # used at step 8: 0.8 (it falls after steps 8, 12, 16, ...); at 16: 0.2; at 24: the floor
    assert [x["theta"] for x in lines] == [0.8, 0.2, 0.1]


@pytest.mark.timeout(300)
def test_hylo_run_reports_each_parameters_codec_and_bytes(tmp_path):
    out = tmp_path / "hylo"
    r = _cli("train", "--workers", "2", "--steps", "6", "--eval-every", "3", "--method", "hylo", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "per parameter" in r.stdout and "fc1.weight" in r.stdout  # the table printed at the end
    s = json.loads((out / "summary.json").read_text())
    rows = {x["name"]: x for x in s["per_parameter"]}
    assert rows["fc1.weight"]["codec"].startswith("twobit:") and rows["conv2.weight"]["codec"].startswith("kernels:")
    assert rows["conv1.weight"]["codec"].startswith("identity")
    # twobit on fc1 (163840 values): 4 + 4 * ceil(163840 / 16) bytes per step, sent to 1 peer
    assert rows["fc1.weight"]["bytes_sent_per_worker"] == 6 * (4 + 4 * 10240)
    assert (sum(x["bytes_sent_per_worker"] for x in rows.values())
            == pytest.approx(s["bytes_sent_per_worker"], rel=1e-12))
    assert (sum(x["fp32_bytes_per_worker"] for x in rows.values())
            == pytest.approx(s["fp32_bytes_per_worker"], rel=1e-12))
    assert s["method"].startswith("hylo:t_conv=16384,t_fc=65536") and s["compression_ratio"] > 4


POLICY = """\
[[rule]]
module = "conv"
min_numel = 10000
codec = "kernels:r_max=0.1"

[[rule]]
module = "linear"
ndim = 2
codec = "{linear}"

[[rule]]
codec = "identity"
"""


@pytest.mark.timeout(300)
def test_policy_file_run_and_its_errors(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(POLICY.format(linear="twobit:alpha=2"))
    out = tmp_path / "run"
    r = _cli("train", "--workers", "2", "--steps", "4", "--policy", str(path), "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    rows = {x["name"]: x["codec"].split(":")[0] for x in s["per_parameter"]}
    assert rows["conv2.weight"] == rows["conv3.weight"] == "kernels" and rows["conv1.weight"] == "identity"
    assert rows["fc1.weight"] == rows["fc2.weight"] == "twobit" and rows["fc1.bias"] == "identity"
    assert s["config"]["policy_rules"][0] == {"codec": "kernels:r_max=0.1", "module": ["conv"], "min_numel": 10000}
    path.write_text(POLICY.format(linear="twobit:alpha=0"))
    r = _cli("train", "--workers", "2", "--steps", "4", "--policy", str(path), "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{path}:6: rule 2: alpha must be > 0, got 0" in r.stderr


@pytest.mark.timeout(300)
def test_dasgd_run_reports_hidden_fraction_and_delay(tmp_path):
    out = tmp_path / "dasgd"
    r = _cli("train", "--workers", "2", "--steps", "24", "--eval-every", "12", "--method",
             "dasgd:period=4,delay=auto,warmup=4", "--link", "1gbit,50us", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    report = s["method_report"]
    assert 0 <= report["delay"] <= 4 and report["launches"] == 5  # after local steps 4, 8, ..., 20
    assert s["hidden_fraction"] is not None and 0.0 <= s["hidden_fraction"] <= 1.0
    # 4 warm-up gradient all_reduces and 5 model all_reduces of the same size: 9/24 of fp32's bytes
    assert s["bytes_sent_per_worker"] == pytest.approx(s["fp32_bytes_per_worker"] * 9 / 24, rel=1e-12)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["launches"] for x in lines] == [2, 5]


@pytest.mark.timeout(300)
def test_dpsgd_ring_run_sends_degree_times_the_model(tmp_path):
    out = tmp_path / "dpsgd"
    r = _cli("train", "--workers", "4", "--steps", "6", "--eval-every", "3", "--method", "dpsgd:topology=ring",
             "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    # each worker sends its model to 2 neighbours per step; fp32 all_reduce sends 2(n-1)/n = 1.5 models
    assert s["compression_ratio"] == pytest.approx(1.5 / 2, rel=1e-12)
    assert "ring (4 workers, 4 edges" in s["method_report"]["topology"]


@pytest.mark.timeout(300)
def test_powergossip_run_sends_what_the_formula_says(tmp_path):
    out = tmp_path / "pg"
    r = _cli("train", "--workers", "4", "--steps", "4", "--eval-every", "2", "--method", "powergossip:rank=1",
             "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["bytes_sent_per_worker"] == pytest.approx(4 * s["method_report"]["bytes_per_step_model"], rel=1e-12)
    assert s["compression_ratio"] > 10
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # the averaged model is evaluated; the local models' mean accuracy and their spread are logged
    assert all(x["consensus_distance"] > 0 and 0 <= x["local_test_accuracy_mean"] <= 1 for x in lines)
    assert s["final_accuracy"] == lines[-1]["test_accuracy"]


@pytest.mark.timeout(300)
def test_ab_run_reports_phases_ranks_and_compression(tmp_path):
    out = tmp_path / "ab"
    r = _cli("train", "--workers", "2", "--steps", "14", "--eval-every", "7", "--method",
             "ab:warmup=4,cycle=6,full_steps=2,rebound=2", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    # two groups of one: the group phases send nothing, so every byte is a warm-up, full-rank or sync byte
    phases = s["bytes_by_phase"]
    assert phases["group"] == 0 and phases["warmup"] > 0 and phases["sync"] > 0 and phases["full"] > 0
    assert sum(phases.values()) == pytest.approx(s["bytes_sent_per_worker"], rel=1e-12)
    # 4 warm-up + 4 full-rank steps (6-7, 12-13) send full gradients: 8/14 of fp32's bytes, plus two rank
    # agreements (all_gather of 3 int64 over 2 ranks: 24 bytes each)
    assert phases["warmup"] + phases["full"] == pytest.approx(s["fp32_bytes_per_worker"] * 8 / 14 + 2 * 24, rel=1e-12)
    assert set(s["ranks"]) == {"conv2", "conv3", "fc1"}  # conv1 and fc2: the first and last layers stay full rank
    ratio = s["param_compression_ratio"]
    assert ratio["factorized_layers"] > 0 and ratio["model"] > 0
    report = s["method_report"]
    # syncs at 6 and 12; step 14 re-factorised (14 % 6 == 2) and finish() went back to the full-rank W
    assert report["steps_by_phase"] == {"warmup": 4, "group": 6, "full": 4} and report["syncs"] == 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["ab_phase"] for x in lines] == ["full", "full"]  # step 7: after the sync at 6; step 14: finish()


@pytest.mark.timeout(300)
def test_compare_writes_the_report_csv_and_plots_from_real_runs(tmp_path):
    import csv

    out = tmp_path / "race"
    r = _cli("compare", "--task", "synthetic", "--methods", "identity,torch-ddp", "--workers", "2", "--steps", "6",
             "--eval-every", "3", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "[1/2] identity" in r.stdout and "[2/2] torch-ddp" in r.stdout and "best at 1gbit,50us" in r.stdout
    for name in ("report.md", "results.csv", "accuracy_vs_step.png", "accuracy_vs_bytes.png",
                 "accuracy_vs_time_1gbit_50us.png", "accuracy_vs_time_100mbit_1ms.png", "time_breakdown_1gbit_50us.png",
                 "time_breakdown_100mbit_1ms.png"):
        assert (out / name).stat().st_size > 0, name
    with open(out / "results.csv") as f:
        rows = {row["method"]: row for row in csv.DictReader(f)}
    for run in sorted((out / "runs").iterdir()):
        s = json.loads((run / "summary.json").read_text())
        row = rows[s["method"].split(":")[0]]
        for key in ("final_accuracy", "final_loss", "bytes_sent_per_worker", "compression_ratio", "wall_seconds",
                    "codec_seconds", "comm_seconds"):
            assert float(row[key]) == s[key], key  # the CSV holds the summary's own numbers
        # compute: the race's shared figure (both methods run the same step); the run's own beside it, and the
        # modeled time moved by the difference
        assert row["compute_figure"] == "shared" and float(row["measured_compute_seconds"]) == s["compute_seconds"]
        shift = float(row["compute_seconds"]) - s["compute_seconds"]
        assert float(row["modeled_seconds@1gbit,50us"]) == pytest.approx(
            s["modeled_seconds_by_link"]["1gbit,50us"] + shift, rel=1e-12, abs=1e-12)
    assert rows["torch-ddp"]["compute_seconds"] == rows["identity"]["compute_seconds"]
    # PyTorch's DDP and thinwire's identity: the same losses and bytes on the same seed
    assert float(rows["torch-ddp"]["final_loss"]) == pytest.approx(float(rows["identity"]["final_loss"]), rel=1e-6)
    assert rows["torch-ddp"]["bytes_sent_per_worker"] == rows["identity"]["bytes_sent_per_worker"]


@pytest.mark.parametrize("args, needle", [
    (["--methods", "identity,nosuch"], "unknown method 'nosuch'"),
    (["--methods", "identity,identity"], "appears twice"),
    (["--methods", "torch-bf16"], "torch-bf16 is unavailable on CPU/gloo"),
    (["--methods", "identity", "--target", "2"], "target must be in (0, 1]"),
    ([], "compare needs exactly one of --methods and --suite"),
    (["--methods", "identity", "--suite", "seeds"], "compare needs exactly one of --methods and --suite"),
    (["--suite", "seeds", "--target", "0.5"], "--target applies to --methods races"),
    (["--suite", "all"], "invalid choice: 'all'"),
    (["--methods", "identity", "--seeds", "0"], "seeds must be >= 1, got 0"),
    (["--suite", "seeds", "--seeds", "3"], "--seeds applies to --methods races"),
    (["--suite", "seeds", "--steps", "100"], "--steps 100 cannot measure the ab race: ab never leaves its warm-up of "
                                            "100 synchronous steps (warmup=100) in 100 steps"),
    (["--methods", "identity,ab", "--workers", "4", "--ranks-per-node", "2"], "ab cannot average in two levels"),
    (["--methods", "identity", "--workers", "4", "--ranks-per-node", "8"], "must divide the world of 4 ranks"),
])
def test_compare_bad_input_is_one_line_and_exit_2(args, needle, capsys, tmp_path):
    assert main(["compare", "--task", "synthetic", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.timeout(300)
def test_cost_probes_every_method_and_gives_a_verdict_against_bf16():
    r = _cli("cost", "--task", "synthetic", "--workers", "2", "--probe-steps", "4", "--methods",
             "identity,topk:ratio=0.05,topk:ratio=0.2,demo:chunk=8", "--link", "1gbit,50us")
    assert r.returncode == 0, r.stderr
    rows = [line.split("│")[1].strip() for line in r.stdout.splitlines() if line.startswith("│")]
    assert rows == ["bf16", "identity", "topk:ratio=0.05", "topk:ratio=0.2", "demo"]  # named as typed
    assert "probing bf16" in r.stdout and "probing identity" in r.stdout and "probing topk" in r.stdout
    assert "probing demo" in r.stdout and "failed" not in r.stdout  # DeMo is its own optimizer, beside the task's
    assert "(the reference)" in r.stdout and "ms @ 1gbit,50us" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["--methods", "nosuch"], "unknown method 'nosuch'"),
    (["--methods", "identity,identity"], "appears twice"),
    (["--probe-steps", "1"], "probe-steps must be >= 2"),
    (["--repeats", "0"], "repeats must be >= 1, got 0"),
    (["--link", "fast"], "link"),
    (["--workers", "4", "--intra-link", "1gbit,1us"], "--intra-link needs --group-size"),
])
def test_cost_bad_input_is_one_line_and_exit_2(args, needle, capsys):
    assert main(["cost", "--task", "synthetic", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_cost_refuses_a_method_that_cannot_run_on_the_task(capsys):
    assert main(["cost", "--task", "synthetic", "--methods", "ab:exclude=first;fc9"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot run on task synthetic" in err, err


@pytest.mark.parametrize("args", [["--workers", "0"], ["--steps", "0"], ["--steps", "x"]])
def test_bench_memory_bad_input_is_one_line_and_exit_2(args, capsys):
    assert main(["bench", "memory", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("args", [
    ["nosuch"], ["bench", "nosuch"], ["bench", "codecs", "--methods", "nosuch"], ["bench", "codecs", "--repeats", "0"],
    ["bench", "consensus", "--workers", "0"], ["bench", "consensus", "--topology", "blob"],
    ["bench", "consensus", "--size", "0"], ["bench", "memory", "--methods", "x", "--workers", "-1"],
    ["cost", "--probe-steps", "1"], ["cost", "--methods", "nosuch"], ["cost", "--workers", "0"],
    ["compare", "--suite", "seeds", "--workers", "0", "--out", "unused"], ["train", "--resume"],
    ["train", "--checkpoint-every", "x"], ["methods", "--extra"], ["methods", "--import", "no_such_codec_module"],
    ["train", "--import"],
])
def test_every_command_refuses_bad_input_with_one_line_and_exit_2(args, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("thinwire: error:") and "Traceback" not in err, err


@pytest.mark.timeout(300)
def test_a_race_on_the_users_own_text_is_judged_by_its_test_loss(tmp_path):
    """``compare --task text --data FILE``: a language model of the user's text, raced by loss."""
    corpus = tmp_path / "notes.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * i % 97}\n"
                              for i in range(3000)))
    out = tmp_path / "race"
    r = _cli("compare", "--task", "text", "--data", str(corpus), "--methods", "identity,diloco:period=4",
             "--workers", "2", "--steps", "12", "--eval-every", "4", "--batch-size", "4", "--option", "context=32",
             "--option", "layers=1", "--option", "d_model=32", "--option", "heads=2", "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    with open(out / "results.csv") as f:
        rows = {row["method"]: row for row in csv.DictReader(f)}
    assert {row["judged_by"] for row in rows.values()} == {"test_loss"}
    best = min(float(row["final_loss"]) for row in rows.values())
    assert float(rows["identity"]["target"]) == pytest.approx(round(1.02 * best, 4))
    report = (out / "report.md").read_text()
    assert "judged by test loss (lower is better" in report and (out / "loss_vs_step.png").stat().st_size > 0
    summary = json.loads((out / "runs" / "01-identity" / "summary.json").read_text())
    assert summary["data"]["path"] == str(corpus) and summary["data"]["sha256"] == hashlib.sha256(
        corpus.read_bytes()).hexdigest()
    rows_of_run = [json.loads(x) for x in (out / "runs" / "01-identity" / "metrics.jsonl").read_text().splitlines()]
    assert [x["tokens_seen_per_worker"] for x in rows_of_run] == [4 * 4 * 32, 8 * 4 * 32, 12 * 4 * 32]

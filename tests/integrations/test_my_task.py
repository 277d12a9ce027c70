"""examples/my_task.py, a task of the user's own, through the real command line: a race
(`compare`), a cost probe (`cost`), a train + resume that ends where a straight run ends,
and the one-line errors of a bad `--import`, task name or option. Ranks are spawned CPU
processes on gloo; `main()` runs in this process, so each test forgets the task afterwards
(the built-in task listing, which other tests read, stays as it was)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

from resumes import rank_states
from thinwire.cli import main
from thinwire.run import checkpoint
from thinwire.run.config import file_module_name, import_modules
from thinwire.tasks import TASKS

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "my_task.py")
NAME = "spirals"
SMALL = ["--workers", "2", "--batch-size", "16", "--quiet"]


@pytest.fixture(autouse=True)
def forget_the_example():
    """After each test: the example's task and module gone, as before any --import."""
    yield
    TASKS.remove(NAME)
    sys.modules.pop(file_module_name(EXAMPLE), None)


def _task(**options):
    import_modules([EXAMPLE])
    return TASKS[NAME](seed=0, **options)


def _fp32_bytes_per_step() -> int:
    """What identity (an fp32 all_reduce) sends per worker and step on 2 workers: the ring's
    2 (n - 1) / n = 1 times the gradient's bytes."""
    return 4 * sum(p.numel() for p in _task().build_model().parameters())


@pytest.mark.timeout(120)
def test_compare_races_identity_and_topk_on_the_users_task(tmp_path, capsys):
    out = tmp_path / "race"
    code = main(["compare", "--import", EXAMPLE, "--task", NAME, "--methods", "identity,topk", "--steps", "30",
                 "--eval-every", "10", "--out", str(out), *SMALL])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "best at 1gbit,50us: " in printed and "best at 100mbit,1ms: " in printed
    assert (out / "report.md").read_text().startswith("# thinwire compare: spirals, 2 workers, 30 steps\n")
    with open(out / "results.csv", newline="") as f:
        rows = {row["method"]: row for row in csv.DictReader(f)}
    assert list(rows) == ["identity", "topk"]
    assert all(r["status"] == "ok" and r["task"] == NAME and r["steps"] == "30" for r in rows.values())
    assert all(0 <= float(r["final_accuracy"]) <= 1 and float(r["final_loss"]) > 0 for r in rows.values())
    fp32 = 30 * _fp32_bytes_per_step()
    assert float(rows["identity"]["bytes_sent_per_worker"]) == float(rows["identity"]["fp32_bytes_per_worker"]) == fp32
    assert float(rows["topk"]["bytes_sent_per_worker"]) < fp32 / 4  # top-k sends a small share of the gradient


@pytest.mark.timeout(120)
def test_cost_probes_every_method_on_the_users_task(capsys):
    code = main(["cost", "--import", EXAMPLE, "--task", NAME, "--methods", "identity,topk", "--probe-steps", "2",
                 "--workers", "2"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "spirals · 2 workers · predicted milliseconds per step" in printed
    rows = {cells[0]: cells for line in printed.splitlines() if line.startswith("│")
            for cells in [[c.strip() for c in line.strip("│").split("│")]]}
    assert list(rows) == ["bf16", "identity", "topk"]  # bf16 is always probed, as the reference
    per_step = _fp32_bytes_per_step()
    assert rows["identity"][1] == f"{per_step / 1e6:.3f}" and rows["bf16"][1] == f"{per_step / 2e6:.3f}"  # MB / step
    assert float(rows["topk"][1]) < float(rows["identity"][1]) and rows["bf16"][-1] == "(the reference)"


@pytest.mark.timeout(120)
def test_a_resumed_run_of_the_users_task_ends_as_a_straight_run(tmp_path, capsys):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["train", "--import", EXAMPLE, "--task", NAME, "--method", "topk", "--steps", "20",
                 "--eval-every", "5", "--checkpoint-every", "10", "--out", str(straight), *SMALL]) == 0
    TASKS.remove(NAME)  # the resume must import the example again itself, from the checkpoint's config
    sys.modules.pop(file_module_name(EXAMPLE), None)
    assert main(["train", "--resume", str(checkpoint.step_dir(straight, 10)), "--out", str(resumed), "--quiet"]) == 0
    capsys.readouterr()
    for rank, a, b in rank_states(straight, resumed, 20, 2):
        assert list(a["model"]) == list(b["model"]) and a["model"]
        for key, tensor in a["model"].items():
            assert torch.equal(tensor, b["model"][key]), f"rank {rank} {key}"
    s, r = (json.loads((d / "summary.json").read_text()) for d in (straight, resumed))
    assert r["resumed_from"] == 10 and r["task"] == s["task"] == NAME
    for figure in ("final_loss", "final_accuracy", "bytes_sent_per_worker"):
        assert r[figure] == s[figure], figure


def test_a_task_module_that_fails_to_import_is_one_line_and_exit_2(tmp_path, capsys):
    broken = tmp_path / "broken_task.py"
    broken.write_text("import thinwire.tasks\nraise RuntimeError('the data server is down')\n")
    assert main(["train", "--import", str(broken), "--task", NAME]) == 2
    err = capsys.readouterr().err
    assert err == f"thinwire: error: --import {broken}: RuntimeError: the data server is down\n"
    assert main(["compare", "--import", str(tmp_path / "missing.py"), "--task", NAME, "--methods", "identity",
                 "--out", str(tmp_path / "race")]) == 2
    assert capsys.readouterr().err == f"thinwire: error: --import {tmp_path / 'missing.py'}: ImportError: no such " \
                                      f"file {tmp_path / 'missing.py'}\n"


@pytest.mark.parametrize("body, rule", [
    ("    metric = 'accuracy'\n    Config = Empty\n", "task halfdone needs defaults = TaskDefaults("),
    ("    defaults = TaskDefaults(steps=1, batch_size=1, lr=0.1, optimizer='sgd', eval_every=1)\n    Config = Empty\n",
     "task halfdone needs metric, one of accuracy, bpc"),
    ("    defaults = TaskDefaults(steps=1, batch_size=1, lr=0.1, optimizer='sgd', eval_every=1)\n"
     "    metric = 'accuracy'\n", "task halfdone needs Config, a dataclass of its options"),
])
def test_a_task_missing_a_part_is_refused_at_its_import_in_one_line(body, rule, tmp_path, capsys):
    module = tmp_path / "halfdone.py"
    module.write_text("import dataclasses\nfrom thinwire.tasks import Task, TaskDefaults, register\n\n"
                      "@dataclasses.dataclass(frozen=True)\nclass Empty:\n    pass\n\n"
                      f"@register\nclass HalfDone(Task):\n    name = 'halfdone'\n{body}")
    assert main(["train", "--import", str(module), "--task", "halfdone"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"thinwire: error: --import {module}: TaskError: {rule}") and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, line", [
    (["--task", "spiral"], "unknown task 'spiral'; available: mnist1d, charlm, text, cifar10, synthetic, spirals"),
    (["--task", NAME, "--option", "hidden=0"], "spirals: need samples >= 10, hidden >= 1 and noise >= 0, got 3000, "
                                               "0 and 0.3"),
    (["--task", NAME, "--option", "depth=3"], "unknown option 'depth' for task spirals; options: csv, hidden, noise, "
                                              "samples"),
    (["--task", NAME, "--option", "csv=no-such.csv"], "spirals: cannot read --option csv=no-such.csv: No such file "
                                                      "or directory"),
])
def test_a_bad_task_name_or_option_is_one_line_and_exit_2(argv, line, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for command in (["train"], ["compare", "--methods", "identity", "--out", "race"]):
        assert main([*command, "--import", EXAMPLE, *argv]) == 2
        assert capsys.readouterr().err == f"thinwire: error: {line}\n"
    assert not (tmp_path / "race").exists()  # refused before anything was written


def test_batches_are_a_pure_function_of_seed_rank_and_step():
    task = _task()
    stream = task.train_batches(1, 2, 16)
    first = [next(stream) for _ in range(200)]  # past the end of an epoch (1200 examples per rank)
    again = task.train_batches(1, 2, 16, start=150)
    for b in range(150, 200):
        x, y = next(again)
        assert torch.equal(x, first[b][0]) and torch.equal(y, first[b][1])
    assert x.shape == (16, 2) and x.dtype == torch.float32 and y.dtype == torch.int64
    other = torch.cat([x for x, _ in (next(task.train_batches(0, 2, 16, start=b)) for b in range(75))])
    own = torch.cat([x for x, _ in first[:75]])  # one epoch: rank 0's points and rank 1's are disjoint
    assert not (other[:, None, :] == own[None, :, :]).all(-1).any()
    reseeded = TASKS[NAME](seed=1)
    assert not torch.equal(next(reseeded.train_batches(1, 2, 16))[0], first[0][0])  # the seed moves the order


def test_a_csv_file_of_the_users_own_replaces_the_generated_points(tmp_path):
    path = tmp_path / "points.csv"
    rows = [[i, (i * 7) % 11, i % 4] for i in range(40)]  # two features, labels 0-3
    path.write_text("a,b,label\n" + "".join(f"{a},{b},{y}\n" for a, b, y in rows))
    task = _task(csv=str(path))
    assert (len(task.y), len(task.y_test), task.classes) == (32, 8, 4)  # every fifth row is a test row
    assert task.y_test.tolist() == [rows[i][2] for i in range(4, 40, 5)]
    assert torch.allclose(task.x.mean(0), torch.zeros(2), atol=1e-6)  # features scaled by the training rows
    assert task.build_model()(task.x_test).shape == (8, 4)
    path.write_text("1,2,0\n3,oops,1\n")
    with pytest.raises(ValueError, match=r"spirals: .*points.csv must hold numbers in equal-length rows"):
        _task(csv=str(path))

"""A resume continues the run's own settings from the command line: ``--resume DIR`` alone keeps
the checkpoint interval, links, method and hyperparameters (the checkpoint's saved config),
writes checkpoints after the resume, and repeating a finished run's command is nothing to do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from thinwire.cli import main

SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}
TASK = ["--task", "synthetic", *[a for k, v in SMALL.items() for a in ("--option", f"{k}={v}")]]
# every setting a resume must keep, each away from its default
SETTINGS = [*TASK, "--method", "topk:ratio=0.1", "--workers", "2", "--batch-size", "16", "--lr", "0.02",
            "--optimizer", "adam", "--seed", "3", "--link", "1gbit,50us", "--eval-every", "3", "--bucket-mb", "1",
            "--threads", "1", "--on-nonfinite", "skip"]
KEPT = ("task", "method", "workers", "batch_size", "lr", "optimizer", "seed", "links", "eval_every", "bucket_mb",
        "threads", "task_options", "on_nonfinite", "checkpoint_every", "emulate_link", "imports")


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _latest(out: Path) -> int:
    return json.loads((out / "checkpoints" / "latest.json").read_text())["step"]


def _files(out: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.timeout(300)
def test_resume_alone_keeps_the_runs_settings_and_keeps_checkpointing(tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["train", "--quiet", *SETTINGS, "--steps", "6", "--out", str(out), "--checkpoint-every", "3"]) == 0
    capsys.readouterr()
    original = _summary(out)["config"]

    # docs/guide.md's pair: the same command with --resume in place of --out; the run finished, so
    # it says so in one line, exits 0 and touches nothing
    before = _files(out)
    assert main(["train", *SETTINGS, "--steps", "6", "--resume", str(out), "--quiet"]) == 0
    said = capsys.readouterr()
    assert said.out.strip() == f"thinwire: {out} already finished its 6 steps (summary.json): nothing to do; " \
                               "raise --steps to train longer" and not said.err
    assert _files(out) == before

    # an option typed again is still checked against the checkpoint
    assert main(["train", "--resume", str(out), "--steps", "12", "--seed", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "seed 3 (this run: 4)" in err, err

    # nothing else: every setting is the run's own
    assert main(["train", "--quiet", "--resume", str(out), "--steps", "12"]) == 0, capsys.readouterr().err
    s = _summary(out)
    assert {k: s["config"][k] for k in KEPT} == {k: original[k] for k in KEPT}
    assert s["config"]["checkpoint_every"] == 3 and s["checkpoints_written"] == 2  # at steps 9 and 12
    assert s["steps"] == 12 and s["resumed_from"] == 6 and _latest(out) == 12
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [3, 6, 9, 12]


@pytest.mark.timeout(300)
def test_a_run_stopped_by_sigint_resumes_with_its_checkpoint_interval(tmp_path, capsys):
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "thinwire", "train", "--quiet", *TASK, "--workers", "2", "--batch-size", "16",
           "--steps", "1000000", "--eval-every", "1000000", "--checkpoint-every", "40", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "latest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    stopped = _latest(out)
    # no --checkpoint-every
    assert main(["train", "--quiet", "--resume", str(out), "--steps", str(stopped + 5)]) == 0, capsys.readouterr().err
    s = _summary(out)
    assert s["config"]["checkpoint_every"] == 40 and s["checkpoints_written"] >= 1
    assert s["resumed_from"] == stopped and _latest(out) == stopped + 5  # the last step's checkpoint


def _model(out: Path) -> dict:
    step = _latest(out)
    return torch.load(out / "checkpoints" / f"step-{step:08d}" / "rank-0.pt", weights_only=True)["model"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["wsd", "cosine"])
def test_a_scheduled_run_extends_only_where_its_rates_so_far_are_the_longer_runs(tmp_path, capsys, schedule):
    """wsd extends from its stable phase and cosine from its warm-up, into exactly the unbroken
    longer run; from anywhere else a larger --steps is refused by name, not taken with a jump
    of the learning rate (20 steps, a warm-up of 10; wsd's decay begins at step 18)."""
    extends_from = 10  # the checkpoints kept: steps 10 and 20
    run = [*TASK, "--workers", "1", "--batch-size", "16", "--eval-every", "100", "--lr-schedule", schedule,
           "--warmup-steps", "10", "--min-lr", "0.1"]
    short, longer, resumed = tmp_path / "short", tmp_path / "longer", tmp_path / "resumed"
    assert main(["train", "--quiet", *run, "--steps", "20", "--checkpoint-every", str(extends_from),
                 "--out", str(short)]) == 0
    assert main(["train", "--quiet", *run, "--steps", "40", "--checkpoint-every", "40", "--out", str(longer)]) == 0
    capsys.readouterr()

    # the checkpoint at the end: the rates trained so far differ from a 40-step run's, so --steps 40 is refused
    before = _files(short)
    assert main(["train", "--resume", str(short), "--steps", "40"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--steps 40 would change the {schedule} schedule of a run of 20 steps resumed at step 20" in err, err
    assert "resume with --steps 20" in err, err
    assert _files(short) == before  # nothing written

    # from inside the stretch both lengths share: the longer run, bit for bit
    first = short / "checkpoints" / f"step-{extends_from:08d}"
    assert main(["train", "--quiet", "--resume", str(first), "--steps", "40", "--checkpoint-every", "40",
                 "--out", str(resumed)]) == 0, capsys.readouterr().err
    a, b = _model(resumed), _model(longer)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

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

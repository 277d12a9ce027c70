"""Faults that reach spawned ranks, from the command line: a group SIGTERM through a wrapper,
a SIGTERM to one rank, a rank stopped by SIGSTOP, a run that did not train. Each ends with
the exit code and the one line the docs promise (docs/fault_tolerance.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from thinwire.run import checkpoint

TESTS = Path(__file__).resolve().parents[1]
SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}
TASK = ["--task", "synthetic", "--batch-size", "16", *[a for k, v in SMALL.items() for a in ("--option", f"{k}={v}")]]


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "thinwire", "train", *TASK, "--workers", "2", "--out", str(out), "--quiet", *extra]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(TESTS), **extra)  # usercodec.signalself is found by its name


def test_a_group_sigterm_through_a_wrapper_still_checkpoints_and_exits_143(tmp_path):
    # `setsid timeout 600 thinwire train ...`: timeout, signalled, passes the signal to its
    # child and then to its whole process group, so the launcher gets it twice at once (batch
    # schedulers do the same); that is one delivery, not a second "stop at once"
    out = tmp_path / "run"
    wrapped = ["setsid", "timeout", "600", *_cmd(out, "--steps", "1000000", "--eval-every", "1000000",
                                                 "--checkpoint-every", "1000")]
    proc = subprocess.Popen(wrapped, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (out / "metrics.jsonl").exists():  # the ranks are training
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # to timeout, which forwards it as described
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    stopped = int(err.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert checkpoint.locate(out) == checkpoint.step_dir(out, stopped)
    assert "Traceback" not in err


@pytest.mark.timeout(180)
def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint_and_exits_143(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(_cmd(out, "--steps", "1000000", "--eval-every", "1000000", "--import", "usercodec.signalself",
                            "--method", "signalself"),
                       capture_output=True, text=True, timeout=150,
                       env=_env(SIGNALSELF_RANK="1", SIGNALSELF_AT="5", SIGNALSELF_SIGNAL="TERM"))
    assert r.returncode == 143, r.stderr
    stopped = int(r.stderr.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert 5 <= stopped < 1000000 and checkpoint.locate(out) == checkpoint.step_dir(out, stopped)
    assert not (out / "summary.json").exists()


@pytest.mark.timeout(180)
def test_a_rank_stopped_by_sigstop_is_the_one_named_and_a_resumed_run_counts_from_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    first = subprocess.run(_cmd(out, "--steps", "6", "--checkpoint-every", "6", "--import", "usercodec.signalself",
                                "--method", "signalself"), capture_output=True, text=True, timeout=150, env=_env())
    assert first.returncode == 0, first.stderr  # no SIGNALSELF_* set: no signal
    # ended by the 10 s collective timeout, which the line below names ("timed out waiting"); the
    # subprocess timeout only guards against a hang
    r = subprocess.run([sys.executable, "-m", "thinwire", "train", "--resume", str(out), "--steps", "1000", "--quiet"],
                       capture_output=True, text=True, timeout=150,
                       env=_env(SIGNALSELF_RANK="1", SIGNALSELF_AT="3", SIGNALSELF_SIGNAL="STOP",
                                THINWIRE_COLLECTIVE_TIMEOUT="10"))
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    # rank 1 stopped in its 3rd step after the checkpoint at 6 (8 completed on rank 0 at most)
    assert (line.startswith("thinwire: rank 1 stopped responding after step ")
            and "rank 0 timed out waiting" in line), line
    step = int(line.split("after step ")[1].split(" ")[0])
    assert 6 <= step <= 8, line
    assert "state T" in line, line


@pytest.mark.timeout(180)
def test_a_run_that_skipped_most_steps_exits_1_naming_the_parameter(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(_cmd(out, "--steps", "20", "--lr", "1e6", "--optimizer", "sgd", "--on-nonfinite", "skip"),
                       capture_output=True, text=True, timeout=150)
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("thinwire: the run did not train: ") and "of 20 steps were skipped" in line, line
    assert "the first non-finite gradient was in fc" in line and f"{out}/summary.json records it" in line, line
    summary = json.loads((out / "summary.json").read_text(), parse_constant=lambda token: pytest.fail(token))
    assert summary["status"] == "diverged"

"""Exact resume of PyTorch's own DDP hooks (real gloo process groups): K steps + resume for
K steps end with the parameters, optimizer and hook state of 2K straight steps; a stopped
(SIGINT) run and a run whose rank was killed resume from their checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resumes import assert_same, rank_states, straight_and_resumed
from thinwire.run import checkpoint
from thinwire.run.config import TrainConfig

SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}
K = 4


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec, bucket_mb", [
    ("torch-ddp", 25.0), ("torch-fp16", 25.0), ("torch-powersgd:rank=2,start_iter=2", 25.0),
    # several buckets: DDP's first step after a resume groups the parameters differently
    ("torch-powersgd:rank=2,start_iter=2", 0.002), ("torch-postlocalsgd:period=3,warmup=2", 25.0)])
def test_pytorch_hooks_resume_exactly(spec, bucket_mb, tmp_path):
    cfg = TrainConfig(task="synthetic", method=spec, workers=2, steps=2 * K, eval_every=K, out=str(tmp_path / "a"),
                      checkpoint_every=K, task_options=SMALL, batch_size=16, bucket_mb=bucket_mb).resolve()
    straight, resumed = straight_and_resumed(cfg, K, tmp_path)
    for rank, a, b in rank_states(cfg.out, tmp_path / "b", 2 * K, 2):
        for part in ("model", "optimizer", "method"):
            assert_same(a[part], b[part], f"rank {rank} {part}")
        # bytes always agree; with several buckets, a fresh DDP's first step runs on its initial
        # buckets (fewer, larger collectives), so calls and messages may differ there
        for op, counts in a["meter"]["ops"].items():
            got = b["meter"]["ops"][op]
            assert (got[1], got[3]) == (counts[1], counts[3]), op
            assert got == counts or bucket_mb < 1, op
    assert resumed.final_loss == straight.final_loss and resumed.resumed_from == K


def _train_cmd(out: Path, *extra: str) -> list[str]:
    opts = [a for k, v in SMALL.items() for a in ("--option", f"{k}={v}")]
    return [sys.executable, "-m", "thinwire", "train", "--task", "synthetic", "--workers", "2", "--batch-size", "16",
            "--out", str(out), "--quiet", *opts, *extra]


def _wait_for_checkpoint(out: Path, proc: subprocess.Popen, timeout: float = 90) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()}")
        try:
            return json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
        except (OSError, ValueError):
            time.sleep(0.2)
    raise AssertionError("no checkpoint appeared")


def _interrupted(out: Path, every: int, strike, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """A long run checkpointing every ``every`` steps, ``strike(proc)`` once its first checkpoint
    is in: (exit code, stderr). It has to end by itself: the wait for that only guards against a hang."""
    proc = subprocess.Popen(_train_cmd(out, "--steps", "1000000", "--eval-every", "1000000", "--checkpoint-every",
                                       str(every), *extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        _wait_for_checkpoint(out, proc)
        strike(proc)
        _, err = proc.communicate(timeout=90)
        return proc.returncode, err
    finally:
        if proc.poll() is None:
            proc.kill()


def _resume_to(out: Path, steps: int) -> dict:
    """``thinwire train --resume OUT --steps STEPS`` to the end, in this process; its summary."""
    from thinwire.cli import main

    assert main(_train_cmd(out, "--steps", str(steps), "--resume", str(out))[3:]) == 0  # less `python -m thinwire`
    return json.loads((out / "summary.json").read_text())


@pytest.mark.timeout(240)
def test_sigint_stops_every_rank_with_a_checkpoint_that_resumes(tmp_path):
    out = tmp_path / "run"
    code, err = _interrupted(out, 50, lambda proc: os.kill(proc.pid, signal.SIGINT))
    assert code == 130, err
    stopped = int(err.split("after step ")[1].split(";")[0])
    assert f"continue with --resume {out}" in err
    assert checkpoint.locate(out) == checkpoint.step_dir(out, stopped)
    assert not (out / "summary.json").exists()
    summary = _resume_to(out, stopped + 6)
    assert summary["steps"] == stopped + 6 and summary["resumed_from"] == stopped


RANK_PIDS = Path(__file__).resolve().parents[1] / "usercodec" / "rankpids.py"  # each rank writes rank<R>.pid


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        children = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True).stdout.split()
        todo += [int(c) for c in children if int(c) not in found]
        found |= {int(c) for c in children}
    return found


def _kill_rank_1(proc: subprocess.Popen, pids_dir: Path) -> None:
    # both ranks wrote their pid file before they joined the group, so before the first checkpoint
    pids = {r: int((pids_dir / f"rank{r}.pid").read_text()) for r in range(2)}
    below = _descendants(proc.pid)  # the ranks start from the launcher's fork server: its children
    assert set(pids.values()) <= below, (pids, below)  # the files name the launcher's rank processes
    os.kill(pids[1], signal.SIGKILL)  # rank 1, by its own word


@pytest.mark.timeout(240)
def test_a_killed_rank_leaves_a_checkpoint_that_resumes(tmp_path):
    out, pids_dir = tmp_path / "run", tmp_path / "pids"
    pids_dir.mkdir()
    # a collective timeout longer than this test: the run can only end by noticing the death
    env = dict(os.environ, THINWIRE_TEST_PIDS=str(pids_dir), THINWIRE_COLLECTIVE_TIMEOUT="3600")
    code, err = _interrupted(out, 20, lambda proc: _kill_rank_1(proc, pids_dir), "--import", str(RANK_PIDS), env=env)
    assert code == 1 and "rank 1 died (SIGKILL)" in err, err
    at = json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
    assert _resume_to(out, at + 5)["resumed_from"] == at


@pytest.mark.timeout(240)
def test_a_scheduler_sigterm_under_torchrun_stops_every_rank_with_a_checkpoint(tmp_path):
    # a scheduler (e.g. Slurm) signals every process of the job: each rank gets SIGTERM from it
    # and again from torchrun, which forwards what it gets; the repeat must not cancel the
    # stop's checkpoint
    out = tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = torchrun + _train_cmd(out, "--steps", "1000000", "--eval-every", "5", "--threads", "1")[1:]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        ranks = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                text=True).stdout.split()]
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        for pid in [proc.pid, *ranks]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    at = json.loads((out / "checkpoints" / "latest.json").read_text())["step"]  # the stop's own checkpoint
    assert at > 0, err
    assert _resume_to(out, at + 5)["resumed_from"] == at

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


GRACE_S = 3  # THINWIRE_STOP_GRACE of the tests of a stop's grace (the default, 10 s: test_reliability.py)


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
    # ended by the 3 s collective timeout, which the line below names ("timed out waiting"); the
    # subprocess timeout only guards against a hang
    r = subprocess.run([sys.executable, "-m", "thinwire", "train", "--resume", str(out), "--steps", "1000", "--quiet"],
                       capture_output=True, text=True, timeout=150,
                       env=_env(SIGNALSELF_RANK="1", SIGNALSELF_AT="3", SIGNALSELF_SIGNAL="STOP",
                                THINWIRE_COLLECTIVE_TIMEOUT="3"))
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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", [True, False])
def test_the_rank_servers_exit_skips_the_interpreters_teardown_and_nothing_else_does(tmp_path, server):
    # the fork server holds the launcher's stderr until it is gone, so its exit is part of the
    # time a stopped rank holds a run (hang_limit); an exit handler registered before its first
    # import (the interpreter's teardown stands for all of them) never runs there, and runs
    # anywhere else that imports the module
    mark = tmp_path / "finalized"
    first = "import multiprocessing.forkserver" if server else "import multiprocessing"
    code = (f"{first}; import atexit, signal; atexit.register(lambda: open({str(mark)!r}, 'w').close()); "
            "import thinwire.run.rank_server; "
            "assert (signal.getsignal(signal.SIGTERM) == signal.SIG_IGN) == " + repr(server) + "; "
            "print('left', flush=True); raise SystemExit(0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and done.stdout == "left\n", done.stderr
    assert mark.exists() is not server


# -- how long a stopped rank or a stop request can hold a run ----------------------------------
def _slow(out: Path, *extra: str) -> list[str]:
    """The run of _cmd on usercodec.slowtask's task: ranks sleep or stop where SLOWTASK_* say."""
    small = [a for k, v in SMALL.items() for a in ("--option", f"{k}={v}")]
    return [sys.executable, "-m", "thinwire", "train", "--task", "slowsynthetic", "--import", "usercodec.slowtask",
            "--batch-size", "16", *small, "--workers", "2", "--out", str(out), "--quiet", "--steps", "1000000",
            "--eval-every", "1000000", *extra]


def _wait_for(paths: list[Path], proc: subprocess.Popen, limit: float = 90) -> None:
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)  # a stopped rank cannot notice its launcher is gone
        except ProcessLookupError:
            pass


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(150)
def test_a_rank_stopped_ends_the_run_within_the_hang_limit_its_timeout_gives(tmp_path, monkeypatch):
    # the limit is the collective timeout plus fixed margins (hang_limit()); the margins are what
    # this run measures, at a short timeout. The default timeout, 50 s, gives the promised 60 s
    # (tests/unit/test_reliability.py checks that arithmetic)
    from thinwire.comm.torch_dist import hang_limit

    out, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    env = _env(THINWIRE_TEST_PIDS=str(pids), THINWIRE_COLLECTIVE_TIMEOUT="3")
    monkeypatch.setenv("THINWIRE_COLLECTIVE_TIMEOUT", "3")
    limit = hang_limit()  # 3 s + the margins
    cmd = _cmd(out, "--steps", "1000000", "--eval-every", "1000000", "--import", "usercodec.rankpids")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    ranks: list[int] = []
    try:
        _wait_for([out / "metrics.jsonl", pids / "rank0.pid", pids / "rank1.pid"], proc)
        ranks = [int((pids / f"rank{r}.pid").read_text()) for r in (0, 1)]
        time.sleep(1.0)  # the ranks are training
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - stopped
    finally:
        _kill([proc.pid, *ranks])
    assert proc.returncode == 1, err
    line = err.strip().splitlines()[-1]
    assert took < limit == 13.0, (took, line)
    assert line.startswith("thinwire: rank 1 stopped responding after step ") and "state T" in line, line
    assert "rank 0 timed out waiting" in line, line  # the collective's path, not the launcher's
    assert all(_gone(pid) for pid in ranks)


@pytest.mark.timeout(120)
def test_a_rank_stopped_while_its_peer_is_in_a_long_step_is_named_by_the_launcher_within_the_limit(tmp_path,
                                                                                                   monkeypatch):
    # rank 0 sleeps in its step, so no collective of its waits on rank 1 and none times out: the
    # launcher, reading the heartbeats, ends the run itself
    from thinwire.comm.torch_dist import hang_limit

    out, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    env = _env(THINWIRE_COLLECTIVE_TIMEOUT="2", SLOWTASK_AT="4", SLOWTASK_SLEEP_RANKS="0", SLOWTASK_SLEEP="600",
               SLOWTASK_STOP_RANK="1", SLOWTASK_MARK=str(marks))
    monkeypatch.setenv("THINWIRE_COLLECTIVE_TIMEOUT", "2")
    limit = hang_limit()  # 2 s + the margins
    proc = subprocess.Popen(_slow(out), stderr=subprocess.PIPE, text=True, env=env)
    ranks: list[int] = []
    try:
        _wait_for([marks / "rank0", marks / "rank1"], proc)
        stopped = time.monotonic()
        ranks = [int((marks / f"rank{r}").read_text()) for r in (0, 1)]
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - stopped
    finally:
        _kill([proc.pid, *ranks])
    assert proc.returncode == 1, err
    line = err.strip().splitlines()[-1]
    assert took < limit == 12, (took, line)
    assert line.startswith("thinwire: rank 1 stopped responding after step 3 (no heartbeat for "), line
    assert "state T" in line and line.endswith("the other ranks were stopped"), line
    assert all(_gone(pid) for pid in ranks)


def _sigterm_asleep(out: Path, marks: Path, ranks: int, **env: str) -> tuple[int, str, float, list[int]]:
    """Run _slow's task (``--checkpoint-every 1``) with ranks 0 to ``ranks - 1`` asleep for 10
    minutes in step 4 and SIGTERM it once they all are: its exit code, stderr, the seconds from
    the signal to its exit, and the ranks' pids."""
    marks.mkdir()
    env = _env(SLOWTASK_AT="4", SLOWTASK_SLEEP_RANKS=",".join(map(str, range(ranks))), SLOWTASK_SLEEP="600",
               SLOWTASK_MARK=str(marks), THINWIRE_STOP_GRACE=str(GRACE_S), **env)
    proc = subprocess.Popen(_slow(out, "--checkpoint-every", "1"), stderr=subprocess.PIPE, text=True, env=env)
    pids: list[int] = []
    try:
        _wait_for([marks / f"rank{r}" for r in range(ranks)], proc)  # every rank is in its 10-minute step
        pids = [int((marks / f"rank{r}").read_text()) for r in range(ranks)]
        proc.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - asked
    finally:
        _kill([proc.pid, *pids])
    return proc.returncode, err, took, pids


@pytest.mark.timeout(120)
def test_a_first_sigterm_ends_a_run_whose_step_takes_minutes_within_the_grace_and_exits_143(tmp_path):
    out = tmp_path / "run"
    code, err, took, ranks = _sigterm_asleep(out, tmp_path / "marks", 2)
    assert code == 143, err
    assert GRACE_S <= took < GRACE_S + 5, (took, err)
    assert f"did not reach a step's end within {GRACE_S} s of the signal and were ended" in err, err
    assert "stopped by SIGTERM after step 3; the ranks did not reach" in err, err
    assert "nothing after the last checkpoint was kept" in err, err
    assert checkpoint.locate(out) == checkpoint.step_dir(out, 3)  # the last one kept stays
    assert not (out / "summary.json").exists() and "Traceback" not in err
    assert all(_gone(pid) for pid in ranks)


@pytest.mark.timeout(120)
def test_a_first_sigterm_ends_a_torchrun_rank_in_a_step_of_minutes_within_the_grace_and_exits_143(tmp_path):
    # a world of one torchrun rank (torchrun's variables, no thinwire launcher): the rank's own timer
    from spawn import free_port

    out = tmp_path / "run"
    code, err, took, _ = _sigterm_asleep(out, tmp_path / "marks", 1, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                                         LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                                         CUDA_VISIBLE_DEVICES="")
    assert code == 143, err
    assert GRACE_S <= took < GRACE_S + 5, (took, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("thinwire: stopped by SIGTERM after step 3; the ranks did not reach a step's end "), line
    assert line.endswith("so nothing after the last checkpoint was kept"), line
    assert checkpoint.locate(out) == checkpoint.step_dir(out, 3)

"""Elastic training on torchft's Lighthouse and Manager (CPU, gloo, spawned workers, a Lighthouse
in the test's process): a worker killed in the middle of a step, one that joins, the per-method
rules, the record of quorum changes, admission and a job left with too few workers."""

from __future__ import annotations

import pytest

from elastic_job import HEARTBEAT_S, Job
from spawn import children

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("spec", ["powersgd:rank=2,min_numel=0", "randomk:ratio=0.1,min_numel=0"])
def test_a_worker_killed_mid_step_leaves_the_survivors_equal_to_a_run_of_them_alone_from_that_step(spec):
    # powersgd: error feedback and Q; randomk: error feedback and indices drawn from its step
    # counter, shared by every worker. The failed step must leave all of it as it was, so the run
    # that lost worker 2 mid-step 6 (its peers' collective failed, the step was discarded and
    # tried again without it) ends bit for bit where the run whose worker 2 left after step 5 ends
    runs = {}
    # (worker 2 sleeps 0.2 s after each backward pass: it dies once the quorum of step 6, which it
    # asked for beside that step, has formed with it, so that its peers' collective fails)
    for name, plan in (("killed", {"die_at": 6, "pace": 0.2}), ("left", {"leave_after": 5})):
        job = Job()
        try:
            for r in range(3):
                job.start(r, spec, 12, start_workers=3, **(plan if r == 2 else {}))
            runs[name] = job.results(3 if name == "left" else 2)
        finally:
            job.close()
    killed, left = runs["killed"], runs["left"]
    assert killed[0]["step"] == killed[1]["step"] == 12
    assert killed[0]["model"] == killed[1]["model"] == left[0]["model"] == left[1]["model"]
    assert killed[0]["shared"] == killed[1]["shared"] == left[0]["shared"]
    assert killed[0]["discarded"] >= 1 and left[0]["discarded"] == 0
    # the quorum changes on record: worker 2 left at step 5, the survivors went on as two
    lost = [c for c in killed[0]["changes"] if c["left"]]
    assert lost and lost[0]["left"] == [2] and lost[0]["step"] == 5 and lost[0]["workers"] == 2
    assert killed[0]["present"][-1] == [6, 12, 2]


def test_a_worker_that_joins_takes_a_peers_state_bit_for_bit_and_the_job_ends_identical():
    job = Job()
    try:
        for r in range(2):
            job.start(r, "topk:ratio=0.1,min_numel=0", 200, pace=0.02)
        job.start(2, "topk:ratio=0.1,min_numel=0", 200, pace=0.02, join_after=1.5, check_join=True)
        res = job.results(3)
    finally:
        job.close()
    assert {r["step"] for r in res.values()} == {200}
    assert res[0]["model"] == res[1]["model"] == res[2]["model"]
    assert res[0]["optimizer"] == res[1]["optimizer"] == res[2]["optimizer"]  # momentum buffers taken
    assert res[0]["shared"] == res[1]["shared"] == res[2]["shared"]
    # it took the peer's model, optimizer and codec state, but not its error-feedback residuals
    assert res[2]["residuals_at_join"] == 0 and res[0]["residuals"] > 0 and res[2]["residuals"] > 0
    joined = res[2]["changes"][0]
    assert joined["healed"] and res[2]["heals"] == 1 and joined["workers"] == 3
    seen = [c for c in res[0]["changes"] if c["joined"] == [2]]
    assert seen and seen[0]["step"] == joined["step"] and not seen[0]["healed"]
    # every committed step of the joiner's ran with three workers
    assert all(w == 3 for _, _, w in res[2]["present"])


def test_a_worker_asks_for_the_next_quorum_beside_its_step_and_a_joiner_takes_the_buffers_of_the_steps_start():
    # worker 1 begins step 80 two seconds late (the Lighthouse waits for it: it is alive).
    # Worker 0, whose method is set up over the quorum, does not wait for it in begin(): it
    # asks beside its forward and backward passes and waits at its commit, before the step's
    # first collective. Worker 2 joins meanwhile:
    # the state it takes was read while a peer's forward pass ran (which updates the batch
    # norm's running statistics), and holds the buffers as they stood at that step's begin()
    job = Job(join_timeout_s=30.0)
    try:
        job.start(0, "topk:ratio=0.1,min_numel=0", 120, pace=0.02, norm=True, clock=True)
        job.start(1, "topk:ratio=0.1,min_numel=0", 120, pace=0.02, norm=True, clock=True, late=(80, 2.0))
        job.start(2, "topk:ratio=0.1,min_numel=0", 120, pace=0.02, norm=True, join_after=1.5, check_join=True)
        res = job.results(3)
    finally:
        job.close()
    assert {r["step"] for r in res.values()} == {120}
    assert res[0]["model"] == res[1]["model"] == res[2]["model"]
    assert res[0]["discarded"] == res[1]["discarded"] == 0
    called_1 = res[1]["begins"][80][0]
    assert res[0]["begins"][80][1] < called_1 - 1.0  # worker 0 was past begin() a second before worker 1 asked
    joined = res[2]["changes"][0]
    assert joined["healed"] and joined["workers"] == 3
    step = joined["step"] + 1  # the step the joiner's first forward pass trains
    assert res[2]["buffers"][step] in (res[0]["buffers"][step], res[1]["buffers"][step])
    seen = [c for c in res[0]["changes"] if c["joined"] == [2]]
    assert seen and seen[0]["step"] == joined["step"] and not seen[0]["healed"]


def test_a_worker_that_dies_inside_a_new_quorums_set_up_is_left_out_without_waiting_the_elastic_timeout(tmp_path):
    # worker 2 joins a running job and dies inside the set-up of the group of the quorum that
    # takes it in: the other two wait for it in gloo's rendezvous. That wait has a bound of its
    # own (RENDEZVOUS_S, 3 s), not the job's elastic timeout, here 60 s, which still bounds
    # every collective and state transfer after the set-up
    from thinwire.elastic.worker import RENDEZVOUS_S

    stamp = tmp_path / "died"
    job = Job()
    try:
        for r in range(2):
            job.start(r, "topk:ratio=0.1,min_numel=0", 150, pace=0.02, timeout_s=60.0)
        job.start(2, "topk:ratio=0.1,min_numel=0", 150, join_after=1.0, timeout_s=60.0, die_in_setup=str(stamp))
        res = job.results(2)
    finally:
        job.close()
    died = float(stamp.read_text())
    assert res[0]["step"] == res[1]["step"] == 150
    assert res[0]["model"] == res[1]["model"] and res[0]["optimizer"] == res[1]["optimizer"]
    # what was left of the job after the death (set-up bound, a new quorum, the steps left)
    # took well under the 60 s an unbounded rendezvous would have waited
    assert RENDEZVOUS_S < 60.0 and res[0]["ended"] - died < 20.0


def test_workers_short_of_start_workers_start_together_once_the_wait_is_over():
    # three wanted, two come, one second apart: each waits wait_s from its own first ask, and
    # they stop waiting together (the first to be done says so over the quorum), so that no one
    # trains a step alone and the wait does not start over at every discarded step
    job = Job()
    try:
        for r in range(2):
            job.start(r, "powersgd:rank=2,min_numel=0", 20, start_workers=3, wait_s=3.0, join_after=float(r))
        res = job.results(2)
    finally:
        job.close()
    assert res[0]["step"] == res[1]["step"] == 20
    assert res[0]["model"] == res[1]["model"]
    assert res[0]["discarded"] == res[1]["discarded"] == 0
    assert res[0]["present"] == res[1]["present"] == [[1, 20, 2]]


def test_diloco_a_joiner_starts_from_the_global_model_and_every_worker_ends_on_it():
    job = Job()
    try:
        for r in range(2):
            job.start(r, "diloco:period=8", 200, pace=0.02)
        job.start(2, "diloco:period=8", 200, pace=0.02, check_join=True, join_after=1.5)
        res = job.results(3)
    finally:
        job.close()
    assert res[2]["joins"] == [True]  # its model was θ, not the peer's weights within the round
    assert res[0]["model"] == res[1]["model"] == res[2]["model"]  # 200 = 25 rounds: every worker ends on θ
    assert res[0]["shared"] == res[1]["shared"] == res[2]["shared"]


def test_diloco_asks_for_a_quorum_only_at_its_averages_and_waits_for_a_live_worker_a_round_behind():
    # period 8, 24 steps: the workers vote at their first step and at the three averages only,
    # training alone in between. Worker 2 reaches the second average 5 s after the others (five
    # heartbeat timeouts, and more than the 4 s a quorum used to wait for a straggler). Alive,
    # it is waited for, not dropped: no step discarded, three workers at every step, one model.
    # (With a 1 s join timeout the other two average without it at step 16 and it is left behind.)
    job = Job(join_timeout_s=30.0)
    try:
        for r in range(3):
            job.start(r, "diloco:period=8", 24, start_workers=3, **({"late": (16, 5.0)} if r == 2 else {}))
        res = job.results(3)
    finally:
        job.close()
    for r in res.values():
        assert r["step"] == 24 and r["committed"] == 24
        assert r["votes"] == 4  # torchft's counter: steps 1, 8, 16 and 24 voted, the others trained alone
        assert r["discarded"] == 0 and r["present"] == [[1, 24, 3]]
        assert [c["step"] for c in r["changes"]] == [0]  # the first quorum; nobody left or joined after it
    assert res[0]["model"] == res[1]["model"] == res[2]["model"]
    assert res[0]["shared"] == res[1]["shared"] == res[2]["shared"]


def test_a_worker_of_another_method_is_refused_by_name_and_the_job_goes_on():
    job = Job()
    try:
        for r in range(2):
            job.start(r, "identity", 200, pace=0.02)
        job.start(2, "bf16", 200, join_after=1.5)
        res = job.results(3)
    finally:
        job.close()
    assert res[2]["error"].startswith("Refused: worker 2 is refused: its method 'bf16:")
    assert "the running job's 'identity:" in res[2]["error"]
    assert res[0]["step"] == res[1]["step"] == 200 and res[0]["model"] == res[1]["model"]


def test_too_few_workers_left_waits_its_stated_time_then_stops():
    job = Job()
    try:
        job.start(0, "identity", 100, wait_s=3.0)
        job.start(1, "identity", 100, leave_after=10)
        res = job.results(2)
    finally:
        job.close()
    assert res[1]["step"] == 10
    assert "QuorumLost" in res[0]["error"] and "within 3 s" in res[0]["error"]
    assert res[0]["step"] == 10  # its last committed state
    assert res[0]["seconds"] < 3.0 + HEARTBEAT_S + 30  # the wait, not a hang


def _read(path):
    import json

    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_local_job_records_its_quorums_per_worker_and_a_whole_job_resumes_exactly(tmp_path):
    import json

    from thinwire.cli import main
    from thinwire.run.summary import JobSummary, WorkerSummary

    common = ["train", "--elastic", "--workers", "2", "--min-workers", "1", "--method", "powersgd", "--quiet",
              "--eval-every", "10", "--elastic-timeout", "3"]
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    assert main([*common, "--steps", "40", "--out", str(straight)]) == 0
    assert main([*common, "--steps", "30", "--out", str(first), "--checkpoint-every", "10"]) == 0
    job = json.loads((first / "summary.json").read_text())
    workers = job["workers"]
    assert sorted(workers) == ["0", "1"] and all(w["exit"] == 0 for w in workers.values())
    s0, s1 = workers["0"]["summary"], workers["1"]["summary"]
    typed = JobSummary.read(str(first / "summary.json"))  # the typed readers take what the job wrote
    assert typed.workers[1].summary == WorkerSummary.read(str(first / "worker-1" / "summary.json"))
    assert s0["status"] == s1["status"] == "ok" and s0["model_sha256"] == s1["model_sha256"]
    assert s0["elastic"]["present"] == [[1, 30, 2]] and s0["elastic"]["discarded"] == 0
    records = _read(first / "worker-0" / "metrics.jsonl")
    evals = [r for r in records if "event" not in r]
    assert [r["step"] for r in evals] == [10, 20, 30] and all(r["workers"] == 2 for r in evals)
    # the seconds of the steps so far: growing, and at the last step the summary's
    seconds = [r["train_seconds"] for r in evals]
    assert 0 < seconds[0] < seconds[1] < seconds[2] == s0["train_seconds"]
    quorum = [r for r in records if r.get("event") == "quorum"]
    assert quorum and quorum[0]["members"] == [0, 1] and quorum[0]["workers"] == 2
    assert json.loads((first / "worker-1" / "checkpoints" / "latest.json").read_text())["step"] == 30
    # the whole job stopped and resumed from its checkpoints ends where the straight run ends
    assert main([*common, "--steps", "40", "--resume", str(first), "--out", str(resumed)]) == 0
    again = json.loads((resumed / "summary.json").read_text())["workers"]
    ref = json.loads((straight / "summary.json").read_text())["workers"]
    assert again["0"]["summary"]["model_sha256"] == ref["0"]["summary"]["model_sha256"]
    assert again["1"]["summary"]["model_sha256"] == ref["1"]["summary"]["model_sha256"]
    assert again["0"]["summary"]["final"]["test_loss"] == ref["0"]["summary"]["final"]["test_loss"]


def test_a_stopped_worker_is_dropped_and_when_it_resumes_takes_the_jobs_state(tmp_path):
    import os
    import signal
    import time

    job = Job()
    try:
        for r in range(3):
            job.start(r, "powersgd:rank=2,min_numel=0", 350, pace=0.02, start_workers=3, mark=str(tmp_path / f"{r}"))
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"{r}").exists() for r in range(3)):  # all three are training
            assert time.monotonic() < deadline and all(p.is_alive() for p in job.procs)
            time.sleep(0.05)
        os.kill(job.procs[2].pid, signal.SIGSTOP)
        stopped = time.time()
        time.sleep(6.0)
        os.kill(job.procs[2].pid, signal.SIGCONT)
        res = job.results(3)
    finally:
        job.close()
    assert {r["step"] for r in res.values()} == {350}
    assert res[0]["model"] == res[1]["model"] == res[2]["model"]
    dropped = [c for c in res[0]["changes"] if 2 in c["left"] and c["time"] > stopped]
    assert dropped and dropped[0]["time"] - stopped < 4.0 + HEARTBEAT_S + 1.0  # the collective's timeout, then out
    assert any(c["healed"] for c in res[2]["changes"][1:])  # told it was behind: took the job's state
    # whether the survivors discard a step depends on where the stop lands (mid-collective, or
    # between a commit and the next quorum, when the Lighthouse drops it before any collective);
    # the killed-mid-step test above pins the discard itself


def test_two_terminals_a_lighthouse_command_and_workers_that_join_it(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys

    from spawn import free_port

    # the job's secret: a file for the Lighthouse and worker 0, the environment for worker 1
    key, other = tmp_path / "job.secret", tmp_path / "other.secret"
    for path, text in ((key, "0123456789abcdef0123456789abcdef\n"), (other, "fedcba9876543210fedcba98\n")):
        path.write_text(text)
        path.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != "THINWIRE_JOB_SECRET"}
    port = free_port()
    lighthouse = subprocess.Popen([sys.executable, "-m", "thinwire", "lighthouse", "--min-workers", "2", "--bind",
                                   f"127.0.0.1:{port}", "--job-secret-file", str(key)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert f"Lighthouse at http://127.0.0.1:{port}" in lighthouse.stdout.readline()
        train = [sys.executable, "-m", "thinwire", "train", "--elastic", "--lighthouse", f"127.0.0.1:{port}",
                 "--workers", "2", "--min-workers", "2", "--steps", "30", "--eval-every", "10", "--quiet"]
        given = [(["--job-secret-file", str(key)], env), ([], {**env, "THINWIRE_JOB_SECRET": key.read_text()}),
                 (["--job-secret-file", str(other)], env)]
        workers = [subprocess.Popen([*train, "--replica", str(k % 2), *flags, "--out", str(tmp_path / f"w{k}")],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
                   for k, (flags, e) in enumerate(given)]
        outs = [w.communicate(timeout=180) for w in workers]
        assert [w.returncode for w in workers] == [0, 0, 2], outs
        assert "worker 1 ok at step 30" in outs[1][0]
        # another secret: one line, at once, naming the mismatch
        assert outs[2][1].strip() == f"thinwire: error: the Lighthouse at 127.0.0.1:{port} refused this worker: the " \
                                     "two hold different job secrets", outs[2]
        sums = [json.loads((tmp_path / f"w{k}" / "summary.json").read_text()) for k in range(2)]
        assert sums[0]["model_sha256"] == sums[1]["model_sha256"] and sums[0]["replica"] == 0
    finally:
        lighthouse.send_signal(signal.SIGINT)
        out, err = lighthouse.communicate(timeout=30)
    assert lighthouse.returncode == 0 and "Lighthouse stopped" in out, err
    refused = [line for line in err.splitlines() if "gate refused" in line]
    assert len(refused) == 1 and refused[0].endswith(": its proof of the job secret fails"), err


def _listeners(pid: int) -> list[str]:
    """The addresses process ``pid`` listens on over TCP (from /proc: its sockets' inodes
    against the machine's listening sockets)."""
    import ipaddress
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    raw = bytes.fromhex(fields[1].split(":")[0])
                    # /proc prints each 32-bit word in host (little-endian) order
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.append(str(ipaddress.ip_address(words if width == 16 else words[:4])))
    return found


@pytest.mark.parametrize("kind", ["resource_tracker", "worker"])
def test_killing_any_process_of_a_local_job_but_the_launcher_loses_at_most_that_worker(tmp_path, kind):
    """A local elastic job's processes: the launcher (with the Lighthouse), a worker per replica
    and multiprocessing's resource tracker (no fork server: docs/fault_tolerance.md). SIGKILL of
    any but the launcher, mid-run, loses at most that one worker; the job exits 0. The job has a
    secret: the Lighthouse behind its gate, each worker through a forwarder of its own."""
    import json
    import os
    import signal
    import subprocess
    import sys

    out, key = tmp_path / "job", tmp_path / "job.secret"
    key.write_text("0123456789abcdef0123456789abcdef")
    key.chmod(0o600)
    cmd = [sys.executable, "-m", "thinwire", "train", "--elastic", "--workers", "3", "--min-workers", "2",
           "--job-secret-file", str(key),
           "--method", "powersgd:rank=2", "--task", "synthetic", "--steps", "100", "--eval-every", "25",
           "--batch-size", "16", "--elastic-timeout", "3", "--out", str(out),
           *[a for kv in ("dim=24", "hidden=32", "classes=4", "samples=512", "test_samples=128")
             for a in ("--option", kv)]]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert job.stderr is not None
        for line in job.stderr:  # the job's progress: kill once the workers train together
            if line.startswith("[worker") and "step 25:" in line:
                break
        else:
            raise AssertionError(f"the job ended before step 25 (exit {job.wait()})")
        kids = children(job.pid)
        workers = sorted(p for p, c in kids.items() if "spawn_main" in c)
        assert len(workers) == 3 and not any("forkserver" in c for c in kids.values()), kids
        for pid in workers:  # its store, gloo and torchft's manager server: this machine alone
            where = _listeners(pid)
            assert len(where) >= 3 and set(where) == {"127.0.0.1"}, where
        victim = next(p for p, c in kids.items() if "resource_tracker" in c) if kind == "resource_tracker" \
            else workers[0]
        os.kill(victim, signal.SIGKILL)
        err = job.stderr.read()
        assert job.wait(timeout=120) == 0, err
    finally:
        if job.poll() is None:
            job.kill()
    exits = {r: w["exit"] for r, w in json.loads((out / "summary.json").read_text())["workers"].items()}
    finished = {r for r, code in exits.items() if code == 0}
    assert len(finished) == (2 if kind == "worker" else 3), exits
    if kind == "worker":
        assert sorted(code for code in exits.values()) == [-signal.SIGKILL, 0, 0], exits
    ends = {json.loads((out / f"worker-{r}" / "summary.json").read_text())["model_sha256"] for r in finished}
    assert len(ends) == 1  # the survivors end on one model

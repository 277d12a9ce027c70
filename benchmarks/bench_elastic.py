"""Elastic training under faults: workers killed, restarted, stopped; the job goes on.

Each job: a Lighthouse in this process and WORKERS workers, each its own
``python -m thinwire train --elastic --lighthouse ... --replica K`` process (a job over
machines, on one), ``--min-workers 2``. Per task and method, four jobs of the same seed:

* **reference**: no fault (and **reference, seed 1**: the same with another seed, the noise
  any loss gap is read against);
* **kill-restart**: every KILL_EVERY steps of the job one worker (1, 2, 3 in turn; worker 0
  stays, to be read) gets SIGKILL and is started again RESTART_S seconds later;
* **stop**: worker 3 gets SIGSTOP at step KILL_EVERY and SIGCONT STOP_S seconds later (it must
  be dropped, then told it is behind and brought up to date);
* **two-killed**: workers 2 and 3 get SIGKILL together at step KILL_EVERY, both restarted
  RESTART_S seconds later.

``--recovery N``: instead, N jobs per kill point of the quorum protocol (``_kill_point.py``:
before asking, while asking, answered, inside the group's rendezvous, group set up), each with
workers 2 and 3 dying at that point of the same quorum call, the first they ask for from step
RECOVERY_STEP on (each writes the moment it dies), and restarted RECOVERY_RESTART_S seconds
later; RECOVERY_STEPS steps of ``mnist1d``. For the last two points, which exist only in a
quorum that changed, worker 1 joins only at step RECOVERY_STEP (the other three start after
``--elastic-wait 3``), so that a new group is set up then. The
figure: from the first of the two deaths to worker 0's first quorum without either (target
TARGET_ABSENT_S, the worst over every job), and every finished worker bit-identical.

Read from the workers' own records (their ``metrics.jsonl`` quorum events and summaries):
steps discarded, seconds from a kill (or stop) to the quorum without the worker, seconds
from a restart (the new process's start) to its first quorum (it takes a present worker's
state there and commits that step), final test loss (worker 0's, averaged over its last
LAST_EVALS evaluations) against the reference's, whether every
worker that finished holds the same model bit for bit, bytes sent by all processes. Then the
steady-state cost: the same method without ``--elastic`` (thinwire's own launcher, gloo over
loopback) against the reference job, step time of the training steps alone, alternated
COST_PAIRS times (``--cost-only``: that alone). Targets: at most 1.03x for ``topk``, 1.05x for
the others. Both runs are timed over the same stretch, from their first evaluation (step
COST_FROM) to their last: the seconds of the training steps between them (the plain run's
``wall_seconds``, the elastic worker 0's ``train_seconds``; reading the batches and evaluating
left out of both) per step. The start is not the steady state: an elastic job's first
quorum waits for every worker to start, and a plain job's rendezvous happens before its clock.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import Figure, Report, load_note, parser, table
from thinwire.run.summary import WorkerSummary

WORKERS = 4
KILL_EVERY = 100
RESTART_S = 10.0
STOP_S = 20.0
COST_PAIRS = 5
COST_FROM = 100  # the steady-state cost is timed from this step (the first evaluation) to the last
LAST_EVALS = 5  # the final loss: worker 0's test loss averaged over its last evaluations (one is noisy)
END_GRACE_S = 20.0  # after worker 0 ends, how long the others get to end before they are killed
TASKS = {  # task: (steps, eval_every, extra options)
    "mnist1d": (1000, 10, []),
    "text": (400, 20, ["--option", "context=64", "--option", "eval_windows=128"]),
}
METHODS = {"mnist1d": ("powersgd", "diloco:period=20", "topk:ratio=0.01"), "text": ("powersgd", "diloco:period=20")}
TARGET_LOSS_PCT = 2.0
TARGET_ABSENT_S = 5.0
TARGET_REJOIN_S = 10.0
TARGET_COST = {"topk": 1.03}  # elastic step time / plain, per method name; the others 1.05
TARGET_COST_DEFAULT = 1.05
RECOVERY_STEP = 30
RECOVERY_STEPS = 400
RECOVERY_RESTART_S = 2.0
LATE_JOIN = ("rendezvous", "configured")  # kill points that need a quorum that changes: worker 1 joins late
KILL_POINT = Path(__file__).with_name("_kill_point.py")


@dataclass
class Incarnation:
    replica: int
    out: Path
    proc: subprocess.Popen
    started: float  # time.time() at the start of the process

    def summary(self) -> WorkerSummary | None:
        path = self.out / "summary.json"
        return WorkerSummary.read(str(path)) if path.exists() else None

    def records(self) -> list[dict[str, Any]]:
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
        return out


@dataclass
class Job:
    task: str
    method: str
    steps: int
    eval_every: int
    options: list[str]
    root: Path
    timeout: float
    lighthouse: Any = None
    seed: int = 0
    kill_point: str | None = None  # workers 2 and 3 die at this point of the quorum protocol
    runs: list[Incarnation] = field(default_factory=list)
    events: list[tuple[str, float, list[int]]] = field(default_factory=list)  # (what, time, replicas)

    def __post_init__(self) -> None:
        from thinwire.elastic import serve

        self.lighthouse = serve(2, join_timeout_s=self.timeout)

    def start(self, r: int) -> Incarnation:
        out = self.root / f"w{r}-{sum(1 for i in self.runs if i.replica == r)}"
        cmd = [sys.executable, "-m", "thinwire", "train", "--elastic", "--lighthouse",
               self.lighthouse.address.split("://", 1)[1], "--replica", str(r), "--workers", str(WORKERS),
               "--min-workers", "2", "--task", self.task, "--method", self.method, "--steps", str(self.steps),
               "--eval-every", str(self.eval_every), "--elastic-timeout", str(self.timeout), "--threads", "1",
               "--seed", str(self.seed),
               "--out", str(out), "--quiet", "--no-tensorboard", *self.options]
        if self.kill_point is not None and r in (2, 3) and out.name.endswith("-0"):
            cmd[1:4] = [str(KILL_POINT), self.kill_point, str(RECOVERY_STEP), str(self.stamp(r)), "--"]
        log = open(self.root / f"{out.name}.log", "w")  # noqa: SIM115  (the process writes it until it ends)
        inc = Incarnation(r, out, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), time.time())
        self.runs.append(inc)
        return inc

    def stamp(self, r: int) -> Path:
        """Where worker ``r`` writes the moment it kills itself."""
        return self.root / f"died-{r}"

    def live(self, r: int) -> Incarnation:
        return [i for i in self.runs if i.replica == r][-1]

    def step(self) -> int:
        """The job's step as worker 0 last recorded it."""
        evals = [x for x in self.live(0).records() if "event" not in x]
        return evals[-1]["step"] if evals else 0

    def signal(self, replicas: list[int], sig: int, what: str) -> None:
        self.events.append((what, time.time(), replicas))
        for r in replicas:
            self.live(r).proc.send_signal(sig)

    def wait(self, limit: float) -> None:
        t0 = time.time()
        for inc in self.runs:
            left = max(1.0, limit - (time.time() - t0))
            try:
                inc.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                inc.proc.kill()
                inc.proc.wait()

    def close(self) -> None:
        for inc in self.runs:
            if inc.proc.poll() is None:
                inc.proc.send_signal(signal.SIGCONT)
                inc.proc.kill()
                inc.proc.wait()
        self.lighthouse.shutdown()


def run_job(task: str, method: str, scenario: str, root: Path, timeout: float, quick: bool,
            eval_every: int | None = None) -> dict[str, Any]:
    steps, every, options = TASKS[task]
    eval_every = eval_every or every
    kill_every = KILL_EVERY
    kill_point = scenario.split("@", 1)[1] if "@" in scenario else None
    if quick:
        steps, kill_every = max(200, steps // 5), max(50, KILL_EVERY // 2)
    if kill_point is not None:
        steps, eval_every = RECOVERY_STEPS, 10
        if kill_point in LATE_JOIN:
            options = [*options, "--elastic-wait", "3"]
    job = Job(task, method, steps, eval_every, options,
              root / f"{task}-{method.split(':')[0]}-{scenario}-{time.time_ns()}", timeout,
              seed=1 if scenario == "reference, seed 1" else 0, kill_point=kill_point)
    job.root.mkdir(parents=True)
    t0 = time.time()
    try:
        pending: list[tuple[float, int]] = []  # (restart at, replica)
        for r in range(WORKERS):
            if kill_point in LATE_JOIN and r == 1:
                pending.append((float("inf"), 1))  # joins at RECOVERY_STEP: a quorum that changes
                continue
            job.start(r)
        next_fault, victim = kill_every, 1
        stopped_at: float | None = None
        while job.live(0).proc.poll() is None:
            time.sleep(0.1)
            now, step = time.time(), job.step()
            if kill_point is not None and step >= RECOVERY_STEP and (float("inf"), 1) in pending:
                pending[pending.index((float("inf"), 1))] = (now, 1)
            for at, r in [p for p in pending if p[0] <= now]:  # noqa: B007
                pending.remove((at, r))
                job.start(r)
            if scenario == "kill-restart" and step >= next_fault and next_fault < steps:
                job.signal([victim], signal.SIGKILL, "kill")
                pending.append((now + RESTART_S, victim))
                next_fault, victim = next_fault + kill_every, victim % (WORKERS - 1) + 1
            elif scenario == "two-killed" and step >= next_fault and next_fault == kill_every:
                job.signal([2, 3], signal.SIGKILL, "kill")
                pending += [(now + RESTART_S, 2), (now + RESTART_S, 3)]
                next_fault = steps + 1
            elif kill_point is not None and len(job.runs) == WORKERS and not pending and all(
                    job.live(r).proc.poll() is not None for r in (2, 3)):
                died = [float(job.stamp(r).read_text()) for r in (2, 3) if job.stamp(r).exists()]
                if len(died) != 2:
                    raise RuntimeError(f"{task} {method} {scenario}: workers 2 and 3 ended without dying at "
                                       f"{job.kill_point} (see {job.root.name}/w2-0.log)")
                job.events.append(("kill", min(died), [2, 3]))
                pending += [(now + RECOVERY_RESTART_S, 2), (now + RECOVERY_RESTART_S, 3)]
            elif scenario == "stop" and step >= next_fault and stopped_at is None:
                job.signal([3], signal.SIGSTOP, "stop")
                stopped_at = now
            if stopped_at is not None and now - stopped_at >= STOP_S and job.live(3).proc.poll() is None:
                job.signal([3], signal.SIGCONT, "cont")
                stopped_at = float("inf")
            if now - t0 > 1800:
                raise RuntimeError(f"{task} {method} {scenario}: the job did not end within 30 min")
        for inc in job.runs:  # a worker still stopped is let go: it finds the job over and ends
            if inc.proc.poll() is None:
                inc.proc.send_signal(signal.SIGCONT)
        job.wait(END_GRACE_S)
    finally:
        job.close()
    return read_job(job, time.time() - t0)


def read_job(job: Job, seconds: float) -> dict[str, Any]:
    summaries = [(inc, inc.summary()) for inc in job.runs]
    finished = [s for _, s in summaries if s is not None and s.status == "ok"]
    zero = job.live(0).summary()
    evals = [r["test_loss"] for r in job.live(0).records() if "event" not in r and r.get("test_loss") is not None]
    membership = zero.elastic if zero is not None else {}
    changes = membership.get("changes", [])
    absent = []  # kill or stop -> the quorum without the worker (worker 0's record)
    for what, at, replicas in job.events:
        if what not in ("kill", "stop"):
            continue
        later = [c for c in changes if c["time"] >= at and set(replicas) & set(c["left"])
                 and not set(replicas) & set(c["members"])]
        if later:
            absent.append(later[0]["time"] - at)
    rejoin = []  # a restarted process's start -> its first quorum (state taken, that step committed)
    for inc, s in summaries:
        if inc in job.runs[:WORKERS] or s is None or not s.elastic["changes"]:
            continue
        rejoin.append(s.elastic["changes"][0]["time"] - inc.started)
    cont = []  # SIGCONT -> the stopped worker brought up to date
    for what, at, replicas in job.events:
        if what == "cont":
            s = job.live(replicas[0]).summary()
            healed = [c for c in (s.elastic.get("changes", []) if s else []) if c["healed"] and c["time"] >= at]
            cont.append(healed[0]["time"] - at if healed else float("nan"))
    return {
        "finished": len(finished), "processes": len(job.runs),
        "identical": len({s.model_sha256 for s in finished}) == 1 if finished else False,
        "loss": statistics.mean(evals[-LAST_EVALS:]) if evals else None,
        "discarded": membership.get("discarded"),
        "absent": absent, "rejoin": rejoin, "cont": cont, "seconds": seconds,
        "bytes": sum(s.bytes_sent for _, s in summaries if s is not None),  # processes that ended cleanly
        "train_seconds": zero.train_seconds if zero else None, "steps": zero.committed_step if zero else None,
        "per_step": steady_seconds(job.live(0).records(), "train_seconds"),
        "faults": sum(1 for e in job.events if e[0] in ("kill", "stop")),
    }


def steady_seconds(records: list[dict[str, Any]], clock: str) -> float | None:
    """Seconds per training step from the first evaluation record to the last, read from
    the cumulative seconds of training steps ``clock`` (None: fewer than two records)."""
    evals = [r for r in records if "event" not in r and r.get(clock) is not None]
    if len(evals) < 2 or evals[-1]["step"] <= evals[0]["step"]:
        return None
    return (evals[-1][clock] - evals[0][clock]) / (evals[-1]["step"] - evals[0]["step"])


def plain_step_seconds(task: str, method: str, steps: int, eval_every: int, options: list[str], root: Path) -> float:
    """The same training without --elastic (thinwire's launcher): seconds per training step
    from the first evaluation to the last."""
    out = root / f"plain-{task}-{method.split(':')[0]}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "thinwire", "train", "--workers", str(WORKERS), "--task", task, "--method", method,
           "--steps", str(steps), "--eval-every", str(eval_every), "--threads", "1", "--out", str(out), "--quiet",
           "--no-tensorboard", *options]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out / "metrics.jsonl") as f:
        seconds = steady_seconds([json.loads(line) for line in f if line.strip()], "wall_seconds")
    if seconds is None:
        raise RuntimeError(f"{task} {method}: the plain run wrote fewer than two evaluations")
    return seconds


def fmt(xs: list[float]) -> str:
    return "-" if not xs else f"{statistics.median(xs):.2f} (max {max(xs):.2f}, n={len(xs)})"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated (default: mnist1d,text)")
    p.add_argument("--methods", help="comma-separated method specs (default: each task's)")
    p.add_argument("--timeout", type=float, default=4.0, help="--elastic-timeout and the join timeout (s)")
    p.add_argument("--recovery", type=int, metavar="N", help="only N jobs per kill point of the quorum protocol")
    p.add_argument("--points", help="with --recovery: comma-separated kill points (default: all)")
    p.add_argument("--no-cost", action="store_true", help="skip the steady-state cost comparison")
    p.add_argument("--cost-only", action="store_true", help="only the steady-state cost comparison (no faults)")
    args = p.parse_args(argv)
    command = "python benchmarks/bench_elastic.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]) if not a.endswith(".json") and a != "--json")
    if args.recovery is not None:
        return recovery(args, command)
    report = Report(f"elastic training under faults ({WORKERS} workers, --min-workers 2)", command)
    report.add(f"kill every {KILL_EVERY} steps (workers 1, 2, 3 in turn), restart {RESTART_S:g} s later; SIGSTOP "
               f"for {STOP_S:g} s; two killed at once; --elastic-timeout {args.timeout:g} s; {load_note()}")
    t0 = time.perf_counter()
    rows, cost_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for task in args.tasks.split(","):
            methods = args.methods.split(",") if args.methods else METHODS[task]
            for method in methods:
                name = method.split(":")[0]
                res = {}
                scenarios = () if args.cost_only else ("reference", "reference, seed 1", "kill-restart", "stop",
                                                       "two-killed")
                for scenario in scenarios:
                    r = res[scenario] = run_job(task, method, scenario, root, args.timeout, args.quick)
                    print(f"[{task} {method} {scenario}] {json.dumps(r)}", flush=True)
                ref = res["reference"]["loss"] if res else None
                seed_gap = 100 * abs(res["reference, seed 1"]["loss"] - ref) / ref if res else float("nan")
                for scenario, r in res.items():
                    gap = 100 * (r["loss"] - ref) / ref if r["loss"] is not None and ref else float("nan")
                    rows.append([task, name, scenario, r["faults"], f"{r['finished']}/{r['processes']}",
                                 "yes" if r["identical"] else "NO", r["discarded"], fmt(r["absent"]),
                                 fmt(r["rejoin"]), fmt(r["cont"]), f"{r['loss']:.4f}" if r["loss"] else "-",
                                 f"{gap:+.2f}%", f"{r['bytes'] / 1e6:.1f}", f"{r['seconds']:.0f}"])
                    if scenario.startswith("reference"):
                        continue
                    tag = f"[{task} {name} {scenario}]"
                    report.figures.append(Figure(f"final loss gap to the uninterrupted run {tag}", abs(gap), "<=",
                                                 TARGET_LOSS_PCT, "%",
                                                 f"{r['loss']:.4f} vs {ref:.4f}; seed 1 against seed 0: "
                                                 f"{seed_gap:.2f}%"))
                    report.figures.append(Figure(f"every finished worker bit-identical {tag}", float(r["identical"]),
                                                 ">=", 1.0, "", f"{r['finished']} finished"))
                    if r["absent"]:
                        report.figures.append(Figure(f"fault to the quorum without the worker, max {tag}",
                                                     max(r["absent"]), "<=", TARGET_ABSENT_S, " s"))
                    if r["rejoin"]:
                        report.figures.append(Figure(f"restart to the first step in the quorum, max {tag}",
                                                     max(r["rejoin"]), "<=", TARGET_REJOIN_S, " s"))
                if not args.no_cost and task == "mnist1d":
                    steps, eval_every, options = TASKS[task]
                    ratios = []
                    for _ in range(1 if args.quick else COST_PAIRS):
                        plain = plain_step_seconds(task, method, steps, COST_FROM, options, root)
                        el = run_job(task, method, "reference", root, args.timeout, False, eval_every=COST_FROM)
                        elastic = el["per_step"]
                        if elastic is None:
                            raise RuntimeError(f"{task} {method}: the elastic run wrote fewer than two evaluations")
                        ratios.append(elastic / plain)
                        cost_rows.append([task, name, f"{1e3 * plain:.2f}", f"{1e3 * elastic:.2f}",
                                          f"{elastic / plain:.3f}"])
                    report.figures.append(Figure(f"elastic step time / plain step time [{task} {name}]",
                                                 statistics.median(ratios), "<=",
                                                 TARGET_COST.get(name, TARGET_COST_DEFAULT), "x",
                                                 f"median of {len(ratios)} pairs"))
    if rows:
        report.add(table(["task", "method", "scenario", "faults", "finished/processes", "bit-identical", "discarded",
                      "fault -> quorum without it (s)", "restart -> in the quorum (s)", "SIGCONT -> up to date (s)",
                          "final test loss", "vs reference", "MB sent (all)", "job seconds"], rows))
    if cost_rows:
        report.add(table(["task", "method", "plain ms/step", "elastic ms/step", "ratio"], cost_rows))
    report.seconds = time.perf_counter() - t0
    return report.finish(args.json)


def recovery(args: Any, command: str) -> int:
    """``--recovery N``: workers 2 and 3 killed at each point of the quorum protocol, N jobs each."""
    from _kill_point import POINTS

    method = args.methods.split(",")[0] if args.methods else METHODS["mnist1d"][0]
    report = Report(f"recovery from two workers killed inside the quorum call ({WORKERS} workers, "
                    f"--min-workers 2, mnist1d, {method})", command)
    report.add(f"{args.recovery} job(s) per kill point, {RECOVERY_STEPS} steps, workers 2 and 3 die at the point "
               f"named of the first quorum call from step {RECOVERY_STEP} on (for {' and '.join(LATE_JOIN)}: the "
               f"one worker 1 joins at, started at step {RECOVERY_STEP}), restarted "
               f"{RECOVERY_RESTART_S:g} s later; --elastic-timeout "
               f"{args.timeout:g} s; {load_note()}")
    t0 = time.perf_counter()
    rows, absent, identical = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.recovery):
            for point in args.points.split(",") if args.points else POINTS:
                if point not in POINTS:
                    raise SystemExit(f"--points: {point!r} is not one of {', '.join(POINTS)}")
                r = run_job("mnist1d", method, f"two-killed@{point}", Path(tmp), args.timeout, False)
                print(f"[{point} {i}] {json.dumps(r)}", flush=True)
                absent += r["absent"] or [float("inf")]
                identical.append(r["identical"] and r["finished"] == r["processes"] - 2)
                rows.append([point, i, fmt(r["absent"]), f"{r['finished']}/{r['processes']}",
                             "yes" if r["identical"] else "NO", r["discarded"], fmt(r["rejoin"]),
                             f"{r['seconds']:.0f}"])
    report.add(table(["kill point", "job", "death -> quorum without both (s)", "finished/processes", "bit-identical",
                      "discarded", "restart -> in the quorum (s)", "job seconds"], rows))
    report.figures.append(Figure(f"death to the quorum without both, worst of {len(absent)} faulty jobs",
                                 max(absent), "<=", TARGET_ABSENT_S, " s",
                                 f"median {statistics.median(absent):.2f} s"))
    report.figures.append(Figure("jobs whose every finished worker is bit-identical (the killed excepted)",
                                 sum(identical) / len(identical), ">=", 1.0, "", f"{sum(identical)}/{len(identical)}"))
    report.seconds = time.perf_counter() - t0
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

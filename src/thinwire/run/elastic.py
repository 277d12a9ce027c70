"""``thinwire train --elastic``: a bundled task (or a user's) trained by workers that may leave and join.

Each worker is one process, one torchft replica group of one rank
(:class:`~thinwire.elastic.worker.ElasticWorker`). :func:`launch_elastic` runs a job on this
machine: a Lighthouse inside the launcher, ``--workers`` worker processes, the run going on
when one of them ends; given ``--lighthouse``, it runs the one worker ``--replica`` in this
process instead (a job over several machines, or a worker added to a running job by hand).

What a worker writes into its ``--out`` (a local job: ``OUT/worker-K``): ``metrics.jsonl``
(an evaluation record every ``--eval-every`` committed steps, with ``workers``, the quorum's
size, which TensorBoard shows as ``thinwire/workers``; and a record ``{"event": "quorum",
...}`` at every change of the quorum: the step, who left, who joined, the seconds it took,
whether this worker took a present worker's state), ``summary.json`` (``elastic``: the
changes, steps committed and discarded, heals, and the workers present per step as runs
``[first, last, workers]``, and ``model_sha256``, the final model's digest) and, with
``--checkpoint-every``, its checkpoints (the summary:
:class:`~thinwire.run.summary.WorkerSummary`). A local job's launcher writes
``OUT/summary.json``: every worker's summary and exit status
(:class:`~thinwire.run.summary.JobSummary`).

The data position is the step: worker ``K`` trains on the batch stream of rank ``K`` of
``--workers``, from batch ``step`` on, so a step tried again after a failed vote takes the
same batch and a worker that joins takes the batch of the step the job is at.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from thinwire.algorithms import reporting
from thinwire.run import checkpoint, outdir
from thinwire.run.config import TrainConfig
from thinwire.run.metrics import MetricsWriter, finite, write_json_atomic
from thinwire.run.summary import JobSummary, WorkerExit, WorkerSummary

Report = Callable[..., None]
EXIT_QUORUM_LOST = 3  # a worker that gave up waiting for --min-workers exits with this


def worker_out(out: str | None, replica: int) -> str | None:
    """A local job's folder for worker ``replica``."""
    return None if out is None else os.path.join(out, f"worker-{replica}")


# -- one worker ------------------------------------------------------------------------------------
def run_worker(cfg: TrainConfig, *, replica: int, lighthouse: str, out: str | None, report: Report | None = None,
               resume: str | None = None, resume_optional: bool = False,
               device: torch.device | str = "cpu", secret: bytes | None = None,
               host: str = "127.0.0.1") -> WorkerSummary:
    """Train as worker ``replica`` of the elastic job whose Lighthouse is at ``lighthouse``
    until the job has committed ``cfg.steps`` steps; returns this worker's summary (also
    written to ``out``). ``resume``: a checkpoint (or a worker folder) of this worker's to
    start from; the job's newest state still wins (a worker behind it takes it from a peer);
    ``resume_optional``: a folder without a checkpoint means a fresh start. ``secret``: the
    job's secret (:mod:`thinwire.elastic.secret`), or None; ``host``: the address the other
    workers reach this one at, and the one its store listens on."""
    run = _WorkerRun(cfg, replica, lighthouse, out, report, device, secret, host)
    try:
        if resume:
            _load(run.worker, resume, device, optional=resume_optional)
        run.train()
    finally:
        run.worker.close()
    return run.finish()


class _WorkerRun:
    """One worker's run: its task, model, optimizer and :class:`ElasticWorker`, the records it
    writes, and the clocks its summary reports."""

    def __init__(self, cfg: TrainConfig, replica: int, lighthouse: str, out: str | None, report: Report | None,
                 device: torch.device | str, secret: bytes | None = None, host: str = "127.0.0.1") -> None:
        from thinwire.elastic.worker import ElasticWorker
        from thinwire.run.trainer import build_optimizer, utc_now
        from thinwire.tasks import get as get_task

        assert cfg.steps is not None and cfg.eval_every is not None and cfg.lr is not None
        assert cfg.batch_size is not None and cfg.optimizer is not None
        self.cfg, self.replica, self.out, self.report, self.device = cfg, replica, out, report, device
        self.started = utc_now()
        self.task = get_task(cfg.task)(seed=cfg.seed, data_dir=cfg.data_dir, **cfg.task_options)
        self.model = self.task.build_model().to(device)
        self.optimizer = build_optimizer(cfg.optimizer, list(self.model.parameters()), cfg.lr,
                                         self.task.defaults.weight_decay, model=self.model, muon_lr=cfg.muon_lr)
        self.worker = ElasticWorker(self.model, self.optimizer, cfg.method, lighthouse=lighthouse, replica=replica,
                                    min_workers=int(cfg.min_workers or 1), timeout_s=cfg.elastic_timeout,
                                    wait_s=cfg.elastic_wait, bucket_mb=cfg.bucket_mb, start_workers=cfg.workers,
                                    secret=secret, host=host)
        self.writer = MetricsWriter(out, tensorboard=bool(cfg.tensorboard)) if out else None
        self.window = [0.0, 0]  # training losses since the last record: sum, count
        self.status: str = "ok"
        self.failure: str | None = None
        self.last_eval: dict[str, Any] = {}
        self.seen_changes = 0
        self.seen_refusals = 0
        self.t_start = time.perf_counter()
        self.first_commit: float | None = None
        self.train_seconds = 0.0  # the steps alone (quorum, forward, backward, average, vote): not reading the
        # batches nor evaluating, as a plain run's wall_seconds

    def train(self) -> None:
        """Steps until the job has committed ``cfg.steps``, or too few workers are left."""
        from thinwire.elastic.worker import QuorumLost

        cfg, worker = self.cfg, self.worker
        batches, at = None, -1
        while True:
            if worker.step >= int(cfg.steps or 0) and worker.method is not None:
                break  # done: a worker past its first quorum asks for no other (it would ask beside a step never run)
            t_step = time.perf_counter()
            try:
                done = worker.begin()
            except QuorumLost as e:
                self.status, self.failure = "stopped", f"{e}; the job's last committed state is step {worker.step}"
                break
            self.seen_changes = _log_changes(worker, self.writer, self.report, self.replica, self.seen_changes)
            self.seen_refusals = _log_refusals(worker, self.writer, self.report, self.replica, self.seen_refusals)
            if done >= int(cfg.steps or 0):
                break
            t_fetch = time.perf_counter()
            if at != done or batches is None:  # a heal moved the step, or a failed vote left it: the step's batch
                batches, at = self.task.train_batches(self.replica, cfg.workers, int(cfg.batch_size or 0),
                                                      start=done), done
            batch = next(batches)
            fetched = time.perf_counter() - t_fetch  # reading the data is not the step's (nor the plain run's)
            x, y = (t.to(self.device, non_blocking=True) for t in batch)
            at += 1
            loss = self.task.loss(self.model(x), y)
            loss.backward()
            committed = worker.commit(loss, self._step_fn(done))
            self.train_seconds += time.perf_counter() - t_step - fetched
            if not committed:
                at = -1
                continue
            self._committed(loss.item())
        if self.status == "stopped" and self.out and cfg.checkpoint_every and worker.step > 0:
            _save(worker, self.out, cfg, self.window)  # the last committed state, for a resume of the whole job

    def _step_fn(self, done: int) -> Callable[[], None]:
        """The optimizer's step for step ``done + 1``, at the schedule's learning rate."""
        from thinwire.optim import schedule

        cfg = self.cfg

        def step_fn() -> None:
            if cfg.lr_schedule != "constant" or cfg.warmup_steps:
                schedule.apply(self.optimizer, schedule.factor(done, int(cfg.steps or 0), cfg.lr_schedule,
                                                               cfg.warmup_steps, cfg.min_lr))
            self.optimizer.step()

        return step_fn

    def _committed(self, value: float) -> None:
        """A step the job committed: its loss on record, an evaluation and a checkpoint when due."""
        cfg, step = self.cfg, self.worker.step
        if self.first_commit is None:
            self.first_commit = time.perf_counter() - self.t_start
        if math.isfinite(value):
            self.window[0] += value
            self.window[1] += 1
        if step % int(cfg.eval_every or 1) == 0 or step == cfg.steps:
            self.last_eval = _evaluate(self.task, self.model, self.worker, value, self.window, step, cfg,
                                       self.t_start, self.optimizer, self.train_seconds)
            self.window = [0.0, 0]
            if self.writer is not None:
                self.writer.write(self.last_eval)
            if self.report is not None:
                self.report("eval", replica=self.replica, **self.last_eval)
        if self.out and cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
            _save(self.worker, self.out, cfg, self.window)

    def finish(self) -> WorkerSummary:
        """The worker's summary, written to its folder."""
        from thinwire.run.trainer import environment, utc_now
        from thinwire.version import __version__

        cfg, worker, tally = self.cfg, self.worker, self.worker.tally
        summary = WorkerSummary(
            task=cfg.task, method=cfg.method, replica=self.replica, workers=cfg.workers, steps=int(cfg.steps or 0),
            min_workers=int(cfg.min_workers or 1), seed=cfg.seed, lr=cfg.lr, optimizer=cfg.optimizer,
            config=_config_record(cfg), status=self.status, failure=self.failure, committed_step=worker.step,
            final=self.last_eval,
            elastic={"changes": [c.record() for c in tally.changes], "refusals": list(tally.refusals),
                     "committed": tally.committed,
                     "discarded": tally.discarded, "heals": tally.heals, "present": tally.present,
                     "seconds_to_first_commit": self.first_commit, "timeout_seconds": cfg.elastic_timeout,
                     "wait_seconds": cfg.elastic_wait},
            bytes_sent=worker.comm.meter.bytes_sent, messages=worker.comm.meter.messages,
            model_sha256=_model_digest(self.model), wall_seconds=time.perf_counter() - self.t_start,
            train_seconds=self.train_seconds, started_at=self.started, ended_at=utc_now(), version=__version__,
            **environment(self.device))
        record = summary.to_json()  # strict JSON: a NaN loss is null, and non_finite says so
        if self.writer is not None:
            self.writer.write_summary(record)
            self.writer.close()
        return WorkerSummary.from_json(record)  # what the file holds, as the trainer's summary


def _evaluate(task: Any, model: torch.nn.Module, worker: Any, value: float, window: list, step: int,
              cfg: TrainConfig, t_start: float, optimizer: torch.optim.Optimizer,
              train_seconds: float) -> dict[str, Any]:
    record: dict[str, Any] = {"step": step, "train_loss": value,
                              "train_loss_mean": window[0] / window[1] if window[1] else None}
    if cfg.evaluate:
        record.update({f"test_{k}": v for k, v in task.evaluate(model).items()})
    record.update(reporting.stats(worker.method))
    t = worker.tally
    record.update(workers=worker.workers, quorum_changes=len(t.changes), discarded_steps=t.discarded, heals=t.heals,
                  bytes_sent=worker.comm.meter.bytes_sent, messages=worker.comm.meter.messages,
                  elapsed_seconds=time.perf_counter() - t_start, train_seconds=train_seconds,
                  lr=optimizer.param_groups[0]["lr"])
    return record


def _log_changes(worker: Any, writer: MetricsWriter | None, report: Report | None, replica: int, seen: int) -> int:
    for change in worker.tally.changes[seen:]:
        record = {"event": "quorum", **change.record()}
        if writer is not None:
            writer.write_event(record)
        if report is not None:
            report("quorum", replica=replica, **change.record())
    return len(worker.tally.changes)


def _log_refusals(worker: Any, writer: MetricsWriter | None, report: Report | None, replica: int, seen: int) -> int:
    """The members of a quorum this worker did not admit, and the peers whose state it
    refused (:attr:`~thinwire.elastic.worker.Tally.refusals`), as events and on the console."""
    for refusal in worker.tally.refusals[seen:]:
        if writer is not None:
            writer.write_event({"event": "refused", **refusal})
        if report is not None:
            report("refused", replica=replica, **refusal)
    return len(worker.tally.refusals)


def _model_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's state, tensor by tensor in order: equal on two workers exactly
    when their models are equal bit for bit."""
    import hashlib

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _config_record(cfg: TrainConfig) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("policy_rules",)}


# -- checkpoints -------------------------------------------------------------------------------------
def _save(worker: Any, out: str, cfg: TrainConfig, window: list) -> None:
    """This worker's state at its last committed step: ``OUT/checkpoints/step-N/rank-0.pt``."""
    step = worker.step
    state = {"format": checkpoint.FORMAT, "rank": 0, "step": step, "model": worker.model.state_dict(),
             "optimizer": worker.optimizer.state_dict(), "method": worker.method.state_dict(),
             "manager": worker.manager.state_dict(), "window": list(window)}
    checkpoint.prepare(out, step)
    record = checkpoint.write_rank(out, step, 0, state)
    checkpoint.commit(out, step, {"world_size": 1, "task": cfg.task, "method": cfg.method, "seed": cfg.seed,
                                  "task_options": dict(cfg.task_options), "config": finite(_config_record(cfg)),
                                  "elastic": {"replica": worker.replica, "workers": cfg.workers}},
                      {"rank-0.pt": record})


def _load(worker: Any, path: str, device: torch.device | str, *, optional: bool = False) -> None:
    """Start from this worker's checkpoint: model, optimizer, the method's state and the step.
    ``optional``: a local job's worker folder without a checkpoint starts afresh (it takes the
    others' state at its first quorum)."""
    saved = (Path(path) / "meta.json").exists() or (checkpoint.root(path) / checkpoint.LATEST).exists()
    if optional and not saved:
        return
    d = checkpoint.locate(path)
    meta = checkpoint.read_meta(d)
    if meta.get("method") != worker.spec:
        raise ValueError(f"--resume {path}: its method is {meta.get('method')!r}, this run's {worker.spec!r}")
    worker.restore(checkpoint.load_rank(d, 0, map_location=device, meta=meta))


# -- a local job ----------------------------------------------------------------------------------------
def launch_elastic(cfg: TrainConfig, *, show_progress: bool = True) -> WorkerSummary | JobSummary:
    """Run the elastic job ``cfg`` describes: one worker here (``cfg.lighthouse`` given), or
    a Lighthouse and ``cfg.workers`` worker processes on this machine. Returns the summary:
    the worker's, or for a local job every worker's with its exit status."""
    from thinwire.elastic import secret as job_secret

    key = job_secret.read(cfg.job_secret_file)
    if cfg.lighthouse is not None:
        replica = cfg.replica if cfg.replica is not None else int(os.environ.get("RANK", "0"))
        from thinwire.elastic.lighthouse import check_reachable

        route = check_reachable(cfg.lighthouse, cfg.elastic_timeout)  # this machine's address towards it
        host = cfg.worker_host or route
        if key is None:  # a Lighthouse behind a gate says so at once (with a key, the worker's own handshake does)
            from thinwire.elastic.gate import probe
            from thinwire.elastic.lighthouse import split_address

            probe(*split_address(cfg.lighthouse), None, cfg.elastic_timeout)
        warning = secret_warning(cfg.lighthouse, key)
        if warning is not None:
            print(warning, file=sys.stderr, flush=True)
        torch.set_num_threads(cfg.threads or torch.get_num_threads())
        return run_worker(cfg, replica=replica, lighthouse=cfg.lighthouse, out=cfg.out,
                          report=_Printer(show_progress).report, resume=cfg.resume and _own_resume(cfg.resume, replica),
                          secret=key, host=host)
    return _local_job(cfg, show_progress, key)


def secret_warning(lighthouse: str, key: bytes | None) -> str | None:
    """The one warning of a worker without a job secret whose Lighthouse is not on this
    machine alone (None when it has a secret, or the job is local)."""
    from thinwire.elastic import secret as job_secret
    from thinwire.elastic.lighthouse import split_address

    if key is not None or job_secret.is_loopback(split_address(lighthouse)[0]):
        return None
    return ("thinwire: warning: this elastic job has no job secret and its Lighthouse is not on this machine alone: "
            f"any process that reaches the job's ports can take part in it; {job_secret.HOW}")


def _own_resume(path: str, replica: int) -> str:
    """A local job's folder holds a folder per worker: resume a worker from its own."""
    own = Path(path) / f"worker-{replica}"
    return str(own) if own.is_dir() else path


def _local_job(cfg: TrainConfig, show_progress: bool, key: bytes | None = None) -> JobSummary:
    """A Lighthouse in this process and ``cfg.workers`` worker processes, each the launcher's own
    child (``spawn``: no fork server, whose death would take every worker's exit status with it,
    and no lock shared between workers: each reports over a pipe of its own, so a worker killed
    mid-report blocks nobody). The one other process of the job is multiprocessing's resource
    tracker, which none of them needs (it tracks shared semaphores and memory; the job has none)."""
    import multiprocessing as mp
    from multiprocessing.connection import wait

    from thinwire.elastic.lighthouse import serve

    # a quorum waits for a live worker as long as a worker waits for a quorum (DiLoCo-family workers
    # ask only at their averages, up to a round apart); a dead one is known by its heartbeat
    lighthouse = serve(int(cfg.min_workers or 1), join_timeout_s=cfg.elastic_wait, secret=key,
                       gate_timeout_s=cfg.elastic_timeout)
    ctx = mp.get_context("spawn")
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // cfg.workers)
    if cfg.out:
        for r in range(cfg.workers):
            outdir.mkdir(cfg.out, f"worker-{r}")
    pipes = [ctx.Pipe(duplex=False) for _ in range(cfg.workers)]
    procs = [ctx.Process(target=_worker_main, args=(cfg, r, lighthouse.address, pipes[r][1], threads,
                                                     dict(os.environ), key), daemon=False)
             for r in range(cfg.workers)]
    readers = {pipes[r][0]: r for r in range(cfg.workers)}
    printer = _Printer(show_progress)
    summaries: dict[int, WorkerSummary] = {}
    errors: dict[int, str] = {}

    def take(conn: Any) -> None:
        """Every message waiting on a worker's pipe; the pipe is dropped at its end."""
        try:
            while conn.poll():
                kind, fields = conn.recv()
                if kind == "done":
                    summaries[fields["replica"]] = fields["summary"]
                elif kind == "error":
                    errors[fields["replica"]] = fields["error"]
                else:
                    printer.report(kind, **fields)
        except (EOFError, OSError):
            readers.pop(conn, None)

    try:
        for p, (_, send) in zip(procs, pipes):
            p.start()
            send.close()  # the worker holds the only writing end: its pipe ends when it does
        live = set(range(cfg.workers))
        while live:
            for ready in wait([*readers, *(procs[r].sentinel for r in live)], timeout=0.5):
                if ready in readers:
                    take(ready)
            for r in sorted(live):
                if not procs[r].is_alive():
                    procs[r].join()
                    take(pipes[r][0])  # what it said before it ended
                    live.discard(r)
                    if procs[r].exitcode != 0:
                        why = errors.get(r) or f"exit {procs[r].exitcode}"
                        printer.line(f"thinwire: worker {r} ended ({why}); the others go on")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)
        for receive, _ in pipes:
            receive.close()
        lighthouse.shutdown()
    printer.close()
    summary = JobSummary(lighthouse.address, {r: WorkerExit(procs[r].exitcode, errors.get(r), summaries.get(r))
                                              for r in range(cfg.workers)})
    if cfg.out:
        outdir.claim(cfg.out, "summary.json", "summary.json.tmp")
        write_json_atomic(os.path.join(cfg.out, "summary.json"), summary.to_json())
    return summary


def _worker_main(cfg: TrainConfig, replica: int, lighthouse: str, conn: Any, threads: int,
                 env: dict[str, str], key: bytes | None) -> None:
    from thinwire.run.launch import loopback_interface
    from thinwire.run.spawn import begin_rank

    begin_rank(env)  # the launcher's environment; gone with the launcher
    torch.set_num_threads(threads)
    loopback = loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:  # a local job's workers talk on this machine only
        os.environ["GLOO_SOCKET_IFNAME"] = loopback

    def report(kind: str, **fields: Any) -> None:
        conn.send((kind, fields))

    try:
        out = worker_out(cfg.out, replica)
        with outdir.hold(out):
            summary = run_worker(cfg, replica=replica, lighthouse=lighthouse, out=out, report=report,
                                 resume=worker_out(cfg.resume, replica) if cfg.resume else None,
                                 resume_optional=True, secret=key)
        conn.send(("done", {"replica": replica, "summary": summary}))
        if summary.status != "ok":
            sys.exit(EXIT_QUORUM_LOST)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001  (one line to the launcher; the others go on)
        first = str(e).splitlines()[0] if str(e) else ""
        conn.send(("error", {"replica": replica, "error": f"{type(e).__name__}: {first}"}))
        sys.exit(1)


class _Printer:
    """Progress of an elastic job: a line per quorum change and per evaluation (stderr)."""

    def __init__(self, show: bool) -> None:
        self.show = show

    def line(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def report(self, kind: str, **f: Any) -> None:
        if not self.show:
            return
        if kind == "quorum":
            what = ", ".join(part for part in (f"joined {f['joined']}" if f["joined"] else "",
                                               f"left {f['left']}" if f["left"] else "") if part)
            self.line(f"[worker {f['replica']}] step {f['step']}: quorum of {f['workers']} {f['members']}"
                      f"{': ' + what if what else ''} ({f['seconds']:.2f} s{', took state' if f['healed'] else ''})")
        elif kind == "refused":
            who = f"worker {f['worker']}" if f.get("worker") is not None else "a peer"
            self.line(f"[worker {f['replica']}] step {f['step']}: {who} refused: {f['why']}")
        elif kind == "eval":
            loss = f.get("test_loss")
            self.line(f"[worker {f['replica']}] step {f['step']}: train loss {f['train_loss']:.4f}"
                      + (f", test loss {loss:.4f}" if loss is not None else "") + f", {f['workers']} worker(s)")

    def close(self) -> None:
        return None

"""One rank's training loop: a plain user of thinwire's public API.

The loop is ordinary PyTorch; the method attaches with two calls (``after_backward`` and
``after_step``), exactly as in a user's own script. All ranks run the same number of steps
and the same evaluation schedule, so their collectives stay in lockstep.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from thinwire.algorithms import reporting
from thinwire.algorithms.base import Method
from thinwire.algorithms.build import build_method, method_optimizer
from thinwire.comm.base import Communicator
from thinwire.comm.fingerprint import agree_on_parameters
from thinwire.comm.groups import local_part, meter_fsdp, shard_replica
from thinwire.comm.link import Link, meter_seconds
from thinwire.comm.meter import LINKS, sent_bytes
from thinwire.optim import schedule
from thinwire.run import checkpoint, memory
from thinwire.run.config import TrainConfig
from thinwire.run.metrics import MetricsWriter
from thinwire.run.summary import Summary
from thinwire.timing import Timing

Report = Callable[..., None]  # report(kind, **fields): progress to the launcher (rank 0 only)
STOP_POLL_SECONDS = 1.0  # how often (in training time) the ranks agree on a stop request


@dataclass
class Clock:
    """Seconds spent in the local part of training (forward, backward, optimizer)."""

    compute: float = 0.0
    backward: float = 0.0  # seconds in loss.backward() (the window gradient averaging can overlap)
    train_wall: float = 0.0
    skipped: int = 0  # steps dropped on every rank for a non-finite gradient (--on-nonfinite skip)
    steps_run: int = 0  # training steps this process ran (a resumed run: those after its checkpoint)
    checkpoints: int = 0  # written by this run (not a resumed run's earlier ones)
    checkpoint_seconds: float = 0.0  # spent writing them (outside the training-step clocks)
    codec_before: float = 0.0  # a resumed run's codec and communication seconds before its checkpoint
    comm_before: float = 0.0
    first_nonfinite: dict[str, Any] = field(default_factory=dict)  # the first skipped step's step, rank, parameter


SKIPPED_SHARE_DEAD = 0.5  # a run that skipped more than this share of its steps did not train: it ends non-zero


def build_optimizer(name: str, params, lr: float, weight_decay: float = 0.0, *, model: torch.nn.Module | None = None,
                    muon_lr: float | None = None) -> torch.optim.Optimizer:
    """``adam``, ``adamw`` (decoupled weight decay), ``sgd`` (momentum 0.9) or ``muon`` (Muon for
    ``model``'s hidden matrices, AdamW for the rest: :mod:`thinwire.optim.muon`)."""
    if name == "muon":
        from thinwire.optim.muon import muon_adamw

        if model is None:
            raise ValueError("--optimizer muon needs the model (its layers decide which weights Muon trains)")
        return muon_adamw(model, lr, weight_decay=weight_decay, muon_lr=muon_lr)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)


def optimizer_for(spec: Any, name: str, params: list[torch.nn.Parameter], lr: float, weight_decay: float,
                  comm: Communicator, *, model: torch.nn.Module | None = None,
                  muon_lr: float | None = None) -> torch.optim.Optimizer:
    """The run's optimizer: the method's own where the method is one (DeMo), else ``name``."""
    own = method_optimizer(spec, params, lr, weight_decay=weight_decay, comm=comm)
    return own if own is not None else build_optimizer(name, params, lr, weight_decay, model=model, muon_lr=muon_lr)


@dataclass
class _Run:
    """One rank's training run: what the loop's parts share."""

    cfg: TrainConfig
    comm: Communicator
    task: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    method: Method
    device: torch.device | str
    report: Report | None
    stop_requested: Callable[[], int | bool] | None
    fp32_per_step: float  # bytes an fp32 all_reduce of the trained parameters sends per step
    model_bytes: int  # the model's state before the method changed it (AB-training's factors)
    steps: int  # cfg.steps and cfg.eval_every, filled by TrainConfig.resolve()
    eval_every: int
    clock: Clock = field(default_factory=Clock)
    start: int = 0  # the step a resumed run continues after
    last_eval: dict[str, Any] = field(default_factory=dict)
    writer: MetricsWriter | None = None
    t_start: float = 0.0
    # stop requests: agreed about once a second from the first whole step
    poll_every: int = 1
    step_seconds: float = 0.0
    stop_signal: int = 0
    stopped_at: int | None = None
    # the traffic counters before the method's end-of-run work (the last record's ``*_before_finish``)
    before_finish: dict[str, float] | None = None
    stop_agreed: Callable[[], None] | None = None  # told when the ranks agreed to stop after this step
    # this rank's training losses since the last metrics row (finite ones): their sum and count
    loss_sum: float = 0.0
    loss_steps: int = 0
    started_at: str = ""  # when this process began the run (ISO 8601, UTC)
    activation_bytes: int | None = None  # what this process's first forward pass saved for backward

    @property
    def skip_mode(self) -> bool:
        """``--on-nonfinite skip``: a step is agreed on before anything is encoded."""
        return self.cfg.on_nonfinite == "skip"


def train_rank(
    cfg: TrainConfig, comm: Communicator, report: Report | None = None, device: torch.device | str = "cpu",
    stop_requested: Callable[[], int | bool] | None = None, stop_agreed: Callable[[], None] | None = None,
) -> Summary | None:
    """Train on this rank's ``device``; rank 0 writes metrics and returns the summary (others
    return None).

    ``cfg.resume`` continues from a checkpoint (every state restored, the data stream
    advanced to its step); ``cfg.checkpoint_every`` writes one every K steps and at the last
    step (a finished run can be extended from where it ended). After each
    backward the gradients are checked (one fused norm) before anything is encoded: with
    ``cfg.on_nonfinite == "raise"`` a rank holding a non-finite one raises, naming the
    parameter (the launcher stops the others); with ``"skip"`` one small all_reduce (not
    metered) per step lets every rank agree and drop the step alike. A stop request
    (``stop_requested()``, e.g. a signal) is agreed on the same way, about once a second
    (:data:`STOP_POLL_SECONDS`): the step is finished, a checkpoint written when there is
    an ``--out``, and the run ends early with ``stopped_at`` in its summary (and ``signal``,
    the signal any rank got: ``stop_requested()`` returns its number, or True for a request
    without one). ``stop_agreed()`` is called on every rank once the ranks agreed to stop
    (also on a rank that had not seen the request itself).

    The summary's ``status`` is ``ok``, ``stopped``, or ``diverged`` (with ``failure`` saying
    why) for a run that skipped most of its steps for non-finite gradients or whose final
    loss is not finite; nothing non-finite is written to JSON (see :mod:`thinwire.run.metrics`)."""
    started = utc_now()
    run = _setup(cfg, comm, report, device, stop_requested)
    run.started_at, run.stop_agreed = started, stop_agreed
    batches = run.task.train_batches(comm.rank, comm.world_size, cfg.batch_size, start=run.start)  # batch b: any start
    net = run.method.forward_module(run.model)  # PyTorch's DDP peers run forward and backward through their wrapper
    run.t_start = time.perf_counter()
    for step in range(run.start + 1, run.steps + 1):
        loss, stop = _train_step(run, net, next(batches), step)
        last = step == run.steps
        due = bool(cfg.out) and ((bool(cfg.checkpoint_every) and (step % cfg.checkpoint_every == 0 or last)) or stop)
        if last:
            # the last checkpoint holds the run before the method's end-of-run work (DiLoCo's merge
            # of the averages in flight, AB-training's final sync), so a longer run resumed from it
            # continues exactly as the straight run would; the metrics see the finished model
            if due:
                _checkpoint(run, step, _window_after(run, loss, step))
            meter = run.comm.meter
            run.before_finish = {"bytes_sent_before_finish": meter.bytes_sent,
                                 "messages_before_finish": meter.messages,
                                 "intra_bytes_before_finish": meter.bound_bytes("intra"),
                                 "intra_messages_before_finish": meter.bound_messages("intra")}
            t6 = time.perf_counter()
            run.method.finish()
            run.clock.train_wall += time.perf_counter() - t6
        _record(run, loss, step, last)
        if due and not last:
            _checkpoint(run, step, (run.loss_sum, run.loss_steps))
        if stop:
            run.stopped_at = step
            break
    return _finish(run)


def _checkpoint(run: _Run, step: int, window: tuple[float, int]) -> None:
    t5 = time.perf_counter()
    _save(run.cfg, run.comm, step, run.model, run.optimizer, run.method, run.clock, run.last_eval, run.device,
          window)
    run.clock.checkpoints += 1
    run.clock.checkpoint_seconds += time.perf_counter() - t5


def _window_after(run: _Run, loss: torch.Tensor, step: int) -> tuple[float, int]:
    """The training-loss window (sum, steps) :func:`_record` leaves after ``step`` in a run
    that goes on past it: emptied at an evaluation step, else with this step's loss added."""
    if step % run.eval_every == 0:
        return 0.0, 0
    value = loss.item()
    return (run.loss_sum + value, run.loss_steps + 1) if math.isfinite(value) else (run.loss_sum, run.loss_steps)


def _setup(cfg: TrainConfig, comm: Communicator, report: Report | None, device: torch.device | str,
           stop_requested: Callable[[], int | bool] | None) -> _Run:
    """The task, an identical model on every rank, the optimizer and the method; a resumed
    run's every state; the metrics writer (rank 0)."""
    from thinwire.tasks import get as get_task

    if cfg.steps is None or cfg.eval_every is None or cfg.optimizer is None or cfg.lr is None:
        raise ValueError("train_rank needs a resolved config (TrainConfig.resolve() fills every default)")
    task = get_task(cfg.task)(seed=cfg.seed, data_dir=cfg.data_dir, **cfg.task_options)
    model = task.build_model().to(device)
    # ranks whose task built another model are named here, before the broadcast below could fail in gloo
    agree_on_parameters(model.named_parameters(), comm)
    with comm.meter.paused():  # set-up traffic is not the method's
        for p in model.parameters():
            comm.broadcast(p.data, src=0)  # identical start even if a user's init is not seeded
    groups = comm.hierarchy
    if groups is not None and groups.sharded:  # --shard: each group's replica sharded over its ranks (FSDP2)
        shard_replica(model, groups.mesh["group"])
        meter_fsdp(model, comm.meter)  # FSDP's own collectives, counted inside the group
    optimizer = optimizer_for(cfg.method_spec(), cfg.optimizer, list(model.parameters()), cfg.lr,
                              task.defaults.weight_decay, comm, model=model, muon_lr=cfg.muon_lr)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # before a method reshapes the model
    model_bytes = memory.tensor_bytes(model.state_dict())
    # gradients are averaged while backward goes on, except where a step must be agreed on
    # before anything is encoded (--on-nonfinite skip)
    method = build_method(cfg.method_spec(), model, optimizer, comm, bucket_mb=cfg.bucket_mb,
                          overlap=cfg.on_nonfinite != "skip")
    run = _Run(cfg, comm, task, model, optimizer, method, device, report, stop_requested,
               fp32_per_step=sent_bytes("all_reduce", 4 * trained, comm.world_size), model_bytes=model_bytes,
               steps=cfg.steps, eval_every=cfg.eval_every)
    if cfg.resume:
        run.start, run.last_eval, history, (run.loss_sum, run.loss_steps) = _resume(
            cfg, comm, model, optimizer, method, run.clock, device)
        with comm.meter.paused():
            comm.barrier()  # every rank loaded its file before rank 0 touches the run's outputs
    else:
        history = []
    if comm.rank == 0 and cfg.out:
        run.writer = MetricsWriter(cfg.out, history, tensorboard=bool(cfg.tensorboard))
        if not (cfg.resume and checkpoint.in_place(checkpoint.locate(cfg.resume), cfg.out)):
            checkpoint.clear(cfg.out)  # a fresh run or one resumed elsewhere (--overwrite): earlier checkpoints go
    return run


def _train_step(run: _Run, net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                step: int) -> tuple[torch.Tensor, bool]:
    """Forward, backward, the non-finite check and the stop agreement, the method's calls
    and the optimizer's step; the clocks. Returns the loss and whether the ranks agreed to
    stop after this step."""
    cfg, clock, method = run.cfg, run.clock, run.method
    t0 = time.perf_counter()
    x, y = (t.to(run.device, non_blocking=True) for t in batch)
    before = _spent(method)
    if run.activation_bytes is None:  # once: the activations a step holds, for the summary's memory figures
        with memory.SavedForBackward() as saved:
            loss = run.task.loss(net(x), y)
        run.activation_bytes = saved.bytes
    else:
        loss = run.task.loss(net(x), y)
    run.optimizer.zero_grad(set_to_none=False)
    tb = time.perf_counter()
    loss.backward()
    t1 = time.perf_counter()
    clock.backward += t1 - tb
    # PyTorch's DDP peers average inside backward, blocking it: their codec and
    # communication time is theirs, not compute (thinwire's overlapping buckets run beside it)
    in_backward = _spent(method) - before if method.averages_in_backward else 0.0
    params = list(run.model.named_parameters())  # each step: AB-training swaps weights for factors
    verdict = _Verdict(run, step, params, _nonfinite(params))  # this rank's own gradients: means land later
    if verdict.bad is not None and cfg.on_nonfinite == "raise":  # the launcher stops the other ranks
        raise FloatingPointError(f"non-finite gradient in {verdict.bad[1]} on rank {run.comm.rank} at step {step} "
                                 "(--on-nonfinite skip drops such steps on every rank instead)")
    if run.skip_mode:
        verdict.agree()  # before anything is encoded: every rank drops a bad step alike
    if verdict.bad is None:
        method.after_backward(loss.detach())
        if not run.skip_mode:
            verdict.agree()  # after the method's collectives, which may still be in flight until after_backward
        t2 = time.perf_counter()
        spent = _spent(method)
        if cfg.lr_schedule != "constant" or cfg.warmup_steps:  # a pure function of the step: resumes exactly
            schedule.apply(run.optimizer, schedule.factor(step - 1, run.steps, cfg.lr_schedule, cfg.warmup_steps,
                                                          cfg.min_lr))
        run.optimizer.step()
        t3 = time.perf_counter()
        # a method that is the optimizer (DeMo) encodes and communicates inside its step
        in_step = _spent(method) - spent if method.replaces_optimizer else 0.0
        method.after_step()
    else:  # skipped on every rank alike, before anything is encoded or stepped
        run.optimizer.zero_grad(set_to_none=False)
        clock.skipped += 1
        if not clock.first_nonfinite:
            clock.first_nonfinite = {"step": step, "rank": verdict.bad[0], "parameter": verdict.bad[1]}
        t2 = t3 = time.perf_counter()
        in_step = 0.0
    t4 = time.perf_counter()
    run.step_seconds = t4 - t0  # the whole step, codec and communication included
    clock.compute += (t1 - t0 - in_backward) + (t3 - t2 - in_step)
    clock.train_wall += t4 - t0
    clock.steps_run += 1
    if verdict.bad is None and not math.isfinite(loss.item()):
        raise FloatingPointError(f"training loss is {loss.item()} at step {step} on rank {run.comm.rank}")
    return loss, verdict.stop and step < run.steps  # a stop agreed on the last step: the run simply finishes


class _Verdict:
    """One step's agreement among the ranks: who holds a non-finite gradient (``bad``: rank
    and parameter name, or None) and whether any rank asked to stop, in one small
    all_reduce, only where one is needed (``--on-nonfinite skip``, or a stop poll)."""

    def __init__(self, run: _Run, step: int, params: list[tuple[str, torch.nn.Parameter]], idx: int | None) -> None:
        self.run, self.step, self.params, self.idx = run, step, params, idx
        self.bad = None if idx is None else (run.comm.rank, params[idx][0])
        self.stop = False
        self.polling = run.stop_requested is not None and (
            step <= run.start + 2 or (step - run.start) % run.poll_every == 0)

    def agree(self) -> None:
        run = self.run
        if not (self.polling or run.skip_mode):
            return
        asked = _signum(run.stop_requested()) if (self.polling and run.stop_requested is not None) else 0
        who, self.idx, run.stop_signal, seconds = _agree(run.comm, self.idx, asked, run.step_seconds, run.device)
        self.stop = run.stop_signal != 0
        if self.stop and run.stop_agreed is not None:
            # also on a rank that polled before the signal reached it: its launcher (or its own
            # grace timer) lets it finish the step and write the checkpoint
            run.stop_agreed()
        self.bad = None if who is None else (who, self.params[self.idx][0])
        if self.polling and self.step == run.start + 2:  # from the first whole step: ask about once a second
            run.poll_every = max(1, min(1000, math.ceil(STOP_POLL_SECONDS / max(seconds, 1e-9))))


def _record(run: _Run, loss: torch.Tensor, step: int, last: bool) -> None:
    """Progress to the launcher and, every ``eval_every`` steps and at the last, an evaluation
    (metrics.jsonl on rank 0)."""
    cfg = run.cfg
    value = loss.item()
    if math.isfinite(value):  # a step skipped for a non-finite gradient may have a NaN loss
        run.loss_sum += value
        run.loss_steps += 1
    if run.report is not None and run.comm.rank == 0:
        run.report("step", step=step, loss=value)
    if step % run.eval_every == 0 or last:
        run.last_eval = _evaluate(run.task, run.model, run.comm, loss, step, cfg, run.clock, run.method,
                                  run.fp32_per_step, run.t_start, window=(run.loss_sum, run.loss_steps))
        run.loss_sum, run.loss_steps = 0.0, 0
        run.last_eval["lr"] = run.optimizer.param_groups[0]["lr"]  # the rate of this step (a schedule moves it)
        if last and run.before_finish is not None:  # the steps' own traffic, without finish()'s (thinwire cost)
            run.last_eval.update(run.before_finish)
        if run.writer:
            run.writer.write(run.last_eval)
        if run.report is not None and run.comm.rank == 0:
            run.report("eval", **run.last_eval)


def _finish(run: _Run) -> Summary | None:
    """The summary (rank 0's is written and returned)."""
    from thinwire.version import __version__

    cfg = run.cfg
    summary = _summary(cfg, run.comm, run.method, run.clock, run.fp32_per_step, run.last_eval, __version__,
                       run.device, run.model_bytes, run.model, done=run.stopped_at or run.steps, task=run.task,
                       optimizer=run.optimizer, activations=run.activation_bytes)
    summary = dataclasses.replace(summary, warnings=list(getattr(run.method, "warned", [])),
                                  resumed_from=run.start or None, stopped_at=run.stopped_at,
                                  started_at=run.started_at, ended_at=utc_now())
    if run.stopped_at is not None:  # not over: no verdict on a run that may yet train
        summary = dataclasses.replace(summary, status="stopped", failure=None, signal=_signal_name(run.stop_signal))
    record = summary.to_json()  # strict JSON: a NaN loss is null, and non_finite says so
    summary = Summary.from_json(record)  # what the file holds
    if run.writer:
        if run.stopped_at is None:  # a stopped run is not finished: no summary.json, a checkpoint instead
            run.writer.write_summary(record)
        run.writer.close()
    return summary if run.comm.rank == 0 else None


def _nonfinite(params) -> int | None:
    """Index of this rank's first parameter whose gradient has a non-finite norm (a NaN or
    inf in it, or values so large the norm overflows fp32), or None; one fused norm pass."""
    held = [i for i, (_, p) in enumerate(params) if p.grad is not None]
    if not held:
        return None
    norms = torch.stack(torch._foreach_norm([local_part(params[i][1].grad) for i in held]))  # a shard: its own
    finite = norms.isfinite()
    if bool(finite.all()):
        return None
    return held[int((~finite).nonzero()[0].item())]  # a norm overflowing fp32 counts too


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # named in this order of precedence when ranks got different ones


def _signum(asked: int | bool) -> int:
    """A ``stop_requested()`` answer as a signal number (-1: a request without a signal)."""
    if isinstance(asked, bool) or asked is None:
        return -1 if asked else 0
    return int(asked)


def _signal_name(signum: int) -> str:
    return signal.Signals(signum).name if signum > 0 else "a stop request"


def _agree(comm: Communicator, bad: int | None, stop: int, seconds: float,
           device: torch.device | str = "cpu") -> tuple[int | None, int, int, float]:
    """One all_reduce (not metered) of every rank's findings: (the highest rank holding a
    non-finite gradient and the index of its first such parameter, or None and -1; the stop
    any rank asked for, as a signal number (SIGTERM before SIGINT; -1 for a request without
    a signal; 0 for none); the mean of ``seconds``). Each rank fills its own slot, so every
    rank names the same parameter."""
    n = comm.world_size
    kinds = len(STOP_SIGNALS)
    values = [0.0] * (n + kinds + 2)
    if bad is not None:
        values[comm.rank] = bad + 1.0
    if stop:  # a count per kind of stop: the sum of the ranks' own
        slot = STOP_SIGNALS.index(stop) if stop in STOP_SIGNALS else kinds
        values[n + slot] = 1.0
    values[-1] = seconds
    flags = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL reduces on the rank's GPU
    with comm.meter.paused():
        comm.all_reduce(flags)
    got = flags.tolist()
    offenders = [(r, int(got[r]) - 1) for r in range(n) if got[r] > 0]
    who, idx = offenders[-1] if offenders else (None, -1)
    asked = [int(sig) for sig, count in zip(STOP_SIGNALS, got[n:n + kinds]) if count > 0]
    agreed = asked[0] if asked else (-1 if got[n + kinds] > 0 else 0)
    return who, idx, agreed, got[-1] / n


def _save(cfg, comm, step, model, optimizer, method, clock, last_eval, device="cpu",
          loss_window: tuple[float, int] = (0.0, 0)) -> None:
    """This rank's checkpoint file; after every rank has written, rank 0 commits it. Between
    sharded groups each group's model and optimizer go through torch.distributed.checkpoint
    into its own folder first (:func:`checkpoint.write_group`), recorded in the rank's file."""
    with comm.meter.paused():
        own = method.state_dict()  # first: it may land work in flight, whose seconds count below
        t = method.timing
        groups = comm.hierarchy if comm.hierarchy is not None and comm.hierarchy.sharded else None
        if comm.rank == 0:
            checkpoint.prepare(cfg.out, step, groups.layout.count if groups is not None else 0)
        comm.barrier()
        held: dict[str, Any] = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if groups is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(model, optimizer)
            held = {"group_files": checkpoint.write_group(cfg.out, step, groups.node, {
                "model": model_state, "optimizer": optimizer_state}, groups.mesh.get_group("group"))}
        state = {
            "format": checkpoint.FORMAT, "rank": comm.rank, "step": step, **held,
            "method": own,
            "meter": _meter_state(comm.meter), "rng": checkpoint.rng_state(), "last_eval": dict(last_eval),
            "seconds": {"compute": clock.compute, "backward": clock.backward, "train_wall": clock.train_wall,
                        "skipped": clock.skipped,
                        "codec": t.codec_seconds + clock.codec_before, "comm": t.comm_seconds + clock.comm_before},
            "first_nonfinite": dict(clock.first_nonfinite),
            "loss_window": list(loss_window),  # this rank's training losses since the last metrics row
        }
        record = checkpoint.write_rank(cfg.out, step, comm.rank, state)
        files = _gather_records(comm, record, device)  # also the barrier: every rank's file is on disk
        if comm.rank == 0:
            checkpoint.commit(cfg.out, step, {"world_size": comm.world_size, "task": cfg.task, "method": cfg.method,
                                              "seed": cfg.seed, "task_options": cfg.task_options,
                                              "config": cfg.to_dict()}, files)
        comm.barrier()  # nobody resumes from, or removes, a checkpoint still being committed


def _gather_records(comm, record: dict[str, Any], device) -> dict[str, dict[str, Any]]:
    """Every rank's checkpoint file record (:func:`checkpoint.write_rank`), on every rank: one
    all_reduce (the caller pauses the meter) of a row per rank, its SHA-256 bytes and size."""
    n = comm.world_size
    rows = torch.zeros(n, 33, dtype=torch.float64, device=device)
    rows[comm.rank, :32] = torch.tensor(list(bytes.fromhex(record["sha256"])), dtype=torch.float64)
    rows[comm.rank, 32] = float(record["bytes"])  # exact below 2**53 bytes
    comm.all_reduce(rows)
    return {f"rank-{r}.pt": {"sha256": bytes(int(v) for v in row[:32]).hex(), "bytes": int(row[32])}
            for r, row in enumerate(rows.tolist())}


def _resume(cfg, comm, model, optimizer, method, clock, device):
    """Restore every state of this rank from ``cfg.resume``: (step, last evaluation, the
    metrics records up to the step, for rank 0, and the training losses since the last row)."""
    from thinwire.run.metrics import read_jsonl

    d = checkpoint.locate(cfg.resume)
    meta = checkpoint.read_meta(d)
    checkpoint.check_matches(meta, workers=comm.world_size, task=cfg.task, method=cfg.method, steps=cfg.steps,
                             task_options=cfg.task_options, seed=cfg.seed, batch_size=cfg.batch_size,
                             optimizer=cfg.optimizer, lr=cfg.lr)
    state = checkpoint.load_rank(d, comm.rank, map_location=device, meta=meta)
    groups = comm.hierarchy if comm.hierarchy is not None and comm.hierarchy.sharded else None
    if groups is not None:  # the group's model and optimizer, through torch.distributed.checkpoint
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if "group_files" not in state:
            raise checkpoint.CheckpointError(f"checkpoint {d} holds whole models (a run without --shard): resume "
                                             "it without --shard")
        model_state, optimizer_state = get_state_dict(model, optimizer)
        held = {"model": model_state, "optimizer": optimizer_state}
        checkpoint.load_group(d, groups.node, held, groups.mesh.get_group("group"), state["group_files"])
        set_state_dict(model, optimizer, model_state_dict=cast(Any, held["model"]),
                       optim_state_dict=cast(Any, held["optimizer"]))
    else:
        if "model" not in state:
            raise checkpoint.CheckpointError(f"checkpoint {d} holds sharded groups (a run with --shard): resume it "
                                             "with --shard")
        model.load_state_dict(state["model"])  # model, optimizer, then the method (AB's factors travel in the model)
        optimizer.load_state_dict(state["optimizer"])
    method.load_state_dict(state["method"])
    _load_meter(comm.meter, state["meter"])
    checkpoint.set_rng_state(state["rng"])
    sec = state["seconds"]
    clock.compute, clock.train_wall, clock.skipped = sec["compute"], sec["train_wall"], int(sec["skipped"])
    clock.backward = float(sec.get("backward", 0.0))
    clock.first_nonfinite = dict(state.get("first_nonfinite") or {})
    t = method.timing
    clock.codec_before, clock.comm_before = sec["codec"] - t.codec_seconds, sec["comm"] - t.comm_seconds
    step = int(state["step"])
    own = checkpoint.run_dir(d)
    source = own / "metrics.jsonl" if own is not None else None
    history = ([r for r in read_jsonl(str(source)) if r["step"] <= step]
               if (comm.rank == 0 and source is not None and source.exists()) else [])
    window = state.get("loss_window") or (0.0, 0)  # a checkpoint written before metrics kept it: none
    return step, dict(state["last_eval"]), history, (float(window[0]), int(window[1]))


def _meter_state(meter) -> dict[str, Any]:
    def counts(c):
        return [c.calls, c.bytes, c.messages, c.payload_bytes]

    return {"ops": {op: counts(c) for op, c in meter.ops.items()},
            "by_group": [[op, n, *counts(c), link] for (op, n, link), c in meter.by_group.items()],
            "by_link": {link: counts(c) for link, c in meter.by_link.items()}}


def _load_meter(meter, state: dict[str, Any]) -> None:
    from thinwire.comm.meter import OpCount

    def count(v):
        return OpCount(calls=int(v[0]), bytes=float(v[1]), messages=int(v[2]), payload_bytes=int(v[3]))

    meter.ops = {op: count(v) for op, v in state["ops"].items()}
    # rows saved before two links were counted have no link: everything was "inter" then
    meter.by_group = {(row[0], int(row[1]), row[6] if len(row) > 6 else "inter"): count(row[2:6])
                      for row in state["by_group"]}
    meter.by_link = {link: count(v) for link, v in state.get("by_link", {}).items()}
    if not meter.by_link and meter.ops:
        meter.by_link = {"inter": count([sum(getattr(c, f) for c in meter.ops.values())
                                         for f in ("calls", "bytes", "messages", "payload_bytes")])}


def _peak_rss() -> int | None:
    """Peak resident set size of this process in bytes (None where the OS does not say)."""
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
    except (ImportError, OSError):
        return None


def _timing(method, clock: Clock):
    """The method's codec and communication seconds, a resumed run's earlier ones included."""
    t = method.timing
    return Timing(codec_seconds=t.codec_seconds + clock.codec_before, comm_seconds=t.comm_seconds + clock.comm_before)


def _spent(method) -> float:
    t = method.timing
    return t.codec_seconds + t.comm_seconds


def _evaluate(task, model, comm, loss, step, cfg, clock, method, fp32_per_step, t_start,
              window: tuple[float, int] = (0.0, 0)) -> dict[str, Any]:
    """Agreed train loss (this step's, and ``train_loss_mean``: the mean over the ranks and
    the steps since the previous row of their finite training losses, from this rank's
    ``window``, (sum, count)), test metrics, cumulative bytes and times. All ranks call it.

    Every rank evaluates its own model (the same model under synchronous methods), so no
    rank idles in a collective, bounded by its timeout, while another evaluates."""
    with comm.meter.paused():  # bookkeeping, not method traffic
        agreed = torch.tensor([loss.item(), *window], dtype=torch.float64, device=loss.device)
        comm.all_reduce(agreed)  # one collective, as before: this step's loss, the window's sum and count
        now, total, count = agreed.tolist()
        record: dict[str, Any] = {"step": step, "train_loss": now / comm.world_size,
                                  "train_loss_mean": total / count if count else None}
        if not cfg.evaluate:
            pass  # a timing probe (thinwire cost): the record without test figures
        elif method.decentralized:
            record.update(_decentralized_eval(task, model, comm))
        else:
            ev = task.evaluate(model)
            record.update({f"test_{k}": v for k, v in ev.items()})
        comm.barrier()  # evaluation skew is not charged to the next timed collective
    record.update(reporting.stats(method))  # e.g. the theta FFT used at this step
    record.update(task.progress(step, comm.world_size, cfg.batch_size))  # e.g. the epoch (text)
    t = _timing(method, clock)
    record.update(
        bytes_sent=comm.meter.bytes_sent,
        messages=comm.meter.messages,
        # of those, the collectives inside a node (on the fast link; thinwire cost times them apart)
        intra_bytes=comm.meter.bound_bytes("intra"),
        intra_messages=comm.meter.bound_messages("intra"),
        inter_share=comm.meter.inter_share,
        fp32_bytes=fp32_per_step * (step - clock.skipped),  # skipped steps send nothing either way
        elapsed_seconds=time.perf_counter() - t_start,  # evaluation included
        wall_seconds=clock.train_wall,  # training steps only, as in summary.json
        compute_seconds=clock.compute,
        backward_seconds=clock.backward,
        codec_seconds=t.codec_seconds,
        comm_seconds=t.comm_seconds,
        skipped_steps=clock.skipped,
    )
    o = reporting.overlap_report(method)
    if o is not None:  # cumulative, as the other clocks: the cost model reads them
        record.update(overlap_steps=o["steps"], overlap_window_seconds=o["window_seconds"],
                      overlap_blocked_seconds=o["blocked_seconds"], overlap_early_share=o["early_share"],
                      overlap_lead_seconds_and_shares=o["leads"])
    intra = Link.parse(cfg.intra_link) if cfg.intra_link else None
    for link in cfg.links:
        record[f"modeled_seconds@{link}"] = _modeled(Link.parse(link), comm, clock, t, method, intra)
    return record


def _decentralized_eval(task, model, comm) -> dict[str, Any]:
    """Gossip methods: the ranks' models differ, so report the averaged model's test metrics
    (as ``test_*``), the mean of the local models' accuracies and the consensus distance
    ``mean_i ||x_i - x_mean||^2`` over parameters and float buffers (all_reduces issued with
    the meter paused by the caller: bookkeeping, not method traffic). Between sharded groups
    each rank holds a shard: the mean is of its shard over the groups, and the distance is
    summed over a group's shards."""
    groups = comm.hierarchy
    across = groups.inter if groups is not None and groups.sharded else comm  # ranks holding the same part
    state = [local_part(t.detach()) for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    local = task.evaluate(model)
    own = torch.cat([t.reshape(-1).double() for t in state])  # (numel,)
    mean = own.clone()
    across.all_reduce(mean)
    mean /= across.world_size
    figures = torch.tensor([(own - mean).square().sum().item(), local.get("accuracy") or 0.0], dtype=torch.float64)
    comm.all_reduce(figures)
    saved = [t.detach().clone() for t in state]
    off = 0
    with torch.no_grad():
        for t in state:
            t.copy_(mean[off : off + t.numel()].view(t.shape))
            off += t.numel()
        averaged = task.evaluate(model)
        for t, keep in zip(state, saved):
            t.copy_(keep)
    out = {f"test_{k}": v for k, v in averaged.items()}
    out["local_test_accuracy_mean"] = figures[1].item() / comm.world_size
    # the world's sum holds each rank's distance, or, between sharded groups, each group's once (a shard each)
    out["consensus_distance"] = figures[0].item() / across.world_size
    return out


def _modeled(link: Link, comm: Communicator, clock: Clock, timing, method=None, intra: Link | None = None) -> float:
    """compute + codec + modeled communication: the run's time on ``link`` (between nodes;
    ``intra`` inside them). Communication a method overlaps with computation (DaSGD's delayed
    averages) counts only where it outlasts the computation it ran behind."""
    comm_s = meter_seconds(link, comm.meter, comm.world_size, intra)
    return clock.compute + timing.codec_seconds + comm_s - _hidden(link, comm, method, intra)


def _hidden(link: Link, comm: Communicator, method: Method, intra: Link | None = None) -> float:
    """Modeled codec and communication seconds the method overlaps with computation on
    ``link``: what the method hides itself (DaSGD's averages behind whole steps) and the
    gradient buckets it averaged beside the backward pass
    (:func:`thinwire.comm.overlap.overlap_hidden_seconds`)."""
    from thinwire.comm.overlap import overlap_hidden_seconds

    hidden = reporting.hidden_seconds(method, link)
    o = reporting.overlap_report(method)
    n = o["reduces"] if o is not None else 0
    if o is None or not n:
        return hidden
    meter = comm.meter
    intra_bytes, intra_messages = meter.bound_bytes("intra"), meter.bound_messages("intra")
    inter_bytes = meter.inter_share * (meter.bytes_sent - intra_bytes)  # the node's link carries its ranks' share
    if intra is not None:  # the collectives inside a node on their own link
        intra_s = intra_messages * intra.latency_s + intra_bytes / intra.bandwidth_Bps
    else:
        intra_s, inter_bytes, intra_messages = 0.0, inter_bytes + intra_bytes, 0
    return hidden + n * overlap_hidden_seconds(
        link, bytes=inter_bytes / n, messages=(meter.messages - intra_messages) / n,
        codec_s=method.timing.codec_seconds / n, window_s=o["window_seconds"] / n, early_share=o["early_share"],
        leads=tuple(map(tuple, o["leads"])), intra_s=intra_s / n)


# summary.json's final figures: the last evaluation's
FINAL = {"loss": "test_loss", "accuracy": "test_accuracy", "bpc": "test_bpc", "train_loss": "train_loss"}


def _summary(cfg, comm, method, clock, fp32_per_step, last_eval, version, device, model_bytes=0, model=None,
             done: int | None = None, task=None, optimizer=None, activations: int | None = None) -> Summary:
    """Rank 0's summary of a run that ended after step ``done`` (default: ``cfg.steps``)."""
    done = cfg.steps if done is None else done
    with comm.meter.paused():
        sent = torch.tensor([comm.meter.bytes_sent], dtype=torch.float64, device=device)
        comm.all_reduce(sent)  # mean over ranks: gossip methods send unequal amounts
    per_worker = sent.item() / comm.world_size
    fp32 = fp32_per_step * (done - clock.skipped)  # what fp32 would have sent for the steps that communicated
    own = method.state_dict()  # first: it may land work in flight, whose seconds count below
    t = _timing(method, clock)
    intra = Link.parse(cfg.intra_link) if cfg.intra_link else None
    modeled = {link: _modeled(Link.parse(link), comm, clock, t, method, intra) for link in cfg.links}
    by_link = _by_link(comm, device)
    return Summary(
        task=cfg.task, method=cfg.method, workers=comm.world_size, steps=cfg.steps, config=cfg.to_dict(),
        data=task.data_facts() if task is not None else None,  # e.g. the text corpus's size and SHA-256
        # inside a node and between nodes (without --group-size every rank is its own node)
        ranks_per_node=cfg.ranks_per_node or 1, intra_link=cfg.intra_link, intra_dtype=cfg.intra_dtype,
        shard=cfg.shard, **_verdict(clock, done, last_eval), steps_run=clock.steps_run, skipped_steps=clock.skipped,
        first_nonfinite=dict(clock.first_nonfinite) or None,
        **{f"final_{key}": last_eval.get(of) for key, of in FINAL.items()},
        bytes_sent_per_worker=per_worker, fp32_bytes_per_worker=fp32,
        compression_ratio=fp32 / per_worker if per_worker > 0 else None,
        messages_per_worker=comm.meter.messages, bytes_by_link_per_worker=by_link[0],
        messages_by_link_per_worker=by_link[1],
        wall_seconds=clock.train_wall, compute_seconds=clock.compute, backward_seconds=clock.backward,
        codec_seconds=t.codec_seconds, comm_seconds=t.comm_seconds,
        checkpoints_written=clock.checkpoints, checkpoint_seconds=clock.checkpoint_seconds,
        modeled_seconds=modeled[cfg.links[0]] if cfg.links else None, modeled_seconds_by_link=modeled,
        modeled_comm_seconds_by_link={link: meter_seconds(Link.parse(link), comm.meter, comm.world_size, intra)
                                      for link in cfg.links},  # before any overlap is credited
        hidden_seconds_by_link={link: _hidden(Link.parse(link), comm, method, intra) for link in cfg.links},
        hidden_fraction=reporting.hidden_fraction(method),
        method_report=reporting.report(method),
        per_parameter=_per_parameter(method, done - clock.skipped, comm.world_size),
        # what the method keeps across steps (residuals, snapshots, factors...): its own state
        # plus what it added to the model (AB-training's factors), rank 0's
        method_state_bytes=memory.tensor_bytes(own)
        + (max(0, memory.tensor_bytes(model.state_dict()) - model_bytes) if model is not None else 0),
        method_fields=reporting.summary_fields(method),
        peak_rss_bytes=_peak_rss(),  # this rank's (rank 0's) peak resident memory so far
        # rank 0's model state in bytes (a shard's, between sharded groups): run/memory.py
        memory=memory.held(model, optimizer, method, own, activations) if model is not None and optimizer is not None
        else None,
        version=version, **environment(device))


def _by_link(comm: Communicator, device: torch.device | str) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes and messages per worker inside a node and between nodes (the mean over ranks)."""
    with comm.meter.paused():
        links = torch.tensor([comm.meter.link_bytes(k) for k in LINKS] + [comm.meter.link_messages(k) for k in LINKS],
                             dtype=torch.float64, device=device)
        comm.all_reduce(links)
    n = len(LINKS)
    return ({k: links[i].item() / comm.world_size for i, k in enumerate(LINKS)},
            {k: links[n + i].item() / comm.world_size for i, k in enumerate(LINKS)})


def utc_now() -> str:
    """The time now, ISO 8601 in UTC to the second: ``2026-01-31T12:00:00Z``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def environment(device: torch.device | str) -> dict[str, Any]:
    """What ran the run, with nothing that names the machine: the torch and Python versions,
    and ``machine``: the CPU count, the platform (OS, kernel, libc), the processor
    architecture and the device type (``cpu`` or ``cuda``)."""
    return {
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "architecture": platform.machine(),
                    "device": torch.device(device).type},
    }


def _verdict(clock: Clock, done: int, last_eval: dict[str, Any]) -> dict[str, Any]:
    """``status`` ``ok``, or ``diverged`` with ``failure`` naming why: more than
    :data:`SKIPPED_SHARE_DEAD` of the ``done`` steps skipped for non-finite gradients, or a
    final loss that is not finite (a run that did not train must not look like one that did)."""
    why = []
    if clock.skipped > SKIPPED_SHARE_DEAD * done:
        why.append(f"{clock.skipped} of {done} steps were skipped for non-finite gradients")
    for key in ("test_loss", "train_loss"):
        value = last_eval.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            why.append(f"the final {key.replace('_', ' ')} is {value}")
    if not why:
        return {"status": "ok"}
    first = clock.first_nonfinite
    if first:
        why.append(f"the first non-finite gradient was in {first['parameter']} on rank {first['rank']} at step "
                   f"{first['step']}")
    return {"status": "diverged", "failure": "; ".join(why)}


def _per_parameter(method, steps: int, n: int) -> list[dict[str, Any]]:
    """Per parameter: name, shape, codec and the bytes this rank sent for it over the run,
    next to what an fp32 all_reduce would have sent in the ``steps`` that communicated (rank
    0's figures: every rank of a synchronous method sends the same)."""
    rows = []
    for r in reporting.per_parameter(method):
        fp32 = sent_bytes("all_reduce", 4 * math.prod(r["shape"]), n) * steps
        rows.append({"name": r["name"], "shape": r["shape"], "codec": r["codec"],
                     "bytes_sent_per_worker": r["bytes_sent"], "fp32_bytes_per_worker": fp32})
    return rows

"""One rank's training loop: a plain user of thinwire's public API.

The loop is ordinary PyTorch; the method attaches with two calls (``after_backward`` and
``after_step``), exactly as in a user's own script. All ranks run the same number of steps
and the same evaluation schedule, so their collectives stay in lockstep.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from thinwire.algorithms.registry import build_method
from thinwire.comm.base import Communicator
from thinwire.comm.link import Link, meter_seconds
from thinwire.comm.meter import sent_bytes
from thinwire.run.config import TrainConfig
from thinwire.run.metrics import MetricsWriter

Report = Callable[..., None]  # report(kind, **fields): progress to the launcher (rank 0 only)


@dataclass
class Clock:
    """Seconds spent in the local part of training (forward, backward, optimizer)."""

    compute: float = 0.0
    train_wall: float = 0.0


def build_optimizer(name: str, params, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)


def train_rank(
    cfg: TrainConfig, comm: Communicator, report: Report | None = None, device: torch.device | str = "cpu"
) -> dict[str, Any] | None:
    """Train on this rank's ``device``; rank 0 writes metrics and returns the summary (others
    return None)."""
    from thinwire import __version__
    from thinwire.tasks import get as get_task

    rank, n = comm.rank, comm.world_size
    task = get_task(cfg.task)(seed=cfg.seed, data_dir=cfg.data_dir, **cfg.task_options)
    model = task.build_model().to(device)
    with comm.meter.paused():  # set-up traffic is not the method's
        for p in model.parameters():
            comm.broadcast(p.data, src=0)  # identical start even if a user's init is not seeded
    optimizer = build_optimizer(cfg.optimizer, model.parameters(), cfg.lr, task.defaults.weight_decay)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)  # before a method reshapes the model
    if cfg.policy_rules:  # a policy file: a codec per parameter
        from thinwire.algorithms.sync import SyncReducer
        from thinwire.policy import Policy

        method = SyncReducer(model, Policy(cfg.policy_rules), comm, bucket_mb=cfg.bucket_mb)
    else:
        method = build_method(cfg.method, model, optimizer, comm, bucket_mb=cfg.bucket_mb)
    fp32_per_step = sent_bytes("all_reduce", 4 * trained, n)  # the uncompressed reference
    writer = MetricsWriter(cfg.out) if (rank == 0 and cfg.out) else None
    batches = task.train_batches(rank, n, cfg.batch_size)
    clock = Clock()
    last_eval: dict[str, Any] = {}
    net = getattr(method, "module", model)  # PyTorch's DDP peers run forward and backward through their wrapper
    t_start = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        before = _spent(method)
        loss = task.loss(net(x), y)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        t1 = time.perf_counter()
        in_backward = _spent(method) - before  # DDP hooks' codec and communication time
        method.after_backward(loss=loss.detach())
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        method.after_step()
        if step == cfg.steps and hasattr(method, "finish"):
            method.finish()  # e.g. AB-training's final sync: one model on every rank
        t4 = time.perf_counter()
        clock.compute += (t1 - t0 - in_backward) + (t3 - t2)
        clock.train_wall += t4 - t0
        loss_value = loss.item()
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"training loss is {loss_value} at step {step} on rank {rank}")
        if report is not None and rank == 0:
            report("step", step=step, loss=loss_value)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            last_eval = _evaluate(task, model, comm, loss, step, cfg, clock, method, fp32_per_step, t_start)
            if writer:
                writer.write(last_eval)
            if report is not None and rank == 0:
                report("eval", **last_eval)
    summary = _summary(cfg, comm, method, clock, fp32_per_step, last_eval, __version__, device)
    if writer:
        writer.write_summary(summary)
        writer.close()
    return summary if rank == 0 else None


def _spent(method) -> float:
    t = method.timing
    return t.codec_seconds + t.comm_seconds


def _evaluate(task, model, comm, loss, step, cfg, clock, method, fp32_per_step, t_start) -> dict[str, Any]:
    """Agreed train loss, test metrics, cumulative bytes and times. All ranks call it.

    Every rank evaluates its own model (the same model under synchronous methods), so no
    rank idles in a collective, bounded by its timeout, while another evaluates."""
    with comm.meter.paused():  # bookkeeping, not method traffic
        agreed = loss.detach().reshape(1).to(torch.float32).clone()
        comm.all_reduce(agreed)
        record: dict[str, Any] = {"step": step, "train_loss": agreed.item() / comm.world_size}
        if getattr(method, "decentralized", False):
            record.update(_decentralized_eval(task, model, comm))
        else:
            ev = task.evaluate(model)
            record.update({f"test_{k}": v for k, v in ev.items()})
        comm.barrier()  # evaluation skew is not charged to the next timed collective
    if hasattr(method, "stats"):
        record.update(method.stats())  # e.g. the theta FFT used at this step
    t = method.timing
    record.update(
        bytes_sent=comm.meter.bytes_sent,
        messages=comm.meter.messages,
        fp32_bytes=fp32_per_step * step,
        elapsed_seconds=time.perf_counter() - t_start,  # evaluation included
        wall_seconds=clock.train_wall,  # training steps only, as in summary.json
        compute_seconds=clock.compute,
        codec_seconds=t.codec_seconds,
        comm_seconds=t.comm_seconds,
    )
    for link in cfg.links:
        record[f"modeled_seconds@{link}"] = _modeled(Link.parse(link), comm, clock, t, method)
    return record


def _decentralized_eval(task, model, comm) -> dict[str, Any]:
    """Gossip methods: the ranks' models differ, so report the averaged model's test metrics
    (as ``test_*``), the mean of the local models' accuracies and the consensus distance
    ``mean_i ||x_i - x_mean||^2`` over parameters and float buffers (all_reduces issued with
    the meter paused by the caller: bookkeeping, not method traffic)."""
    state = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    local = task.evaluate(model)
    own = torch.cat([t.detach().reshape(-1).double() for t in state])  # (numel,)
    mean = own.clone()
    comm.all_reduce(mean)
    mean /= comm.world_size
    figures = torch.tensor([(own - mean).square().sum().item(), local["accuracy"] or 0.0], dtype=torch.float64)
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
    out["consensus_distance"] = figures[0].item() / comm.world_size
    return out


def _modeled(link: Link, comm: Communicator, clock: Clock, timing, method=None) -> float:
    """compute + codec + modeled communication: the run's time on ``link``. Communication a
    method overlaps with computation (DaSGD's delayed averages) counts only where it
    outlasts the computation it ran behind."""
    return clock.compute + timing.codec_seconds + meter_seconds(link, comm.meter, comm.world_size) - _hidden(link, comm, method)


def _hidden(link: Link, comm: Communicator, method) -> float:
    """Modeled communication seconds the method overlaps with computation on ``link``."""
    return method.hidden_link_seconds(link, comm.world_size) if hasattr(method, "hidden_link_seconds") else 0.0


def _summary(cfg, comm, method, clock, fp32_per_step, last_eval, version, device) -> dict[str, Any]:
    with comm.meter.paused():
        sent = torch.tensor([comm.meter.bytes_sent], dtype=torch.float64, device=device)
        comm.all_reduce(sent)  # mean over ranks: gossip methods send unequal amounts
    per_worker = sent.item() / comm.world_size
    fp32 = fp32_per_step * cfg.steps
    t = method.timing
    modeled = {link: _modeled(Link.parse(link), comm, clock, t, method) for link in cfg.links}
    return {
        "task": cfg.task,
        "method": cfg.method,
        "workers": comm.world_size,
        "steps": cfg.steps,
        "final_loss": last_eval.get("test_loss"),
        "final_accuracy": last_eval.get("test_accuracy"),
        "final_bpc": last_eval.get("test_bpc"),
        "final_train_loss": last_eval.get("train_loss"),
        "bytes_sent_per_worker": per_worker,
        "fp32_bytes_per_worker": fp32,
        "compression_ratio": fp32 / per_worker if per_worker > 0 else None,
        "wall_seconds": clock.train_wall,
        "compute_seconds": clock.compute,
        "codec_seconds": t.codec_seconds,
        "comm_seconds": t.comm_seconds,
        "modeled_seconds": modeled[cfg.links[0]] if cfg.links else None,
        "modeled_seconds_by_link": modeled,
        "modeled_comm_seconds_by_link": {link: meter_seconds(Link.parse(link), comm.meter, comm.world_size)
                                         for link in cfg.links},  # before any overlap is credited
        "hidden_seconds_by_link": {link: _hidden(Link.parse(link), comm, method) for link in cfg.links},
        "messages_per_worker": comm.meter.messages,
        "method_report": method.report() if hasattr(method, "report") else {},
        "per_parameter": _per_parameter(method, cfg.steps, comm.world_size),
        "hidden_fraction": method.hidden_fraction() if hasattr(method, "hidden_fraction") else None,
        **(method.summary_fields() if hasattr(method, "summary_fields") else {}),
        "config": cfg.to_dict(),
        "version": version,
    }


def _per_parameter(method, steps: int, n: int) -> list[dict[str, Any]]:
    """Per parameter: name, shape, codec and the bytes this rank sent for it over the run,
    next to what an fp32 all_reduce would have sent (rank 0's figures: every rank of a
    synchronous method sends the same)."""
    if not hasattr(method, "per_parameter"):
        return []
    rows = []
    for r in method.per_parameter():
        fp32 = sent_bytes("all_reduce", 4 * math.prod(r["shape"]), n) * steps
        rows.append({"name": r["name"], "shape": r["shape"], "codec": r["codec"],
                     "bytes_sent_per_worker": r["bytes_sent"], "fp32_bytes_per_worker": fp32})
    return rows

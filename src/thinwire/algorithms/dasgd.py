"""DaSGD (Zhou et al., arXiv 2006.00441): local SGD whose model averaging runs while the next
steps compute, merged ``delay`` steps after it was launched.

    averager = thinwire.DaSGD(model, optimizer, period=4, delay=2)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        averager.after_backward()   # averages gradients during the warm-up steps only
        optimizer.step()
        averager.after_step()       # merge an average that is due, launch the next

After each step ``t`` (steps counted after the warm-up):

* if an average launched at step ``t - d`` is pending, wait for it and merge:
  ``w = avg + (w - snap)``, the mean of the ranks' snapshots plus this rank's own progress
  since its snapshot (the weight-delta merge of CoCoD-SGD, with the delay decoupled from
  the period; the paper does not publish its exact rule, so this one is thinwire's choice),
  computed as ``w + (avg - snap)`` so that one worker, or ranks whose models agree, get
  their own model back bit for bit;
* if ``t`` is a multiple of ``period``, take a snapshot ``snap = w``, launch an
  asynchronous all_reduce of ``snap / n`` into a buffer of its own, and merge it ``d``
  steps later (``d = 0``: at once, which is blocking local SGD exactly).

The steps between launch and merge touch only the live model, never the snapshot or the
buffer in flight. Memory: two flat fp32 copies of the averaged state (snapshot and buffer);
a ``codec`` adds the anchor and, with error feedback, its residual (the delta is encoded
from the buffer, where its mean lands). Every average goes through an
:class:`~thinwire.aggregate.Aggregator` (:meth:`~thinwire.aggregate.Aggregator.start`),
as local SGD's do.

``delay=auto`` measures, during the warm-up (synchronous gradient averaging, the same bytes
as one model average), the mean time of one all_reduce and of one step's computation,
averages each over the ranks (one small all_reduce: every rank gets the same values) and
sets ``d = min(period, ceil(T_comm / T_step))``.

``codec`` averages the model *deltas* through any SUM codec (e.g. ``bf16``): after a first
exact average (the anchor, identical on every rank), each launch sends
``encode(snap - anchor)`` and the average is ``anchor + mean delta``, which becomes the next
anchor. ``identity`` sends the snapshots themselves.

Overlap is measured: per launch, the time from launch to the collective's completion
(watched by a helper thread that polls the reduction) and the time the merge blocked in
``wait()``; ``hidden_fraction = 1 - blocked / communication``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.aggregate import Aggregator, Reduction, Watch
from thinwire.algorithms.base import Loss, PeriodicAveraging
from thinwire.algorithms.methods import METHODS
from thinwire.codecs.specs import build_codec
from thinwire.comm.base import Communicator
from thinwire.comm.link import Link, meter_seconds
from thinwire.comm.meter import ByteMeter
from thinwire.knobs import knob, require
from thinwire.payload import Aggregation, Payload


@dataclass(frozen=True, kw_only=True)
class DaSGDConfig:
    period: int = knob(4, "steps between launches of a model average (tau)", ">= 1")
    delay: str = knob(
        "auto", "steps between a launch and its merge (d); auto = ceil(T_comm / T_step) measured in the "
        "warm-up, capped at period", "0..period or auto",
    )
    warmup: int = knob(8, "synchronous gradient-averaging steps first (auto measures there)", ">= 0; >= 2 for auto")
    average_momentum: bool = knob(False, "also average the optimizer's momentum (delayed like the weights)",
                                  "true|false")
    codec: str = knob("identity", "SUM codec for the averaged model deltas, e.g. bf16; its own knobs "
                      "separated by ';' (randomk:ratio=0.1;ef=false)", "a SUM codec spec")

    def __post_init__(self) -> None:
        require(self.period >= 1, f"period must be >= 1, got {self.period}")
        require(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        if self.delay != "auto":
            try:
                d = int(str(self.delay), 10)
            except ValueError:
                raise ValueError(f"delay must be an integer in 0..period or auto, got {self.delay!r}") from None
            require(d >= 0, f"delay must be >= 0, got {d}")
            require(d <= self.period, f"delay must be <= period: d={d} > period={self.period}")
            object.__setattr__(self, "delay", str(d))
        else:
            require(self.warmup >= 2, f"delay=auto measures during the warm-up: warmup must be >= 2, got {self.warmup}")
        codec = build_codec(self.codec.replace(";", ","))
        require(codec.aggregation is Aggregation.SUM and codec.rounds == 1,
                f"codec must be a single-round SUM codec (summed by all_reduce), got {codec.name} "
                f"({codec.aggregation.value}, {codec.rounds} round(s))")
        object.__setattr__(self, "codec", codec.describe().replace(",", ";"))  # nests inside a method spec


@METHODS.register
class DaSGD(PeriodicAveraging):
    """Delayed model averaging: launched every ``period`` steps, merged ``delay`` steps later."""

    name = "dasgd"
    summary = "DaSGD: model averages launched every period steps run during the next delay steps, then merged"
    Config = DaSGDConfig
    elastic_unsafe = "its model average stays in flight for delay steps, across which the quorum may change"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: DaSGDConfig | None = None, *,
                 bucket_mb: float = 25.0, overlap: bool = True, **knobs: Any) -> None:
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        self.codec = build_codec(self.config.codec.replace(";", ","))
        self._exact = self.codec.is_identity  # send the snapshots themselves, not deltas
        self.delay: int | None = None if self.config.delay == "auto" else int(self.config.delay)
        self.launches = 0
        # flat fp32 vectors: the snapshot, the buffer the average lands in, the codec's anchor
        self._snap: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None
        self._anchor: torch.Tensor | None = None
        # the averages' aggregators, built at the first launch: snapshots in fp32, deltas through the codec
        self._plain: Aggregator | None = None
        self._coded: Aggregator | None = None
        self._pending: Reduction | None = None  # the average in flight
        self._pending_coded = False  # whether it averages deltas (the anchor is added at the merge)
        self._merge_at: int | None = None  # local step of the pending merge; None: none pending
        self._watch = Watch()
        # measurements
        self.blocked_seconds = 0.0
        self._warm = {"comm": 0.0, "step": 0.0, "n": 0}
        self._last_step_end: float | None = None
        self._backward_end: float | None = None
        self._in_flight: tuple[ByteMeter, float] | None = None  # (its traffic, launch time) of the pending average
        # per merged average: (its traffic, seconds between launch and merge)
        self._windows: list[tuple[ByteMeter, float]] = []

    # -- the trainer's interface --------------------------------------------------------------
    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """During the warm-up, replace every gradient with its mean over the ranks (and time it);
        after it, with nodes, with its mean inside the node."""
        if not self.warming_up:
            self.node_mean()
            return True
        now = time.perf_counter()
        before = self.warmup.timing.comm_seconds
        self.warmup.reduce()
        if self._last_step_end is not None:  # skip the first step (one-time costs)
            self._warm["comm"] += self.warmup.timing.comm_seconds - before
            self._warm["step"] += now - self._last_step_end
            self._warm["n"] += 1
        self._backward_end = time.perf_counter()
        return True

    def after_step(self) -> None:
        """Count the step, merge an average that is due, launch the next one when it is time."""
        super().after_step()
        if self.step <= self.config.warmup:
            if self._backward_end is not None and self._warm["n"]:
                self._warm["step"] += time.perf_counter() - self._backward_end  # the optimizer step
            self._last_step_end = time.perf_counter()
            if self.step == self.config.warmup and self.delay is None:
                self.delay = self._agree_delay()

    def after_local_step(self, local: int) -> None:
        if self.delay is None:  # auto with no warm-up left to measure (resumed past it, or warmup=0)
            self.delay = self._agree_delay()
        if self._merge_at is not None and local == self._merge_at:
            self._merge()
        if local % self.config.period == 0:
            self._launch(local)

    # -- averaging ----------------------------------------------------------------------------
    def _launch(self, local: int) -> None:
        t0 = time.perf_counter()
        snap = self._snap = self.state.gather(self._snap)
        buf = self._buf = _like(self._buf, snap)
        self._pending_coded = not self._exact and self._anchor is not None
        if self._pending_coded:  # the delta from the anchor, through the codec
            assert self._anchor is not None  # _pending_coded needs one
            torch.sub(snap, self._anchor, out=buf)
            if self._coded is None:
                self._coded = self.averager(buf, self.codec)
            agg = self._coded
            agg.step = self.launches  # the codec's step (its seeds): the launch count, identical on every rank
        else:  # the snapshot itself (the first launch sets the anchor)
            buf.copy_(snap)
            if self._plain is None:
                self._plain = self.averager(buf)
            agg = self._plain
        t1 = time.perf_counter()
        before = self.comm.meter.counts()
        self._pending = agg.start({"model": buf})  # encodes, then starts the collective
        self._watch.start(self._pending, self._pending.started_at)
        # what runs behind the next steps: in two levels the node's reduce_scatter has blocked already
        self._in_flight = (self.comm.meter.since(before, "inter"), time.perf_counter())
        self.launches += 1
        self._timing.codec_seconds += t1 - t0
        assert self.delay is not None  # agreed before the first local step
        self._merge_at = local + self.delay
        if self.delay == 0:
            self._merge()

    def _merge(self) -> None:
        t0 = time.perf_counter()
        if self._in_flight is not None:  # traffic, and the seconds of work the transfer had to hide behind
            self._windows.append((self._in_flight[0], t0 - self._in_flight[1]))
            self._in_flight = None
        if self._pending is not None:
            self._pending.settle()
            self.blocked_seconds += time.perf_counter() - t0
            self._pending.wait()  # decoded into the buffer
            self._pending = None
        t1 = time.perf_counter()
        avg = self._average()
        if self.delay == 0:
            self.state.scatter(avg)  # w = the average: blocking local SGD exactly
        else:
            # w + (avg - snap): the correction is exactly 0 for one worker or identical models
            assert self._snap is not None  # set at the launch
            self.state.add_(avg.sub_(self._snap))
        self._merge_at = None
        self._timing.codec_seconds += time.perf_counter() - t1

    def _average(self) -> torch.Tensor:
        """The mean of the snapshots, from the landed average (sets the next anchor)."""
        avg = self._buf
        assert avg is not None  # set at the launch
        if self._pending_coded:
            assert self._anchor is not None  # _pending_coded needs one
            avg.add_(self._anchor)  # the buffer holds the mean delta
        if not self._exact:
            self._anchor = _like(self._anchor, avg)
            self._anchor.copy_(avg)
        return avg

    def _agree_delay(self) -> int:
        """d = min(period, ceil(T_comm / T_step)) from the warm-up, the same on every rank."""
        n = max(1, self._warm["n"])
        measured = torch.tensor([self._warm["comm"] / n, self._warm["step"] / n], dtype=torch.float64)
        agreed = measured.to(self.state.params[0].device)
        with self.comm.meter.paused():  # bookkeeping, not the method's traffic
            self.comm.all_reduce(agreed)
        t_comm, t_step = (agreed / self.comm.world_size).tolist()
        if t_step <= 0:
            return self.config.period
        return int(min(self.config.period, max(0, math.ceil(t_comm / t_step))))

    # -- figures -----------------------------------------------------------------------------
    @property
    def comm_seconds(self) -> float:
        """Launch-to-completion time of every model average so far."""
        return self._watch.total

    def hidden_seconds(self, link: Link) -> float:
        """Modeled seconds of the averages' collectives on ``link`` that the steps between
        launch and merge hide: ``min(T_link(average), window)`` per merged average, each
        average's traffic as the meter counted it at its launch (what ``meter_seconds``
        counts beyond the exposed part; in two levels, the collectives between nodes)."""
        n = self.comm.world_size
        return sum(min(meter_seconds(link, sent, n), window) for sent, window in self._windows)

    def hidden_fraction(self) -> float | None:
        """1 - blocked / communication time (None before any average completed)."""
        total = self._watch.total
        return None if total <= 0 else max(0.0, 1.0 - self.blocked_seconds / total)

    def stats(self) -> dict[str, Any]:
        return {"delay": self.delay, "launches": self.launches, "hidden_fraction": self.hidden_fraction()}

    def report(self) -> dict[str, Any]:
        # snapshot and buffer; a codec adds the anchor and (with EF) the residual
        flats = 2 if self._exact else 3 + int(bool(self.codec.config.ef))
        return {
            "method": self.spec, "delay": self.delay, "launches": self.launches,
            "blocked_seconds": self.blocked_seconds, "average_seconds": self._watch.total,
            "hidden_fraction": self.hidden_fraction(), "extra_memory_bytes": flats * 4 * self.state.numel(),
        }

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs; an average in flight is landed first (its mean is
        stored, and merged at the same step after resuming)."""
        if self._pending is not None:
            t0 = time.perf_counter()
            self._pending.settle()
            self.blocked_seconds += time.perf_counter() - t0
            self._pending.wait()
            self._pending = None
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        return {
            **super().state_dict(), "launches": self.launches, "delay": self.delay, "merge_at": self._merge_at,
            "snap": clone(self._snap), "buf": clone(self._buf), "anchor": clone(self._anchor),
            "pending_coded": self._pending_coded,
            "coded": None if self._coded is None else self._coded.state_dict(), "warm": dict(self._warm),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "payload_wire" in state:  # saved before averages went through an Aggregator
            self._load_earlier(state)
            return
        super().load_state_dict(state)
        self.launches, self.delay = int(state["launches"]), state["delay"]
        self._merge_at = state["merge_at"]
        self._snap, self._buf, self._anchor = state["snap"], state["buf"], state["anchor"]
        self._pending, self._pending_coded = None, bool(state["pending_coded"])
        if state["coded"] is not None:
            self._coded = self._coded or self.averager(self._snap, self.codec)
            self._coded.load_state_dict(state["coded"])
        self._warm = dict(state["warm"])

    def _load_earlier(self, state: dict[str, Any]) -> None:
        """A state of the earlier layout: DaSGD's own error feedback, and an average of deltas
        in flight kept as its summed wire (``payload_wire``, encoded at ``payload_step``),
        which is decoded here as that layout's merge decoded it, so the run goes on exactly
        (where that layout itself could not resume one: randomk's positions are recomputed)."""
        wire = state["payload_wire"]
        coded = {"pending_coded": wire is not None, "coded": None}
        self.load_state_dict({k: v for k, v in state.items() if k not in ("payload_wire", "payload_step", "feedback")}
                             | coded)
        assert self._snap is not None or not (wire is not None or state["feedback"])  # both need a launch first
        if self._snap is not None and not self._exact:
            self._coded = self._coded or self.averager(self._snap, self.codec)
            self._coded.feedback.load_state_dict(state["feedback"])
        if wire is not None:
            assert self._snap is not None
            self._buf = _like(self._buf, self._snap)
            self.codec.step = int(state["payload_step"])
            # the payload's rank-local meta (randomk's positions, from seed, step and key) was
            # not saved: encoding zeros at the same step gives it again
            meta = self.codec.encode(torch.zeros_like(self._snap), key="model").meta
            self.codec.decode_sum([Payload((wire,), self._snap.shape, torch.float32, meta=meta)], self._buf)


def _like(buf: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    if buf is None or buf.shape != ref.shape or buf.device != ref.device:
        return torch.empty_like(ref)
    return buf

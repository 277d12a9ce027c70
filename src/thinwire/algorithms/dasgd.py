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
a ``codec`` adds the delta, the anchor and, with error feedback, its residual.

``delay=auto`` measures, during the warm-up (synchronous gradient averaging, the same bytes
as one model average), the mean time of one all_reduce and of one step's computation,
averages each over the ranks (one small all_reduce: every rank gets the same values) and
sets ``d = min(period, ceil(T_comm / T_step))``.

``codec`` averages the model *deltas* through any SUM codec (e.g. ``bf16``): after a first
exact average (the anchor, identical on every rank), each launch sends
``encode(snap - anchor)`` and the average is ``anchor + mean delta``, which becomes the next
anchor. ``identity`` sends the snapshots themselves.

Overlap is measured: per launch, the time from launch to the collective's completion
(watched by a helper thread that polls the handle) and the time the merge blocked in
``wait()``; ``hidden_fraction = 1 - blocked / communication``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass

import torch

from thinwire.aggregate import Timing
from thinwire.algorithms.averaging import GradientMean, ModelState, comm_or_world
from thinwire.codecs.identity import Identity, IdentityConfig
from thinwire.codecs.registry import build_codec
from thinwire.comm.base import Communicator, Handle
from thinwire.feedback import ErrorFeedback
from thinwire.knobs import describe_config, knob, require
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


class DaSGD:
    """Delayed model averaging: launched every ``period`` steps, merged ``delay`` steps later."""

    name = "dasgd"
    summary = "DaSGD: model averages launched every period steps run during the next delay steps, then merged"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: DaSGDConfig | None = None, *,
                 bucket_mb: float = 25.0, overlap: bool = True, **knobs) -> None:
        self.config = config if config is not None else DaSGDConfig(**knobs)
        self.comm = comm = comm_or_world(comm)
        self.state = ModelState(model, optimizer, self.config.average_momentum)
        self._warmup = GradientMean([(n, p) for n, p in model.named_parameters() if p.requires_grad], comm, bucket_mb,
                                    overlap=overlap, armed=self.config.warmup > 0)
        self._sync = self._warmup
        self.codec = build_codec(self.config.codec.replace(";", ","))
        self.codec.rank = comm.rank
        self._exact = self.codec.describe() == Identity(IdentityConfig()).describe()  # send snapshots, not deltas
        self.feedback = ErrorFeedback()
        self.delay: int | None = None if self.config.delay == "auto" else int(self.config.delay)
        self.step = 0  # optimizer steps completed; identical on every rank
        self.launches = 0
        # flat fp32 vectors: snapshot, the buffer in flight, merge scratch, the codec's anchor
        self._snap: torch.Tensor | None = None
        self._buf: torch.Tensor | None = None
        self._work: torch.Tensor | None = None
        self._anchor: torch.Tensor | None = None
        self._payload = None  # the launched payload (codec path), decoded at the merge
        self._payload_step = 0  # the codec step it was encoded at
        self._handle: Handle | None = None
        self._merge_at: int | None = None  # local step of the pending merge; None: none pending
        self._watch = _Watch()
        # measurements
        self._timing = Timing()
        self.blocked_seconds = 0.0
        self._warm = {"comm": 0.0, "step": 0.0, "n": 0}
        self._last_step_end: float | None = None
        self._backward_end: float | None = None
        self._in_flight: tuple[int, float] | None = None  # (wire bytes, launch time) of the pending average
        self._windows: list[tuple[int, float]] = []  # per merged average: (wire bytes, seconds between launch and merge)

    # -- the trainer's interface --------------------------------------------------------------
    @property
    def timing(self) -> Timing:
        return Timing(self._timing.codec_seconds + self._sync.timing.codec_seconds,
                      self._timing.comm_seconds + self._sync.timing.comm_seconds)

    def after_backward(self, loss: float | torch.Tensor | None = None) -> None:
        """During the warm-up, replace every gradient with its mean over the ranks."""
        if self.step >= self.config.warmup:
            return
        now = time.perf_counter()
        before = self._sync.timing.comm_seconds
        self._warmup.reduce()
        if self._last_step_end is not None:  # skip the first step (one-time costs)
            self._warm["comm"] += self._sync.timing.comm_seconds - before
            self._warm["step"] += now - self._last_step_end
            self._warm["n"] += 1
        self._backward_end = time.perf_counter()

    def after_step(self) -> None:
        """Count the step, merge an average that is due, launch the next one when it is time."""
        self.step += 1
        self._warmup.armed = self.step < self.config.warmup  # the warm-up's gradients overlap backward
        if self.step <= self.config.warmup:
            if self._backward_end is not None and self._warm["n"]:
                self._warm["step"] += time.perf_counter() - self._backward_end  # the optimizer step
            self._last_step_end = time.perf_counter()
            if self.step == self.config.warmup and self.delay is None:
                self.delay = self._agree_delay()
            return
        if self.delay is None:  # auto with no warm-up left to measure (resumed past it, or warmup=0)
            self.delay = self._agree_delay()
        local = self.step - self.config.warmup
        if self._merge_at is not None and local == self._merge_at:
            self._merge()
        if local % self.config.period == 0:
            self._launch(local)

    # -- averaging ----------------------------------------------------------------------------
    def _launch(self, local: int) -> None:
        t0 = time.perf_counter()
        n = self.comm.world_size
        snap = self._snap = self.state.gather(self._snap)
        self._buf = _like(self._buf, snap)
        self.codec.step = self._payload_step = self.launches
        if self._exact or self._anchor is None:  # the snapshot itself (the first launch sets the anchor)
            self._payload = None
            wire = self._buf
            wire.copy_(snap).div_(n)
        else:
            delta = _like(self._work, snap)
            self._work = torch.sub(snap, self._anchor, out=delta)
            u = self.feedback.compensate("model", delta) if self.codec.config.ef else delta
            payload = self.codec.encode(u, key="model")
            wire = payload.tensors[0].clone() if len(payload.tensors) == 1 else None
            if wire is None:
                raise ValueError(f"codec {self.codec.name} sends {len(payload.tensors)} tensors; DaSGD sends one")
            if self.codec.config.ef:
                self.feedback.update_decoded("model", u, self.codec, payload)
            wire.div_(n)
            self._payload = payload.with_tensors((wire,))
        t1 = time.perf_counter()
        self._handle = self.comm.all_reduce(wire, async_op=True)
        self._watch.start(self._handle, t1)
        self._in_flight = (wire.numel() * wire.element_size(), time.perf_counter())
        self.launches += 1
        self._timing.codec_seconds += t1 - t0
        self._merge_at = local + self.delay
        if self.delay == 0:
            self._merge()

    def _merge(self) -> None:
        t0 = time.perf_counter()
        if self._in_flight is not None:  # bytes, and the seconds of work the transfer had to hide behind
            self._windows.append((self._in_flight[0], t0 - self._in_flight[1]))
            self._in_flight = None
        self._handle.wait()
        t1 = time.perf_counter()
        self.blocked_seconds += t1 - t0
        self._timing.comm_seconds += t1 - t0
        avg = self._average()
        if self.delay == 0:
            self.state.scatter(avg)  # w = the average: blocking local SGD exactly
        else:
            # w + (avg - snap): the correction is exactly 0 for one worker or identical models
            self.state.add_(avg.sub_(self._snap))
        self._handle, self._merge_at = None, None
        self._timing.codec_seconds += time.perf_counter() - t1

    def _average(self) -> torch.Tensor:
        """The mean of the snapshots, from the completed all_reduce (sets the next anchor)."""
        if self._payload is None:
            avg = self._buf
        else:
            avg = self._buf
            self.codec.step = self._payload_step
            self.codec.decode_sum([self._payload], avg)  # the mean delta (the wire was divided by n)
            avg.add_(self._anchor)
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

    def hidden_link_seconds(self, link, n: int) -> float:
        """Modeled seconds of the averages' all_reduces on ``link`` that the steps between
        launch and merge hide: ``min(T_link(bytes), window)`` per merged average (what
        ``meter_seconds`` counts beyond the exposed part)."""
        return sum(min(link.all_reduce_time(nbytes, n), window) for nbytes, window in self._windows)

    def hidden_fraction(self) -> float | None:
        """1 - blocked / communication time (None before any average completed)."""
        total = self._watch.total
        return None if total <= 0 else max(0.0, 1.0 - self.blocked_seconds / total)

    def stats(self) -> dict:
        return {"delay": self.delay, "launches": self.launches, "hidden_fraction": self.hidden_fraction()}

    def report(self) -> dict:
        # snapshot and buffer; a codec adds the delta, the anchor and (with EF) the residual
        flats = 2 if self._exact else 4 + int(bool(self.codec.config.ef))
        return {
            "method": describe_config(self.name, self.config), "delay": self.delay, "launches": self.launches,
            "blocked_seconds": self.blocked_seconds, "average_seconds": self._watch.total,
            "hidden_fraction": self.hidden_fraction(), "extra_memory_bytes": flats * 4 * self.state.numel(),
        }

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resumed run needs; an average in flight is waited for first (its
        result is stored, and merged at the same step after resuming)."""
        if self._handle is not None:
            t0 = time.perf_counter()
            self._handle.wait()
            self.blocked_seconds += time.perf_counter() - t0
        clone = lambda t: None if t is None else t.detach().clone()  # noqa: E731
        return {
            "step": self.step, "launches": self.launches, "delay": self.delay, "merge_at": self._merge_at,
            "snap": clone(self._snap), "buf": clone(self._buf), "anchor": clone(self._anchor),
            "payload_wire": None if self._payload is None else self._payload.tensors[0].detach().clone(),
            "payload_step": self._payload_step,
            "feedback": self.feedback.state_dict(), "sync": self._sync.state_dict(), "warm": dict(self._warm),
        }

    def load_state_dict(self, state: dict) -> None:
        from thinwire.comm.base import Done

        self.step, self.launches, self.delay = int(state["step"]), int(state["launches"]), state["delay"]
        self._merge_at = state["merge_at"]
        self._snap, self._buf, self._anchor = state["snap"], state["buf"], state["anchor"]
        self._work = None
        wire, self._payload_step = state["payload_wire"], int(state["payload_step"])
        self._payload = None if wire is None else Payload((wire,), self._snap.shape, torch.float32)
        self._handle = Done() if self._merge_at is not None else None
        self.feedback.load_state_dict(state["feedback"])
        self._sync.load_state_dict(state["sync"])
        self._warmup.armed = self.step < self.config.warmup
        self._warm = dict(state["warm"])


def _like(buf: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    if buf is None or buf.shape != ref.shape or buf.device != ref.device:
        return torch.empty_like(ref)
    return buf


class _Watch:
    """Times each launched collective from launch to completion on a helper thread that polls
    its handle (every 0.2 ms; ``is_completed`` has no side effects, unlike ``wait``)."""

    POLL_S = 2e-4

    def __init__(self) -> None:
        self.total = 0.0
        self._thread: threading.Thread | None = None

    def start(self, handle: Handle, t_launch: float) -> None:
        self.join()
        if handle.is_completed():  # a one-rank world or an in-process communicator
            self.total += time.perf_counter() - t_launch
            return

        def run() -> None:
            while not handle.is_completed():
                time.sleep(self.POLL_S)
            self.total += time.perf_counter() - t_launch

        self._thread = threading.Thread(target=run, daemon=True, name="thinwire-dasgd-watch")
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

"""Streaming DiLoCo (Douillard et al., arXiv 2501.18512): DiLoCo whose model is synced in
fragments on a staggered schedule, each fragment's average running behind the next inner
steps.

    streaming = thinwire.StreamingDiLoCo(model, inner_optimizer, period=50, fragments=4, delay=1)
    for x, y in loader:
        inner_optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        streaming.after_backward()   # averages gradients during the warm-up steps only
        inner_optimizer.step()
        streaming.after_step()       # merge the fragments that are due, launch the next
    streaming.finish()               # merge what is still in flight

The parameter tensors are split into ``fragments`` (P) contiguous groups in the model's
order, balanced by size (the split that makes the largest group smallest; every rank
computes the same one from the tensors' sizes). Fragment ``p`` has its own outer parameters
``θ_p`` and syncs after the local steps ``t`` with ``t mod H = o_p``, ``o_p = ⌊p·H/P⌋``
(fragment 0 after steps H, 2H, ...; fragment p after o_p, o_p + H, ...: its first round is
o_p steps long, every later one H). ``P <= H``, so no two fragments share an offset and
each step sends at most one fragment's average. A sync of fragment ``p`` at step ``t``:

* launch: the pseudo-gradient ``Δ_p,i = θ_p − θ_p,i`` (this rank's fragment at step ``t``) is
  averaged over the ranks through ``codec`` in the background, while training goes on;
* merge, after local step ``t + τ`` (``τ`` = ``delay``, ``0 <= τ <= H``; ``τ = H``, a whole
  round, merges just before the fragment's next launch): the outer optimizer
  steps ``θ_p`` with the mean ``Δ_p`` as its gradient (only fragment ``p``'s outer
  parameters step), and the worker's fragment becomes

      θ_p,i ← α · θ_p,i + (1 − α) · θ_p

  mixing its own ``τ`` steps of progress since the launch with the new global value
  (``α`` = ``alpha``; ``α = 0`` takes the global value, dropping those steps). With
  ``merge=rebase`` instead (ours, not the paper's) it becomes

      θ_p,i ← θ_p + (θ_p,i − θ_p,i at the launch)

  the new global value plus all of its own ``τ`` steps since the launch, which the next
  pseudo-gradient, measured from ``θ_p``, then carries: nothing is dropped, and nothing
  from before the launch is kept. At a delay of many steps (the 19-21 of 30 a fp32 fragment
  needs at 10 Mbit/s on the ``text`` task) mixing drops half of them; see docs/methods.md.

With one fragment, no delay and ``α = 0`` this is :class:`~thinwire.algorithms.diloco.DiLoCo`
exactly (the same code path: DiLoCo is the one-fragment schedule). Each step sends at most
the largest fragment's average, about 1/P of DiLoCo's; ``peak_bytes_per_sync`` in the
report is the most this rank sent in one step. The ranks' models never all agree at
once (some fragment is always mid-round), so the trainer evaluates their mean, as for the
decentralized methods. Float buffers (and, with ``average_momentum``, the inner optimizer's
state) are averaged plainly, blocking, when fragment 0 merges.

``delay=auto`` takes the smallest ``τ`` whose steps outlast the largest fragment's average on
the link (``link``, or the emulated link's): ``⌈(T_link + T_codec) / t_step⌉`` capped at ``H``,
from the cost model's time for the fragment's payload, the seconds its codec takes here and the
mean step before the first launch, averaged over the ranks; it is resolved before the first
launch, grown (never shrunk, up to ``H``) when an average run on the background thread took
longer than its steps, and reported and checkpointed.

With a delay (and no worker groups) a fragment's whole average, encode, every collective and
decode (with ``scatter=true`` both phases and the re-encode between them), runs on a
background thread over a second group of the same ranks
(:mod:`thinwire.algorithms.background_sync`), the fragments in the order they launched, so
none of it waits on the training thread; its bytes count when it merges. Over worker groups
the collectives are issued at the launch and the rest runs at the merge.

Overlap is measured as DaSGD's is: per sync, launch to completion (a helper thread polls the
reduction) against the time the merge blocked; ``hidden_fraction = 1 − blocked / comm``.

The paper's strided fragments and its exact mixing default are not what this uses: the
contiguous split and the defaults ``delay = 1``, ``alpha = 0.5`` are ours.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from thinwire.algorithms.background_sync import BackgroundSync
from thinwire.algorithms.diloco import DiLoCo, DiLoCoConfig
from thinwire.algorithms.methods import METHODS
from thinwire.comm.link import EmulatedLink, Link
from thinwire.knobs import knob, require
from thinwire.payload import Aggregation

MERGES = ("mix", "rebase")


@dataclass(frozen=True, kw_only=True)
class StreamingDiLoCoConfig(DiLoCoConfig):
    fragments: int = knob(4, "contiguous groups of parameter tensors, balanced by size, synced in turn (P)",
                          "1..period, at most the model's parameter tensors")
    delay: int | Literal["auto"] = knob(
        1, "inner steps between a fragment's launch and its merge (tau), up to a whole round; auto: the smallest "
        "that hides a fragment's average, from the cost model's link time, the codec's seconds and the steps before "
        "the first launch, grown when an average takes longer",
        "0..period, or auto")
    alpha: float = knob(0.5, "share of the worker's own fragment kept at a merge (0: take the global value); "
                        "merge=mix's", "[0, 1]")
    merge: str = knob("mix", "how a fragment's landed average meets the worker's steps since its launch: mix "
                      "(alpha * own + (1 - alpha) * theta, the paper's) or rebase (theta plus the worker's own steps "
                      "since the launch, all of them)", "|".join(MERGES))
    link: str = knob("", "the link between workers that delay=auto reads, e.g. 10mbit;50us (default: the emulated "
                     "link's, --emulate-link)", "a link, or empty")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.fragments >= 1, f"fragments must be >= 1, got {self.fragments}")
        require(self.fragments <= self.period,
                f"fragments must be <= period (one fragment's sync per step): fragments={self.fragments} > "
                f"period={self.period}")
        if self.delay != "auto":
            require(self.delay >= 0, f"delay must be >= 0, got {self.delay}")
            require(self.delay <= self.period,
                    f"delay must be <= period (a whole round): delay={self.delay} > period={self.period}")
        if self.link:
            Link.parse(self.link.replace(";", ","))  # refuses a link it cannot read, naming the grammar
        require(0.0 <= self.alpha <= 1.0, f"alpha must be in [0, 1], got {self.alpha}")
        require(self.merge in MERGES, f"merge must be one of {', '.join(MERGES)}, got {self.merge!r}")
        require(self.merge != "rebase" or self.delay != 0,
                "merge=rebase keeps the worker's steps between a fragment's launch and its merge: it needs a delay "
                "(delay=0 merges at the launch)")
        require(self.sync == "blocking", f"streaming-diloco runs its fragments' averages behind the next steps "
                f"through delay, not sync={self.sync}")


@METHODS.register
class StreamingDiLoCo(DiLoCo):
    """DiLoCo synced fragment by fragment, each average overlapped with ``delay`` inner steps."""

    name = "streaming-diloco"
    summary = ("Streaming DiLoCo: the model synced in fragments on a staggered schedule, each average "
               "overlapped with the next inner steps")
    Config = StreamingDiLoCoConfig
    decentralized = True  # some fragment is always mid-round: the trainer evaluates the ranks' mean

    @classmethod
    def check_model(cls, config: Any, model: torch.nn.Module) -> None:
        tensors = sum(1 for p in model.parameters() if p.requires_grad)
        require(config.fragments <= tensors,
                f"fragments must be at most the model's {tensors} trainable parameter tensors, got {config.fragments}")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Any = None, config: StreamingDiLoCoConfig | None = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer, comm, config, **kwargs)
        self._delay: int | None = None if self.config.delay == "auto" else int(self.config.delay)
        if self._delay != 0:  # the averages behind the steps, whole, on a thread
            self.offload = BackgroundSync(self.comm)
            self.reads_took = self.config.delay == "auto"  # a fixed delay's state holds no timing
        self.link: Link | None = None
        if self.config.link:
            self.link = Link.parse(self.config.link.replace(";", ","))
        elif isinstance(self.comm, EmulatedLink):
            self.link = self.comm.link
        if self._delay is None and self.link is None:
            raise ValueError("delay=auto needs a link to read: give link=RATE;LATENCY (e.g. link=10mbit;50us), or "
                             "run over an emulated link (--emulate-link)")
        self._first_step: tuple[float, int] | None = None  # delay=auto's clock: (when, local step) of the first seen
        self.auto_figures: dict[str, float] | None = None  # what delay=auto read, once resolved

    @property
    def delay(self) -> int:
        assert self._delay is not None  # resolved before the first launch
        return self._delay

    def after_local_step(self, local: int) -> None:
        """Resolve ``delay=auto`` before the first launch, then DiLoCo's schedule."""
        if self._delay is None:
            now = time.perf_counter()
            if self._first_step is None:
                self._first_step = (now, local)
            if any(local % self.config.period == f.offset for f in self.fragments):
                self._resolve_delay(local, now)
        super().after_local_step(local)

    def _resolve_delay(self, local: int, now: float) -> None:
        """The smallest delay whose steps outlast the largest fragment's average:
        ``ceil((T_link + T_codec) / t_step)``, capped at a whole round. ``t_step`` is the mean of
        the steps since the first local step this object saw end (with none between, the time
        since it was built, as one step); ``T_codec`` the seconds one encode and decode of that
        fragment take here (twice with ``scatter=true``: the mean's chunk is decoded, encoded
        again and the gathered means decoded); both averaged over the ranks (one small
        collective, not counted: every rank takes the same delay). ``T_link`` is the cost
        model's time for the fragment's payload on the link."""
        assert self.link is not None  # checked when built
        start, seen = self._first_step if self._first_step is not None else (self._built_at, local)
        steps = local - seen
        start, steps = (start, steps) if steps >= 1 else (self._built_at, 1)
        largest = max(self.fragments, key=lambda f: f.numel)
        mine = torch.tensor([(now - start) / steps, self._codec_seconds(largest)], dtype=torch.float64,
                            device=self.outer_params[0].device)
        with self.comm.meter.paused():
            self.comm.all_reduce(mine)
        step_s, codec_s = (v / self.comm.world_size for v in mine.tolist())
        link_s = self._average_seconds(largest.numel)
        wanted = math.ceil((link_s + codec_s) / step_s) if step_s > 0 else self.config.period
        self._delay = max(1, min(self.config.period, wanted))
        self.auto_figures = {"delay": self._delay, "step_seconds": step_s, "fragment_link_seconds": link_s,
                             "fragment_codec_seconds": codec_s}
        if wanted > self.config.period:
            self.warn(f"streaming-diloco: delay=auto: a fragment's average takes {link_s:.2f} s on {self.link} and "
                      f"{codec_s:.2f} s of codec work, more than a whole round ({self.config.period} steps of "
                      f"{step_s:.3f} s): delay={self._delay} hides what it can")

    def _average_took(self, seconds: float) -> None:
        """``delay=auto`` over the background thread: an average that took longer than the
        delay's steps grows the delay to ``ceil(took / t_step)`` (capped at a whole round; it
        never shrinks), ``took`` averaged over the ranks (one small collective, not counted),
        so that a link or a codec slower than the estimate is hidden from then on. The
        averages already in flight keep the merge steps they were launched with."""
        if self.config.delay != "auto" or self.auto_figures is None or self._delay is None:
            return
        took = torch.tensor([seconds], dtype=torch.float64, device=self.outer_params[0].device)
        with self.comm.meter.paused():
            self.comm.all_reduce(took)
        mean = took.item() / self.comm.world_size
        step_s = self.auto_figures["step_seconds"]
        needed = min(self.config.period, math.ceil(mean / step_s)) if step_s > 0 else self.config.period
        if needed > self._delay:
            self.auto_figures.setdefault("first_delay", self._delay)
            self._delay = needed
            self.auto_figures.update(delay=needed, average_seconds=mean)

    def _codec_seconds(self, f: Any) -> float:
        """Seconds of one encode and decode of fragment ``f``'s values through a fresh copy of
        its codec (its state untouched), twice with ``scatter=true``."""
        from thinwire.codecs.specs import build_codec

        codec = build_codec(self.config.codec.replace(";", ","))
        with torch.no_grad():
            x = torch.cat([t.detach().reshape(-1).float() for t in self.outer_params[f.lo : f.hi]])
            t0 = time.perf_counter()
            codec.decode(codec.encode(x))
            seconds = time.perf_counter() - t0
        return seconds * (2 if self.scatter else 1)

    def _average_seconds(self, numel: int) -> float:
        """The cost model's seconds for one fragment's average of ``numel`` values on the link."""
        assert self.link is not None
        n = self.comm.world_size
        nbytes = self.fragments[0].codec.nbytes(torch.Size([numel]), torch.float32)
        if self.fragments[0].codec.aggregation is Aggregation.SUM:
            return self.link.all_reduce_time(nbytes, n)
        if self.scatter:  # each rank's chunks to their owners, then the means' all_gather
            return self.link.exchange_time(nbytes * (n - 1) // n, 1) + self.link.all_gather_time(nbytes // n, n)
        return self.link.all_gather_time(nbytes, n)

    @property
    def alpha(self) -> float:
        """``merge=mix``'s share of the worker's own fragment; ``merge=rebase`` keeps none at a
        merge with no steps since the launch (a sync called between the scheduled ones)."""
        return 0.0 if self.rebases else float(self.config.alpha)

    @property
    def rebases(self) -> bool:
        return self.config.merge == "rebase"

    def _groups(self) -> list[tuple[int, int]]:
        params = self.state.params
        if self.config.fragments > len(params):  # check_model says so in a user's words; this is the guard
            raise ValueError(f"fragments must be at most the model's {len(params)} trainable parameter tensors, "
                             f"got {self.config.fragments}")
        return balanced_split([p.numel() for p in params], self.config.fragments)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "hidden_fraction": self.hidden_fraction()}

    def report(self) -> dict[str, Any]:
        report = super().report()
        report["delay"] = self._delay
        if self.auto_figures is not None:
            report["delay_auto"] = self.auto_figures
        return report

    def state_dict(self) -> dict[str, Any]:
        figures = None if self.auto_figures is None else dict(self.auto_figures)
        return {**super().state_dict(), "delay": self._delay, "delay_auto": figures, "merge": self.config.merge}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resumed ``delay=auto`` run keeps the delay it chose; a fixed delay must match
        one saved with averages in flight (their merge steps were set by it), and so must
        ``merge`` (a rebase needs where the rank stood at the launch)."""
        saved_merge = state.get("merge", "mix")
        in_flight = any(f.get("merge_at") is not None for f in state.get("fragments", []))
        if saved_merge != self.config.merge and in_flight:
            raise ValueError(f"checkpoint was saved with merge={saved_merge} and averages in flight; this run has "
                             f"merge={self.config.merge}: resume with merge={saved_merge}")
        super().load_state_dict(state)
        saved = state.get("delay")
        if self.config.delay == "auto":
            self._delay = saved if saved is not None else None
            figures = state.get("delay_auto")
            self.auto_figures = None if figures is None else dict(figures)
        elif saved is not None and saved != self._delay and any(f.merge_at is not None for f in self.fragments):
            raise ValueError(f"checkpoint was saved with delay={saved} and averages in flight; this run has "
                             f"delay={self._delay}: resume with delay={saved}")


def balanced_split(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, non-empty ``(lo, hi)`` ranges covering ``sizes`` whose largest
    sum is the smallest possible (a binary search on that bound, each bound checked by
    filling ranges greedily); the same on every rank for the same sizes."""
    if not 1 <= parts <= len(sizes):
        raise ValueError(f"cannot split {len(sizes)} tensors into {parts} fragments")

    def fill(cap: int) -> list[tuple[int, int]]:
        out, lo, total = [], 0, 0
        for i, s in enumerate(sizes):
            if total + s > cap and i > lo:
                out.append((lo, i))
                lo, total = i, 0
            total += s
        out.append((lo, len(sizes)))
        return out

    low, high = max(sizes), sum(sizes)
    while low < high:
        mid = (low + high) // 2
        if len(fill(mid)) <= parts:
            high = mid
        else:
            low = mid + 1
    groups = fill(low)
    while len(groups) < parts:  # fewer ranges than asked: split the first that has several tensors
        i = next(i for i, (lo, hi) in enumerate(groups) if hi - lo > 1)
        lo, hi = groups[i]
        groups[i : i + 1] = [(lo, hi - 1), (hi - 1, hi)]
    return groups

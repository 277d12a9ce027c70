"""DiLoCo (Douillard et al., arXiv 2311.08105): ``period`` local steps of the inner optimizer,
then an outer optimizer step on the averaged pseudo-gradient.

    diloco = thinwire.DiLoCo(model, inner_optimizer, period=50)
    for x, y in loader:
        inner_optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        diloco.after_backward()   # averages gradients during the warm-up steps only
        inner_optimizer.step()
        diloco.after_step()       # every `period` steps: the outer step

Every rank keeps the outer parameters ``θ`` (the model at the start of the round, identical on
every rank). After every ``period``-th local step (H):

* each rank's pseudo-gradient ``Δ_i = θ − θ_i`` (its own progress, reversed) is averaged over
  the ranks through ``codec`` (default fp32; any thinwire codec spec, with the error feedback
  that codec's ``ef`` asks for): ``Δ = mean_i Δ_i``;
* the outer optimizer steps ``θ`` with ``Δ`` as its gradient (default: SGD, ``outer_lr`` 0.7,
  Nesterov momentum 0.9, the paper's); with plain SGD that is ``v = μ v + Δ``,
  ``θ ← θ − lr (Δ + μ v)`` (Nesterov) or ``θ ← θ − lr v``;
* every rank continues from ``θ``: the model's parameters are set to it. Floating-point
  buffers (BatchNorm statistics) are averaged in fp32; the inner optimizer's state is kept
  (with ``average_momentum``, its per-parameter tensors are averaged too).

With outer SGD at lr 1 and no momentum, ``θ − Δ`` is the mean of the ranks' models: local SGD
(up to fp32 rounding: ``θ − mean(θ − θ_i)`` against ``mean θ_i``). The first ``warmup`` steps
are synchronous data-parallel steps (fp32 gradient mean, as local SGD's), after which ``θ``
starts from the model as it is.

The outer optimizer of the spec is ``outer=sgd`` (momentum ``outer_momentum``, ``nesterov``)
or ``outer=adam`` (lr ``outer_lr``, torch's defaults otherwise); in Python any optimizer can be
given as ``outer_optimizer=lambda params: torch.optim.X(params, ...)``. Memory: the outer
parameters and the outer optimizer's state (SGD: one momentum buffer; Adam: two), the flat
pseudo-gradient, and a codec's residual when it has error feedback.

With ``sync=eager`` or ``sync=delayed`` a round's average runs on a background thread over a
second group of the same ranks (:mod:`thinwire.algorithms.background_sync`), behind the next
round's inner steps, and steps ``θ`` at that round's end (after Kale, Douillard and Donchev
2025, arXiv 2502.12996): delayed continues every rank from ``θ``; eager from the step ``θ``
would take with the rank's own progress in place of the mean still in flight (measured from
halfway between the round's start and ``θ``: :meth:`DiLoCo._from_midway`), ``θ`` and the
outer state left as they were, so ``θ`` stays the same on every rank (our form of the
paper's eager updates). docs/methods.md gives the details.

The rounds are kept per *fragment* (a contiguous group of the parameter tensors, each with
its own pseudo-gradient, codec and schedule): DiLoCo has one, the whole model, synced and
applied at once; :class:`~thinwire.algorithms.streaming_diloco.StreamingDiLoCo` has several,
on a staggered schedule, each applied some steps after its launch.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from thinwire.aggregate import Aggregator, Reduction, Watch
from thinwire.algorithms.background_sync import BackgroundSync, InFlight
from thinwire.algorithms.base import PeriodicAveraging
from thinwire.algorithms.methods import METHODS
from thinwire.codecs.base import Codec
from thinwire.codecs.specs import build_codec
from thinwire.comm.base import Communicator
from thinwire.comm.link import Link, meter_seconds
from thinwire.comm.meter import ByteMeter
from thinwire.knobs import knob, require
from thinwire.payload import Aggregation
from thinwire.scatter import ScatterMean, ScatterReduction

OUTER = ("sgd", "adam")
SYNCS = ("blocking", "eager", "delayed")
SYNC_HELP = ("how a round's average runs: blocking (the next round waits for it), or in the background behind the "
             "next round's inner steps and applied at that round's end, eager (this worker's own progress "
             "applied at once in its stead) or delayed (nothing in its stead)")
OuterFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    period: int = knob(50, "inner steps between outer steps (H); the paper's is 500, ours suits the bundled tasks",
                       ">= 1")
    warmup: int = knob(0, "synchronous gradient-averaging steps before the first round", ">= 0")
    outer: str = knob("sgd", "the outer optimizer", "|".join(OUTER))
    outer_lr: float = knob(0.7, "the outer optimizer's learning rate", "> 0")
    outer_momentum: float = knob(0.9, "outer SGD's momentum", "[0, 1)")
    nesterov: bool = knob(True, "Nesterov momentum for outer SGD", "true|false")
    codec: str = knob("identity", "codec of the averaged pseudo-gradients, e.g. rangefloat with bits=4; its own "
                      "knobs separated by ';' (topk:ratio=0.01;ef=true)", "a codec spec")
    scatter: bool = knob(False, "average a gathered codec's pseudo-gradients by a compressed reduce-scatter + "
                         "all-gather (each rank sends 2(n - 1)/n of its payload) instead of all_gather (n - 1 "
                         "payloads); the mean is encoded once more", "true|false")
    average_momentum: bool = knob(False, "also average the inner optimizer's per-parameter state at each outer step",
                                  "true|false")
    final_sync: bool = knob(True, "finish() ends with one more outer step on the steps since each fragment's last "
                            "sync, so every rank holds the same model (false: each keeps its own)", "true|false")
    sync: str = knob("blocking", SYNC_HELP, "|".join(SYNCS))

    def __post_init__(self) -> None:
        require(self.period >= 1, f"period must be >= 1, got {self.period}")
        check_sync(self)
        require(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        require(self.outer in OUTER, f"outer must be one of {', '.join(OUTER)}, got {self.outer!r}")
        require(self.outer_lr > 0, f"outer_lr must be > 0, got {self.outer_lr}")
        require(0 <= self.outer_momentum < 1, f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        codec = build_codec(self.codec.replace(";", ","))  # refuses an unknown codec or knob, naming it
        object.__setattr__(self, "codec", codec.describe().replace(",", ";"))  # nests inside a method spec
        require(not self.scatter or codec.aggregation is Aggregation.GATHER,
                f"scatter=true needs a gathered codec (rangefloat, qsgd, topk, ...); {codec.name} is summed by "
                "all_reduce, which is a reduce-scatter + all-gather already")


def check_sync(config: Any) -> None:
    """Refuse a ``sync`` the config cannot take (shared by the DiLoCo family's configs)."""
    require(config.sync in SYNCS, f"sync must be one of {', '.join(SYNCS)}, got {config.sync!r}")
    require(config.sync == "blocking" or config.final_sync,
            f"sync={config.sync} needs final_sync=true: the last round's average lands in finish()")


@dataclass(eq=False)
class Fragment:
    """A contiguous group of parameter tensors (``lo``:``hi`` in the model's order) synced on
    its own schedule: after local steps ``t`` with ``t % period == offset``."""

    index: int
    lo: int
    hi: int
    numel: int
    offset: int
    codec: Codec
    syncs: int = 0  # outer steps applied to this fragment
    delta: torch.Tensor | None = None  # the flat pseudo-gradient; its mean once landed
    agg: Aggregator | ScatterMean | None = None
    pending: Reduction | ScatterReduction | InFlight | None = None  # the average in flight
    landed: bool = False  # the mean is in ``delta`` (a resumed run's average that was in flight)
    merge_at: int | None = None  # the local step of the pending merge
    merged_at: int | None = 0  # the local step of its last merge (None: unknown, a checkpoint from before it was kept)
    launched: tuple[ByteMeter | None, float] | None = None  # what the launch sent (None: known when it lands), and when
    took: float | None = None  # an offloaded average's seconds from launch to completion, once landed
    own: torch.Tensor | None = None  # merge=rebase: this rank's pseudo-gradient at the launch, until the merge
    watch: Watch = field(default_factory=Watch)


@METHODS.register
class DiLoCo(PeriodicAveraging):
    """Local rounds of ``period`` inner steps; an outer optimizer step on the averaged
    pseudo-gradient ends each."""

    name = "diloco"
    summary = "DiLoCo: every period inner steps, an outer Nesterov SGD step on the averaged pseudo-gradient"
    Config = DiLoCoConfig

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: DiLoCoConfig | None = None, *,
                 bucket_mb: float = 25.0, overlap: bool = True, outer_optimizer: OuterFactory | None = None,
                 **knobs: Any) -> None:
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        self.codec = build_codec(self.config.codec.replace(";", ","))
        # θ, sharded like the model: a shard's θ is its own part (FSDP2's local tensor); in fp32
        # whatever the parameters' dtype, as the pseudo-gradient is (a bf16 model's master copy)
        self.outer_params = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
                             for p in self.state.local_params()]
        self.outer = (outer_optimizer or self._outer_from_config)(self.outer_params)
        self.fragments = [
            Fragment(i, lo, hi, sum(t.numel() for t in self.outer_params[lo:hi]), self._offset(i, len(groups)),
                     self.codec if len(groups) == 1 else build_codec(self.config.codec.replace(";", ",")))
            for groups in [self._groups()] for i, (lo, hi) in enumerate(groups)
        ]
        self.syncs = 0  # fragment syncs applied, all fragments together
        self.peak_bytes = 0.0  # the most this rank sent in one step past the warm-up
        self.blocked_seconds = 0.0  # merges waiting for an average still in flight
        self._windows: list[tuple[ByteMeter, float]] = []  # per merged sync: its traffic, seconds it ran behind
        self._rest: torch.Tensor | None = None  # buffers (and inner state), averaged plainly
        self._plain: Aggregator | None = None
        self._built_at = time.perf_counter()
        self.syncs_before_finish: int | None = None  # set by finish(): the outer steps of the run itself
        self.never_synced_warned = False
        # sync=eager|delayed: each round's average runs behind the next round (one fragment: DiLoCo's)
        sync = getattr(self.config, "sync", "blocking")
        self.background = BackgroundSync(self.comm) if sync != "blocking" else None
        # eager: a worker continues from θ stepped with its own progress in place of the mean in flight
        self.eager = sync == "eager"
        # averages merged some steps after their launch (streaming DiLoCo's delay), when set: run
        # whole (encode, collectives, decode) on a background thread over a twin group
        self.offload: BackgroundSync | None = None
        self.reads_took = False  # whether _average_took reads each offloaded average's seconds (kept in the state)
        self._fresh: torch.Tensor | None = None  # this round's pseudo-gradient
        self._start: torch.Tensor | None = None  # eager: where this rank's round started (None: at θ)

    @classmethod
    def check_elastic(cls, config: Any) -> str | None:
        """An average launched in one step and merged ``delay`` steps later (streaming DiLoCo's
        overlap) may cross a change of the quorum: refused, as is one run behind a whole round
        (``sync=eager|delayed``); a sync within its step runs elastic."""
        if getattr(config, "sync", "blocking") != "blocking":
            return (f"sync={config.sync} keeps a round's average in flight through the next round, over which the "
                    "quorum may change (sync=blocking runs elastic)")
        if getattr(config, "delay", 0) != 0:
            return (f"delay={config.delay} keeps a fragment's average in flight across steps, over which the "
                    "quorum may change (delay=0 runs elastic)")
        return cls.elastic_unsafe

    def elastic_join(self) -> None:
        """A worker joining a running job starts its round from the global model ``θ`` (the
        outer parameters it took), not from the present worker's weights within the round,
        and with no error-feedback residual of its own (a codec's ``ef``, SparseLoCo's error
        buffer: the one it took is the present worker's unsent error)."""
        if self.step >= self.config.warmup:
            with torch.no_grad():
                for theta, p in zip(self.outer_params, self.state.local_params(), strict=True):
                    p.copy_(theta)
        for f in self.fragments:
            if f.agg is not None:
                f.agg.feedback.clear()

    # -- what a subclass varies -------------------------------------------------------------
    @property
    def delay(self) -> int:
        """Local steps between a fragment's launch and its merge (DiLoCo: 0, at once)."""
        return 0

    @property
    def scatter(self) -> bool:
        """Whether a fragment's gathered codec is averaged by reduce-scatter + all-gather (a
        config without the knob: no)."""
        return bool(getattr(self.config, "scatter", False))

    @property
    def alpha(self) -> float:
        """The share of the worker's own parameters kept at a merge (DiLoCo: 0)."""
        return 0.0

    @property
    def rebases(self) -> bool:
        """Whether a delayed merge sets the worker's fragment to ``θ`` plus its own steps since
        the launch, instead of mixing by :attr:`alpha` (DiLoCo: no, it merges at the launch)."""
        return False

    def _groups(self) -> list[tuple[int, int]]:
        """The fragments' ``(lo, hi)`` ranges of parameter tensors (DiLoCo: the whole model)."""
        return [(0, len(self.state.params))]

    def _offset(self, index: int, count: int) -> int:
        """Fragment ``index``'s sync offset within a period: ``index · period // count``."""
        return index * self.config.period // count

    def _outer_from_config(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        cfg = self.config
        if cfg.outer == "adam":
            return torch.optim.Adam(params, lr=cfg.outer_lr)
        return torch.optim.SGD(params, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                               nesterov=cfg.nesterov and cfg.outer_momentum > 0)

    # -- the schedule -----------------------------------------------------------------------
    def after_step(self) -> None:
        super().after_step()
        if self.step == self.config.warmup and self.config.warmup > 0:
            self._restart()  # the rounds start from the model the warm-up trained

    def averages_after(self, local: int) -> bool:
        """A fragment merges or launches after local step ``local`` (a background round's
        launch included: it hands its average to the twin group)."""
        return any(f.merge_at == local or local % self.config.period == f.offset for f in self.fragments)

    def after_local_step(self, local: int) -> None:
        """Merge the fragments that are due, then launch those whose turn it is (a fragment
        with no delay is merged at its launch). Every rank runs the same schedule, so the
        collectives are issued in the same order everywhere."""
        before = self.comm.meter.bytes_sent
        for f in self.fragments:
            if f.merge_at == local:
                self._merge(f)
        for f in self.fragments:
            if local % self.config.period == f.offset:
                self._launch(f, local)
        self.peak_bytes = max(self.peak_bytes, self.comm.meter.bytes_sent - before)

    def outer_step(self) -> None:
        """Sync every fragment now: average the pseudo-gradients, step the outer optimizer,
        continue from ``θ`` (with the fragments' mixing; ``sync=eager|delayed``: the average in
        flight lands first)."""
        if self.background is not None:
            self._drain(self.fragments[0])
            return
        for f in self.fragments:
            if f.merge_at is not None:
                self._merge(f)
        for f in self.fragments:
            self._launch(f, None)

    def _launch(self, f: Fragment, local: int | None, alpha: float | None = None) -> None:
        """Start averaging fragment ``f``'s pseudo-gradient ``θ − θ_i``; merged ``delay`` local
        steps after ``local`` (at once with no delay, or with ``local`` None, with ``alpha``).
        With ``sync=eager|delayed`` a round's average goes to the background (:meth:`_round`)."""
        if self.background is not None and local is not None:
            self._round(f, local)
            return
        t0 = time.perf_counter()
        delta = f.delta = self._pseudo(f, f.delta)
        self._before_encode(f)
        if f.agg is None:
            f.agg = self.averager(delta, f.codec, scatter=self.scatter, comm=self._sync_comm)
        f.agg.step = f.syncs  # the codec's step (its seeds): identical on every rank
        t1 = time.perf_counter()
        at_once = local is None or self.delay == 0
        before = self.comm.meter.counts()
        twin_here = self.offload is not None and at_once  # over the twin's group, on this thread (none in flight)
        if twin_here:
            assert self.offload is not None
            self.offload.twin.use_meter(ByteMeter(inter_share=self.comm.meter.inter_share))
        if not at_once and self.rebases:  # where this rank stood at the launch, as θ − Δ_i: kept for the merge
            f.own = delta.clone()
        pending: Reduction | ScatterReduction | InFlight
        if not at_once and self.offload is not None:  # the whole average on the background thread
            agg = f.agg
            pending = self.offload.start(lambda: agg.start({"model": delta}).wait())
        else:
            pending = f.agg.start({"model": delta})
        f.pending = pending
        if not at_once:  # an average behind the next steps: its seconds, and the steps it runs behind
            f.watch.start(pending, pending.started_at)
            sent = None if self.offload is not None else self.comm.meter.since(before, "inter")  # not the node's
            f.launched = (sent, time.perf_counter())
        f.landed = False
        self._timing.codec_seconds += t1 - t0
        if local is None or at_once:
            self._merge(f, alpha)
            if twin_here:
                assert self.offload is not None
                self.comm.meter.absorb(self.offload.twin.meter)
        else:
            f.merge_at = local + self.delay

    def _merge(self, f: Fragment, alpha: float | None = None) -> None:
        """Land ``f``'s mean pseudo-gradient, step the outer optimizer on ``f``'s ``θ`` and
        set the fragment's parameters to ``α · θ_i + (1 − α) · θ`` (``alpha``: in place of
        :attr:`alpha`; finish()'s final sync sets every rank to ``θ``)."""
        t0 = time.perf_counter()
        launched, f.launched = f.launched, None  # an average run behind later steps, not merged at its launch
        if f.pending is not None:
            f.pending.settle()
            if launched is not None:
                self.blocked_seconds += time.perf_counter() - t0
            f.pending.wait()  # the mean pseudo-gradient, in f.delta
            f.took = _took(f.pending) if self.reads_took else None
            if launched is not None:  # what the sync sent, and the seconds of work it ran behind
                sent = launched[0] if launched[0] is not None else getattr(f.pending, "sent", None)
                if sent is not None:
                    self._windows.append((sent, t0 - launched[1]))
            f.pending = None
        elif launched is not None and launched[0] is not None:  # landed before a checkpoint
            self._windows.append((launched[0], t0 - launched[1]))
        elif not f.landed:
            raise RuntimeError(f"fragment {f.index} has no average to merge")
        t1 = time.perf_counter()
        assert f.delta is not None  # set at the launch
        own, f.own = f.own, None
        if own is not None and alpha is None:  # merge=rebase: θ plus this rank's steps since the launch
            since = self._since_launch(f, own)
            self._step_outer(f, f.delta)
            self._continue(f, 0.0)
            with torch.no_grad():
                for p, at in _spans(self.state.local_params()[f.lo : f.hi]):
                    p.add_(since[at].view(p.shape))
        else:
            self._step_outer(f, f.delta)
            self._continue(f, self.alpha if alpha is None else alpha)
        t2 = time.perf_counter()
        if f.index == 0:
            self._average_rest()
        f.syncs += 1
        f.landed = False
        f.merge_at = None
        f.merged_at = self.step - self.config.warmup
        self.syncs += 1
        self._timing.codec_seconds += t2 - t1
        took, f.took = f.took, None
        if took is not None:
            self._average_took(took)

    def _since_launch(self, f: Fragment, own: torch.Tensor) -> torch.Tensor:
        """This rank's steps since fragment ``f``'s launch, flat, written over ``own`` (its
        pseudo-gradient then): ``θ_i − (θ − Δ_i)``, with ``θ`` not yet stepped."""
        with torch.no_grad():
            for (theta, at), p in zip(_spans(self.outer_params[f.lo : f.hi]), self.state.local_params()[f.lo : f.hi]):
                own[at].add_(p.reshape(-1)).sub_(theta.detach().reshape(-1))
        return own

    def _average_took(self, seconds: float) -> None:
        """Called on every rank at a merge of an average run whole on the background thread,
        with its seconds from launch to completion on this rank (streaming DiLoCo's
        ``delay=auto`` reads them). Default: nothing."""

    @property
    def _sync_comm(self) -> Communicator | None:
        """The communicator the fragments' averages run over: the background's own, or the
        world's (None)."""
        behind = self.background if self.background is not None else self.offload
        return behind.twin if behind is not None else None

    def _pseudo(self, f: Fragment, out: torch.Tensor | None) -> torch.Tensor:
        """This rank's pseudo-gradient ``θ − θ_i`` of fragment ``f``, flat, in ``out`` (fp32,
        allocated when it does not fit)."""
        params = self.state.local_params()[f.lo : f.hi]
        out = _flat(out, f.numel, params[0])
        for (theta, at), p in zip(_spans(self.outer_params[f.lo : f.hi]), params):
            torch.sub(theta.detach().reshape(-1), p.reshape(-1), out=out[at])
        return out

    def _before_encode(self, f: Fragment) -> None:
        """What a subclass does to its codec's state before a pseudo-gradient is encoded, with
        no average in flight (SparseLoCo: decay its error buffer). Default: nothing."""

    def _step_outer(self, f: Fragment, grad: torch.Tensor) -> None:
        """Step the outer optimizer on fragment ``f``'s ``θ`` with the flat ``grad`` (only this
        fragment's ``θ`` steps)."""
        thetas = self.outer_params[f.lo : f.hi]
        for theta, at in _spans(thetas):
            theta.grad = grad[at].view(theta.shape)
        self.outer.step()
        for theta in thetas:
            theta.grad = None

    def _continue(self, f: Fragment, alpha: float) -> None:
        """Set fragment ``f``'s parameters to ``α · θ_i + (1 − α) · θ`` (``θ`` at ``α = 0``)."""
        with torch.no_grad():
            for theta, p in zip(self.outer_params[f.lo : f.hi], self.state.local_params()[f.lo : f.hi]):
                if alpha == 0.0:
                    p.copy_(theta)
                elif p.dtype == theta.dtype:
                    p.lerp_(theta, 1.0 - alpha)  # p + (1 − α)(θ − p)
                else:  # in fp32, rounded once to the parameter's dtype
                    p.copy_(torch.lerp(p.float(), theta, 1.0 - alpha))

    # -- sync=eager|delayed: a round's average behind the next round ----------------------
    def _round(self, f: Fragment, local: int) -> None:
        """End a round with its average in the background. ``Δ_i`` is this round's
        pseudo-gradient, measured from where the round started (under eager the preview it
        continued from, under delayed ``θ``). The previous round's mean, landing now, steps
        ``θ`` (the same on every rank); then every rank continues from ``θ`` stepped with its own
        progress in place of the mean in flight (eager, :meth:`_preview`: ``Δ_i`` measured from
        halfway between the start and ``θ``, :meth:`_from_midway`; SparseLoCo: its own message)
        or from ``θ`` (delayed), and ``Δ_i`` is averaged behind the next round's inner steps."""
        assert self.background is not None  # sync=eager|delayed
        t0 = time.perf_counter()
        fresh = self._fresh = self._from_start(f, self._fresh)
        delta = f.delta = _flat(f.delta, f.numel, fresh)
        t1 = time.perf_counter()
        landed = self._take_landed(f)  # waiting for it counts as blocked, not as codec work
        t2 = time.perf_counter()
        if landed:
            self._step_outer(f, delta)
            self.syncs += 1
        agg = self._ready(f, fresh)  # the codec's state is idle now (nothing in flight)
        started, counted = None, 0.0  # the encode here is the aggregator's to count, not this method's
        if self.eager and self.previews_own_message:  # encoded here: the preview is what this rank sends
            t_start = time.perf_counter()
            started = agg.start({"model": delta})
            counted = time.perf_counter() - t_start
            self._preview(f, self._own_message(agg, started, fresh))
        elif self.eager:  # this rank's progress in place of the mean in flight
            self._preview(f, self._from_midway(f, fresh))
        else:
            self._continue(f, 0.0)
        t3 = time.perf_counter()
        if f.index == 0:
            self._average_rest()
        t4 = time.perf_counter()

        def work() -> float:
            before = agg.timing.codec_seconds
            (started or agg.start({"model": delta})).wait()
            return agg.timing.codec_seconds - before

        self.background.launch(work)
        f.merged_at = local
        self._timing.codec_seconds += (t1 - t0) + (t3 - t2 - counted) + (time.perf_counter() - t4)

    def _ready(self, f: Fragment, pseudo: torch.Tensor) -> Aggregator | ScatterMean:
        """Put ``pseudo`` in ``f.delta`` to be averaged over the background's group, with the
        codec's state made ready (``_before_encode``) and its step set: the aggregator to start."""
        assert f.delta is not None  # allocated by the caller
        f.delta.copy_(pseudo)
        self._before_encode(f)
        if f.agg is None:
            f.agg = self.averager(f.delta, f.codec, scatter=self.scatter, comm=self._sync_comm)
        f.agg.step = f.syncs
        f.syncs += 1
        return f.agg

    #: eager: preview with this rank's own decoded message (encoded on the training thread at the
    #: round's end) rather than its pseudo-gradient; DiLoCo: no, its codec's message is the
    #: pseudo-gradient itself or a quantization of it
    previews_own_message = False

    @staticmethod
    def _own_message(agg: Aggregator | ScatterMean, started: Any, out: torch.Tensor) -> torch.Tensor:
        """This rank's own message of the average ``started`` (:meth:`Aggregator.start` of one
        flat bucket), decoded into the flat fp32 ``out`` (a kept buffer: no model-sized
        allocation per round): what it adds to the mean, at the scale of one rank's."""
        if not isinstance(agg, Aggregator) or not isinstance(started, Reduction) or len(started.payloads) != 1:
            raise RuntimeError("an eager preview of the rank's own message needs one flat bucket's average")
        out.zero_()
        agg.buckets[0].codec.decode_add(started.payloads[0], out)
        return out

    def _preview(self, f: Fragment, own: torch.Tensor) -> None:
        """Set fragment ``f``'s parameters to the outer step ``θ`` would take with ``own`` as
        its gradient (this rank's progress in place of the mean still in flight), and
        leave ``θ`` and the outer optimizer's state as they were."""
        thetas = self.outer_params[f.lo : f.hi]
        state = copy.deepcopy(self.outer.state_dict())
        start = self._start = _flat(self._start, f.numel, own)  # where the next round starts
        kept = [theta.data for theta in thetas]
        with torch.no_grad():
            for theta, at in _spans(thetas):  # the outer step runs on a copy of θ (fp32, as its gradient is): `start`
                start[at].copy_(theta.detach().reshape(-1))
                theta.data = start[at].view(theta.shape)
        try:
            self._step_outer(f, own)
        finally:
            for theta, saved in zip(thetas, kept):
                theta.data = saved
            self.outer.load_state_dict(state)
        with torch.no_grad():
            for p, at in _spans(self.state.local_params()[f.lo : f.hi]):
                p.copy_(start[at].view(p.shape))

    def _from_midway(self, f: Fragment, fresh: torch.Tensor) -> torch.Tensor:
        """Eager's preview gradient: this round's progress measured from halfway between the
        preview it started at and ``θ`` (just stepped with the mean that landed), written over
        ``fresh`` (whose progress from the start is already in the average, which this leaves
        alone). How far a rank's start stood off ``θ``, ``e_i``, comes back in its next
        preview scaled by the outer step's gain on a gradient ``k`` (SGD: ``lr (1 + μ)`` with
        Nesterov): measured from the start, by ``k·ρ`` for the share ``ρ`` of ``e_i`` the inner
        steps undid; from ``θ``, by ``k·(1 − ρ)``; from halfway, by ``k·|ρ − 1/2| <= k/2``. So
        the ranks' starts do not drift apart for any ``k < 2``, whatever the inner steps undo
        (the paper's lr 0.7 with momentum 0.9 is ``k = 1.33``). What is averaged is still each
        rank's progress from its start. Our rule, not the paper's."""
        if self._start is None:  # the round started at θ
            return fresh
        fresh.sub_(self._start, alpha=0.5)
        for theta, at in _spans(self.outer_params[f.lo : f.hi]):
            fresh[at].add_(theta.detach().reshape(-1), alpha=0.5)
        return fresh

    def _from_start(self, f: Fragment, out: torch.Tensor | None) -> torch.Tensor:
        """This rank's progress since its round started, as a pseudo-gradient: ``θ − θ_i``
        (delayed: the round started at ``θ``), or ``start − θ_i`` with ``start`` the preview
        it continued from (eager; kept in ``self._start``)."""
        if self._start is None:
            return self._pseudo(f, out)
        params = self.state.local_params()[f.lo : f.hi]
        out = _flat(out, f.numel, params[0])
        for p, at in _spans(params):
            torch.sub(self._start[at], p.reshape(-1), out=out[at])
        return out

    def _take_landed(self, f: Fragment) -> bool:
        """Land the average in flight into ``f.delta``; whether a mean is there to apply (just
        landed, or landed before a checkpoint), which this call consumes."""
        if self.background is not None and self.background.land():
            f.landed = True
        landed, f.landed = f.landed, False
        return landed

    def _drain(self, f: Fragment) -> None:
        """Land the average in flight and step ``θ`` with it, sync the steps since the round's
        start (blocking, through the same codec), step ``θ`` again, and continue every rank from
        ``θ``: one model on every rank, every round's progress applied once."""
        local = self.step - self.config.warmup
        partial = local > 0 and f.merged_at != local
        fresh = None
        if partial:
            fresh = self._fresh = self._from_start(f, self._fresh)
        delta = f.delta = _flat(f.delta, f.numel, self.outer_params[f.lo])
        if self._take_landed(f):
            self._step_outer(f, delta)
            self.syncs += 1
        self._start = None
        if fresh is not None:
            self._ready(f, fresh).start({"model": delta}).wait()  # nothing in flight: this thread may use the twin
            assert self.background is not None
            self.comm.meter.absorb(self.background.twin.meter)
            self._step_outer(f, delta)
            self.syncs += 1
        self._continue(f, 0.0)
        if f.index == 0:
            self._average_rest()
        f.merged_at = local

    def _average_rest(self) -> None:
        """Float buffers (and, with ``average_momentum``, the inner optimizer's state): their
        plain fp32 mean, written back."""
        tensors = self.state.tensors()[len(self.state.params):]
        if not tensors:
            return
        rest = self._rest = _flat(self._rest, sum(t.numel() for t in tensors), tensors[0])
        for t, at in _spans(tensors):
            rest[at].copy_(t.reshape(-1))
        if self._plain is None or self._plain.buckets[0].numel != rest.numel():
            self._plain = self.averager(rest)
        self._plain.start({"model": rest}).wait()
        for t, at in _spans(tensors):
            t.copy_(rest[at].view(t.shape))

    def _restart(self) -> None:
        """``θ`` := the model's parameters (identical on every rank after synchronous steps)."""
        with torch.no_grad():
            for theta, p in zip(self.outer_params, self.state.local_params()):
                theta.copy_(p)

    def finish(self) -> None:
        """Land and merge the averages still in flight, then (``final_sync``, the default) one
        more outer step for every fragment with local steps since its last sync (or mixed
        with ``alpha``), after which every rank's parameters are ``θ``: the run ends with one
        global model, the same on every rank. With ``final_sync=false`` each rank keeps its
        own model (apart by the local steps since the last sync). A run past its warm-up that
        never synced before this (fewer local steps than ``period``) is warned about once:
        it trained one round, and ``report()`` says so (``syncs_before_finish``). Ending with
        an outer step on the partial round, rather than a plain average of the models, is our
        choice: the papers do not say how a run ends between syncs."""
        local = self.step - self.config.warmup
        self.syncs_before_finish = self.syncs
        launched = self.syncs > 0 or any(f.merge_at is not None or f.syncs for f in self.fragments)
        if local > 0 and not launched and not self.never_synced_warned:
            self.never_synced_warned = True
            self.warn(f"{self.spec.split(':')[0]}: {local} local steps and no outer step before finish() "
                      f"(period={self.config.period}): the run trained a single round"
                      + (" and finish() averages it" if self.config.final_sync else
                         "; with final_sync=false every rank keeps its own model"))
        if self.background is not None:
            self._drain(self.fragments[0])
            self.background.close()  # nothing in flight: its thread ends
            return None
        for f in self.fragments:
            if f.merge_at is not None:
                self._merge(f)
        if self.offload is not None:
            self.offload.close()  # nothing in flight: its thread ends (the final sync runs here, over its group)
        if not self.config.final_sync or local <= 0:
            return None
        for f in self.fragments:  # the same on every rank: the schedule's state is
            # a fragment merged at this step is at θ, unless the merge kept some of the rank's own
            if f.merged_at != local or self.alpha != 0.0 or self.rebases:
                self._launch(f, None, alpha=0.0)
        return None

    # -- figures ----------------------------------------------------------------------------
    @property
    def comm_seconds(self) -> float:
        """Launch-to-completion seconds of every fragment average so far (run behind later steps)."""
        own = self.background.seconds if self.background is not None else 0.0
        return sum(f.watch.total for f in self.fragments) + own

    @property
    def waited_seconds(self) -> float:
        """Seconds the training thread waited for averages still in flight."""
        return self.blocked_seconds + (self.background.blocked if self.background is not None else 0.0)

    def hidden_seconds(self, link: Link) -> float:
        """Modeled seconds of the syncs' collectives on ``link`` that the steps between launch
        and merge hide: ``min(T_link(sync), window)`` per merged sync (none with no delay: a
        sync merged at its launch hides nothing and is not counted; in two levels, the
        collectives between nodes)."""
        n = self.comm.world_size
        own = self.background.hidden_seconds(link) if self.background is not None else 0.0
        return sum(min(meter_seconds(link, sent, n), window) for sent, window in self._windows) + own

    def hidden_fraction(self) -> float | None:
        """1 − blocked / communication time of the syncs run behind later steps (None with no
        delay, or before one completed); an average still in flight counts once it completes.
        Like the window figures, it covers the run since its start or its last resume."""
        total = self.comm_seconds
        return None if total <= 0 else max(0.0, 1.0 - self.waited_seconds / total)

    def stats(self) -> dict[str, Any]:
        return {"outer_steps": self.syncs, "peak_bytes_per_sync": self.peak_bytes}

    def overlap_report(self) -> dict[str, Any] | None:
        """``sync=eager|delayed``: the rounds' averages in the cost model's terms (see
        :mod:`thinwire.lab.cost`): every averaged element runs early (``early_share`` 1),
        behind ``window_seconds`` of computation (from each launch to the round's end that
        needed its mean), so a step costs ``compute + max(0, G − window)``; none without."""
        if self.background is None:
            return None
        b = self.background
        return {"enabled": True, "steps": len(b.windows), "window_seconds": sum(w for _, _, w in b.windows),
                "blocked_seconds": b.blocked, "early_share": 1.0, "reduces": 0, "leads": []}

    def summary_fields(self) -> dict[str, Any]:
        report = self.overlap_report()
        return {} if report is None else {"overlap": report}

    def report(self) -> dict[str, Any]:
        for f in self.fragments:  # after the last merge: every watch has seen its average complete
            if f.pending is None:
                f.watch.join()
        outer_state = sum(t.numel() for s in self.outer.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor) and t.dim() > 0)
        return {"method": self.spec, "outer_steps": self.syncs, "syncs_before_finish": self.syncs_before_finish,
                "sync": getattr(self.config, "sync", "blocking"),
                "outer_optimizer": type(self.outer).__name__,
                "fragments": [[f.lo, f.hi, f.numel, f.offset] for f in self.fragments],
                "peak_bytes_per_sync": self.peak_bytes, "hidden_fraction": self.hidden_fraction(),
                "blocked_seconds": self.waited_seconds, "average_seconds": self.comm_seconds,
                "extra_memory_bytes": 4 * ((2 + self._copies) * self.state.numel() + outer_state)}

    @property
    def _copies(self) -> int:
        """Flat model-sized buffers beyond θ and the pseudo-gradient: a background sync keeps
        this round's pseudo-gradient apart from the mean in flight, eager also where the round
        started; ``merge=rebase`` keeps where each fragment in flight stood at its launch."""
        return (0 if self.background is None else 2 if self.eager else 1) + (1 if self.rebases else 0)

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs; an average in flight is landed first (its mean is
        stored, and merged at the same step after resuming)."""
        self.settle()
        fragments = []
        for f in self.fragments:
            fragments.append({"syncs": f.syncs, "merge_at": f.merge_at, "merged_at": f.merged_at, "landed": f.landed,
                              "took": f.took,
                              "delta": None if f.delta is None or not f.landed else f.delta.detach().clone(),
                              "own": None if f.own is None else f.own.detach().clone(),
                              "agg": None if f.agg is None else f.agg.state_dict()})
        return {**super().state_dict(), "syncs": self.syncs, "peak_bytes": self.peak_bytes,
                "outer_params": [t.detach().clone() for t in self.outer_params],
                "outer": self.outer.state_dict(), "fragments": fragments,
                "outer_sync": getattr(self.config, "sync", "blocking"),
                "start": None if self._start is None else self._start.detach().clone()}

    def settle(self) -> None:
        """Wait for every average still in flight and keep its mean, to be applied when it is
        due, as planned (a checkpoint does this; so does a benchmark that times whole rounds,
        between them). The results are those of a run that never settled."""
        if self.background is not None and self.background.land():  # a round's average in flight
            self.fragments[0].landed = True
        for f in self.fragments:
            if f.pending is not None:
                t0 = time.perf_counter()
                f.pending.settle()
                self.blocked_seconds += time.perf_counter() - t0
                f.pending.wait()
                sent = getattr(f.pending, "sent", None)  # an offloaded average's traffic, known once it ran
                if f.launched is not None and f.launched[0] is None and sent is not None:
                    f.launched = (sent, f.launched[1])
                f.took = _took(f.pending) if self.reads_took else None
                f.pending, f.landed = None, True

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "fragments" not in state:  # saved before fragments: one, never in flight
            state = {**{k: v for k, v in state.items() if k != "pseudo"}, "peak_bytes": 0.0,
                     "fragments": [{"syncs": state["syncs"], "merge_at": None, "landed": False, "delta": None,
                                    "agg": state["pseudo"]}]}
        if len(state["fragments"]) != len(self.fragments):
            raise ValueError(f"the state holds {len(state['fragments'])} fragment(s), this run has "
                             f"{len(self.fragments)}")
        saved_sync, sync = state.get("outer_sync", "blocking"), getattr(self.config, "sync", "blocking")
        if saved_sync != sync and saved_sync != "blocking" and state["fragments"][0]["landed"]:
            raise ValueError(f"checkpoint was saved with sync={saved_sync} and a round's average in flight; this run "
                             f"has sync={sync}: resume with sync={saved_sync}")
        super().load_state_dict(state)
        self.syncs = int(state["syncs"])
        self.peak_bytes = float(state["peak_bytes"])
        with torch.no_grad():
            for theta, saved in zip(self.outer_params, state["outer_params"], strict=True):
                theta.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        for f, saved in zip(self.fragments, state["fragments"]):
            f.syncs, f.merge_at, f.landed = int(saved["syncs"]), saved["merge_at"], bool(saved["landed"])
            f.merged_at = saved.get("merged_at")  # None (an older checkpoint): finish() syncs it to be safe
            f.took = saved.get("took")
            f.pending, f.launched = None, None
            like = self.state.params[f.lo]
            own = saved.get("own")  # merge=rebase, with a fragment in flight
            f.own = None if own is None else own.to(like.device).clone()
            f.delta = _flat(f.delta, f.numel, like)
            if saved["delta"] is not None:
                f.delta.copy_(saved["delta"])
            if saved["agg"] is not None:
                f.agg = f.agg or self.averager(f.delta, f.codec, scatter=self.scatter, comm=self._sync_comm)
                f.agg.load_state_dict(saved["agg"])
        start = state.get("start") if self.eager else None
        self._start = None if start is None else start.to(self.outer_params[0].device).clone()


def _took(pending: Any) -> float | None:
    """An offloaded average's seconds from launch to completion (None for one run inline)."""
    finished = getattr(pending, "finished_at", None)
    return None if finished is None else finished - pending.started_at


def _spans(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[torch.Tensor, slice]]:
    """Each tensor with its span in a flat buffer that lays the tensors out one after another."""
    off = 0
    for t in tensors:
        n = t.numel()
        yield t, slice(off, off + n)
        off += n


def _flat(buf: torch.Tensor | None, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat fp32 buffer of ``numel`` on ``like``'s device, ``buf`` when it fits."""
    if buf is not None and buf.numel() == numel and buf.device == like.device:
        return buf
    return torch.empty(numel, dtype=torch.float32, device=like.device)


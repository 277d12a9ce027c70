"""Gradient averaging with PyTorch's semantics: the core of every method that reduces gradients.

:class:`GradientReducer` replaces the ``.grad`` of a model's parameters with their mean over
the ranks, through codecs, and behaves in a user's loop as ``DistributedDataParallel`` does:

* **``None`` stays ``None``.** Only parameters that require a gradient *and* hold one this
  step are averaged; ``requires_grad`` is read again every step, so a layer frozen mid-run,
  or a module no rank used, is left exactly as plain PyTorch leaves it (its ``.grad`` is not
  created, an optimizer's momentum and weight decay never see it) and costs no bytes.
* **Ranks that disagree** about which parameters have a gradient (a branch taken on one rank
  only) need ``find_unused_parameters=True``, as DDP does: one all_reduce of a map of the
  used parameters per step (float64, counted by the byte meter) lets every rank average the
  parameters some rank used (a rank without a gradient contributes zeros and, unless the
  parameter is frozen there, receives the mean in a new ``.grad``) and leave alone those no
  rank used. Without it (the default, DDP's too) the ranks must agree, or their collectives
  would not match; when a scaler makes the ranks agree anyway, a fingerprint of each rank's
  set rides along and a mismatch raises ``ValueError`` on every rank alike.
* **Mixed precision.** With a ``torch.amp.GradScaler``, gradients are unscaled before they
  are encoded and scaled back after, so error-feedback residuals and codec state live in
  the model's own units whatever the scale does (plain casts without state, ``fp16`` above
  all, stay in the scaler's units: :func:`is_plain`). A step whose gradients are not finite
  on some rank (a scaler overflow) is agreed on by every rank (one all_reduce of 24 bytes,
  sharing the used map's when there is one, read back once), sends nothing, changes no residual, codec state or
  step counter, and fills every gradient with NaN on every rank, so each rank's
  ``scaler.step`` skips it and ``scaler.update`` backs the scale off, as under DDP.
* **Sparse gradients** (``nn.Embedding(sparse=True)``) are refused naming the parameter.

At most :data:`MAX_SETS` sets keep their aggregators (and buffers); the least recently
used is evicted, its bytes and seconds kept in the totals.

Distributed invariant: the averaged names are a pure function of the agreed map (or, without
``find_unused_parameters``, of state the ranks share), and each distinct set has its own
:class:`~thinwire.aggregate.Aggregator` built from the names in reverse
``named_parameters()`` order, so every rank issues the same collectives in the same order. All aggregators share
one :class:`~thinwire.feedback.ErrorFeedback` (residuals keyed by parameter name) and the
same codec objects (codec state keyed by name), so a parameter keeps its residual when the
set around it changes.
"""

from __future__ import annotations

import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from thinwire.aggregate import Aggregator, CodecChooser
from thinwire.codecs.base import Codec
from thinwire.comm.background import Worker
from thinwire.comm.base import Communicator
from thinwire.comm.groups import is_sharded, local_part
from thinwire.feedback import ErrorFeedback
from thinwire.hierarchical import build_aggregator
from thinwire.timing import Timing

MAX_SETS = 8  # distinct sets of parameters whose aggregators (and buffers) are kept


@dataclass
class _Window:
    """One step's averaging in the backward pass: what was launched, and when."""

    agg: Aggregator | None = None  # the aggregator of the expected set, whose buckets launch
    fired: dict[str, int] = field(default_factory=dict)  # name -> gradients accumulated since reduce()
    next: int = 0  # the next bucket (index into agg.buckets) to launch
    launched: list[int] = field(default_factory=list)
    sent: set[str] = field(default_factory=set)  # names of launched buckets
    futures: list[torch.futures.Future] = field(default_factory=list)
    late: str | None = None  # a name whose gradient grew after its bucket was launched
    t_first: float | None = None  # when the first bucket was launched
    times: list[float] = field(default_factory=list)  # when each launched bucket was launched


class GradientReducer:
    """Averages the ``.grad`` of ``named`` parameters over the ranks of ``comm``.

    ``named``: every parameter that may take part, in ``named_parameters()`` order (frozen
    ones included: ``requires_grad`` is read each step). ``codec_for(name, tensor)`` picks
    each parameter's codec, the same on every rank.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        codec_for: CodecChooser,
        comm: Communicator,
        *,
        bucket_mb: float = 25.0,
        find_unused_parameters: bool = False,
        overlap: bool = True,
    ) -> None:
        self.named = list(named)
        live = tuple(n for n, p in self.named if p.requires_grad)
        if not live:
            raise ValueError("gradient averaging needs at least one parameter with requires_grad=True")
        self.comm = comm
        self.codec_for = codec_for
        self.bucket_mb = bucket_mb
        self.find_unused_parameters = find_unused_parameters
        self.feedback = ErrorFeedback()
        self.step = 0  # steps averaged (skipped overflow steps not counted); identical on all ranks
        self.skipped = 0  # steps dropped on every rank for a non-finite gradient under a scaler
        self._aggregators: OrderedDict[tuple[str, ...], Aggregator] = OrderedDict()  # most recently used last
        self._retired = Timing()  # seconds of aggregators evicted from the cache
        self._retired_sent: dict[str, float] = {}  # and their bytes, by name
        self._plain: dict[str, bool] = {}  # name -> sent as a plain cast (stays in the scaler's units)
        self.aggregator = self._aggregator_for(live)  # the set at construction: plans and codecs
        # overlap: buckets of the expected set launched from the backward pass
        # FSDP2 writes a shard's gradient after backward's hooks: launching from them is not possible
        self.overlap = overlap = overlap and not any(is_sharded(p) for _, p in self.named)
        self.armed = True  # launches happen only while armed (a method whose warm-up ended disarms)
        self._expected = live  # the names averaged at the last reduce(): their buckets launch in backward
        self._passes = 0  # the most backward passes seen before one reduce(); 0: none yet (step 0 waits)
        self._scaled = False  # the last reduce() had a scaler: such steps are decided whole, at reduce()
        self._window = _Window()
        self._worker: Worker | None = None
        self._out: dict[str, torch.Tensor] = {}  # name -> the buffer a launched bucket's mean lands in
        self._flat_out: dict[tuple[str, int], torch.Tensor] = {}  # a fused bucket's flat buffer of those
        self._names = {id(p): n for n, p in self.named}
        self._params = dict(self.named)
        # cumulative; per launch position k: seconds from launch to reduce(), elements, steps
        # (summed): the cost model's queue of buckets (lab/cost.py)
        self.overlap_figures: dict[str, Any] = {"steps": 0, "window_seconds": 0.0, "blocked_seconds": 0.0,
                                                "early_elements": 0, "elements": 0, "reduces": 0,
                                                "lead_seconds": [], "lead_elements": [], "lead_steps": []}
        if overlap:
            ref = weakref.ref(self)  # a dropped reducer's hooks do nothing (the parameters outlive it)

            def on_grad(p: torch.Tensor) -> None:
                reducer = ref()
                if reducer is not None:
                    reducer._on_grad(p)

            self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for _, p in self.named]

    @property
    def codecs(self) -> list[Codec]:
        return self.aggregator.codecs

    @property
    def timing(self) -> Timing:
        return Timing.total([self._retired, *(agg.timing for agg in self._aggregators.values())])

    @property
    def sent_bytes(self) -> dict[str, float]:
        """Bytes this rank sent per parameter name, over every set averaged so far."""
        out = {n: self._retired_sent.get(n, 0.0) for n, _ in self.named}
        for agg in self._aggregators.values():
            for name, b in agg.sent_bytes.items():
                out[name] += b
        return out

    def plan(self) -> list[dict]:
        """Per parameter of the construction-time set, in parameter order: name, shape,
        codec, wire bytes."""
        order = {n: i for i, (n, _) in enumerate(self.named)}
        return sorted(self.aggregator.plan(), key=lambda row: order[row["name"]])

    def _aggregator_for(self, names: tuple[str, ...]) -> Aggregator:
        """The aggregator of this set of names (built on first use; at most
        :data:`MAX_SETS` are kept, the least recently used other than the construction-time
        one evicted with its buffers, its bytes and seconds kept in the totals)."""
        agg = self._aggregators.get(names)
        if agg is None:
            params = dict(self.named)
            # buckets filled from the last parameter: backward computes gradients roughly in
            # reverse order, so the first buckets are ready first (DDP's order too)
            held = [(n, local_part(params[n].detach())) for n in reversed(names)]  # a shard: its own shape
            agg = build_aggregator(held, self.codec_for, self.comm, bucket_mb=self.bucket_mb, feedback=self.feedback)
            self._aggregators[names] = agg
            while len(self._aggregators) > MAX_SETS:
                old = next(k for k, a in self._aggregators.items() if a is not self.aggregator)
                self._retire(self._aggregators.pop(old))
        self._aggregators.move_to_end(names)
        return agg

    def _retire(self, agg: Aggregator) -> None:
        self._retired = Timing.total([self._retired, agg.timing])
        for name, b in agg.sent_bytes.items():
            self._retired_sent[name] = self._retired_sent.get(name, 0.0) + b

    def _is_plain(self, name: str, p: torch.Tensor) -> bool:
        plain = self._plain.get(name)
        if plain is None:
            plain = self._plain[name] = is_plain(self.codec_for(name, p), local_part(p.detach()).shape)
        return plain

    # -- work ------------------------------------------------------------------------------
    def reduce(self, scaler: Any = None) -> bool:
        """Average this step's gradients in place; False when the step was non-finite under
        ``scaler`` and skipped on every rank (gradients filled with NaN, nothing else changed).

        Mutates the parameters' ``.grad`` (creating one, for a parameter some other rank
        used, under ``find_unused_parameters``), the residuals and the codecs' state. Call it
        after ``backward()`` and before ``scaler.unscale_``/``scaler.step``. Raises
        ``ValueError`` on every rank alike when a scaler's agreement shows that the ranks hold
        gradients for different parameters without ``find_unused_parameters``.
        """
        window, self._window = self._window, _Window()
        t_reduce = time.perf_counter()
        self._drain(window)  # the buckets launched in backward have landed in their buffers
        if window.fired:
            self._passes = max(self._passes, max(window.fired.values()))
        scale = loss_scale(scaler)
        if window.late is not None:
            raise RuntimeError(f"the gradient of {window.late!r} grew after its bucket was sent during backward "
                               f"(more backward passes before this reduce() than the {self._passes - 1} seen "
                               "before): this step's average would be wrong; keep the number of backward passes "
                               "per reduce() at most the largest so far, or build the reducer with overlap=False")
        if window.launched and scale is not None:
            raise RuntimeError("reduce(scaler=...) got a GradScaler after steps without one, so buckets were sent "
                               "during backward in the scaler's units: pass the scaler from the first step on")
        self._scaled = scale is not None
        local = [p.requires_grad and p.grad is not None for _, p in self.named]
        for (name, p), has in zip(self.named, local):
            if has and p.grad is not None and p.grad.is_sparse:
                raise ValueError(f"parameter {name!r} has a sparse gradient, which thinwire cannot average; "
                                 "build its layer with sparse=False (e.g. nn.Embedding(..., sparse=False))")
        found = None
        if scale is not None:
            held = [(name, p) for (name, p), has in zip(self.named, local) if has]
            found = check_and_unscale([local_part(g) for _, p in held if (g := p.grad) is not None],  # every one held
                                      [1.0 if self._is_plain(name, p) else 1.0 / scale for name, p in held])
        bad, used = False, local
        if scale is not None or self.find_unused_parameters:
            bad, used = self._agree(found, local)
        if bad:
            self._skip(used)
            return False
        tensors: dict[str, torch.Tensor] = {}
        back: list[torch.Tensor] = []
        for (name, p), u, has in zip(self.named, used, local):
            if not u:
                continue
            if not has and p.requires_grad:
                p.grad = torch.zeros_like(p)  # used on another rank: DDP gives this rank the mean too
            grad = p.grad if p.requires_grad else torch.zeros_like(p)  # frozen here: sent, not kept
            assert grad is not None  # requires_grad: held, or created just above
            grad = local_part(grad)  # a shard's gradient (FSDP2): the part this rank holds
            tensors[name] = grad
            if scale is not None and p.requires_grad and not self._is_plain(name, p):
                back.append(grad)  # averaged unscaled on every rank, this one's zeros included
        self._average(tensors, window, t_reduce)
        if back and scale != 1.0:
            assert scale is not None  # back is filled under a scaler only
            torch._foreach_mul_(back, scale)  # back to the scaler's units: scaler.step unscales
        self.step += 1
        return True

    def _average(self, tensors: dict[str, torch.Tensor], window: _Window, t_reduce: float) -> None:
        """Average ``tensors`` in place as the expected set's buckets (those launched in
        backward land from their buffers; the others whose names are all here go now) plus
        one set of whatever is left. Overlap or not, the same buckets: the same bits."""
        if not tensors:
            return
        agg = window.agg if window.agg is not None else self._aggregator_for(self._expected)
        agg.step = self.step  # the step of the whole reducer, whichever set is averaged
        covered: set[str] = set(window.sent)
        for i in window.launched:
            for slot in agg.buckets[i].slots:
                if slot.name in tensors:  # a gradient dropped after backward stays dropped
                    tensors[slot.name].copy_(self._out[slot.name])
        launched = set(window.launched)
        rest = [i for i, b in enumerate(agg.buckets)
                if i not in launched and all(slot.name in tensors for slot in b.slots)]
        for i in rest:
            covered.update(slot.name for slot in agg.buckets[i].slots)
        if rest:
            agg.reduce_(tensors, rest)
        left = tuple(n for n in tensors if n not in covered)
        if left:
            extra = self._aggregator_for(left)
            extra.step = self.step
            extra.reduce_(tensors)
        self._aggregator_for(self._expected)  # most recently used: kept for the next step
        if tuple(tensors) != self._expected:
            self._expected = tuple(tensors)
        figures = self.overlap_figures
        total = sum(t.numel() for t in tensors.values())
        figures["elements"] += total
        figures["reduces"] += 1
        if window.launched:
            assert window.t_first is not None  # set with the first launch
            figures["steps"] += 1
            figures["window_seconds"] += t_reduce - window.t_first
            seconds, counts, steps = figures["lead_seconds"], figures["lead_elements"], figures["lead_steps"]
            for k, (i, t) in enumerate(zip(window.launched, window.times)):
                elements = sum(s.numel for s in agg.buckets[i].slots if s.name in tensors)
                figures["early_elements"] += elements
                if k == len(seconds):
                    seconds.append(0.0), counts.append(0), steps.append(0)
                seconds[k] += t_reduce - t
                counts[k] += elements
                steps[k] += 1

    # -- overlap: buckets launched from the backward pass ------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        """A gradient is final for this backward pass: count it, and launch every bucket of
        the expected set, in bucket order, whose gradients have all arrived as often as the
        most backward passes seen per step (the order is the same on every rank)."""
        if not (self.overlap and self.armed):
            return
        w = self._window
        name = self._names[id(p)]
        w.fired[name] = w.fired.get(name, 0) + 1
        if name in w.sent:
            w.late = w.late or name
            return
        if not self._passes or self._scaled or self.find_unused_parameters:
            return  # decided whole at reduce(): the first step, a scaler's, or the used map's
        if w.agg is None:
            w.agg = self._aggregator_for(self._expected)
            w.agg.step = self.step
        buckets = w.agg.buckets
        while w.next < len(buckets):
            slots = buckets[w.next].slots
            if any(w.fired.get(s.name, 0) < self._passes for s in slots):
                break
            self._launch(w, w.next)
            w.next += 1

    def _outs(self, agg: Aggregator, i: int, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Where bucket ``i``'s means land: for a fused bucket of fp32 gradients, views at the
        slots' offsets of one flat buffer of the bucket's own (the aggregator then encodes and
        decodes in it with no further copy); else a buffer per parameter."""
        b = agg.buckets[i]
        first = grads[b.slots[0].name]
        if b.fused and all(g.dtype == torch.float32 for g in grads.values()):
            keep = {bucket.key for bucket in agg.buckets}
            for key in [k for k in self._flat_out if k[0] not in keep]:
                del self._flat_out[key]  # buckets of a set no longer averaged
            flat = self._flat_out.get((b.key, b.numel))
            if flat is None or flat.device != first.device:
                flat = self._flat_out[(b.key, b.numel)] = torch.empty(b.numel, device=first.device)
            outs: dict[str, torch.Tensor] = {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in b.slots}
            self._out.update(outs)
            return outs
        outs = {}
        for s in b.slots:
            g, out = grads[s.name], self._out.get(s.name)
            if out is None or out.shape != g.shape or out.dtype != g.dtype or out.device != g.device \
                    or out.untyped_storage().nbytes() != out.numel() * out.element_size():
                out = self._out[s.name] = torch.empty_like(g)  # its own storage, not a fused bucket's
            outs[s.name] = out
        return outs

    def _launch(self, w: _Window, i: int) -> None:
        params = self._params
        agg = w.agg
        assert agg is not None  # set by _on_grad before any launch
        slots = agg.buckets[i].slots
        grads: dict[str, torch.Tensor] = {}
        for s in slots:
            grad = params[s.name].grad
            assert grad is not None  # its post-accumulate-grad hook fired
            grads[s.name] = grad
        outs = self._outs(agg, i, grads)
        if self._worker is None:
            self._worker = Worker("thinwire-gradients")
            weakref.finalize(self, self._worker.close)  # the thread ends with the reducer
        now = time.perf_counter()
        if w.t_first is None:
            w.t_first = now
        w.times.append(now)
        w.launched.append(i)
        w.sent.update(grads)
        if agg.pipelines:
            # identity and casts: launched here, in backward; the worker waits and decodes, so
            # the next bucket's collective starts while this one is on the wire. The gradients
            # are copied into the bucket's flat buffer, which is encoded and decoded in place
            for s in slots:
                outs[s.name].copy_(grads[s.name])
            launched = agg.launch(outs, [i])
            w.futures.append(self._worker.submit(lambda: agg.land(launched, outs)))
        else:
            w.futures.append(self._worker.submit(lambda: agg.reduce_bucket(i, grads, outs)))

    def _drain(self, w: _Window) -> None:
        """Wait for every bucket launched in backward; re-raise the first failure."""
        if not w.futures:
            return
        t0 = time.perf_counter()
        failure = None
        for fut in w.futures:
            try:
                fut.wait()
            except BaseException as e:  # noqa: BLE001  (every bucket waited for, then the first raised)
                failure = failure or e
        self.overlap_figures["blocked_seconds"] += time.perf_counter() - t0
        if failure is not None:
            raise failure

    def _skip(self, used: list[bool]) -> None:
        """A step non-finite on some rank under a scaler: every used gradient becomes NaN on
        every rank, so every rank's scaler sees the overflow and skips; nothing else changes."""
        for (_, p), u in zip(self.named, used):
            if u and p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.fill_(float("nan"))
        self.skipped += 1

    def _agree(self, found: torch.Tensor | None, local: list[bool]) -> tuple[bool, list[bool]]:
        """One all_reduce (metered, float64) of [non-finite flag, h, h^2, used map]: the same
        answers on every rank, with one host read. ``h`` fingerprints this rank's set of
        parameters holding a gradient: without ``find_unused_parameters`` the ranks must
        agree, and n * sum(h^2) == (sum h)^2 exactly when every rank's ``h`` is the same."""
        device = self.named[0][1].device
        h = float(zlib.crc32(bytes(local)) & 0xFFFF)  # h^2 * n^2 stays exact in float64 up to ~1,400 ranks
        head = [0.0, h, h * h] + ([float(u) for u in local] if self.find_unused_parameters else [])
        flags = torch.tensor(head, dtype=torch.float64).to(device)  # (3 [+ params],)
        if found is not None:
            flags[:1].copy_(found.to(device))  # stays on the device: no sync before the collective
        self.comm.all_reduce(flags)
        got = flags.tolist()
        n = self.comm.world_size
        if not self.find_unused_parameters and n * got[2] != got[1] ** 2:
            raise ValueError("ranks hold gradients for different parameters this step (a layer used on some ranks "
                             "only); pass find_unused_parameters=True, as DDP needs")
        used = [v > 0 for v in got[3:]] if self.find_unused_parameters else local
        return got[0] > 0, used

    # -- state -------------------------------------------------------------------------------
    def clear_feedback(self) -> None:
        """Forget every error-feedback residual (an elastic worker that just joined)."""
        for agg in {id(a): a for a in (self.aggregator, *self._aggregators.values())}.values():
            agg.feedback.clear()

    def state_dict(self) -> dict:
        """Step, bytes per name, residuals by name, every codec's state, and what overlap
        learned (the expected set, the backward passes per step, whether a scaler is used)."""
        state = self.aggregator.state_dict()
        state.update(step=self.step, skipped=self.skipped, sent_bytes=self.sent_bytes,
                     expected=list(self._expected), passes=self._passes, scaled=self._scaled,
                     overlap={k: list(v) if isinstance(v, list) else v for k, v in self.overlap_figures.items()})
        return state

    def load_state_dict(self, state: dict) -> None:
        self.aggregator.load_state_dict(state)
        for names in [k for k, a in self._aggregators.items() if a is not self.aggregator]:
            del self._aggregators[names]  # their bytes are in the loaded totals
        self._retired_sent = {}
        self.step = int(state["step"])
        self.skipped = int(state.get("skipped", 0))
        known = {n for n, _ in self.named}
        expected = tuple(n for n in state.get("expected", ()) if n in known)
        self._expected = expected or self._expected
        self._passes = int(state.get("passes", 0))
        self._scaled = bool(state.get("scaled", False))
        self._window = _Window()
        for key, value in state.get("overlap", {}).items():
            self.overlap_figures[key] = list(value) if isinstance(value, list) else value


def loss_scale(scaler: Any) -> float | None:
    """The loss scale of an enabled ``GradScaler``, or None (no scaler, or disabled)."""
    if scaler is None or not scaler.is_enabled():
        return None
    states = getattr(scaler, "_per_optimizer_states", {})
    if any(s.get("stage") is not None and s["stage"].name == "UNSCALED" for s in states.values()):
        raise ValueError("scaler.unscale_(optimizer) was called before the gradients were averaged: "
                         "average first, then unscale_ (e.g. to clip), then scaler.step")
    return float(scaler.get_scale())


def is_plain(codec: Any, shape: torch.Size) -> bool:
    """Whether a tensor of ``shape`` travels as a plain cast (fp32, bf16 or fp16 without error
    feedback): such tensors keep no state, so under a scaler they stay in its units, where
    fp16 keeps the small gradients loss scaling exists to keep (as PyTorch's fp16 hook
    sees them); every other codec gets unscaled gradients."""
    return not codec.compresses(shape) or (codec.fusable and not codec.config.ef)


def check_and_unscale(grads: list[torch.Tensor], inv_scales: list[float]) -> torch.Tensor:
    """Multiply each gradient by its ``inv_scale`` in place (1.0: a check alone) and return a
    one-element float32 tensor on the first gradient's device, non-zero when any held an inf
    or NaN: ``GradScaler``'s own fused check and unscale, per device, dtype and factor,
    with no read back to the host."""
    groups: dict[tuple[torch.device, torch.dtype, float], list[torch.Tensor]] = {}
    for g, inv in zip(grads, inv_scales):
        groups.setdefault((g.device, g.dtype, inv), []).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for (dev, _, inv), gs in groups.items():
        flag = torch.zeros(1, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, flag, torch.full((1,), inv, device=dev))
        found += flag.to(device)
    return found


def refuse_sparse(model: torch.nn.Module) -> None:
    """Raise naming the first parameter that would get a sparse gradient (an ``Embedding`` or
    ``EmbeddingBag`` built with ``sparse=True``): thinwire's codecs average dense tensors."""
    for mname, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            name = f"{mname}.weight" if mname else "weight"
            raise ValueError(f"parameter {name!r} gets sparse gradients ({type(m).__name__}(sparse=True)), which "
                             f"thinwire cannot average; build it with sparse=False")


"""Gradient averaging with PyTorch's semantics: the core of every method that reduces gradients.

:class:`GradientReducer` replaces the ``.grad`` of a model's parameters with their mean over
the ranks, through codecs, and behaves in a user's loop as ``DistributedDataParallel`` does:

* **``None`` stays ``None``.** Only parameters that require a gradient *and* hold one this
  step are averaged; ``requires_grad`` is read again every step, so a layer frozen mid-run,
  or a module no rank used, is left exactly as plain PyTorch leaves it (its ``.grad`` is not
  created, an optimizer's momentum and weight decay never see it) and costs no bytes.
* **Ranks that disagree** about which parameters have a gradient (a branch taken on one rank
  only) need ``find_unused_parameters=True``, as DDP does: one all_reduce of an int32 map of
  the used parameters per step (counted by the byte meter) lets every rank average the
  parameters some rank used (a rank without a gradient contributes zeros and, unless the
  parameter is frozen there, receives the mean in a new ``.grad``) and leave alone those no
  rank used. Without it (the default, DDP's too) the ranks must agree, or their collectives
  would not match.
* **Mixed precision.** With a ``torch.amp.GradScaler``, gradients are unscaled before they
  are encoded and scaled back after, so error-feedback residuals and codec state live in
  the model's own units whatever the scale does. A step whose gradients are not finite on
  some rank (a scaler overflow) is agreed on by every rank (one 4-byte all_reduce, sharing
  the used map's when there is one), sends nothing, changes no residual, codec state or
  step counter, and fills every gradient with NaN on every rank, so each rank's
  ``scaler.step`` skips it and ``scaler.update`` backs the scale off, as under DDP.
* **Sparse gradients** (``nn.Embedding(sparse=True)``) are refused naming the parameter.

Distributed invariant: the averaged names are a pure function of the agreed map (or, without
``find_unused_parameters``, of state the ranks share), and each distinct set has its own
:class:`~thinwire.aggregate.Aggregator` built from the names in ``named_parameters()``
order, so every rank issues the same collectives in the same order. All aggregators share
one :class:`~thinwire.feedback.ErrorFeedback` (residuals keyed by parameter name) and the
same codec objects (codec state keyed by name), so a parameter keeps its residual when the
set around it changes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from thinwire.aggregate import Aggregator, CodecChooser, Timing
from thinwire.comm.base import Communicator
from thinwire.feedback import ErrorFeedback


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
        self._aggregators: dict[tuple[str, ...], Aggregator] = {}
        self.aggregator = self._aggregator_for(live)  # the set at construction: plans and codecs

    @property
    def codecs(self):
        return self.aggregator.codecs

    @property
    def timing(self) -> Timing:
        return Timing.total(agg.timing for agg in self._aggregators.values())

    @property
    def sent_bytes(self) -> dict[str, float]:
        """Bytes this rank sent per parameter name, over every set averaged so far."""
        out = {n: 0.0 for n, _ in self.named}
        for agg in self._aggregators.values():
            for name, b in agg.sent_bytes.items():
                out[name] += b
        return out

    def plan(self) -> list[dict]:
        """Per parameter of the construction-time set: name, shape, codec, wire bytes."""
        return self.aggregator.plan()

    def _aggregator_for(self, names: tuple[str, ...]) -> Aggregator:
        agg = self._aggregators.get(names)
        if agg is None:
            params = dict(self.named)
            agg = Aggregator([(n, params[n]) for n in names], self.codec_for, self.comm,
                             bucket_mb=self.bucket_mb, feedback=self.feedback)
            self._aggregators[names] = agg
        return agg

    # -- work ------------------------------------------------------------------------------
    def reduce(self, scaler: Any = None) -> bool:
        """Average this step's gradients in place; False when the step was non-finite under
        ``scaler`` and skipped on every rank (gradients filled with NaN, nothing else changed).

        Mutates the parameters' ``.grad`` (creating one, for a parameter some other rank
        used, under ``find_unused_parameters``), the residuals and the codecs' state. Call it
        after ``backward()`` and before ``scaler.unscale_``/``scaler.step``.
        """
        scale = loss_scale(scaler)
        local = [p.requires_grad and p.grad is not None for _, p in self.named]
        for (name, p), has in zip(self.named, local):
            if has and p.grad.is_sparse:
                raise ValueError(f"parameter {name!r} has a sparse gradient, which thinwire cannot average; "
                                 "build its layer with sparse=False (e.g. nn.Embedding(..., sparse=False))")
        held = [p.grad for (_, p), has in zip(self.named, local) if has]
        bad = scale is not None and unscale_nonfinite(held, 1.0 / scale)
        used = local
        if scale is not None or self.find_unused_parameters:
            bad, used = self._agree(bad, local)
        if bad:
            for (_, p), u in zip(self.named, used):
                if u and p.requires_grad:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.fill_(float("nan"))  # every rank's scaler sees the overflow and skips
            self.skipped += 1
            return False
        tensors = {}
        for (name, p), u, has in zip(self.named, used, local):
            if not u:
                continue
            if not has and p.requires_grad:
                p.grad = torch.zeros_like(p)  # used on another rank: DDP gives this rank the mean too
            tensors[name] = p.grad if p.requires_grad else torch.zeros_like(p)  # frozen here: sent, not kept
        if tensors:
            agg = self._aggregator_for(tuple(tensors))
            agg.step = self.step  # the step of the whole reducer, whichever set is averaged
            agg.reduce_(tensors)
        if scale is not None and scale != 1.0:
            torch._foreach_mul_([t for t in tensors.values()], scale)  # back to the scaler's units
        self.step += 1
        return True

    def _agree(self, bad: bool, local: list[bool]) -> tuple[bool, list[bool]]:
        """One all_reduce (metered) of [non-finite flag, used map]: identical answers on all ranks."""
        device = self.named[0][1].device
        width = 1 + (len(local) if self.find_unused_parameters else 0)
        flags = torch.zeros(width, dtype=torch.int32, device=device)  # (1 + params,)
        flags[0] = int(bad)
        if self.find_unused_parameters:
            flags[1:] = torch.tensor(local, dtype=torch.int32, device=device)
        self.comm.all_reduce(flags)
        got = flags.tolist()
        used = [v > 0 for v in got[1:]] if self.find_unused_parameters else local
        return got[0] > 0, used

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Step, bytes per name, residuals by name and every codec's state."""
        state = self.aggregator.state_dict()
        state.update(step=self.step, skipped=self.skipped, sent_bytes=self.sent_bytes)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.aggregator.load_state_dict(state)
        for names in [k for k, a in self._aggregators.items() if a is not self.aggregator]:
            del self._aggregators[names]  # their bytes are in the loaded totals
        self.step = int(state["step"])
        self.skipped = int(state.get("skipped", 0))


def loss_scale(scaler: Any) -> float | None:
    """The loss scale of an enabled ``GradScaler``, or None (no scaler, or disabled)."""
    if scaler is None or not scaler.is_enabled():
        return None
    states = getattr(scaler, "_per_optimizer_states", {})
    if any(s.get("stage") is not None and s["stage"].name == "UNSCALED" for s in states.values()):
        raise ValueError("scaler.unscale_(optimizer) was called before the gradients were averaged: "
                         "average first, then unscale_ (e.g. to clip), then scaler.step")
    return float(scaler.get_scale())


def unscale_nonfinite(grads: list[torch.Tensor], inv_scale: float) -> bool:
    """Multiply ``grads`` by ``inv_scale`` in place; True when any holds an inf or NaN (the
    check and unscale ``GradScaler`` itself runs, per device and dtype)."""
    found = False
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), gs in groups.items():
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(gs, flag, inv)
        found = found or bool(flag.item())
    return found


def refuse_sparse(model: torch.nn.Module) -> None:
    """Raise naming the first parameter that would get a sparse gradient (an ``Embedding`` or
    ``EmbeddingBag`` built with ``sparse=True``): thinwire's codecs average dense tensors."""
    for mname, m in model.named_modules():
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            name = f"{mname}.weight" if mname else "weight"
            raise ValueError(f"parameter {name!r} gets sparse gradients ({type(m).__name__}(sparse=True)), which "
                             f"thinwire cannot average; build it with sparse=False")


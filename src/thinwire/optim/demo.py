"""DeMo, Decoupled Momentum Optimization (Peng, Quesnelle, Kingma, arXiv 2411.19870).

Every worker keeps its own momentum and sends only its fast-moving part: the strongest
coefficients of a chunked DCT. Per parameter ``θ`` with gradient ``g``, on every rank::

    θ ← (1 − lr·λ) θ                       decoupled weight decay (λ = weight_decay)
    m ← β m + g                             this rank's momentum (β = decay)
    q = dct-topk(m)                         the top coefficients of every block, sent
    m ← m − decode(q)                       what was sent leaves the momentum
    Δ = mean over ranks of decode(q_i)      one all_gather per bucket, one inverse transform
    θ ← θ − lr · sign(Δ)                    (θ ← θ − lr·Δ with sign=False)

The codec is ``dct`` (:mod:`thinwire.codecs.dct`) with error feedback: its residual *is*
the momentum (decayed by β before each step), so the transform, the payload and the
accounting are the ones a ``dct`` gradient codec uses, metered by the communicator as
every thinwire collective is. No gradient all_reduce and no DDP are needed: build the model
plainly, or under DDP run forward and backward inside ``model.no_sync()`` so DDP sends
nothing, and step this optimizer.

Where thinwire differs from the paper's code (``bloc97/DeMo``), each a choice of ours:

* the momentum accumulates ``g``, not ``lr·g``: with ``sign=True`` the two agree for a
  constant lr (a sign ignores a positive scale), and ``sign=False`` is then a plain
  ``lr``-step rather than an ``lr²`` one;
* the ranks' coefficients are averaged over all ranks (a coefficient only some ranks sent
  counts as zero from the others); the paper's code divides each coefficient by the number
  of ranks that sent it;
* values travel as bf16 by default (``values=fp32`` sends the paper's fp32; ``sign``:
  one bit each and a per-tensor scale) and positions as the smallest integer that holds a
  block index, not int64;
* blocks are ``chunk × chunk`` with sides zero-padded to whole blocks (the paper's code
  takes each side's largest divisor up to ``chunk``).

The update written into ``p.grad`` before the step is the averaged direction (its sign with
``sign=True``), as the paper's code leaves it. A parameter whose gradient is ``None`` is
left alone, momentum included; every rank must agree on which those are, as under DDP
without ``find_unused_parameters``. The state (``optimizer.state_dict()``) holds each
parameter's momentum, so a run resumes exactly: as its DCT coefficients (``momentum_dct``,
(blocks, coefficients per block)) where the blocks tile the parameter with no padding, else
as a tensor of the parameter's shape (``momentum``). In the transform domain the step above
needs two transforms, not three: ``m ← β m + dct(g)`` and ``m[kept] ← m[kept] − sent`` are
exact there (the transform is a rotation), so this rank's own sent coefficients need no
inverse transform. A padded parameter's momentum stays in its own domain, where every step
crops the padding's share of ``idct(sent)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from thinwire.aggregate import Aggregator
from thinwire.codecs.dct import COEFFICIENTS, VALUES
from thinwire.codecs.specs import build_codec
from thinwire.comm.base import Communicator
from thinwire.feedback import ErrorFeedback
from thinwire.hierarchical import build_aggregator
from thinwire.numerics import dct_basis
from thinwire.timing import Timing


class DeMo(torch.optim.Optimizer):
    """Sign-SGD on the all-gathered top DCT coefficients of each rank's own momentum.

    ``params``: parameters or ``(name, parameter)`` pairs (``model.named_parameters()``),
    or parameter groups; ``lr`` and ``weight_decay`` may differ per group. ``comm``: the
    communicator (default: the default ``torch.distributed`` group). ``chunk``, ``topk``,
    ``values`` are the ``dct`` codec's knobs (``values``: fp32, bf16, rangefloat (8 bits),
    sign); ``decay`` is the momentum's β; ``sign=False`` steps with the averaged direction
    itself; ``bucket_mb`` caps the fp32 size of the tensors one all_gather carries.
    """

    def __init__(self, params: Iterable[Any], lr: float, *, chunk: int = 64, topk: int = 32, decay: float = 0.999,
                 values: str = "bf16", weight_decay: float = 0.0, sign: bool = True,
                 comm: Communicator | None = None, bucket_mb: float = 25.0) -> None:
        if not lr >= 0:
            raise ValueError(f"DeMo: lr must be >= 0, got {lr}")
        if not 0 <= decay < 1:
            raise ValueError(f"DeMo: decay must be in [0, 1), got {decay}")
        if not weight_decay >= 0:
            raise ValueError(f"DeMo: weight_decay must be >= 0, got {weight_decay}")
        if values not in VALUES:
            raise ValueError(f"DeMo: values must be one of {', '.join(VALUES)}, got {values!r}")
        params = list(params)
        names: list[str] | None = None
        if params and isinstance(params[0], tuple):
            names, params = [n for n, _ in params], [p for _, p in params]
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.codec_spec = f"dct:chunk={chunk},topk={topk},values={values},ef=true,min_numel=0"
        build_codec(self.codec_spec)  # the knobs' own errors, now
        self.decay, self.sign, self.bucket_mb, self.chunk = decay, sign, bucket_mb, chunk
        from thinwire.algorithms.averaging import comm_or_world

        self.comm = comm_or_world(comm)
        every = [p for g in self.param_groups for p in g["params"]]
        self.names = {p: (names[i] if names else str(i)) for i, p in enumerate(every)}
        self.feedback = ErrorFeedback()  # its residuals are the momenta (the same tensors as the state's)
        self._aggregators: dict[tuple[str, ...], Aggregator] = {}
        self._timing = Timing()

    @property
    def timing(self) -> Timing:
        """Seconds in the codec and in communication so far."""
        return self._timing

    def _tiling(self, p: torch.Tensor) -> dct_basis.Tiling:
        return dct_basis.tiling(tuple(p.shape), self.chunk)

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s momentum, registered as the codec's residual (which it updates in place):
        its DCT coefficients, (chunks, size), where the blocks tile ``p`` exactly (the codec
        keeps error feedback in that domain: ``dct``'s ``encode_feedback``), else
        ``p``-shaped."""
        state, t = self.state[p], self._tiling(p)
        key = "momentum_dct" if t.whole else "momentum"
        m = state.get(key)
        if m is None:
            shape = (t.chunks, t.size) if t.whole else p.shape
            m = state[key] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        self.feedback.residuals[self.names[p] + (COEFFICIENTS if t.whole else "")] = m
        return m

    def _aggregator(self, live: list[tuple[str, torch.Tensor]]) -> Aggregator:
        key = tuple(n for n, _ in live)
        agg = self._aggregators.get(key)
        if agg is None:
            if len(self._aggregators) >= 8:  # parameters without gradients vary from step to step: keep a few
                self._aggregators.clear()
            codec = build_codec(self.codec_spec)
            agg = self._aggregators[key] = build_aggregator(live, lambda _n, _t: codec, self.comm,
                                                            bucket_mb=self.bucket_mb, feedback=self.feedback,
                                                            as_given=True)
        return agg

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        live = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not live:
            return loss
        t0 = time.perf_counter()
        grads: dict[str, torch.Tensor] = {}  # fp32 gradients by name: where the means land
        for p, _ in live:
            self._momentum(p).mul_(self.decay)  # m ← β m; the codec then adds g and takes out what it sent
            grads[self.names[p]] = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
        agg = self._aggregator([(self.names[p], grads[self.names[p]]) for p, _ in live])
        comm = agg.timing.comm_seconds
        agg.reduce_(grads)  # each gradient ← the mean over ranks of what they sent
        comm = agg.timing.comm_seconds - comm
        self._timing.comm_seconds += comm
        self._timing.codec_seconds += time.perf_counter() - t0 - comm  # all of the momentum's handling
        for p, group in live:
            lr, wd, update = group["lr"], group["weight_decay"], grads[self.names[p]]
            if self.sign:
                update.sign_()
            if update is not p.grad:
                p.grad.copy_(update)
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(p.grad, alpha=-lr)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts loaded state to each parameter's dtype: the momenta stay fp32 (bf16 models too)
        keys = ("momentum", "momentum_dct")
        saved = {i: {k: s[k] for k in keys if k in s} for i, s in state_dict["state"].items()}
        params = [p for g in self.param_groups for p in g["params"]]
        for i, moms in saved.items():  # checked before anything is loaded
            coefficients, t = moms.get("momentum_dct"), self._tiling(params[int(i)])
            if coefficients is None:
                continue
            if not t.whole or tuple(coefficients.shape) != (t.chunks, t.size):
                blocks = f"{(t.chunks, t.size)}" if t.whole else "padded blocks"
                raise ValueError(f"DeMo: the momentum of {self.names[params[int(i)]]!r} was saved as "
                                 f"{tuple(coefficients.shape)} coefficients; chunk={self.chunk} gives {blocks}: "
                                 "resume with the chunk it was saved with")
        super().load_state_dict(state_dict)
        for i, moms in saved.items():
            if not moms:
                continue
            p = params[int(i)]
            state = self.state[p]
            for k, m in moms.items():
                state[k] = m.detach().to(device=p.device, dtype=torch.float32, copy=True)
            t = self._tiling(p)
            if t.whole and "momentum_dct" not in state:  # saved p-shaped (before momenta were coefficients)
                state["momentum_dct"] = dct_basis.forward(state.pop("momentum"), t)
            self._momentum(p)  # the loaded tensors become the codec's residuals

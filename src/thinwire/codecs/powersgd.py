"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019): rank-r power iteration, two all_reduces.

``x`` is viewed as the fp32 matrix ``M = x.view(shape[0], -1)``, ``(m, n)``, as in PyTorch's
``powerSGD_hook``; ``r' = min(rank, m, n)``. The caller drives the rounds:

* ``encode``: sends ``P = M Q`` ``(m, r')``; the caller all_reduces the mean ``P̄``.
* ``encode_next``: ``P̂ = orth(P̄)``, sends ``Q = Mᵀ P̂`` ``(n, r')``; the caller averages ``Q̄``.
* ``decode``: ``P̂ Qᵀ``; of this rank's own round-1 payload that is ``P̂ P̂ᵀ M`` (what error
  feedback subtracts, as in the paper), of the reduced one ``P̂ Q̄ᵀ = P̂ P̂ᵀ mean(M)``.
* ``update``: ``Q̄`` becomes the key's next ``Q`` (warm start, used as is, as in the paper).

The first ``Q`` (every ``Q`` if ``warm_start=false``) is a normal draw from
``generator_for(seed, step, key)`` on the CPU: the same bits on every rank and device type.
``orth`` is Householder QR (``torch.linalg.qr``), not Gram-Schmidt: deterministic for identical
input, library and thread count (every rank holds the same ``P̄``, so gets the same ``P̂``),
stable, scale-free and never NaN: a zero ``P̄`` gives unit vectors, so a zero gradient's
``Q̄ = 0`` does not stall the warm start. Measured here 2-5x faster than a Gram-Schmidt loop.

Layout, measured on this machine (MKL, 2304x576, median of 60 interleaved repeats, 1 thread;
2 threads on a quiet machine in brackets): MKL cares about the layout of the product's output.
``Mᵀ P̂`` written column-major takes 0.22-0.28 ms, row-major 0.66-1.02 ms at rank 2-8 [0.09 vs
0.43-0.48 ms], so ``Q`` and ``P̂`` live column-major (as contiguous ``Qᵀ``, ``P̂ᵀ``) and the
``n r'`` values are copied into the row-major wire. ``M Q`` written column-major wins at
rank 2 (0.23 vs 0.42-0.51 ms [0.08 vs 0.17]), ties at rank 4 [0.14 vs 0.18] and loses at rank 8
(1.03 vs 0.73-0.80 ms [0.23 vs 0.18]), hence ``_COLMAJOR_P_BELOW``. At rank 1 the layouts are the
same memory. Wire tensors are always contiguous and row-major: the caller may all_reduce them
in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from thinwire.codecs.base import Codec, generator_for
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.registry import register
from thinwire.payload import Aggregation, Payload, WireSpec

_COLMAJOR_P_BELOW = 8  # round 0 computes P column-major below this rank, row-major from it
_F32 = torch.float32


@dataclass(frozen=True, kw_only=True)
class PowerSGDConfig(CodecConfig):
    rank: int = knob(1, "rank of the approximation: lower = more compression, more error", ">= 1")
    warm_start: bool = knob(True, "start each step's power iteration from last step's mean Q", "true|false")
    min_compression_rate: float = knob(
        2.0, "compress only if m*n > rate*(m+n)*rank (torch's hook rule): higher = fewer compressed", "> 0"
    )
    seed: int = knob(0, "seed of the random Q, drawn from (seed, step, key): same on every rank", "integer")
    ef: bool = knob(True, "error feedback: what was not sent is added to the next step's tensor", "true|false")
    min_numel: int = knob(0, "matrices with fewer elements travel uncompressed (0: the rate rule alone)", ">= 0")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(_is_int(self.rank) and self.rank >= 1, f"rank must be an integer >= 1, got {self.rank!r}")
        require(self.min_compression_rate > 0, f"min_compression_rate must be > 0, got {self.min_compression_rate}")
        require(_is_int(self.seed), f"seed must be an integer, got {self.seed!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Work:
    """Per-key scratch reused across steps (not state: rebuilt whenever the shape changes)."""

    def __init__(self, m: int, n: int, r: int, device: torch.device) -> None:
        new = lambda *s: torch.empty(s, dtype=_F32, device=device)  # noqa: E731
        self.dims, self.device = (m, n, r), device
        self.mat: torch.Tensor | None = None  # (m, n) fp32 copy, for non-contiguous or non-fp32 input
        self.q_t = new(r, n)  # Qᵀ drawn at random (first step, or warm_start=false)
        self.p = new(m, r)  # round-0 wire
        self.p_hat_t = new(r, m)  # P̂ᵀ (P̂ column-major); also round 0's column-major P
        self.tri = new(r, r)  # QR's R, unused
        self.q_local_t = new(r, n)  # Qᵀ = P̂ᵀ M
        self.q = new(n, r)  # round-1 wire


@register
class PowerSGD(Codec):
    """Rank-r PowerSGD, SUM over two rounds (P then Q). Keeps the warm-start Q per key."""

    name = "powersgd"
    summary = "rank-r power iteration (PowerSGD): all_reduce P then Q, warm start, EF"
    Config = PowerSGDConfig
    aggregation = Aggregation.SUM
    rounds = 2

    def __init__(self, config: PowerSGDConfig) -> None:
        super().__init__(config)
        self._warm: dict[str, torch.Tensor] = {}  # key -> Q̄ᵀ (r', n), the next step's start
        self._work: dict[str, _Work] = {}

    def _dims(self, shape: torch.Size) -> tuple[int, int, int]:
        m = shape[0] if len(shape) else 1
        n = torch.Size(shape).numel() // m if m else 0
        return m, n, min(self.config.rank, m, n)

    def compresses(self, shape: torch.Size) -> bool:
        """ndim >= 2, ``(m+n) r' rate < m n`` (torch's ``_should_compress``), ``m n >= min_numel``."""
        if len(shape) < 2:
            return False
        m, n, r = self._dims(shape)
        return (m + n) * r * self.config.min_compression_rate < m * n and m * n >= self.config.min_numel

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        require(round in (0, 1), f"powersgd has rounds 0 and 1, got {round}")
        m, n, r = self._dims(shape)
        return [((m, r) if round == 0 else (n, r), _F32)]

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        """Round 0: ``P = M Q``. Does not modify ``x``; ``meta['m']`` may be a view of it."""
        require(x.dim() >= 1 and x.numel() > 0, f"powersgd needs a non-empty tensor, got shape {tuple(x.shape)}")
        w = self._work_for(key, *self._dims(x.shape), x.device)
        mat = _as_matrix(x, w)  # (m, n) fp32, a view of x when x is contiguous fp32
        q_t = self._start(key, w)  # (r', n)
        if w.dims[2] < _COLMAJOR_P_BELOW:
            _mm_colmajor(q_t, mat.t(), w.p, w.p_hat_t)  # P = M Q
        else:
            torch.mm(mat, q_t.t(), out=w.p)
        return Payload((w.p,), x.shape, x.dtype, {"m": mat})

    def encode_next(self, reduced: Payload, *, key: str = "") -> Payload:
        """Round 1 from the reduced P: ``P̂ = orth(P̄)``, ``Q = Mᵀ P̂``."""
        mat, p_bar = reduced.meta["m"], reduced.tensors[0]
        w = self._work_for(key, *self._dims(reduced.shape), mat.device)
        m, n, r = w.dims
        require(tuple(p_bar.shape) == (m, r), f"reduced P must have shape {(m, r)}, got {tuple(p_bar.shape)}")
        # Every rank holds the same P̄ bits after the all_reduce, so every rank computes the same P̂.
        torch.linalg.qr(p_bar, out=(w.p_hat_t.t(), w.tri))
        _mm_colmajor(w.p_hat_t, mat, w.q, w.q_local_t)  # Q = Mᵀ P̂
        return Payload((w.q,), reduced.shape, reduced.dtype, {"p_hat": w.p_hat_t.t()})

    def decode(self, payload: Payload) -> torch.Tensor:
        """``P̂ Qᵀ`` as a new tensor of the payload's shape and dtype (round-1 payloads only)."""
        out = torch.mm(_p_hat(payload), payload.tensors[0].t())  # (m, n)
        return out.view(payload.shape).to(payload.dtype)

    def decode_add(self, payload: Payload, out: torch.Tensor) -> None:
        """``out += P̂ Qᵀ`` (mutates ``out``), without a temporary when ``out`` is contiguous fp32."""
        if out.dtype == _F32 and out.is_contiguous() and out.shape == payload.shape:
            out.view(out.shape[0], -1).addmm_(_p_hat(payload), payload.tensors[0].t())
        else:
            super().decode_add(payload, out)

    def update(self, key: str, reduced: Payload) -> None:
        """Keep the mean ``Q̄`` as ``key``'s next start (copied: the caller may reuse its buffer)."""
        if not self.config.warm_start:
            return
        q = reduced.tensors[0]  # (n, r')
        dst = self._warm.get(key)
        if dst is None or dst.shape != q.t().shape or dst.device != q.device:
            dst = self._warm[key] = torch.empty(q.t().shape, dtype=_F32, device=q.device)
        dst.copy_(q.t())

    def state_dict(self) -> dict[str, Any]:
        """``{key: Q̄ (n, r')}``, the warm-start factors, as fresh contiguous tensors."""
        return {k: v.t().clone(memory_format=torch.contiguous_format) for k, v in self._warm.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            require(isinstance(v, torch.Tensor) and v.dim() == 2, f"powersgd state {k!r} must be a 2-D Q tensor")
        self._warm = {k: v.detach().t().to(_F32).clone(memory_format=torch.contiguous_format) for k, v in state.items()}

    # -- helpers -------------------------------------------------------------------------
    def _work_for(self, key: str, m: int, n: int, r: int, device: torch.device) -> _Work:
        w = self._work.get(key)
        if w is None or w.dims != (m, n, r) or w.device != device:
            w = self._work[key] = _Work(m, n, r, device)
        return w

    def _start(self, key: str, w: _Work) -> torch.Tensor:
        """This step's Qᵀ: the warm-start state when there is one, else a draw from (seed, step, key)."""
        _, n, r = w.dims
        q_t = self._warm.get(key) if self.config.warm_start else None
        if q_t is not None and q_t.shape == (r, n):
            if q_t.device != w.device:
                q_t = self._warm[key] = q_t.to(w.device)
            return q_t
        g = generator_for(self.config.seed, self.step, key)  # CPU draw: same bits on any device
        return w.q_t.copy_(torch.randn(r, n, generator=g, dtype=_F32))


def _as_matrix(x: torch.Tensor, w: _Work) -> torch.Tensor:
    """``x`` as an (m, n) fp32 matrix: a view when possible, else one copy into ``w.mat``."""
    m, n, _ = w.dims
    if x.dtype == _F32 and x.is_contiguous():
        return x.view(m, n)
    if w.mat is None:
        w.mat = torch.empty(m, n, dtype=_F32, device=w.device)
    w.mat.view(x.shape).copy_(x)  # converts dtype and gathers strides in one pass
    return w.mat


def _mm_colmajor(a_t: torch.Tensor, b_t: torch.Tensor, wire: torch.Tensor, scratch: torch.Tensor) -> None:
    """``wire (k, r) = (a_t @ b_t)ᵀ``, computed column-major (see the module doc) then copied to the
    row-major wire; at ``r = 1`` both layouts are the same memory, so no copy."""
    if wire.shape[1] == 1:
        torch.mm(a_t, b_t, out=wire.t())
    else:
        wire.copy_(torch.mm(a_t, b_t, out=scratch).t())


def _p_hat(payload: Payload) -> torch.Tensor:
    p_hat = payload.meta.get("p_hat")
    if p_hat is None:
        raise ValueError("powersgd decodes round-1 payloads (from encode_next), not round 0")
    return p_hat

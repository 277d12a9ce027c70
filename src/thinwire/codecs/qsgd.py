"""QSGD (Alistarh et al., NeurIPS 2017): stochastic rounding to s levels of |x| / ||x||_2.

Each value becomes ``norm * sign_i * l_i / s`` with ``l_i`` in ``{0..s}`` drawn so that
``E[l_i] = s |x_i| / norm``: unbiased, with ``E||x_hat - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2``
for a bucket of ``d`` values (the paper's Lemma 3.1).

Wire (GATHER): one fp32 norm per bucket, then one code per value. With
``L = ceil(log2(s+1))`` level bits and ``b = 1 + L <= 8`` a code is ``sign << L | level``
(sign 1 = negative), bit-packed MSB-first: ``4 * n_buckets + ceil(N * b / 8)`` bytes. For
``s > 127`` (``b > 8``) codes travel as int16 words holding ``±level``: ``4 * n_buckets + 2 * N``.

thinwire's own defaults (not the paper's): ``levels=127``, so sign + 7 bits fill exactly one
byte (4x smaller than fp32), and ``bucket=0``, one norm for the whole tensor as the per-tensor
form of the method. The paper's experiments bucket (e.g. d = 512), which cuts the variance
bound from ``sqrt(N)/s`` to ``sqrt(d)/s`` for 4 bytes per bucket: set ``bucket=512``.

Rounding noise is per rank: the generator is seeded with ``(seed + rank, step, key)``, so
ranks round independently and their errors partly cancel in the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from thinwire.codecs.base import Codec, generator_for, in_range, not_negative
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.registry import register
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.payload import Aggregation, Payload, WireSpec

MAX_LEVELS = 32767  # the largest level an int16 word holds


@dataclass(frozen=True, kw_only=True)
class QSGDConfig(CodecConfig):
    levels: int = knob(127, "quantization levels s per sign; higher = more bits, less noise", f"1..{MAX_LEVELS}")
    bucket: int = knob(0, "values sharing one norm, 0 = whole tensor; lower = less noise, 4 bytes per bucket", ">= 0")
    seed: int = knob(0, "seed of the stochastic rounding (combined with the rank)", "any integer")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(1 <= self.levels <= MAX_LEVELS, f"levels must be in 1..{MAX_LEVELS}, got {self.levels}")
        require(self.bucket >= 0, f"bucket must be >= 0 (0 = whole tensor), got {self.bucket}")


@register
class QSGD(Codec):
    """Norm-scaled stochastic rounding to ``levels`` levels plus a sign bit, bit-packed."""

    name = "qsgd"
    summary = "QSGD: ||x|| + stochastically rounded levels, sign + log2(s+1) bits per value (all_gather)"
    Config = QSGDConfig
    aggregation = Aggregation.GATHER

    @property
    def level_bits(self) -> int:
        return self.config.levels.bit_length()  # == ceil(log2(s + 1))

    def _layout(self, n: int) -> tuple[int, int]:
        """(bucket size d, number of buckets) for N values."""
        d = self.config.bucket or max(n, 1)
        return d, -(-n // d)

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        n = math.prod(shape)
        bits = 1 + self.level_bits
        codes = ((packed_nbytes(n, bits),), torch.uint8) if bits <= 8 else ((n,), torch.int16)
        return [((self._layout(n)[1],), torch.float32), codes]

    def check_fields(self, payload: Payload) -> None:
        norms, codes = payload.tensors
        not_negative(self.name, "bucket norms", norms)
        s = self.config.levels
        if codes.dtype == torch.int16:
            in_range(self.name, "levels", codes, -s, s)
        elif s < (1 << self.level_bits) - 1:  # some codes name a level above s
            in_range(self.name, "levels", self._signed_levels(codes, math.prod(payload.shape)).abs(), 0, s)

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        n, s = x.numel(), self.config.levels
        d, nb = self._layout(n)
        rows = _padded(x.reshape(-1).float(), nb * d).view(nb, d)  # (nb, d) fp32, a new tensor
        norms = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64).float()  # (nb,) no overflow of the squares
        y = rows.abs_().div_(torch.where(norms > 0, norms, 1)[:, None]).mul_(s)  # (nb, d) in [0, s]
        g = generator_for(self.config.seed + self.rank, self.step, key, device=x.device)
        noise = torch.rand(y.shape, generator=g, device=x.device)  # (nb, d)
        level = y.add_(noise).floor_().clamp_(0, s).reshape(-1)[:n]  # (N,) P(up) = frac(y)
        neg = x.reshape(-1) < 0  # (N,)
        return Payload((norms, self._codes(level, neg)), x.shape, x.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        norms, codes = payload.tensors
        n, s = math.prod(payload.shape), self.config.levels
        d, nb = self._layout(n)
        signed = self._signed_levels(codes, n)  # (N,) fp32
        scale = (norms / s)[:, None]  # (nb, 1)
        out = (_padded(signed, nb * d).view(nb, d) * scale).reshape(-1)[:n]  # (N,)
        return out.to(payload.dtype).view(payload.shape)

    def _codes(self, level: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        if 1 + self.level_bits > 8:
            return torch.where(neg, -level, level).to(torch.int16)  # (N,)
        code = level.to(torch.uint8) | (neg.to(torch.uint8) << self.level_bits)  # (N,)
        return pack(code, 1 + self.level_bits)

    def _signed_levels(self, codes: torch.Tensor, n: int) -> torch.Tensor:
        if 1 + self.level_bits > 8:
            return codes.float()
        code = unpack(codes, n, 1 + self.level_bits)  # (N,) uint8
        level = (code & ((1 << self.level_bits) - 1)).float()
        return torch.where(code >> self.level_bits == 1, -level, level)


def _padded(flat: torch.Tensor, size: int) -> torch.Tensor:
    """``flat`` zero-padded to ``size`` (a new tensor either way, so it may be mutated)."""
    out = flat.new_zeros(size)
    out[: flat.numel()] = flat
    return out

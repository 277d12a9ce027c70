"""TernGrad (Wen et al., NeurIPS 2017): unbiased stochastic ternary values ``{-s, 0, +s}``.

``s = max |x|`` per tensor; ``b_i ~ Bernoulli(|x_i| / s)``; value ``s * sign(x_i) * b_i``, so
``E[value] = x_i``. Wire (GATHER): one fp32 ``s``, then 2-bit codes packed MSB-first
(0 = zero, 1 = +s, 2 = -s): ``4 + ceil(N / 4)`` bytes, 16x smaller than fp32.

Not included (thinwire's choice, the defaults being the plain per-layer method): the paper's
gradient clipping to 2.5 sigma and its scaler sharing across workers (a max over ranks needs
a collective, which a codec may not issue). Rounding noise is per rank: the generator is
seeded with ``(seed + rank, step, key)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from thinwire.codecs.base import Codec, generator_for, not_negative
from thinwire.codecs.config import CodecConfig, knob
from thinwire.codecs.registry import register
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.payload import Aggregation, Payload, WireSpec


@dataclass(frozen=True, kw_only=True)
class TernGradConfig(CodecConfig):
    seed: int = knob(0, "seed of the stochastic ternarization (combined with the rank)", "any integer")


@register
class TernGrad(Codec):
    """Per-tensor max scale and stochastic ternary codes, 2 bits per value."""

    name = "terngrad"
    summary = "TernGrad: max|x| + unbiased stochastic {-1, 0, +1}, 2 bits per value (all_gather)"
    Config = TernGradConfig
    aggregation = Aggregation.GATHER

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        return [((1,), torch.float32), ((packed_nbytes(math.prod(shape), 2),), torch.uint8)]

    def check_fields(self, payload: Payload) -> None:
        not_negative(self.name, "the scale max|x|", payload.tensors[0])  # code 3 decodes to 0

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        flat = x.reshape(-1).float()  # (N,) only read
        mag = flat.abs()  # (N,) a new tensor
        s = mag.max() if flat.numel() else mag.new_zeros(())
        g = generator_for(self.config.seed + self.rank, self.step, key, device=x.device)
        keep = torch.rand(mag.shape, generator=g, device=x.device) < mag.div_(torch.where(s > 0, s, 1))  # (N,)
        code = keep.to(torch.uint8) << (flat < 0).to(torch.uint8)  # (N,) 0, 1 (+) or 2 (-)
        return Payload((s.reshape(1), pack(code, 2)), x.shape, x.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        s, packed = payload.tensors
        code = unpack(packed, math.prod(payload.shape), 2)  # (N,)
        table = torch.tensor([0.0, 1.0, -1.0, 0.0], device=s.device)  # code -> sign
        out = table[code.long()] * s  # (N,)
        return out.to(payload.dtype).view(payload.shape)

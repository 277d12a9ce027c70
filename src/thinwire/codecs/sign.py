"""Scaled sign (EF-signSGD, Karimireddy et al., ICML 2019): ``(||u||_1 / N) * sign(u)``.

Wire (GATHER): one fp32 scale, then one sign bit per value packed MSB-first (bit 1 =
negative; zero is sent as +): ``4 + ceil(N / 8)`` bytes, 32x smaller than fp32. The scale
makes the compressor a contraction, which is what error feedback (default on) needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from thinwire.codecs.base import Codec, not_negative
from thinwire.codecs.config import CodecConfig, knob
from thinwire.codecs.registry import register
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.payload import Aggregation, Payload, WireSpec


@dataclass(frozen=True, kw_only=True)
class SignConfig(CodecConfig):
    ef: bool = knob(True, "error feedback: what was not sent is added to the next step's tensor", "true|false")


@register
class SignSGD(Codec):
    """One bit per value plus the mean magnitude; deterministic."""

    name = "signsgd"
    summary = "EF-signSGD: 1 sign bit per value + fp32 scale ||x||_1/N (all_gather), EF on"
    Config = SignConfig
    aggregation = Aggregation.GATHER

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        return [((1,), torch.float32), ((packed_nbytes(math.prod(shape), 1),), torch.uint8)]

    def check_fields(self, payload: Payload) -> None:
        not_negative(self.name, "the scale", payload.tensors[0])

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        flat = x.reshape(-1).float()  # (N,) only read
        scale = torch.linalg.vector_norm(flat, 1).div(max(1, flat.numel())).reshape(1)  # (1,)
        bits = pack(flat < 0, 1)  # (ceil(N/8),)
        return Payload((scale, bits), x.shape, x.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        scale, bits = payload.tensors
        neg = unpack(bits, math.prod(payload.shape), 1)  # (N,) 0/1
        out = (1 - 2 * neg.float()) * scale  # (N,) +-scale
        return out.to(payload.dtype).view(payload.shape)

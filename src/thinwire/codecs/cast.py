"""Half-precision casts: ``bf16`` and ``fp16`` (2 bytes per value, SUM in the half dtype)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from thinwire.codecs.base import Codec
from thinwire.codecs.config import CodecConfig, knob
from thinwire.codecs.specs import register
from thinwire.payload import Aggregation, Payload, WireSpec


@dataclass(frozen=True, kw_only=True)
class CastConfig(CodecConfig):
    min_numel: int = knob(
        0, "tensors with fewer elements travel in fp32 (element-wise: any tensor, 1-D too, can be cast)", ">= 0"
    )


class _Cast(Codec):
    """Casts to a 2-byte float; the all_reduce sums in that dtype, as PyTorch's compress hooks do."""

    wire_dtype: torch.dtype
    Config = CastConfig
    aggregation = Aggregation.SUM
    fusable = True
    elementwise = True
    concurrent = True

    def compresses(self, shape: torch.Size) -> bool:
        return math.prod(shape) >= self.config.min_numel  # element-wise: 1-D tensors too

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        return [((int(torch.Size(shape).numel()),), self.wire_dtype)]

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        wire = x.reshape(-1).to(self.wire_dtype)  # a fresh tensor: x is not modified
        return Payload((wire,), x.shape, x.dtype)

    def encode_into(self, x: torch.Tensor, buffer: Callable[[tuple[int, ...], torch.dtype], torch.Tensor], *,
                    key: str = "") -> Payload:
        wire = buffer((x.numel(),), self.wire_dtype)
        wire.copy_(x.reshape(-1))  # the same cast as encode's, into a kept buffer
        return Payload((wire,), x.shape, x.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        return payload.tensors[0].reshape(payload.shape).to(payload.dtype)

    def decode_to(self, payload: Payload, out: torch.Tensor) -> None:
        out.copy_(payload.tensors[0].reshape(out.shape))  # one cast, as PyTorch's fp16 hook decompresses


@register
class BF16(_Cast):
    name = "bf16"
    summary = "cast to bfloat16 (8-bit mantissa, fp32 range), all_reduce in bf16"
    wire_dtype = torch.bfloat16


@register
class FP16(_Cast):
    name = "fp16"
    summary = "cast to float16 (10-bit mantissa, max 65504), all_reduce in fp16"
    wire_dtype = torch.float16

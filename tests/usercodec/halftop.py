"""A user's codec, outside the package: the example of docs/adding_a_codec.md, registered
when imported (``thinwire train --import usercodec.halftop --method halftop``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from thinwire.codecs.base import Codec
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.specs import register
from thinwire.payload import Aggregation, Payload


@dataclass(frozen=True, kw_only=True)
class HalfTopConfig(CodecConfig):
    fraction: float = knob(0.5, "share of values sent; lower = more compression", "(0, 1]")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.fraction <= 1, f"fraction must be in (0, 1], got {self.fraction}")


@register
class HalfTop(Codec):
    name = "halftop"
    summary = "the first values of the tensor, fp32"
    Config = HalfTopConfig
    aggregation = Aggregation.GATHER

    def _k(self, shape):  # 0 values for an empty tensor, else >= 1
        return math.ceil(self.config.fraction * math.prod(shape))

    def wire_spec(self, shape, dtype, round=0):
        return [((self._k(shape),), torch.float32)]

    def encode(self, x, *, key=""):
        head = x.reshape(-1)[: self._k(x.shape)].to(torch.float32)
        return Payload((head,), x.shape, x.dtype)

    def decode(self, payload):
        out = torch.zeros(math.prod(payload.shape), dtype=torch.float32, device=payload.tensors[0].device)
        out[: payload.tensors[0].numel()] = payload.tensors[0]
        return out.reshape(payload.shape).to(payload.dtype)

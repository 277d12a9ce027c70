"""fp32 passthrough: the uncompressed baseline (a plain all_reduce of the tensor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from thinwire.codecs.base import Codec
from thinwire.codecs.config import CodecConfig, knob
from thinwire.codecs.specs import register
from thinwire.payload import Aggregation, Payload, WireSpec


@dataclass(frozen=True, kw_only=True)
class IdentityConfig(CodecConfig):
    min_numel: int = knob(0, "has no effect: identity is already fp32", ">= 0")


@register
class Identity(Codec):
    """Sends the tensor as fp32. Lossless; SUM (all_reduce)."""

    name = "identity"
    elementwise = True
    summary = "fp32 all_reduce, no compression (the baseline)"
    Config = IdentityConfig
    aggregation = Aggregation.SUM
    fusable = True
    concurrent = True

    @property
    def is_identity(self) -> bool:
        # this class itself (a subclass may do more in encode), without error feedback (which
        # keeps residuals, zero but state of its own)
        return type(self) is Identity and not self.config.ef

    def compresses(self, shape: torch.Size) -> bool:
        return True  # nothing to skip: identity is already the fallback

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        return [((int(torch.Size(shape).numel()),), torch.float32)]

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        wire = x.reshape(-1).to(torch.float32)  # a view when x is contiguous fp32
        return Payload((wire,), x.shape, x.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        return payload.tensors[0].reshape(payload.shape).to(payload.dtype)

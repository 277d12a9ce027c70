"""Range-based float codec: every value as an n-bit float whose exponent window follows the data.

Wire (GATHER): ``E_max`` as one int32, then one code per value: bit-packed MSB-first for
``bits <= 8`` (``4 + ceil(N * bits / 8)`` bytes), as 16-bit words for ``bits = 16``
(``4 + 2N``). See :mod:`thinwire.numerics.range_format` for the format. Ranks have different
windows, so payloads are gathered, not summed. The default 8 bits = 1 + 3 + 4 is
thinwire's own choice (the paper does not publish its layout).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from thinwire.codecs.base import E_MAX_HIGH, E_MAX_LOW, Codec, in_range
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.specs import register
from thinwire.numerics import range_format
from thinwire.payload import Aggregation, Payload, WireSpec


@dataclass(frozen=True, kw_only=True)
class RangeFloatConfig(CodecConfig):
    bits: int = knob(8, "bits per value: 1 sign + exp_bits + man_bits; lower = more compression", "3..8 or 16")
    exp_bits: int = knob(3, "exponent bits: the window spans 2^exp_bits - 1 octaves below the max", "1..bits-1")
    man_bits: int | None = knob(
        None, "mantissa bits; exp_bits + man_bits + 1 must equal bits (default: the rest)", "bits-1-exp_bits"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(3 <= self.bits <= 8 or self.bits == 16, f"bits must be in 3..8 or 16, got {self.bits}")
        resolve_layout(self)


class _Layout(Protocol):
    """A config with a range-float layout (``RangeFloatConfig``, ``FFTConfig``)."""

    @property
    def bits(self) -> int: ...

    @property
    def exp_bits(self) -> int: ...

    @property
    def man_bits(self) -> int | None: ...


def resolve_layout(cfg: _Layout) -> None:
    """Check ``exp_bits`` and fill or check ``man_bits`` of a frozen config with ``bits``."""
    bits, exp_bits = cfg.bits, cfg.exp_bits
    require(1 <= exp_bits <= bits - 1, f"exp_bits must be in 1..{bits - 1}, got {exp_bits}")
    if cfg.man_bits is None:
        object.__setattr__(cfg, "man_bits", bits - 1 - exp_bits)  # resolved, so the config shows it
    man_bits = cfg.man_bits
    assert man_bits is not None  # filled just above
    require(
        exp_bits + man_bits + 1 == bits,
        f"exp_bits + man_bits + 1 must equal bits: {exp_bits} + {man_bits} + 1 != {bits}",
    )


@register
class RangeFloat(Codec):
    """n-bit floats with a data-driven exponent window; relative error <= 2^-(man_bits+1) inside it."""

    name = "rangefloat"
    elementwise = True
    summary = "n-bit floats (sign, exponent, mantissa) with the exponent window set by max |x| (all_gather)"
    Config = RangeFloatConfig
    aggregation = Aggregation.GATHER

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        return [((1,), torch.int32), self.wire.spec(math.prod(shape))]

    def check_fields(self, payload: Payload) -> None:
        in_range(self.name, "the exponent E_max", payload.tensors[0], E_MAX_LOW, E_MAX_HIGH)

    @functools.cached_property
    def wire(self) -> range_format.Wire:
        cfg = self.config
        return range_format.Wire(cfg.bits, cfg.exp_bits, cfg.man_bits)

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        e_max, wire = self.wire.encode(x.reshape(-1))  # (N,) only read
        header = torch.tensor([e_max], dtype=torch.int32, device=x.device)
        return Payload((header, wire), x.shape, x.dtype)

    def encode_into(self, x: torch.Tensor, buffer: Callable[[tuple[int, ...], torch.dtype], torch.Tensor], *,
                    key: str = "") -> Payload:
        """:meth:`encode` with the wire written into a kept buffer (3..8 bits)."""
        if not 3 <= self.config.bits <= 8:
            return self.encode(x, key=key)
        shape, dtype = self.wire.spec(x.numel())
        e_max, wire = self.wire.encode(x.reshape(-1), out=buffer(shape, dtype))
        header = torch.tensor([e_max], dtype=torch.int32, device=x.device)
        return Payload((header, wire), x.shape, x.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        header, wire = payload.tensors
        out = self.wire.decode(int(header[0].item()), wire, math.prod(payload.shape))
        return out.to(payload.dtype).view(payload.shape)

    def decode_to(self, payload: Payload, out: torch.Tensor) -> None:
        """Straight into ``out`` when it is a contiguous fp32 tensor: no temporary."""
        if out.dtype != torch.float32 or not out.is_contiguous():
            super().decode_to(payload, out)
            return
        header, wire = payload.tensors
        self.wire.decode(int(header[0].item()), wire, out.numel(), out=out.view(-1))

    def decode_add(self, payload: Payload, out: torch.Tensor) -> None:
        """Through a kept fp32 buffer of this thread's: a fresh model-sized temporary faults its
        pages in on every call, which costs more than the decode."""
        room = getattr(self._local, "values", None)
        n = out.numel()
        if room is None or room.numel() < n or room.device != out.device:
            room = self._local.values = torch.empty(n, dtype=torch.float32, device=out.device)
        values = room[:n]
        header, wire = payload.tensors
        self.wire.decode(int(header[0].item()), wire, n, out=values)
        out.add_(values.view(out.shape).to(out.dtype))

    def decode_sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        """The first payload decoded straight into ``out``, the others added."""
        if not payloads or out.dtype != torch.float32 or not out.is_contiguous():
            super().decode_sum(payloads, out)
            return
        self.decode_to(payloads[0], out)
        for p in payloads[1:]:
            self.decode_add(p, out)

    @functools.cached_property
    def _local(self) -> threading.local:
        return threading.local()

"""What crosses the wire: a typed, self-describing payload and its aggregation kind."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


class Aggregation(enum.Enum):
    """How payloads from all ranks are combined on the wire.

    SUM: payload tensors are summed element-wise (all_reduce). Only legal for codecs
    that are linear in the payload: ``decode(a) + decode(b) == decode(a + b)``.
    GATHER: payloads are all_gathered (fixed size) and every rank decodes and sums.
    """

    SUM = "sum"
    GATHER = "gather"


class PayloadError(ValueError):
    """A payload that does not match its codec's declared layout, or whose header fields
    (counts, exponents, indices) are out of their allowed ranges: refused before decoding."""


WireSpec = tuple[tuple[int, ...], torch.dtype]
"""Shape and dtype of one wire tensor; a codec's wire layout is a list of these."""


def spec_nbytes(spec: list[WireSpec]) -> int:
    """Bytes of a wire layout."""
    total = 0
    for shape, dtype in spec:
        numel = 1
        for s in shape:
            numel *= s
        total += numel * _itemsize(dtype)
    return total


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Payload:
    """Wire tensors plus local metadata that never leaves the rank.

    ``tensors`` are exactly what is sent, in the order of the codec's ``wire_spec``.
    ``shape`` and ``dtype`` describe the original tensor; ``meta`` holds local-only
    values a codec needs to decode or to run its next round (never sent, never counted).
    """

    tensors: tuple[torch.Tensor, ...]
    shape: torch.Size
    dtype: torch.dtype
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the wire tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Payload:
        """The same payload description carrying other wire tensors (e.g. after a collective)."""
        return Payload(tuple(tensors), self.shape, self.dtype, self.meta)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat (a view when ``t`` is contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(row: torch.Tensor, off: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The ``shape`` ``dtype`` tensor stored at byte ``off`` of the flat uint8 ``row`` (a view,
    or a copy when the start is not aligned for ``dtype``)."""
    itemsize = dtype.itemsize
    raw = row[off : off + math.prod(shape) * itemsize]
    if (raw.storage_offset() % itemsize) != 0:
        raw = raw.clone()  # view(dtype) needs an aligned start
    return raw.view(dtype).view(shape)

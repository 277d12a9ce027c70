"""The pieces an aggregator moves: a bucket of named tensors with one codec, its slots, its
step in flight, and the buffers it keeps across steps. Shared by the flat
:class:`~thinwire.aggregate.Aggregator` and the :class:`~thinwire.hierarchical.HierarchicalAggregator`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from thinwire.codecs.base import Codec
from thinwire.comm.base import Handle
from thinwire.payload import Payload


@dataclass
class Slot:
    name: str
    shape: torch.Size
    numel: int
    offset: int  # element offset inside a fused bucket's flat input


@dataclass
class Flight:
    """One bucket's step in progress: inputs, current payloads, the collective in flight."""

    us: list[tuple[str, torch.Tensor]]  # (key, compensated input)
    payloads: list[Payload]
    wire: torch.Tensor | None = None  # SUM: the summed buffer; GATHER: (n, row_bytes) bytes
    handle: Handle | None = None
    # seconds spent on this bucket so far, added to the aggregator's timing when it lands (so
    # a bucket launched on one thread and landed on another never races on the totals)
    codec_seconds: float = 0.0
    comm_seconds: float = 0.0
    started_at: float = 0.0  # perf_counter() when round 0's collective was started


@dataclass
class Bucket:
    codec: Codec
    fused: bool  # element-wise codec without EF: encode the whole flat bucket once
    slots: list[Slot]
    # byte offsets of each slot's wire tensors inside one rank's gather row, per slot (this step)
    layout: list[list[tuple[int, tuple[int, ...], torch.dtype]]] = field(default_factory=list)
    row_bytes: int = 0
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.slots[0].name if len(self.slots) == 1 else f"{self.slots[0].name}..{self.slots[-1].name}"

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)


def bucket_buffer(b: Bucket, key: str, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """A buffer reused across steps (fresh large allocations cost several copies' time): a
    view of a kept flat store, regrown only when a step needs more (e.g. FFT's theta falls)."""
    numel = math.prod(shape)
    store = b.buffers.get(key)
    if store is None or store.numel() < numel or store.dtype != dtype or store.device != device:
        store = b.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return store[:numel].view(shape)

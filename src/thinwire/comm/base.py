"""The communicator protocol: the only way thinwire moves tensors between ranks.

Implementations override the underscored primitives; the public methods here count bytes
with the rank's :class:`ByteMeter` first, so every implementation is metered identically.
Every collective must be issued by all ranks of the group in the same order (that is what
keeps them from deadlocking); callers derive the order from the explicit step counter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from thinwire.comm.meter import ByteMeter


class Handle(Protocol):
    """An in-flight operation. ``wait()`` blocks until its output tensors are ready."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class Done:
    """A handle for work that already finished (synchronous ops, one-rank worlds)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class Communicator:
    """A group of ``world_size`` ranks; this object is rank ``rank`` of it."""

    rank: int
    world_size: int

    def __init__(self, rank: int, world_size: int, meter: ByteMeter | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.meter = meter if meter is not None else ByteMeter()

    # -- public, metered ----------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Sum ``t`` over all ranks, in place."""
        self.meter.record("all_reduce", _nbytes(t), self.world_size)
        return self._finish(self._all_reduce(t, async_op), async_op)

    def all_gather(self, t: torch.Tensor, out: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Write every rank's ``t`` into ``out`` (shape ``(world_size, *t.shape)``, same dtype)."""
        if out.shape != (self.world_size, *t.shape) or out.dtype != t.dtype:
            raise ValueError(
                f"all_gather out must be {(self.world_size, *t.shape)} {t.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
        self.meter.record("all_gather", _nbytes(t), self.world_size)
        return self._finish(self._all_gather(t, out, async_op), async_op)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``t`` on every rank with rank ``src``'s ``t``."""
        if self.rank == src:
            self.meter.record("broadcast", _nbytes(t), self.world_size)
        self._broadcast(t, src)

    def exchange(
        self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], *, async_op: bool = False
    ) -> Handle:
        """Point-to-point: send ``sends[peer]`` to each peer and receive into ``recvs[peer]``.

        Both ends of every edge must call ``exchange`` in the same step (neighbour gossip).
        """
        for peer, t in sends.items():
            self._check_peer(peer)
            self.meter.record("send", _nbytes(t), self.world_size)
        for peer in recvs:
            self._check_peer(peer)
        return self._finish(self._exchange(sends, recvs, async_op), async_op)

    def barrier(self) -> None:
        self._barrier()

    def subgroup(self, ranks: Sequence[int]) -> Communicator | None:
        """A communicator over ``ranks`` (all ranks must call this, in the same order).

        Returns ``None`` on ranks outside ``ranks``. Its ranks are positions in ``ranks``;
        its bytes are counted by this communicator's meter.
        """
        ranks = list(ranks)
        if sorted(set(ranks)) != sorted(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"subgroup ranks must be distinct and in [0, {self.world_size}), got {ranks}")
        return self._subgroup(ranks)

    # -- implementation primitives -------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, async_op: bool) -> Handle:
        raise NotImplementedError

    def _all_gather(self, t: torch.Tensor, out: torch.Tensor, async_op: bool) -> Handle:
        raise NotImplementedError

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        raise NotImplementedError

    def _exchange(
        self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], async_op: bool
    ) -> Handle:
        raise NotImplementedError

    def _barrier(self) -> None:
        raise NotImplementedError

    def _subgroup(self, ranks: list[int]) -> Communicator | None:
        raise NotImplementedError

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _finish(handle: Handle, async_op: bool) -> Handle:
        if not async_op:
            handle.wait()
            return Done()
        return handle

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"peer must be another rank in [0, {self.world_size}), got {peer} on rank {self.rank}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

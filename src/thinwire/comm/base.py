"""The communicator protocol: the only way thinwire moves tensors between ranks.

Implementations override the underscored primitives; the public methods here count bytes
with the rank's :class:`ByteMeter` first, so every implementation is metered identically.
Every collective must be issued by all ranks of the group in the same order (that is what
keeps them from deadlocking); callers derive the order from the explicit step counter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from thinwire.comm.layout import INTRA_DTYPES, NodeLayout
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
    """A group of ``world_size`` ranks; this object is rank ``rank`` of it.

    Which link its traffic crosses (for the meter's two-link counts): ``scope``, ``"intra"``
    for a group inside one node, ``"inter"`` (the default: every rank its own node) for one
    across nodes; or, for a world over several ranks per node, ``nodes`` (its layout), which
    attributes each rank's ring traffic to the link towards its successor. ``hierarchy``,
    when set, is the world's node groups: every :class:`~thinwire.aggregate.Aggregator` over
    this communicator then averages in two levels.
    """

    rank: int
    world_size: int
    scope: str = "inter"
    nodes: NodeLayout | None = None
    hierarchy: Hierarchy | None = None

    def __init__(self, rank: int, world_size: int, meter: ByteMeter | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.meter = meter if meter is not None else ByteMeter()

    def _record(self, op: str, nbytes: int, peer: int | None = None) -> None:
        layout = self.nodes
        if layout is None or layout.world_size != self.world_size:
            self.meter.record(op, nbytes, self.world_size, self.scope)
        elif peer is not None:  # point to point: the link between the two ranks
            link = "intra" if layout.node(peer) == layout.node(self.rank) else "inter"
            self.meter.record(op, nbytes, self.world_size, link)
        else:  # a ring over the ranks in order: the slow link bounds it; a node's last rank crosses
            successor = (self.rank + 1) % self.world_size
            sent_on = "intra" if layout.node(successor) == layout.node(self.rank) else "inter"
            self.meter.record(op, nbytes, self.world_size, "inter" if layout.count > 1 else "intra", sent_on)

    # -- public, metered ----------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Sum ``t`` over all ranks, in place."""
        self._record("all_reduce", _nbytes(t))
        return self._finish(self._all_reduce(t, async_op), async_op)

    def reduce_scatter(self, t: torch.Tensor, out: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Sum ``t`` (``world_size`` equal chunks, flat) over all ranks; rank ``i`` gets the
        sum of chunk ``i`` in ``out``."""
        if t.dim() != 1 or out.dim() != 1 or t.numel() != self.world_size * out.numel() or t.dtype != out.dtype:
            raise ValueError(f"reduce_scatter needs a flat input of {self.world_size} x the output's numel, same "
                             f"dtype; got {tuple(t.shape)} {t.dtype} into {tuple(out.shape)} {out.dtype}")
        self._record("reduce_scatter", _nbytes(t))
        return self._finish(self._reduce_scatter(t, out, async_op), async_op)

    def all_gather(self, t: torch.Tensor, out: torch.Tensor, *, async_op: bool = False) -> Handle:
        """Write every rank's ``t`` into ``out`` (shape ``(world_size, *t.shape)``, same dtype)."""
        if out.shape != (self.world_size, *t.shape) or out.dtype != t.dtype:
            raise ValueError(
                f"all_gather out must be {(self.world_size, *t.shape)} {t.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
        self._record("all_gather", _nbytes(t))
        return self._finish(self._all_gather(t, out, async_op), async_op)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``t`` on every rank with rank ``src``'s ``t``."""
        if self.rank == src:
            self._record("broadcast", _nbytes(t))
        self._broadcast(t, src)

    def exchange(
        self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], *, async_op: bool = False
    ) -> Handle:
        """Point-to-point: send ``sends[peer]`` to each peer and receive into ``recvs[peer]``.

        Both ends of every edge must call ``exchange`` in the same step (neighbour gossip).
        """
        for peer, t in sends.items():
            self._check_peer(peer)
            self._record("send", _nbytes(t), peer)
        for peer in recvs:
            self._check_peer(peer)
        return self._finish(self._exchange(sends, recvs, async_op), async_op)

    def barrier(self) -> None:
        self._barrier()

    def same_ranks(self) -> Communicator:
        """A second communicator over the same ranks, on process groups of its own (every rank
        of the job calls this, in the same order), whose collectives never meet this one's: for
        work on another thread. Its bytes are counted by this communicator's meter. Worker
        groups are not copied (:func:`thinwire.comm.nodes.twin` builds them)."""
        twin = self.subgroup(list(range(self.world_size)))
        assert twin is not None  # every rank is a member
        return twin

    def use_meter(self, meter: ByteMeter) -> None:
        """Count this communicator's bytes, its worker groups' included, with ``meter``."""
        self.meter = meter
        if self.hierarchy is not None:
            self.hierarchy.intra.meter = self.hierarchy.inter.meter = meter

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

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor, async_op: bool) -> Handle:
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


@dataclass
class Hierarchy:
    """A world's worker groups (nodes): ``intra`` (this rank's group, ranked by local rank)
    and ``inter`` (this local rank in every group, ranked by group).

    ``sharded``: the group's ranks hold one replica sharded between them (FSDP2's
    ``fully_shard`` over ``intra``), so each rank holds only its shard of every parameter, and
    the group's own averaging (the gradients' reduce-scatter) is FSDP's. thinwire then averages
    each rank's shard with the same shard in the other groups, over ``inter`` alone. Not
    sharded: the ranks of a group are replicas, and thinwire averages inside the group itself
    (fp32, as DDP does) before the codec between groups (:mod:`thinwire.hierarchical`)."""

    layout: NodeLayout
    intra: Communicator
    inter: Communicator
    dtype: torch.dtype = torch.float32  # of the collectives inside the node
    sharded: bool = False
    mesh: Any = None  # the 2-D DeviceMesh the groups were built from (across, inside), if any

    @property
    def dtype_name(self) -> str:
        return next(k for k, v in INTRA_DTYPES.items() if v == self.dtype)

    @property
    def node(self) -> int:
        return self.inter.rank

    @property
    def local_rank(self) -> int:
        return self.intra.rank

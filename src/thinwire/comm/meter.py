"""Byte accounting: bytes and messages *sent by this rank* per collective.

Standard algorithms: ring all_reduce of ``B`` bytes sends ``2(n-1)/n * B`` in ``2(n-1)``
messages; all_gather of a ``B``-byte contribution sends ``(n-1) * B`` in ``n-1`` messages;
ring reduce_scatter of a ``B``-byte input sends ``(n-1)/n * B`` in ``n-1`` messages;
point-to-point sends ``B`` in one message. One rank (n = 1) sends nothing.

Two links (hierarchical runs, :mod:`thinwire.comm.nodes`): every count also carries the link
it belongs to, ``"intra"`` (inside a node) or ``"inter"`` (between nodes). ``by_group`` keys
a collective by the link that bounds its time (a collective whose ranks span nodes waits on
the slow link); ``by_link`` counts the bytes this rank itself put on each link (in a ring
over ranks laid out node by node, only a node's last rank sends across). A run without
nodes counts everything as ``"inter"``: every rank is its own node. ``inter_share``: how many
of a node's ranks send between nodes at once, sharing its network link (the ranks per node in
a hierarchical run, where every local rank averages its shard between nodes; 1 otherwise):
the link's time for this rank's bytes is that many times theirs alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def sent_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for ``op`` over ``n`` ranks with a ``nbytes`` payload."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("all_gather", "broadcast"):
        # broadcast is counted as the tree/ring volume the root sends; used only for set-up
        return (n - 1) * nbytes
    if op == "reduce_scatter":
        return (n - 1) / n * nbytes
    if op == "send":
        return float(nbytes)
    raise ValueError(f"unknown op {op!r}; expected all_reduce, all_gather, reduce_scatter, broadcast or send")


def sent_messages(op: str, n: int) -> int:
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "broadcast": n - 1,
            "send": 1}[op]


LINKS = ("intra", "inter")


@dataclass
class OpCount:
    calls: int = 0
    bytes: float = 0.0
    messages: int = 0
    payload_bytes: int = 0  # the tensor bytes handed to the collective (before the algorithm factor)


@dataclass
class ByteMeter:
    """Counts what this rank sends. ``paused()`` excludes bookkeeping traffic (e.g. metrics)."""

    ops: dict[str, OpCount] = field(default_factory=dict)
    enabled: bool = True
    # (op, ranks in the collective, the link bounding its time)
    by_group: dict[tuple[str, int, str], OpCount] = field(default_factory=dict)
    by_link: dict[str, OpCount] = field(default_factory=dict)  # what this rank sent on each link
    inter_share: int = 1  # a node's ranks sending between nodes at once, on one link

    def record(self, op: str, nbytes: int, n: int, link: str = "inter", sent_on: str | None = None) -> None:
        """Count one ``op`` of a ``nbytes`` payload over ``n`` ranks, bounded by ``link``,
        this rank's bytes crossing ``sent_on`` (default: ``link``)."""
        if not self.enabled:
            return
        for c in (self.ops.setdefault(op, OpCount()), self.by_group.setdefault((op, n, link), OpCount()),
                  self.by_link.setdefault(sent_on or link, OpCount())):
            c.calls += 1
            c.bytes += sent_bytes(op, nbytes, n)
            c.messages += sent_messages(op, n)
            c.payload_bytes += nbytes

    @property
    def bytes_sent(self) -> float:
        return sum(c.bytes for c in self.ops.values())

    @property
    def messages(self) -> int:
        return sum(c.messages for c in self.ops.values())

    def link_bytes(self, link: str) -> float:
        """Bytes this rank sent on ``link`` (``"intra"`` or ``"inter"``)."""
        c = self.by_link.get(link)
        return c.bytes if c is not None else 0.0

    def bound_bytes(self, link: str) -> float:
        """Bytes of the collectives whose time ``link`` bounds (``by_group``), this rank's."""
        return sum(c.bytes for (_, _, scope), c in self.by_group.items() if scope == link)

    def bound_messages(self, link: str) -> int:
        return sum(c.messages for (_, _, scope), c in self.by_group.items() if scope == link)

    def link_messages(self, link: str) -> int:
        c = self.by_link.get(link)
        return c.messages if c is not None else 0

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {op: vars(c).copy() for op, c in self.ops.items()}

    def counts(self) -> dict[tuple[str, int, str], OpCount]:
        """A copy of the per-collective counts (``by_group``), for :meth:`since`."""
        return {k: OpCount(**vars(c)) for k, c in self.by_group.items()}

    def since(self, before: dict[tuple[str, int, str], OpCount], link: str | None = None) -> ByteMeter:
        """What this meter counted after ``before`` (:meth:`counts`), as a meter of its own
        with the same ``inter_share``: the traffic of one piece of work, for ``meter_seconds``;
        ``link``: only the collectives bounded by that link."""
        out = ByteMeter(inter_share=self.inter_share)
        for key, c in self.by_group.items():
            if link is not None and key[2] != link:
                continue
            b = before.get(key, OpCount())
            if c.calls != b.calls:
                out.by_group[key] = OpCount(c.calls - b.calls, c.bytes - b.bytes, c.messages - b.messages,
                                            c.payload_bytes - b.payload_bytes)
        return out

    def absorb(self, other: ByteMeter, *, empty: bool = True) -> None:
        """Add what ``other`` counted to this meter and (``empty``) empty ``other``: the traffic
        of work run on a communicator of its own (a background sync's), counted here once it
        lands."""
        pairs: list[tuple[dict[Any, OpCount], dict[Any, OpCount]]] = [
            (self.ops, other.ops), (self.by_group, other.by_group), (self.by_link, other.by_link)]
        for mine, theirs in pairs:
            for key, c in theirs.items():
                into = mine.setdefault(key, OpCount())
                into.calls += c.calls
                into.bytes += c.bytes
                into.messages += c.messages
                into.payload_bytes += c.payload_bytes
        if empty:
            other.reset()

    def reset(self) -> None:
        self.ops.clear()
        self.by_group.clear()
        self.by_link.clear()

    def paused(self) -> _Paused:
        return _Paused(self)


class _Paused:
    def __init__(self, meter: ByteMeter) -> None:
        self.meter = meter

    def __enter__(self) -> ByteMeter:
        self.prev, self.meter.enabled = self.meter.enabled, False
        return self.meter

    def __exit__(self, *exc: object) -> None:
        self.meter.enabled = self.prev

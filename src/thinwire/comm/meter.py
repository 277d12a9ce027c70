"""Byte accounting: bytes and messages *sent by this rank* per collective.

Standard algorithms: ring all_reduce of ``B`` bytes sends ``2(n-1)/n * B`` in ``2(n-1)``
messages; all_gather of a ``B``-byte contribution sends ``(n-1) * B`` in ``n-1`` messages;
point-to-point sends ``B`` in one message. One rank (n = 1) sends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def sent_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for ``op`` over ``n`` ranks with a ``nbytes`` payload."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("all_gather", "broadcast"):
        # broadcast is counted as the tree/ring volume the root sends; used only for set-up
        return (n - 1) * nbytes
    if op == "send":
        return float(nbytes)
    raise ValueError(f"unknown op {op!r}; expected all_reduce, all_gather, broadcast or send")


def sent_messages(op: str, n: int) -> int:
    if n <= 1:
        return 0
    return {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "broadcast": n - 1, "send": 1}[op]


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
    by_group: dict[tuple[str, int], OpCount] = field(default_factory=dict)  # (op, ranks in the collective)

    def record(self, op: str, nbytes: int, n: int) -> None:
        if not self.enabled:
            return
        for c in (self.ops.setdefault(op, OpCount()), self.by_group.setdefault((op, n), OpCount())):
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

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {op: vars(c).copy() for op, c in self.ops.items()}

    def reset(self) -> None:
        self.ops.clear()
        self.by_group.clear()

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

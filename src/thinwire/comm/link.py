"""The alpha-beta network model and a communicator that emulates it.

A :class:`Link` is ``(latency α seconds, bandwidth β bytes/s)``. Modeled times, for ``n``
ranks and a ``B``-byte payload (one rank, or nothing to send: 0 s):

* ring all_reduce: ``2(n-1)α + 2(n-1)/n * B/β``
* all_gather of a ``B``-byte contribution: ``(n-1)α + (n-1) * B/β``
* ring reduce_scatter of a ``B``-byte input: ``(n-1)α + (n-1)/n * B/β``
* broadcast (not in §0.4; set-up only): ``(n-1)α + (n-1) * B/β``, the root sending ``n-1``
  copies, which is what the meter counts for it
* neighbour exchange with degree ``k``: ``α + k * B/β`` (sends serialised on one NIC)

:class:`EmulatedLink` wraps a real communicator and makes every operation complete no
earlier than its modeled time after it was issued, so overlap with computation is real
and measurable on one machine.

Text form (``Link.parse`` / ``str(link)``), case-insensitive, the two parts in either order::

    link       := part "," part            one bandwidth part and one latency part
    bandwidth  := <number> (bit|kbit|mbit|gbit)   bits per second, SI: gbit = 1e9 bit/s
    latency    := <number> (s|ms|us|ns)
    <number>   := decimal, optional exponent: 1, 2.5, 1e3

e.g. ``1gbit,50us`` is 125e6 bytes/s with 50 µs latency.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from thinwire.comm.base import Communicator, Done, Handle, _nbytes
from thinwire.comm.meter import ByteMeter

# bytes/s per unit; each is exact in binary floating point, so parsing rounds once
_BANDWIDTH_UNITS = {"gbit": 125_000_000.0, "mbit": 125_000.0, "kbit": 125.0, "bit": 0.125}
# seconds = value / divisor; dividing by an exact integer rounds once (50us -> exactly 5e-05)
_LATENCY_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}
_PART = re.compile(r"\s*((?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]+)\s*", re.IGNORECASE)
_GRAMMAR = "link must look like 1gbit,50us (bandwidth <number>bit|kbit|mbit|gbit, latency <number>s|ms|us|ns)"
# The clock and the wait of every emulated delay: module-level so a test can record the waits
# the link asks for instead of measuring wall time.
_now = time.perf_counter
_sleep = time.sleep


@dataclass(frozen=True)
class Link:
    """One rank's network link: ``latency_s`` per message, ``bandwidth_Bps`` bytes per second."""

    latency_s: float  # α: seconds per message; higher = small messages cost more
    bandwidth_Bps: float  # β: bytes per second; lower = large payloads cost more

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and self.latency_s != float("inf")):
            raise ValueError(f"link latency must be a finite number of seconds >= 0, got {self.latency_s}")
        if not (self.bandwidth_Bps > 0 and self.bandwidth_Bps != float("inf")):
            raise ValueError(f"link bandwidth must be a finite number of bytes/s > 0, got {self.bandwidth_Bps}")

    @classmethod
    def parse(cls, text: str) -> Link:
        """Parse ``"1gbit,50us"`` (see the module docstring for the grammar)."""
        parts = text.split(",") if isinstance(text, str) else []
        bandwidth = latency = None
        for part in parts:
            m = _PART.fullmatch(part)
            unit = m.group(2).lower() if m else ""
            if m is not None and unit in _BANDWIDTH_UNITS and bandwidth is None:
                bandwidth = float(m.group(1)) * _BANDWIDTH_UNITS[unit]
            elif m is not None and unit in _LATENCY_UNITS and latency is None:
                latency = float(m.group(1)) / _LATENCY_UNITS[unit]
            else:
                bandwidth = latency = None
                break
        if len(parts) != 2 or bandwidth is None or latency is None:
            raise ValueError(f"{_GRAMMAR}, got {text!r}")
        return cls(latency_s=latency, bandwidth_Bps=bandwidth)

    def __str__(self) -> str:
        """The text form; ``Link.parse(str(link)) == link`` exactly."""
        bw = _format(self.bandwidth_Bps, _BANDWIDTH_UNITS, encode=lambda x, s: x / s, decode=lambda v, s: v * s)
        lat = _format(self.latency_s, _LATENCY_UNITS, encode=lambda x, s: x * s, decode=lambda v, s: v / s)
        return f"{bw},{lat}"

    # -- modeled seconds (the formulas above) ----------------------------------------------
    def all_reduce_time(self, nbytes: int, n: int) -> float:
        """Ring all_reduce of ``nbytes`` over ``n`` ranks."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * self.latency_s + 2 * (n - 1) / n * nbytes / self.bandwidth_Bps

    def all_gather_time(self, nbytes: int, n: int) -> float:
        """all_gather of a ``nbytes`` contribution per rank over ``n`` ranks."""
        if n <= 1:
            return 0.0
        return (n - 1) * self.latency_s + (n - 1) * nbytes / self.bandwidth_Bps

    def reduce_scatter_time(self, nbytes: int, n: int) -> float:
        """Ring reduce_scatter of a ``nbytes`` input (every rank's whole tensor) over ``n`` ranks."""
        if n <= 1:
            return 0.0
        return (n - 1) * self.latency_s + (n - 1) / n * nbytes / self.bandwidth_Bps

    def broadcast_time(self, nbytes: int, n: int) -> float:
        """Broadcast of ``nbytes``: the root sends ``n-1`` copies (matches the meter)."""
        return self.all_gather_time(nbytes, n)

    def exchange_time(self, nbytes: int, degree: int) -> float:
        """Neighbour exchange of ``nbytes`` with each of ``degree`` peers (concurrent latency)."""
        if degree <= 0:
            return 0.0
        return self.latency_s + degree * nbytes / self.bandwidth_Bps


def meter_seconds(link: Link, meter: ByteMeter, n: int, intra: Link | None = None) -> float:
    """Modeled seconds of everything ``meter`` counted, on ``link``; each collective over
    the ranks it spanned (sub-group collectives over their group; ``n`` is the world size,
    used for counts recorded without one). ``intra``: the link inside a node, for the
    collectives counted on it (default: ``link`` too). The bytes between nodes take
    ``meter.inter_share`` times their own time: that many ranks of the node send at once on
    its one link.

    Exact for a sequence of blocking collectives: every model time is linear in the number
    of calls and in the bytes, so per-op totals suffice. Point-to-point sends are charged
    one latency each (an upper bound when several sends share one exchange).
    """
    groups = meter.by_group or {(op, n, "inter"): c for op, c in meter.ops.items()}
    total = 0.0
    for (op, n, scope), c in groups.items():
        on = intra if scope == "intra" and intra is not None else link
        if scope == "inter" and meter.inter_share > 1:  # the node's ranks share its link: each gets a part
            on = Link(latency_s=on.latency_s, bandwidth_Bps=on.bandwidth_Bps / meter.inter_share)
        timed = {"all_reduce": on.all_reduce_time, "all_gather": on.all_gather_time,
                 "broadcast": on.all_gather_time, "reduce_scatter": on.reduce_scatter_time}.get(op)
        if timed is not None:
            fixed = timed(0, n)
            total += c.calls * fixed + timed(c.payload_bytes, n) - fixed
        elif op == "send":
            total += c.calls * on.latency_s + c.payload_bytes / on.bandwidth_Bps
    return total


def _format(value: float, units: Mapping[str, float], *, encode: Callable, decode: Callable) -> str:
    """``value`` in the largest unit that reads >= 1 and parses back to exactly ``value``."""
    exact = []
    for unit, scale in units.items():
        text = _number(encode(value, scale))
        if decode(float(text), scale) == value:
            if float(text) >= 1:
                return text + unit
            exact.append(text + unit)
    if exact:
        return exact[0]
    raise AssertionError(f"no exact text form for {value}")  # unreachable: bit and s are exact


def _number(v: float) -> str:
    text = repr(float(v))
    return text[:-2] if text.endswith(".0") else text


class _LinkClock:
    """One NIC: operations queue on it back to back. Shared by a communicator and its subgroups."""

    def __init__(self) -> None:
        self.free_at = 0.0  # perf_counter time when the link finishes its queued work
        self.modeled_seconds = 0.0
        self._lock = threading.Lock()

    def book(self, seconds: float) -> float:
        """Queue ``seconds`` of transfer issued now; returns its completion deadline."""
        with self._lock:
            start = max(_now(), self.free_at)
            self.free_at = start + seconds
            self.modeled_seconds += seconds
            return self.free_at


class _Delayed:
    """The real operation's handle, complete no earlier than ``deadline`` (perf_counter)."""

    def __init__(self, inner: Handle, deadline: float | None) -> None:
        self.inner, self.deadline = inner, deadline

    def wait(self) -> None:
        self.inner.wait()
        if self.deadline is not None:
            remaining = self.deadline - _now()
            if remaining > 0:
                _sleep(remaining)

    def is_completed(self) -> bool:
        return self.inner.is_completed() and (self.deadline is None or _now() >= self.deadline)


class EmulatedLink(Communicator):
    """``comm`` as if each rank's traffic crossed ``link``.

    Every operation runs for real on ``comm`` and its handle completes no earlier than
    ``max(issue time, link free) + modeled time``: back-to-back operations queue on the
    link, and async operations overlap with computation for real. The real transport time
    is hidden under the modeled time unless it is longer. Bytes are counted once, by
    ``comm``'s meter (this wrapper shares it). ``modeled_seconds`` accumulates the modeled
    time of every operation. Traffic issued while the meter is paused (bookkeeping such as
    metrics) is neither counted nor delayed. Subgroups are emulated too and share this
    rank's link (one NIC: the same queue and the same ``modeled_seconds``).

    With ``sleep=False`` nothing is delayed and only ``modeled_seconds`` accumulates (a
    fast simulation of the cost model).
    """

    def __init__(self, comm: Communicator, link: Link, *, sleep: bool = True, _clock: _LinkClock | None = None) -> None:
        super().__init__(comm.rank, comm.world_size, comm.meter)
        self.inner = comm
        self.link = link
        self.sleep = sleep
        self._clock = _clock if _clock is not None else _LinkClock()

    @property
    def modeled_seconds(self) -> float:
        """Sum of the modeled times of every operation on this rank's link so far."""
        return self._clock.modeled_seconds

    def __repr__(self) -> str:
        return f"EmulatedLink({self.inner!r}, Link.parse({str(self.link)!r}))"

    def _book(self, seconds: float) -> float | None:
        if not self.meter.enabled:
            return None
        deadline = self._clock.book(seconds)  # booked at issue, before a blocking inner call
        return deadline if self.sleep else None

    # -- primitives: the real operation on the inner communicator, then the delay ---------
    def _all_reduce(self, t: torch.Tensor, async_op: bool) -> Handle:
        deadline = self._book(self.link.all_reduce_time(_nbytes(t), self.world_size))
        return _Delayed(self.inner._all_reduce(t, async_op), deadline)

    def _all_gather(self, t: torch.Tensor, out: torch.Tensor, async_op: bool) -> Handle:
        deadline = self._book(self.link.all_gather_time(_nbytes(t), self.world_size))
        return _Delayed(self.inner._all_gather(t, out, async_op), deadline)

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor, async_op: bool) -> Handle:
        deadline = self._book(self.link.reduce_scatter_time(_nbytes(t), self.world_size))
        return _Delayed(self.inner._reduce_scatter(t, out, async_op), deadline)

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        deadline = self._book(self.link.broadcast_time(_nbytes(t), self.world_size))
        self.inner._broadcast(t, src)
        _Delayed(Done(), deadline).wait()

    def _exchange(
        self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], async_op: bool
    ) -> Handle:
        # α once (the messages go out concurrently) plus the bytes serialised on this NIC:
        # the larger of what it sends and what it receives (full duplex). For a symmetric
        # exchange with k peers of B bytes each this is §0.4's α + k*B/β.
        sent = sum(_nbytes(t) for t in sends.values())
        received = sum(_nbytes(t) for t in recvs.values())
        seconds = self.link.exchange_time(max(sent, received), 1) if (sends or recvs) else 0.0
        deadline = self._book(seconds)
        return _Delayed(self.inner._exchange(sends, recvs, async_op), deadline)

    def _barrier(self) -> None:
        self.inner._barrier()  # control traffic: not modeled

    def _subgroup(self, ranks: list[int]) -> Communicator | None:
        sub = self.inner._subgroup(ranks)
        if sub is None:
            return None
        return EmulatedLink(sub, self.link, sleep=self.sleep, _clock=self._clock)

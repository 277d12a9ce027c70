"""N ranks in one process, one thread each: the communicator for unit tests and simulation.

``LocalWorld(n).run(fn)`` calls ``fn(comm)`` on ``n`` threads and returns the results by
rank. Collectives rendezvous the ranks of their group, then every rank computes the result
itself from copies of all contributions in rank order (sums run 0, 1, ..., n-1), so results
are bitwise identical on all ranks and from run to run. (torch.distributed may sum in
another order, so its float results can differ in the last bits.) Every operation finishes
before it returns; async handles are already complete.

Nothing hangs: when a rank raises, every rank waiting on it is released with
:class:`RankAborted`; a wait longer than ``timeout_s``, or one on a rank that already
returned (mismatched collectives), raises on the waiting rank. ``run`` re-raises the first
failure.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from thinwire.comm.base import Communicator, Done, Handle
from thinwire.comm.meter import ByteMeter

T = TypeVar("T")
_EMPTY = object()  # a slot whose rank has not arrived


class RankAborted(RuntimeError):
    """Raised on a rank that was waiting for another rank which failed."""


class LocalWorld:
    """``n`` in-process ranks. Each ``run`` gets fresh communicators and meters.

    The ranks are threads of this process, and a collective blocks until every rank has
    joined it. On a CUDA device the ranks share the device's one autograd thread, so a method
    that averages in a gradient hook (``overlap=True``, the default of ``thinwire.attach``)
    blocks that thread waiting for a rank whose backward pass cannot then run: build such
    methods with ``overlap=False`` here. Ranks that are processes (torchrun) do not share it.
    """

    def __init__(self, n: int, *, timeout_s: float = 60.0) -> None:
        if n < 1:
            raise ValueError(f"LocalWorld needs n >= 1 ranks, got {n}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.n = n
        self.timeout_s = timeout_s  # longest a rank waits in one rendezvous before TimeoutError

    def run(self, fn: Callable[[LocalComm], T]) -> list[T]:
        """``fn(comm)`` on every rank, concurrently; the results by rank, or the first error."""
        state = _WorldState(self.n, self.timeout_s)
        group = _Group(state, list(range(self.n)))
        results: list[Any] = [None] * self.n
        errors: list[tuple[int, BaseException]] = []  # in the order they happened

        def body(rank: int) -> None:
            try:
                results[rank] = fn(LocalComm(group, rank))
            except BaseException as e:  # noqa: BLE001 - re-raised by run()
                with state.lock:
                    errors.append((rank, e))
                state.fail(rank)
            finally:
                state.exit(rank)

        threads = [
            threading.Thread(target=body, args=(r,), name=f"thinwire-rank-{r}", daemon=True) for r in range(self.n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            rank, err = next(((r, e) for r, e in errors if not isinstance(e, RankAborted)), errors[0])
            if hasattr(err, "add_note"):
                err.add_note(f"(raised on LocalWorld rank {rank} of {self.n})")
            raise err
        return results


class _WorldState:
    """What all threads of one run share: who failed, who returned."""

    def __init__(self, n: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.failed: int | None = None  # the first rank that raised
        self.exited = [False] * n
        self.groups: list[_Group] = []  # woken when a rank fails or returns

    def fail(self, rank: int) -> None:
        with self.lock:
            if self.failed is None:
                self.failed = rank
        self._wake()

    def exit(self, rank: int) -> None:
        self.exited[rank] = True
        self._wake()

    def _wake(self) -> None:
        with self.lock:
            groups = list(self.groups)
        for g in groups:
            with g.cond:
                g.cond.notify_all()

    def check(self, me: int, waiting_for: Sequence[int], what: str, deadline: float) -> None:
        """Raise on world rank ``me`` if its wait on ``waiting_for`` can never end."""
        if self.failed is not None:
            raise RankAborted(f"rank {me}: gave up waiting in {what} because rank {self.failed} failed")
        gone = [r for r in waiting_for if self.exited[r]]
        if gone:
            raise RuntimeError(
                f"rank {me}: {what} waits for rank(s) {gone}, which already returned "
                "(all ranks of a group must issue the same operations in the same order)"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {me}: {what} waited {self.timeout_s} s for rank(s) {list(waiting_for)}")


class _Group:
    """A rendezvous point and mailboxes for ``members`` (world ranks; position = group rank)."""

    def __init__(self, state: _WorldState, members: list[int]) -> None:
        self.state = state
        self.members = members
        self.cond = threading.Condition()
        self.slots: list[Any] = [_EMPTY] * len(members)
        self.arrived = 0
        self.generation = 0
        self.result: list[Any] = []
        self.mail: dict[tuple[int, int], deque[torch.Tensor]] = {}  # (src, dst) -> FIFO of messages
        with state.lock:
            state.groups.append(self)

    def rendezvous(self, rank: int, value: Any, what: str) -> list[Any]:
        """Contribute ``value``; once every member has, return all contributions by group rank.

        A finished round's ``result`` stays readable until the next round completes, which
        needs every member (this one included) to arrive again, so no one reads a newer one.
        """
        with self.cond:
            gen = self.generation
            self.slots[rank] = value
            self.arrived += 1
            if self.arrived == len(self.members):
                self.result, self.slots = self.slots, [_EMPTY] * len(self.members)
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
                return self.result
            deadline = time.monotonic() + self.state.timeout_s
            while self.generation == gen:
                missing = [self.members[i] for i, s in enumerate(self.slots) if s is _EMPTY]
                self.state.check(self.members[rank], missing, what, deadline)
                self.cond.wait(0.1)
            return self.result

    def post(self, src: int, dst: int, t: torch.Tensor) -> None:
        with self.cond:
            self.mail.setdefault((src, dst), deque()).append(t)
            self.cond.notify_all()

    def take(self, src: int, dst: int) -> torch.Tensor:
        deadline = time.monotonic() + self.state.timeout_s
        with self.cond:
            while not self.mail.get((src, dst)):
                self.state.check(self.members[dst], [self.members[src]], f"exchange (recv from {src})", deadline)
                self.cond.wait(0.1)
            return self.mail[(src, dst)].popleft()


class LocalComm(Communicator):
    """One rank of a :class:`LocalWorld` (or of one of its subgroups)."""

    def __init__(self, group: _Group, rank: int, meter: ByteMeter | None = None) -> None:
        super().__init__(rank, len(group.members), meter)
        self._group = group

    def __repr__(self) -> str:
        return f"LocalComm(rank={self.rank}, world_size={self.world_size})"

    def _gather_copies(self, t: torch.Tensor, what: str) -> list[torch.Tensor]:
        # copies: each rank writes its own tensor in place while others may still read
        values = self._group.rendezvous(self.rank, t.detach().clone(), what)
        _check_same(values, what)
        return values

    def _all_reduce(self, t: torch.Tensor, async_op: bool) -> Handle:
        values = self._gather_copies(t, "all_reduce")
        acc = values[0]
        for v in values[1:]:  # rank order: the same bits on every rank
            acc = acc + v
        t.copy_(acc)
        return Done()

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor, async_op: bool) -> Handle:
        values = self._gather_copies(t, "reduce_scatter")
        k = out.numel()
        acc = values[0][self.rank * k : (self.rank + 1) * k]
        for v in values[1:]:  # rank order, as all_reduce
            acc = acc + v[self.rank * k : (self.rank + 1) * k]
        out.copy_(acc)
        return Done()

    def _all_gather(self, t: torch.Tensor, out: torch.Tensor, async_op: bool) -> Handle:
        for i, v in enumerate(self._gather_copies(t, "all_gather")):
            out[i].copy_(v)
        return Done()

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        mine = t.detach().clone() if self.rank == src else None
        values = self._group.rendezvous(self.rank, (src, mine), "broadcast")
        if len({s for s, _ in values}) != 1:
            raise ValueError(f"broadcast: ranks passed different src: {[s for s, _ in values]}")
        t.copy_(values[src][1])

    def _exchange(
        self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], async_op: bool
    ) -> Handle:
        # Sends never block (unbounded mailboxes), so posting all of them before taking any
        # message cannot deadlock; messages between a pair are matched in posting order.
        for peer in sorted(sends):
            self._group.post(self.rank, peer, sends[peer].detach().clone())
        for peer in sorted(recvs):
            msg = self._group.take(peer, self.rank)
            if msg.shape != recvs[peer].shape or msg.dtype != recvs[peer].dtype:
                raise ValueError(
                    f"exchange: rank {self.rank} expected {tuple(recvs[peer].shape)} {recvs[peer].dtype} "
                    f"from rank {peer}, got {tuple(msg.shape)} {msg.dtype}"
                )
            recvs[peer].copy_(msg)
        return Done()

    def _barrier(self) -> None:
        self._group.rendezvous(self.rank, None, "barrier")

    def _subgroup(self, ranks: list[int]) -> LocalComm | None:
        # Every rank proposes a group; all adopt rank 0's, so members share one rendezvous.
        proposal = _Group(self._group.state, [self._group.members[r] for r in ranks])
        values = self._group.rendezvous(self.rank, (tuple(ranks), proposal), "subgroup")
        if len({r for r, _ in values}) != 1:
            raise ValueError(f"subgroup: ranks passed different rank lists: {[list(r) for r, _ in values]}")
        if self.rank not in ranks:
            return None
        return LocalComm(values[0][1], ranks.index(self.rank), self.meter)


def _check_same(values: list[torch.Tensor], what: str) -> None:
    first = values[0]
    if any(v.shape != first.shape or v.dtype != first.dtype for v in values):
        layouts = [f"{tuple(v.shape)} {v.dtype}" for v in values]
        raise ValueError(f"{what}: ranks passed different tensors: {layouts}")

"""The communicator over ``torch.distributed``: gloo on CPU, nccl on GPU.

Device-agnostic: tensors stay where the caller put them (CPU tensors for gloo, the rank's
GPU for nccl); nothing here moves them. Every operation is issued with ``async_op=True``
and wrapped in a handle; the synchronous public methods just wait on it.

Non-contiguous tensors travel through a contiguous copy that is written back when the
handle is waited on, so always ``wait()`` before reading an output (``is_completed()``
only says that ``wait()`` will not block).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from thinwire.comm.base import Communicator, Done, Handle
from thinwire.comm.meter import ByteMeter
from thinwire.knobs import env_seconds

# -- how long a rank that stops responding can hold a run ----------------------------------------
# A rank that stops (SIGSTOP, a frozen machine) ends the run within HANG_LIMIT_S. Its peers
# notice when a collective times out; the one that timed out then watches the heartbeat counters
# for SILENT_AFTER_S to name the silent peer, and reports. The launcher of spawned ranks also
# watches the counters itself and ends the run when one stands still too long (a peer busy in a
# long step is not waiting on a collective yet); it comes after the collective's path, so that
# the usual report names the rank that timed out waiting. The collective timeout is what is left:
HANG_LIMIT_S = 60.0  # the promise: a hung rank ends a run this long after it stopped, at most
HEARTBEAT_S = 1.0  # each rank's heartbeat period (a counter's last move can be this long before the hang)
SILENT_AFTER_S = 3.0  # a peer whose heartbeat stands still this long stopped responding
REPORT_S = 3.0  # margin for the timed-out rank's report and the launcher's look at it (measured: 1.4 s)
END_S = 3.0  # margin for ending the ranks and the command once the launcher decides (measured: < 0.5 s)
# the launcher ends the run itself when a counter stood still this much longer than the collective timeout
LAUNCHER_AFTER_TIMEOUT_S = SILENT_AFTER_S + REPORT_S + HEARTBEAT_S
COLLECTIVE_TIMEOUT_S = HANG_LIMIT_S - END_S - LAUNCHER_AFTER_TIMEOUT_S  # 50 s: a collective waiting longer fails
TIMEOUT_ENV = "THINWIRE_COLLECTIVE_TIMEOUT"  # seconds; replaces COLLECTIVE_TIMEOUT_S where set


def hang_limit() -> float:
    """Seconds within which a rank that stops responding ends the run: :data:`HANG_LIMIT_S`
    with the default collective timeout; with ``THINWIRE_COLLECTIVE_TIMEOUT`` set, that timeout
    plus the same margins (:func:`collective_timeout` + 10 s)."""
    return collective_timeout() + LAUNCHER_AFTER_TIMEOUT_S + END_S


def collective_timeout() -> float:
    """Seconds a collective waits on a silent peer before it fails: :data:`COLLECTIVE_TIMEOUT_S`
    (derived from :data:`HANG_LIMIT_S`), or the ``THINWIRE_COLLECTIVE_TIMEOUT`` environment
    variable (a number > 0), which sets the timeout itself; the hang limit then follows it
    (:func:`hang_limit`)."""
    return env_seconds(TIMEOUT_ENV, COLLECTIVE_TIMEOUT_S)


_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# all_gather into one flat tensor: ``all_gather_single`` where it exists (it deprecates the other)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


EXIT_SETTLE_S = 0.2  # at exit, how long gloo's threads get to release the last works
_launched = False  # whether this process started a collective through TorchComm


@atexit.register
def _settle() -> None:
    """Give gloo's threads a moment to release their last works before the interpreter shuts
    down. A work holds the tensors it was given; those made in Python own a Python object, and
    a gloo thread that drops the last reference to one during shutdown needs the GIL, is
    stopped in the attempt and aborts the process ("terminate called without an active
    exception") after the script has finished. PyTorch's own Python hooks share the race."""
    if _launched:
        time.sleep(EXIT_SETTLE_S)


@contextlib.contextmanager
def _launching() -> Iterator[None]:
    """Launch a collective without the Python object that ``backward()`` stashes in torch's
    thread-local state (its ``contextvars`` context): a gloo work keeps the state it was
    created in, and releasing that object on gloo's thread during shutdown aborts as above."""
    global _launched
    _launched = True
    tls = torch._C
    if not (hasattr(tls, "_is_key_in_tls") and tls._is_key_in_tls("context")):
        yield
        return
    saved = tls._get_obj_in_tls("context")
    tls._remove_obj_from_tls("context")
    try:
        yield
    finally:
        tls._stash_obj_in_tls("context", saved)


class _Works:
    """Handles of torch.distributed work, plus a copy-back run once after they finish."""

    def __init__(self, works: Sequence[dist.Work], after: Callable[[], object] | None = None, *keep: object) -> None:
        self.works = list(works)
        self.after = after
        self.keep = keep  # buffers the backend reads or writes until the work finishes

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.after is not None:
            after = self.after
            self.after = None
            after()
        self.keep = ()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class TorchComm(Communicator):
    """A torch.distributed process group (``None``: the default group) as a communicator.

    Its ranks are the group's ranks; a communicator from :meth:`subgroup` numbers them by
    position in the list it was given (torch itself numbers a new group in sorted order;
    all_gather reorders its output to match).

    A group of one rank skips its collectives (an all_reduce leaves the tensor as it is, an
    all_gather copies it): there is no one to send to. ``one_rank_collectives=True`` issues
    them through ``torch.distributed`` all the same, as DDP does on one rank, so that the
    collective path's own cost on one device can be measured against DDP's with the network
    out of the way (``benchmarks/bench_gpu.py``); the results are the same either way. Its
    subgroups inherit it.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        meter: ByteMeter | None = None,
        *,
        one_rank_collectives: bool = False,
        _order: Sequence[int] | None = None,  # our rank -> global rank (subgroups); default: torch's order
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call thinwire.comm.torch_dist.init_from_env() "
                "(torchrun env vars) or torch.distributed.init_process_group() first"
            )
        self.group = group
        torch_order = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self._global = list(_order) if _order is not None else torch_order  # our rank -> global rank
        if dist.get_rank() not in self._global:
            raise ValueError(f"global rank {dist.get_rank()} is not a member of this group {self._global}")
        super().__init__(self._global.index(dist.get_rank()), len(self._global), meter)
        self.one_rank_collectives = one_rank_collectives
        # all_gather output row i must be our rank i; torch writes torch-group rank j to row j
        self._gather_rows = None if self._global == torch_order else [torch_order.index(g) for g in self._global]

    def __repr__(self) -> str:
        return f"TorchComm(rank={self.rank}, world_size={self.world_size}, global_ranks={self._global})"

    @property
    def _alone(self) -> bool:
        """Whether the collectives are skipped: one rank, and not told to issue them anyway."""
        return self.world_size == 1 and not self.one_rank_collectives

    def _all_reduce(self, t: torch.Tensor, async_op: bool) -> Handle:
        if self._alone:
            return Done()
        buf = t if t.is_contiguous() else t.contiguous()
        with _launching():
            work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Works([work], None if buf is t else (lambda: t.copy_(buf)), buf)

    def _all_gather(self, t: torch.Tensor, out: torch.Tensor, async_op: bool) -> Handle:
        if self._alone:
            out[0].copy_(t)
            return Done()
        src = t.contiguous().view(-1)
        direct = out.is_contiguous() and self._gather_rows is None
        dst = out if direct else torch.empty(out.shape, dtype=out.dtype, device=out.device)  # (world, *t.shape)
        with _launching():
            work = _all_gather_flat(dst.view(-1), src, group=self.group, async_op=True)
        return _Works([work], None if direct else (lambda: self._copy_rows(dst, out)), src, dst)

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor, async_op: bool) -> Handle:
        if self._alone:
            out.copy_(t)
            return Done()
        src = t.contiguous()
        if self._gather_rows is not None:  # chunk i is our rank i's; torch hands chunk j to its rank j
            chunks = src.view(self.world_size, -1)
            src = torch.empty_like(chunks)
            for i, j in enumerate(self._gather_rows):
                src[j].copy_(chunks[i])
            src = src.view(-1)
        dst = out if out.is_contiguous() else torch.empty_like(out)
        with _launching():
            work = _reduce_scatter_flat(dst, src, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Works([work], None if dst is out else (lambda: out.copy_(dst)), src, dst)

    def _copy_rows(self, gathered: torch.Tensor, out: torch.Tensor) -> None:
        if self._gather_rows is None:
            out.copy_(gathered)
            return
        for i, j in enumerate(self._gather_rows):
            out[i].copy_(gathered[j])

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        if self._alone:
            return
        buf = t if t.is_contiguous() else t.contiguous()
        with _launching():
            dist.broadcast(buf, src=self._global[src], group=self.group)
        if buf is not t:
            t.copy_(buf)

    def _exchange(
        self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor], async_op: bool
    ) -> Handle:
        # Why this cannot deadlock: every send and receive of this call is *posted* before
        # any of them is waited on. gloo's isend/irecv return at once (the transfer runs in
        # the background), and on nccl batch_isend_irecv fuses them into one group call, so
        # no rank blocks while a peer still has to post its half of an edge, whatever the
        # order of posting. Both ends call exchange in the same step, and each call carries
        # at most one message per direction per peer, so messages between a pair of ranks
        # match in call order (same tag, FIFO). Peers are posted in sorted order so every
        # rank's posting order is deterministic.
        ops, copies = [], []
        for peer in sorted(sends):
            ops.append(dist.P2POp(dist.isend, sends[peer].contiguous(), self._global[peer], group=self.group))
        for peer in sorted(recvs):
            t = recvs[peer]
            buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            if buf is not t:
                copies.append((t, buf))
            ops.append(dist.P2POp(dist.irecv, buf, self._global[peer], group=self.group))
        if not ops:
            return Done()
        with _launching():
            works = dist.batch_isend_irecv(ops)

        def copy_back() -> None:
            for t, buf in copies:
                t.copy_(buf)

        return _Works(works, copy_back if copies else None, ops)

    def _barrier(self) -> None:
        if self.world_size > 1:
            with _launching():
                dist.barrier(group=self.group)

    def same_ranks(self) -> TorchComm:
        """A second group over the same ranks. Over the whole job: ``subgroup`` of every rank.
        Over one of several groups that split the job (a ``DeviceMesh``'s dimension, one group
        per rank of the other), every process creates every such group anew, in one order
        learnt from all of them (one all_gather of the groups' ranks over the job, not
        metered), as ``torch.distributed.new_group`` asks."""
        if self.world_size == dist.get_world_size():
            return super().same_ranks()  # type: ignore[return-value]  # a TorchComm's subgroup is one
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, tuple(self._global))
        mine = None
        for members in sorted(set(every)):
            group = dist.new_group(ranks=sorted(members))
            if members == tuple(self._global):
                mine = TorchComm(group, self.meter, one_rank_collectives=self.one_rank_collectives,
                                 _order=list(members))
        assert mine is not None  # this process's own group is among them
        return mine

    def _subgroup(self, ranks: list[int]) -> TorchComm | None:
        # dist.new_group must be entered by every process of the job (members or not), in
        # the same order; this communicator's subgroup() is called by all of its ranks, so
        # that holds only when this communicator spans the whole job.
        if self.world_size != dist.get_world_size():
            raise NotImplementedError(
                "TorchComm.subgroup needs a communicator over all processes (torch.distributed.new_group "
                "must be entered by every process); create every group from the world communicator"
            )
        members = [self._global[r] for r in ranks]  # global ranks, in our rank order
        if not members:
            return None
        group = dist.new_group(ranks=sorted(members))
        if dist.get_rank() not in members:
            return None
        return TorchComm(group, self.meter, one_rank_collectives=self.one_rank_collectives, _order=members)


def init_from_env(backend: str | None = None, timeout_s: float | None = None, *,
                  meter: ByteMeter | None = None) -> TorchComm:
    """Join the torchrun-style world described by the environment and return its communicator.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. The backend defaults
    to ``nccl`` when CUDA is available and ``LOCAL_RANK`` is set (that GPU becomes the
    current device), else ``gloo``. ``timeout_s`` bounds every collective (and the
    rendezvous; None: :func:`collective_timeout`): a rank whose peer died raises after at
    most that long instead of hanging, so the run exits. gloo applies it directly; on nccl
    it acts through the watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default),
    which aborts the process.
    If torch.distributed is already initialised it is used as is (``backend`` and
    ``timeout_s`` are then ignored).
    """
    if not dist.is_initialized():
        missing = [k for k in _ENV if not os.environ.get(k)]
        if missing:
            raise RuntimeError(
                f"init_from_env needs the torchrun env vars {', '.join(_ENV)}; missing {', '.join(missing)}"
            )
        if timeout_s is None:
            timeout_s = collective_timeout()
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and "LOCAL_RANK" in os.environ else "gloo"
        if backend == "nccl" and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return TorchComm(meter=meter)

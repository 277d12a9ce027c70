"""The communicator of an elastic worker: torchft's reconfigurable gloo group, one quorum at a time.

At each step the torchft ``Manager`` forms a quorum and reconfigures its process group over
the workers in it; :class:`QuorumComm` is that group as a thinwire
:class:`~thinwire.comm.base.Communicator`, with ``rank`` and ``world_size`` the worker's place
in the quorum and the quorum's size (:meth:`reconfigure`). Every method built on it therefore
averages over the workers present: the divisor is the quorum's size.

A collective that fails (a peer died or stopped answering within the timeout) does not
raise: the error goes to the manager (``report_error``), which then votes against committing
the step, and every later collective of the step returns at once without sending, so no
worker waits on a broken group. What the step computed from such collectives is garbage, and
the elastic worker throws it away (:mod:`thinwire.elastic.worker`); the outputs of a gather,
a scatter or a receive that failed are zeros, so that no size or index is read from bytes an
earlier step left behind. Bytes are metered as they
are sent, failed steps included: the meter counts what this worker sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from thinwire.comm.base import Communicator, Done, Handle
from thinwire.comm.meter import ByteMeter


class _Guarded:
    """A torchft work whose failure is reported to the manager instead of raised."""

    def __init__(self, comm: QuorumComm, works: list[Any], after: Callable[[], object] | None = None,
                 fail: Callable[[], object] | None = None) -> None:
        self.comm, self.works, self.after, self.fail = comm, works, after, fail

    def wait(self) -> None:
        works, self.works = self.works, []
        for w in works:
            try:
                w.wait(self.comm.timeout)  # a send or recv waits its own timeout (gloo's is the set-up's)
            except Exception as e:  # a dead or silent peer: the step is discarded, not the run
                self.comm.failed(e)
        after, fail, self.after, self.fail = self.after, self.fail, None, None
        if self.comm.broken:
            if fail is not None:
                fail()
        elif after is not None:
            after()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class QuorumComm(Communicator):
    """torchft's process group ``pg`` over the current quorum, failures reported to ``manager``."""

    def __init__(self, manager: Any, pg: Any, meter: ByteMeter | None = None, *,
                 timeout: timedelta = timedelta(seconds=4)) -> None:
        super().__init__(0, 1, meter)
        self.manager, self.pg, self.timeout = manager, pg, timeout

    def __repr__(self) -> str:
        return f"QuorumComm(rank={self.rank}, world_size={self.world_size})"

    def reconfigure(self, rank: int, world_size: int) -> None:
        """This worker's place in the new quorum, and the quorum's size."""
        self.rank, self.world_size = rank, world_size

    @property
    def broken(self) -> bool:
        """Whether a collective of this step failed (the step will be discarded)."""
        return self.manager.errored() is not None

    def failed(self, e: Exception) -> None:
        if not self.broken:
            self.manager.report_error(e)

    def _run(self, launch: Callable[[], list[Any]], after: Callable[[], object] | None = None,
             fail: Callable[[], object] | None = None) -> Handle:
        """Launch; ``after`` runs once the work succeeded, ``fail`` (zeroing the outputs, so
        nothing reads what an earlier step left there) once it failed or was not launched."""
        if not self.broken:
            try:
                return _Guarded(self, launch(), after, fail)
            except Exception as e:
                self.failed(e)
        if fail is not None:
            fail()
        return Done()

    # -- the primitives ---------------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, async_op: bool) -> Handle:
        if self.world_size == 1:
            return Done()
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        buf = t if t.is_contiguous() else t.contiguous()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs: RedOpType
        return self._run(lambda: [self.pg.allreduce([buf], opts)], None if buf is t else (lambda: t.copy_(buf)))

    def _all_gather(self, t: torch.Tensor, out: torch.Tensor, async_op: bool) -> Handle:
        if self.world_size == 1:
            out[0].copy_(t)
            return Done()
        from torch.distributed.distributed_c10d import AllgatherOptions

        src = t.contiguous()
        rows = [torch.empty_like(src) for _ in range(self.world_size)]

        def copy_rows() -> None:
            for i, r in enumerate(rows):
                out[i].copy_(r)

        return self._run(lambda: [self.pg.allgather([rows], [src], AllgatherOptions())], copy_rows, out.zero_)

    def _reduce_scatter(self, t: torch.Tensor, out: torch.Tensor, async_op: bool) -> Handle:
        # torchft's gloo group has no reduce_scatter: a sum of the whole, this rank's chunk kept
        # (the meter counts a reduce_scatter's bytes, as a group with one would send)
        if self.world_size == 1:
            out.copy_(t)
            return Done()
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        buf = t.contiguous().clone()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs: RedOpType
        n = out.numel()
        return self._run(lambda: [self.pg.allreduce([buf], opts)],
                         lambda: out.copy_(buf[self.rank * n:(self.rank + 1) * n].view_as(out)), out.zero_)

    def _broadcast(self, t: torch.Tensor, src: int) -> None:
        if self.world_size == 1:
            return
        from torch.distributed.distributed_c10d import BroadcastOptions

        buf = t if t.is_contiguous() else t.contiguous()
        opts = BroadcastOptions()
        opts.rootRank = src
        self._run(lambda: [self.pg.broadcast([buf], opts)], None if buf is t else (lambda: t.copy_(buf))).wait()

    def _exchange(self, sends: Mapping[int, torch.Tensor], recvs: Mapping[int, torch.Tensor],
                  async_op: bool) -> Handle:
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []

        def launch() -> list[Any]:
            works = [self.pg.send([sends[p].contiguous()], p, 0) for p in sorted(sends)]
            for p in sorted(recvs):
                t = recvs[p]
                buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                if buf is not t:
                    copies.append((t, buf))
                works.append(self.pg.recv([buf], p, 0))
            return works

        def copy_back() -> None:
            for t, buf in copies:
                t.copy_(buf)

        def zero() -> None:
            for t in recvs.values():
                t.zero_()

        if not sends and not recvs:
            return Done()
        return self._run(launch, copy_back, zero)

    def _barrier(self) -> None:
        if self.world_size > 1:
            from torch.distributed.distributed_c10d import BarrierOptions

            self._run(lambda: [self.pg.barrier(BarrierOptions())]).wait()

    def _subgroup(self, ranks: list[int]) -> Communicator | None:
        raise NotImplementedError("an elastic worker's quorum has no subgroups: elastic mode averages in one level")

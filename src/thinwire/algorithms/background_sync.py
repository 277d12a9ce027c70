"""A round's average run in the background, behind the next round's inner steps.

The DiLoCo family's ``sync=eager|delayed`` launch a round's average (encode, every collective,
decode) as one piece of work on a background thread (:class:`~thinwire.comm.background.Worker`)
and land it at the end of the next round. The work runs over a communicator of its own, a
second group over the same ranks, so that the collectives the training thread issues in the
meantime (the trainer's metrics, buffers' averages, a user's) can never interleave with it in
another order on another rank. Its bytes are counted on that communicator's own meter and
added to the world's when the average lands, with the seconds it ran behind computation.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch.futures import Future

from thinwire.comm.background import Worker
from thinwire.comm.base import Communicator
from thinwire.comm.link import Link, meter_seconds
from thinwire.comm.meter import ByteMeter
from thinwire.comm.nodes import twin


class InFlight:
    """One average queued with :meth:`BackgroundSync.start`, several of which may be in flight
    (streaming DiLoCo's fragments): the handle a fragment's merge settles and waits on."""

    def __init__(self, owner: BackgroundSync, future: Future[tuple[ByteMeter, float]], started_at: float) -> None:
        self._owner, self._future, self.started_at = owner, future, started_at
        self.sent: ByteMeter | None = None  # its traffic, once landed
        self.finished_at: float | None = None  # when the work ended (perf_counter), once landed
        self.done = False

    def is_completed(self) -> bool:
        return self._future.done()

    def settle(self) -> None:
        """Wait for the work (its error, if it failed, is raised here)."""
        self.sent, self.finished_at = self._future.wait()

    def wait(self) -> None:
        """Settle, then count its bytes on the world's meter; a second call does nothing."""
        if self.done:
            return
        self.settle()
        assert self.sent is not None
        self._owner.comm.meter.absorb(self.sent, empty=False)
        self.done = True


class BackgroundSync:
    """Averages run on a background thread over a twin of ``comm``: one at a time with
    :meth:`launch` and :meth:`land` (a round's), or queued with :meth:`start` (fragments)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.twin = twin(comm)  # every rank calls this, in the same order; counted apart, absorbed on landing
        self.worker: Worker | None = None  # started by the first launch, ended by close()
        self.launched_at = 0.0
        self.seconds = 0.0  # launch to completion, summed over the landed averages
        self.blocked = 0.0  # the training thread waiting for an average still in flight
        # per landed average: its traffic, its codec seconds, the seconds of computation it ran behind
        self.windows: list[tuple[ByteMeter, float, float]] = []
        self._future: Future[tuple[float, float]] | None = None

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def launch(self, work: Callable[[], float]) -> None:
        """Run ``work`` (one whole average; it returns its codec seconds) on the thread."""
        if self._future is not None:
            raise RuntimeError("an average is in flight already: land it first")
        self.launched_at = time.perf_counter()

        def run() -> tuple[float, float]:
            codec = work()
            return codec, time.perf_counter()

        if self.worker is None:
            self.worker = Worker("thinwire-outer-sync")
        self._future = self.worker.submit(run)

    def land(self) -> bool:
        """Wait for the average in flight (its error, if it failed, is raised here) and count
        its bytes on the world's meter; False when none was in flight."""
        if self._future is None:
            return False
        t0 = time.perf_counter()
        future, self._future = self._future, None
        codec, done_at = future.wait()
        self.blocked += time.perf_counter() - t0
        self.seconds += done_at - self.launched_at
        sent = ByteMeter(inter_share=self.twin.meter.inter_share)
        sent.absorb(self.twin.meter)
        self.windows.append((sent, codec, t0 - self.launched_at))
        self.comm.meter.absorb(sent, empty=False)
        return True

    def start(self, work: Callable[[], object]) -> InFlight:
        """Queue ``work`` (one whole average) behind what is queued already; its traffic is
        counted on a meter of its own, added to the world's when its handle is waited on."""
        twin = self.twin

        def run() -> tuple[ByteMeter, float]:
            meter = ByteMeter(inter_share=self.comm.meter.inter_share)  # this work's alone
            twin.use_meter(meter)
            work()
            return meter, time.perf_counter()

        if self.worker is None:
            self.worker = Worker("thinwire-outer-sync")
        return InFlight(self, self.worker.submit(run), time.perf_counter())

    def close(self) -> None:
        """Land what is in flight and end the thread (a later launch starts another)."""
        self.land()
        if self.worker is not None:
            self.worker.join()
            self.worker = None

    def hidden_seconds(self, link: Link) -> float:
        """Modeled seconds of the landed averages' codec and collectives on ``link`` that the
        computation behind which they ran hides: ``min(codec + T_link, window)`` each."""
        n = self.comm.world_size
        return sum(min(codec + meter_seconds(link, sent, n), window) for sent, codec, window in self.windows)

"""One background thread that runs communication work in the order it was submitted.

Overlapping gradient averaging (the DDP hook, :class:`~thinwire.algorithms.gradients.GradientReducer`)
hands each bucket's whole average (encode, every collective round, decode) to a
:class:`Worker` while the backward pass goes on in the training thread. One thread, one
queue: buckets are averaged in submission order, so every rank issues the same collectives
in the same order as long as every rank submits the same buckets in the same order.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()
EXIT_WAIT_S = 5.0  # how long interpreter exit waits for a worker still busy with a collective


class Worker:
    """A daemon thread running submitted callables in order; each completes a
    ``torch.futures.Future`` with its result, or with its exception (``wait()`` raises it)."""

    def __init__(self, name: str = "thinwire-worker") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def submit(self, work: Callable[[], Any], fut: torch.futures.Future | None = None) -> torch.futures.Future:
        """Queue ``work``; returns the future it completes (``fut`` when given)."""
        fut = torch.futures.Future() if fut is None else fut
        self._queue.put((work, fut))
        return fut

    def close(self) -> None:
        """Let the thread end once the work queued before this has run."""
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> None:
        """Close, then wait up to ``timeout`` seconds for the thread to end."""
        self.close()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, fut = item
            try:
                result = work()
            except BaseException as e:  # noqa: BLE001  (the waiting thread raises it)
                fut.set_exception(e)
            else:
                fut.set_result(result)


@atexit.register
def _end_workers() -> None:
    """Let every worker's thread end before the interpreter shuts down. A daemon thread still
    inside a torch call then (waiting for a collective, the GIL released) is stopped when it
    takes the GIL back, unwinding through C++ frames, which aborts the process ("terminate
    called without an active exception") after the user's script has finished."""
    for worker in list(_LIVE):
        worker.join(EXIT_WAIT_S)

"""One background thread that runs communication work in the order it was submitted.

Overlapping gradient averaging (the DDP hook, :class:`~thinwire.algorithms.gradients.GradientReducer`)
hands each bucket's whole average (encode, every collective round, decode) to a
:class:`Worker` while the backward pass goes on in the training thread. One thread, one
queue: buckets are averaged in submission order, so every rank issues the same collectives
in the same order as long as every rank submits the same buckets in the same order.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch


class Worker:
    """A daemon thread running submitted callables in order; each completes a
    ``torch.futures.Future`` with its result, or with its exception (``wait()`` raises it)."""

    def __init__(self, name: str = "thinwire-worker") -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, work: Callable[[], Any], fut: torch.futures.Future | None = None) -> torch.futures.Future:
        """Queue ``work``; returns the future it completes (``fut`` when given)."""
        fut = torch.futures.Future() if fut is None else fut
        self._queue.put((work, fut))
        return fut

    def close(self) -> None:
        """Let the thread end once the work queued before this has run."""
        self._queue.put(None)

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

"""A task for fault tests: ``synthetic``, except that chosen ranks take a very long step, or
stop their own process, when they build a chosen batch.

Environment: ``SLOWTASK_AT`` (the batch number, counted from 1, of this process's stream);
``SLOWTASK_SLEEP_RANKS`` (comma-separated ranks that sleep ``SLOWTASK_SLEEP`` seconds there);
``SLOWTASK_STOP_RANK`` (the rank that sends itself SIGSTOP there); ``SLOWTASK_MARK`` (a
directory: each of those ranks writes ``rank<R>`` there just before it sleeps or stops, so a
test knows when). Unset, it is ``synthetic``. Used as ``--import usercodec.slowtask --task
slowsynthetic``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import ClassVar

from thinwire.tasks import register
from thinwire.tasks.synthetic import Synthetic


def _mark(rank: int) -> None:
    folder = os.environ.get("SLOWTASK_MARK")
    if folder:
        with open(os.path.join(folder, f"rank{rank}"), "w") as f:
            f.write(str(os.getpid()))


@register
class SlowSynthetic(Synthetic):
    name: ClassVar[str] = "slowsynthetic"
    summary: ClassVar[str] = "synthetic; chosen ranks sleep or stop at a chosen batch (fault tests)"

    def train_batches(self, rank, world_size, batch_size, start=0):
        at = int(os.environ.get("SLOWTASK_AT", "0"))
        sleepers = {int(r) for r in os.environ.get("SLOWTASK_SLEEP_RANKS", "").split(",") if r}
        stopper = os.environ.get("SLOWTASK_STOP_RANK")
        for n, batch in enumerate(super().train_batches(rank, world_size, batch_size, start), 1):
            if n == at and rank in sleepers:
                _mark(rank)
                time.sleep(float(os.environ.get("SLOWTASK_SLEEP", "300")))
            if n == at and stopper is not None and int(stopper) == rank:
                _mark(rank)
                os.kill(os.getpid(), signal.SIGSTOP)
            yield batch

"""TensorBoard event files beside ``metrics.jsonl``: every numeric figure of every record.

``thinwire train --out DIR`` (and every run of ``thinwire compare``) writes them into ``DIR``
when the ``tensorboard`` package is installed (``pip install 'thinwire[tensorboard]'``; the
dev install has it), so ``tensorboard --logdir DIR`` (or ``--logdir OUT/runs`` for a
comparison, one run per method) plots what ``metrics.jsonl`` holds. Tags, by record key:

* ``train_<name>`` -> ``train/<name>`` (``train/loss``, ``train/loss_mean``); ``test_<name>`` -> ``test/<name>``;
* ``modeled_seconds@<link>`` -> ``modeled_seconds/<link>`` (the modeled time per ``--link``);
* every other number -> ``thinwire/<key>``: ``bytes_sent``, ``messages``, ``intra_bytes``,
  the clocks, and the method's own figures (FFT's ``theta``, DaSGD's ``delay``, ...);

the record's ``step`` is the global step; text, lists and nested figures are left out.
The event files are rewritten with the run, as ``metrics.jsonl`` is: an earlier run's in the
directory go (only thinwire's own, recorded in its manifest), and a resumed run writes its
history (up to its checkpoint) first.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Any

from thinwire.figures import numeric
from thinwire.run import outdir

INSTALL = "pip install 'thinwire[tensorboard]'"


def available() -> bool:
    """Whether the ``tensorboard`` package (which ``torch.utils.tensorboard`` needs) is installed."""
    return importlib.util.find_spec("tensorboard") is not None


def tag(key: str) -> str:
    """The TensorBoard tag of a ``metrics.jsonl`` key."""
    if key.startswith("train_"):
        return f"train/{key[len('train_'):]}"
    if key.startswith("test_"):
        return f"test/{key[len('test_'):]}"
    if key.startswith("modeled_seconds@"):
        return f"modeled_seconds/{key.partition('@')[2]}"
    return f"thinwire/{key}"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """``{tag: value}`` of every numeric figure of ``record`` but its ``step``."""
    out = {}
    for key, value in record.items():
        v = numeric(value)
        if key != "step" and v is not None:
            out[tag(key)] = v
    return out


EVENTS = "events.out.tfevents.*"  # the event files SummaryWriter names


class TensorBoardWriter:
    """Writes each record's :func:`scalars` at its ``step`` into an event file in ``out``,
    in place of the event files an earlier run of thinwire's left there (those its manifest
    records, :mod:`thinwire.run.outdir`: an event file of anyone else's stays)."""

    def __init__(self, out: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        for stale in sorted(glob.glob(os.path.join(out, EVENTS))):
            outdir.remove(out, os.path.basename(stale))
        before = set(glob.glob(os.path.join(out, EVENTS)))
        self._writer = SummaryWriter(log_dir=out)
        # SummaryWriter creates its file as it opens, named by the time, host and process: a new
        # name, which nobody else's file held a moment before
        self.files = sorted(set(glob.glob(os.path.join(out, EVENTS))) - before)
        outdir.record(out, *(os.path.basename(p) for p in self.files))

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not isinstance(step, int):
            return
        for name, value in scalars(record).items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

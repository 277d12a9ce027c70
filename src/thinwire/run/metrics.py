"""Run outputs: ``metrics.jsonl`` (one object per logged step) and ``summary.json``.

Both are strict JSON: a figure that is NaN or infinite is written as ``null``, and the
record says why under ``non_finite`` (``{"final_loss": "nan"}``; nested figures by their
dotted path), so any JSON reader takes the files and no figure silently reads as a number.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from thinwire import jsonfile
from thinwire.run import outdir

NON_FINITE = "non_finite"  # the key naming a record's figures that were NaN or infinite


def finite(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with every non-finite float replaced by None and, when there was one,
    ``non_finite``: {dotted path: "nan" | "inf" | "-inf"}."""
    found: dict[str, str] = {}

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            found[path] = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
            return None
        if isinstance(v, dict):
            return {k: walk(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{path}.{i}") for i, x in enumerate(v)]
        return v

    out = walk(record, "")
    if found:
        out[NON_FINITE] = {**(record.get(NON_FINITE) or {}), **found}
    return out


class MetricsWriter:
    """Writes into ``out``; the summary is written atomically (temporary file + rename)."""

    def __init__(self, out: str, history: list[dict[str, Any]] | None = None, *, tensorboard: bool = False) -> None:
        """``history``: a resumed run's records up to its checkpoint, written first (records a
        crashed run logged after its checkpoint are dropped, so none appears twice).
        ``tensorboard``: every record, the history's first, also goes to TensorBoard event
        files in ``out`` (:mod:`thinwire.run.tensorboard`), which replace an earlier run's
        there as ``metrics.jsonl`` does."""
        os.makedirs(out, exist_ok=True)
        self.out = out
        path = os.path.join(out, "metrics.jsonl")
        tmp = f"{path}.tmp"
        # only files of thinwire's own are replaced (thinwire.run.outdir): a user's file of one of
        # these names is refused before anything is written
        outdir.claim(out, "metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "summary.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:  # the history replaces the file in one step
            f.writelines(json.dumps(finite(record), allow_nan=False) + "\n" for record in history or [])
        os.replace(tmp, path)
        self._jsonl = open(path, "a", encoding="utf-8")
        self._tensorboard = None
        if tensorboard:
            from thinwire.run.tensorboard import TensorBoardWriter

            self._tensorboard = TensorBoardWriter(out)
            for record in history or []:
                self._tensorboard.write(record)
        outdir.remove(out, "summary.json")  # an earlier run's (or the resumed one's): not this run's

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(finite(record), sort_keys=False, allow_nan=False) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            self._tensorboard.write(record)

    def write_event(self, record: dict[str, Any]) -> None:
        """A record of something that happened (an elastic job's change of quorum): into
        ``metrics.jsonl`` only, not TensorBoard (it has no figures to plot over steps)."""
        self._jsonl.write(json.dumps(finite(record), sort_keys=False, allow_nan=False) + "\n")
        self._jsonl.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        outdir.claim(self.out, "summary.json", "summary.json.tmp")
        write_json_atomic(os.path.join(self.out, "summary.json"), summary)

    def close(self) -> None:
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(finite(obj) if isinstance(obj, dict) else obj, f, indent=2, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (:func:`thinwire.jsonfile.read_lines`: size and nesting bounded)."""
    return jsonfile.read_lines(path)

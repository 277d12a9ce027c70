"""Run outputs: ``metrics.jsonl`` (one object per logged step) and ``summary.json``."""

from __future__ import annotations

import json
import os
from typing import Any


class MetricsWriter:
    """Writes into ``out``; the summary is written atomically (temporary file + rename)."""

    def __init__(self, out: str, history: list[dict[str, Any]] | None = None) -> None:
        """``history``: a resumed run's records up to its checkpoint, written first (records a
        crashed run logged after its checkpoint are dropped, so none appears twice)."""
        os.makedirs(out, exist_ok=True)
        self.out = out
        path = os.path.join(out, "metrics.jsonl")
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:  # the history replaces the file in one step
            f.writelines(json.dumps(record) + "\n" for record in history or [])
        os.replace(tmp, path)
        self._jsonl = open(path, "a", encoding="utf-8")
        stale = os.path.join(out, "summary.json")  # an earlier run's (or the resumed one's): not this run's
        if os.path.exists(stale):
            os.remove(stale)

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record, sort_keys=False) + "\n")
        self._jsonl.flush()

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(os.path.join(self.out, "summary.json"), summary)

    def close(self) -> None:
        self._jsonl.close()


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]

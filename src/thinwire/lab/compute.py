"""One compute figure for the methods of a race that run the same step.

Methods that run the task's plain forward, backward and optimizer step (every method but
those whose :attr:`~thinwire.algorithms.base.Method.own_compute` is set) do the same work
per step; what they measure differs only by the machine's noise (another process, a busy
core, the clock). ``compare`` and ``cost`` therefore give them one shared figure: the
median of per-step compute over *blocks* (a run's evaluation windows in ``compare``, a
probe's timed span in ``cost``) taken from every such method across the race, whose runs
alternate in time, so a burst of load is spread over all of them instead of landing on
one. Its range is the blocks' interquartile range (ours: the middle half of what was
measured, wide on a busy machine, narrow on a quiet one); a verdict that holds at both
ends of the range holds whatever the compute of that race truly was.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SharedCompute:
    """Seconds of compute per step: ``per_step`` (the median over ``blocks``) and its range
    ``lo``–``hi`` (the blocks' quartiles); ``methods``: whose blocks they were."""

    per_step: float
    lo: float
    hi: float
    blocks: int
    methods: tuple[str, ...] = ()

    @property
    def spread(self) -> float:
        """The range's width as a share of the figure (0 for one block)."""
        return (self.hi - self.lo) / self.per_step if self.per_step > 0 else 0.0

    def text(self) -> str:
        """``12.3 ms a step [11.9–13.0] over 24 blocks``."""
        return (f"{1e3 * self.per_step:.1f} ms a step [{1e3 * self.lo:.1f}–{1e3 * self.hi:.1f}] over "
                f"{self.blocks} block{'s' if self.blocks != 1 else ''}")


def summarize(blocks: list[float], methods: tuple[str, ...] = ()) -> SharedCompute | None:
    """The shared figure of per-step compute ``blocks`` (seconds), or None when there are none."""
    values = sorted(b for b in blocks if b > 0)
    if not values:
        return None
    if len(values) < 4:
        return SharedCompute(statistics.median(values), values[0], values[-1], len(values), methods)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return SharedCompute(statistics.median(values), q1, q3, len(values), methods)


def window_blocks(rows: list[dict[str, Any]]) -> list[float]:
    """Per-step compute seconds of each evaluation window of a run's metrics rows (the rows
    hold cumulative ``compute_seconds`` and ``skipped_steps``); the first window, which holds
    the start-up's first steps, only when it is the run's only one."""
    evals = [r for r in rows if r.get("compute_seconds") is not None and r.get("step") is not None]
    out: list[float] = []
    prev_step, prev_s = 0, 0.0
    for r in evals:
        steps = r["step"] - prev_step
        if steps > 0:
            out.append((r["compute_seconds"] - prev_s) / steps)
        prev_step, prev_s = r["step"], r["compute_seconds"]
    return out[1:] if len(out) > 1 else out

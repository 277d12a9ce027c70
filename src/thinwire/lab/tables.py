"""Cells of the lab's tables: a figure over repeats, as its median and range."""

from __future__ import annotations

import math
import statistics


def spread(values: list[float], fmt: str = ".1f") -> str:
    """``median [min–max]`` of ``values`` (one value: itself; none: ``-``; ``∞``: a run that
    did not get there, in compare's times to the target)."""
    def one(x: float) -> str:
        return "∞" if x == math.inf else format(x, fmt)

    if not values:
        return "-"
    if len(values) == 1:
        return one(values[0])
    return f"{one(statistics.median(values))} [{one(min(values))}–{one(max(values))}]"

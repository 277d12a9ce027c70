"""Seconds a method spends outside the model's own computation, split as the cost model reads them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Timing:
    """Seconds spent, accumulated over calls (host clock)."""

    codec_seconds: float = 0.0  # encode, decode, error feedback, packing
    comm_seconds: float = 0.0  # inside collectives, waiting included

    @classmethod
    def total(cls, timings: Iterable[Timing]) -> Timing:
        """The sum of several timings (e.g. of every aggregator a reducer or hook built)."""
        out = cls()
        for t in timings:
            out.codec_seconds += t.codec_seconds
            out.comm_seconds += t.comm_seconds
        return out

    def __add__(self, other: Timing) -> Timing:
        return Timing(self.codec_seconds + other.codec_seconds, self.comm_seconds + other.comm_seconds)

"""The per-step figures a logger takes: one flat ``{tag: number}`` dict.

``Attached.scalars()``, ``HookState.scalars()`` and the Lightning strategy's ``scalars()``
give these, so a user's own ``SummaryWriter`` (or ``LightningModule.log_dict``) logs them in
one call::

    for tag, value in run.scalars().items():
        writer.add_scalar(tag, value, step)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from thinwire.comm.meter import ByteMeter
from thinwire.timing import Timing

PREFIX = "thinwire/"


def numeric(value: Any) -> float | None:
    """``value`` as a finite float when it is a number (bools as 0/1), else None: what a
    scalar logger can take."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def figures(meter: ByteMeter, timing: Timing, stats: Mapping[str, Any] | None = None,
            prefix: str = PREFIX) -> dict[str, float]:
    """Bytes and messages this rank sent, seconds in codecs and in collectives, and the
    method's own numeric figures (``stats``: DaSGD's delay, DiLoCo's outer steps, a codec's
    theta...), each under ``prefix``; non-numeric figures are left out."""
    out = {
        f"{prefix}bytes_sent": float(meter.bytes_sent),
        f"{prefix}messages": float(meter.messages),
        f"{prefix}codec_seconds": timing.codec_seconds,
        f"{prefix}comm_seconds": timing.comm_seconds,
    }
    for key, value in (stats or {}).items():
        v = numeric(value)
        if v is not None:
            out[f"{prefix}{key}"] = v
    return out

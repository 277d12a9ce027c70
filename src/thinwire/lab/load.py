"""How busy this machine is before a command times anything: one check for every command that
measures (``thinwire cost``, ``thinwire compare``, ``thinwire bench codecs``).

The 1-minute load average counts the processes running or waiting for a core. At or above the
number of cores, every core is already taken before the command starts a rank: its compute
and codec seconds (and every time built on them: predicted step times, modeled times to a
target) then stretch by however much the other work takes, and move from one run to the next.
"""

from __future__ import annotations

import os

HIGH_LOAD_PER_CORE = 1.0  # load average per core from which timings are called unreliable


def load1() -> float | None:
    """The 1-minute load average (``os.getloadavg()[0]``); None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def cores() -> int:
    return os.cpu_count() or 1


def high_load(load: float | None = None, ncores: int | None = None) -> float | None:
    """The 1-minute load average when it is at least :data:`HIGH_LOAD_PER_CORE` per core, else
    None. ``load`` and ``ncores`` default to this machine's."""
    load = load1() if load is None else load
    ncores = cores() if ncores is None else ncores
    return load if load is not None and load >= HIGH_LOAD_PER_CORE * ncores else None


def load_warning(command: str, load: float | None = None, ncores: int | None = None) -> str | None:
    """One line warning that ``command``'s timings are unreliable when the load is high at
    start (:func:`high_load`), else None."""
    ncores = cores() if ncores is None else ncores
    found = high_load(load, ncores)
    if found is None:
        return None
    return (f"warning: load average {found:.1f} on {ncores} cores at the start of {command}: other work holds the "
            "cores, so the measured compute and codec times (and every time built on them) vary from run to run")


def load_text() -> str:
    """``load average 0.52 0.58 0.59 on 2 cores`` (the 1, 5 and 15-minute averages), or ``""``."""
    try:
        averages = os.getloadavg()
    except (OSError, AttributeError):
        return ""
    return f"load average {' '.join(f'{x:.2f}' for x in averages)} on {cores()} cores"

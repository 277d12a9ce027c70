"""How runs are named on the terminal, in tables and on disk: from what the user typed.

A label is the user's own string (a method spec as typed, or a ``--policy`` file), never the
resolved spec with every knob filled in. :func:`labels` names the runs of a set (a race, a
benchmark): a method's name alone where no other run of the set has that name, else the spec
as typed, so two variants of one method stay apart by what the user wrote. :func:`short`
cuts a label longer than :data:`LABEL_WIDTH` in the middle with ``…`` (its start names the
method, its end usually holds the knob that differs); :func:`slug` makes a run folder name.
"""

from __future__ import annotations

import re

LABEL_WIDTH = 32  # characters: the longest label a table or progress bar shows whole
ELLIPSIS = "…"


def short(text: str, width: int = LABEL_WIDTH) -> str:
    """``text`` with its whitespace collapsed, cut in the middle with ``…`` to at most
    ``width`` characters (its start and its end kept; at least 2 characters)."""
    text = " ".join(text.split())
    width = max(2, width)
    if len(text) <= width:
        return text
    head = width // 2
    tail = width - 1 - head
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


def labels(specs: list[str], width: int = LABEL_WIDTH, *, alone: bool = True) -> list[str]:
    """One label per spec (as typed), each :func:`short`: the method's name where no other
    spec of ``specs`` names that method (unless ``alone`` is false), else the whole spec.
    Labels that would still coincide (two specs alike up to the part cut away) get their
    position appended: ``#2``."""
    names = [spec.strip().partition(":")[0] for spec in specs]
    out = [short(name if alone and names.count(name) == 1 else spec, width)
           for spec, name in zip(specs, names, strict=True)]
    alike = [i for i, text in enumerate(out) if out.count(text) > 1]
    for i in alike:
        out[i] = f"{short(out[i], width - 4)} #{i + 1}"
    return out


def slug(spec: str, width: int = 60) -> str:
    """A folder name for ``spec``: ``:`` becomes ``-``, every run of other characters than
    letters, digits and ``_.=-`` one ``_``; at most ``width`` characters, never starting or
    ending in a separator (``method`` when nothing is left)."""
    text = re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec.strip().replace(":", "-"))[:width]
    return text.strip("-_.=") or "method"

"""Reading back JSON that thinwire wrote (``latest.json``, ``meta.json``, ``summary.json``,
``metrics.jsonl``) with a size bound and a nesting bound.

A file thinwire reads back may have been damaged or replaced by anyone who can write the run
directory. Python's parser recurses once per nesting level, so ``[[[[...]]]]`` a few thousand
levels deep ends in a ``RecursionError`` (not a ``ValueError``), and a huge file is read
whole into memory. Here the file's size is checked before it is read and the text's nesting
before it is parsed; every failure is a :class:`JsonFileError` (a ``ValueError``) whose
message names the file and the rule, so a command can print one line.

The bounds are ours: thinwire's own files nest fewer than ten levels, and their size grows
with the model's parameter count (``summary.json``'s per-parameter table) and the run's
length (``metrics.jsonl``), far below :data:`MAX_BYTES`.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

MAX_DEPTH = 64  # nesting levels of arrays and objects
MAX_BYTES = 256 << 20  # one JSON document (or one metrics.jsonl line)
MAX_JSONL_BYTES = 1 << 30  # a whole metrics.jsonl (read a line at a time)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


class JsonFileError(ValueError):
    """A JSON file that cannot be used: unreadable, too large, too deep, or not JSON."""


def depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (brackets inside strings do not count)."""
    deepest = level = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        level += 1 if m.group() in "[{" else -1
        deepest = max(deepest, level)
    return deepest


def loads(text: str, what: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)`` after checking its nesting; ``what`` names the text in errors."""
    if len(text) > MAX_BYTES:
        raise JsonFileError(f"{what} is larger than {MAX_BYTES >> 20} MiB")
    if (d := depth(text)) > max_depth:
        raise JsonFileError(f"{what} nests {d} levels deep (at most {max_depth})")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise JsonFileError(f"{what} is not valid JSON ({str(e).splitlines()[0][:120]})") from None


def read(path: str | os.PathLike[str], *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON document in the file at ``path``, checked against both bounds."""
    text = _text(path, max_bytes)
    return loads(text, str(path), max_depth=max_depth)


def read_lines(path: str | os.PathLike[str], *, max_bytes: int = MAX_JSONL_BYTES,
               max_depth: int = MAX_DEPTH) -> list[Any]:
    """The documents of a JSON-lines file (blank lines skipped), read a line at a time, each
    line checked against both bounds (a line at most :data:`MAX_BYTES`) and the whole file
    against ``max_bytes``."""
    try:
        size = os.stat(path).st_size
        if size > max_bytes:
            raise JsonFileError(f"{path} is {size >> 20} MiB, larger than the {max_bytes >> 20} MiB thinwire reads")
        out = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(iter(lambda: f.readline(MAX_BYTES + 1), ""), 1):
                if len(line) > MAX_BYTES:
                    raise JsonFileError(f"{path} line {i} is longer than {MAX_BYTES >> 20} MiB")
                if line.strip():
                    out.append(loads(line, f"{path} line {i}", max_depth=max_depth))
        return out
    except OSError as e:
        raise JsonFileError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise JsonFileError(f"{path} is not UTF-8 text ({e.reason})") from None


def _text(path: str | os.PathLike[str], max_bytes: int) -> str:
    try:
        size = os.stat(path).st_size
        if size > max_bytes:
            raise JsonFileError(f"{path} is {size >> 20} MiB, larger than the {max_bytes >> 20} MiB thinwire reads")
        with open(path, encoding="utf-8") as f:
            return f.read(max_bytes + 1)
    except OSError as e:
        raise JsonFileError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise JsonFileError(f"{path} is not UTF-8 text ({e.reason})") from None

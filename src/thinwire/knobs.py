"""Typed knobs shared by codec configs and task options: fields, validation, value parsing."""

from __future__ import annotations

import math
import os
import types
import typing
from dataclasses import field
from typing import Any

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: a float knob ends up in float32 tensors


def knob(default: Any, help: str, allowed: str = "") -> Any:
    """A config field with its help text and allowed range (shown by ``thinwire methods``)."""
    return field(default=default, metadata={"help": help, "allowed": allowed})


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``: the message states the rule broken."""
    if not ok:
        raise ValueError(message)


def env_seconds(name: str, default: float) -> float:
    """Seconds from the environment variable ``name`` (a number > 0), or ``default`` where it
    is not set; ``ValueError`` names the variable and the rule."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a number of seconds > 0, got {text!r}")
    return value


def convert(value: Any, typ: Any, what: str) -> Any:
    """Parse ``value`` (a string from a spec or the CLI, or an already typed value) into the
    annotated type ``typ``; ``ValueError`` names ``what`` and the rule."""
    origin = typing.get_origin(typ)
    if origin is typing.Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ValueError(f"{what} must be one of {'|'.join(map(str, choices))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(kinds) < len(typing.get_args(typ)) and (
                value is None or (isinstance(value, str) and value.lower() in ("none", "null", ""))):
            return None
        if len(kinds) == 1:
            return convert(value, kinds[0], what)
        for kind in kinds:  # the first that takes it (an integer, or the word auto)
            try:
                return convert(value, kind, what)
            except ValueError:
                pass
        names = ["an integer" if k is int else "a number" if k is float else
                 " or ".join(map(str, typing.get_args(k))) if typing.get_origin(k) is typing.Literal else str(k)
                 for k in kinds]
        raise ValueError(f"{what} must be {' or '.join(names)}, got {value!r}")
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{what} must be true or false, got {value!r}")
    if typ in (int, float):
        if isinstance(value, bool):
            raise ValueError(f"{what} must be a number, got {value!r}")
        try:
            number = float(value) if typ is float else int(str(value), 10)
        except (ValueError, OverflowError):
            raise ValueError(f"{what} must be {'an integer' if typ is int else 'a number'}, got {value!r}") from None
        if typ is float:
            require(math.isfinite(number), f"{what} must be a finite number, got {value!r}")
            require(abs(number) <= FLOAT32_MAX,
                    f"{what} must be within float32's range (|x| <= {FLOAT32_MAX:.4g}): the value is "
                    f"used in float32 tensors, got {value!r}")
        return number
    return str(value)


def describe_config(name: str, config: Any) -> str:
    """``name:key=value,...`` with every field of the config dataclass (booleans lower-case)."""
    import dataclasses

    show = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
    return f"{name}:" + ",".join(f"{k}={show(v)}" for k, v in dataclasses.asdict(config).items())


def read_user_file(path: str | os.PathLike[str], what: str) -> str:
    """The text of a file the user named; ``ValueError`` ("cannot read WHAT PATH: reason")
    instead of an OSError, so the CLI can print one line."""
    from pathlib import Path

    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror or e}") from None

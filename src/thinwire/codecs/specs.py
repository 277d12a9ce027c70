"""Name -> codec class, and parsing of specs ``name[:key=value,...]`` into validated configs."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar

from thinwire.codecs.base import Codec
from thinwire.knobs import convert
from thinwire.registry import Entry, Registry

C = TypeVar("C", bound=type[Codec])


def _listing(entry: Entry[type[Codec]]) -> tuple[int, str]:
    module = entry.value.__module__.rpartition(".")[2]
    return _ORDER.get(module, 99), module


# the built-in codecs: every module of this package registers its own with @register
CODECS: Registry[type[Codec]] = Registry("codec", builtins=("thinwire.codecs",), order=_listing)


def register(cls: C) -> C:
    """Class decorator: make a codec available by ``cls.name`` (its ``Config`` and
    ``summary`` go with it). A codec from outside this package (a user's module) registers
    after the built-in ones, so it is listed after them and cannot take a built-in name."""
    return CODECS.register(cls)


def available() -> dict[str, type[Codec]]:
    """Registered codecs by name (in registration order)."""
    return {e.name: e.value for e in CODECS.entries()}


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"topk:ratio=0.01,ef=false"`` into ``("topk", {"ratio": "0.01", "ef": "false"})``."""
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"empty method name in spec {spec!r}; expected name[:key=value,...]")
    knobs: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"bad knob {item!r} in spec {spec!r}; expected key=value")
        if key.strip() in knobs:
            raise ValueError(f"knob {key.strip()!r} given twice in spec {spec!r}")
        knobs[key.strip()] = value.strip()
    return name, knobs


def build_config(config_cls: type, knobs: dict[str, str], owner: str) -> Any:
    """Convert string knobs to the config's field types and construct (which validates)."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(knobs) - set(fields))
    if unknown:
        raise ValueError(f"unknown knob {unknown[0]!r} for {owner}; knobs: {', '.join(fields)}")
    hints = typing.get_type_hints(config_cls)
    values = {k: convert(v, hints[k], f"{owner}: {k}") for k, v in knobs.items()}
    return config_cls(**values)


def build_codec(spec: str) -> Codec:
    """Build a codec from a spec such as ``topk:ratio=0.01,ef=false``; errors name the rule."""
    name, knobs = parse_spec(spec)
    cls = CODECS[name]
    return cls(build_config(cls.Config, knobs, name))


def knob_table(config_cls: type) -> list[tuple[str, str, str, str]]:
    """(knob, default, allowed, help) rows for ``thinwire methods``."""
    rows = []
    for f in dataclasses.fields(config_cls):
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        rows.append((f.name, _show(default), f.metadata.get("allowed", ""), f.metadata.get("help", "")))
    return rows


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# Listing order for `thinwire methods` (whatever module a program imported first): baselines first, then
# the range-float quantizer, then the rest alphabetically.
_ORDER = {"identity": 0, "cast": 1, "topk": 2, "randomk": 3, "qsgd": 4, "sign": 5, "terngrad": 6, "powersgd": 7,
          "rangefloat": 8}

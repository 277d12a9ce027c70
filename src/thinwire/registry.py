"""Names to things: the one registry type behind codecs, methods, presets, tasks and topologies.

Every entry has a name, the thing it names (a class or a builder), the frozen dataclass of
its knobs (``Config``; :class:`NoKnobs` for none) and a one-line summary. ``thinwire
methods`` and the documentation tables are generated from the entries.

A registry may be filled lazily: ``load`` runs once, under a lock, before the first lookup
(ranks simulated on threads may ask at the same time), and imports the modules whose
entries register themselves. An entry added from outside (a user's module) waits for the
built-in ones, so it is listed after them and cannot take a built-in name.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast


class _Named(Protocol):
    """What :meth:`Registry.register` takes: anything (a class) with a ``name``."""

    @property
    def name(self) -> str: ...


T = TypeVar("T")
V = TypeVar("V", bound=_Named)


@dataclass(frozen=True, kw_only=True)
class NoKnobs:
    """The config of an entry without knobs."""


@dataclass(frozen=True)
class Entry(Generic[T]):
    name: str
    value: T
    Config: type
    summary: str


class Registry(Generic[T]):
    """``kind`` names what is registered, in errors (``unknown codec 'x'; available: ...``).

    ``taken(name)``, when given, says what else in the package already answers to ``name``
    (a codec, for a method of that name), or None: an entry from outside the package may not
    shadow it. Two locks: one held while ``load`` imports modules, one only while the entries
    change, so a built-in module that registers while another thread loads never waits for
    that load (which may be waiting to import the same module)."""

    def __init__(self, kind: str, load: Callable[[], None] | None = None, package: str = "",
                 taken: Callable[[str], str | None] | None = None,
                 order: Callable[[Entry[T]], Any] | None = None) -> None:
        self.kind = kind
        self.package = package  # classes defined under it are built-in: they never wait for ``load``
        self.taken = taken
        # the built-in entries' listing order after ``load`` (stable: ties keep registration order),
        # so that it does not depend on which module a program happened to import first
        self._order = order
        self._builtin: set[str] = set()
        self._entries: dict[str, Entry[T]] = {}
        self._load = load
        self._state = "empty" if load is not None else "loaded"  # empty -> loading -> loaded
        self._load_lock = threading.RLock()
        self._entries_lock = threading.Lock()

    def add(self, name: str, value: T, *, Config: type = NoKnobs, summary: str = "",  # noqa: N803
            builtin: bool = False) -> T:
        """Register ``value`` under ``name``; a name registered twice, or one that another
        registry of the package answers to (``taken``), raises ``ValueError``."""
        if not builtin:
            self._ensure_loaded()  # a user's entry comes after the built-in ones
            other = self.taken(name) if self.taken is not None else None
            if other is not None:
                raise ValueError(f"{self.kind} {name!r} registered twice: {name!r} is already {other}")
        with self._entries_lock:
            if name in self._entries:
                if self._entries[name].value is value:
                    return value  # the same thing again (a load tried again after a failure)
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = Entry(name, value, Config, summary)
            if builtin:
                self._builtin.add(name)
        return value

    def register(self, value: V) -> V:
        """Class decorator: register a class by its ``name``, ``Config`` and ``summary``."""
        module = getattr(value, "__module__", "")
        builtin = bool(self.package) and (module == self.package or module.startswith(self.package + "."))
        # a V is the registry's T (a type variable cannot be bounded by another one)
        self.add(value.name, cast(T, value), Config=getattr(value, "Config", NoKnobs),
                 summary=getattr(value, "summary", ""), builtin=builtin)
        return value

    def remove(self, name: str) -> None:
        """Forget ``name`` (a test's or a user's own entry)."""
        with self._entries_lock:
            self._entries.pop(name, None)

    def entry(self, name: str) -> Entry[T]:
        """The entry called ``name``; an unknown name raises ``ValueError`` listing the choices."""
        self._ensure_loaded()
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {', '.join(self._entries)}")
        return self._entries[name]

    def __getitem__(self, name: str) -> T:
        return self.entry(name).value

    def __contains__(self, name: object) -> bool:
        self._ensure_loaded()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        self._ensure_loaded()
        return iter(list(self._entries))

    def __len__(self) -> int:
        self._ensure_loaded()
        return len(self._entries)

    def names(self) -> list[str]:
        """Every name, in registration order."""
        return list(self)

    def entries(self) -> list[Entry[T]]:
        self._ensure_loaded()
        return list(self._entries.values())

    def _ensure_loaded(self) -> None:
        """Run ``load`` once; after a load that fails, the next lookup tries again (what the
        failed one registered stays: registering the same thing again is no error)."""
        if self._state == "loaded":
            return
        with self._load_lock:
            if self._state != "empty":  # loaded meanwhile, or this thread is loading
                return
            self._state = "loading"
            try:
                assert self._load is not None
                self._load()
            except BaseException:
                self._state = "empty"
                raise
            if self._order is not None:
                with self._entries_lock:
                    order = self._order
                    built = sorted((e for e in self._entries.values() if e.name in self._builtin), key=order)
                    rest = [e for e in self._entries.values() if e.name not in self._builtin]
                    self._entries = {e.name: e for e in [*built, *rest]}
            self._state = "loaded"

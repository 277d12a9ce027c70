"""Names to things: the one registry type behind codecs, methods, presets, tasks and topologies.

Every entry has a name, the thing it names (a class or a builder function), the frozen
dataclass of its knobs (``Config``; :class:`NoKnobs` for none) and a one-line summary.
``thinwire methods`` and the documentation tables are generated from the entries.

One way to register, for every registry: the decorator :meth:`Registry.register` on the class
(name, ``Config`` and ``summary`` read from it) or on the builder function (given as
keywords). The built-in entries are found one way too: a registry names the modules and
packages that hold them (``builtins``), and the first lookup imports them all, under a lock
(ranks simulated on threads may ask at the same time), so their decorators run. An entry
registered from outside (a user's module) waits for the built-in ones, so it is listed after
them and cannot take a built-in name.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast, overload


class _Named(Protocol):
    """What :meth:`Registry.register` takes: anything (a class) with a ``name``."""

    @property
    def name(self) -> str: ...


T = TypeVar("T")
V = TypeVar("V", bound=_Named)
U = TypeVar("U")


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

    def __init__(self, kind: str, *, builtins: tuple[str, ...] = (), load: Callable[[], None] | None = None,
                 taken: Callable[[str], str | None] | None = None,
                 order: Callable[[Entry[T]], Any] | None = None,
                 check: Callable[[Any], None] | None = None) -> None:
        self.kind = kind
        # modules and packages whose entries are built in: imported on the first lookup, and an
        # entry defined under one of them never waits for that (it is being imported)
        self.builtins = builtins
        self.taken = taken
        self.check = check  # raises naming what a value lacks, before it is registered
        # the built-in entries' listing order after loading (stable: ties keep registration order),
        # so that it does not depend on which module a program happened to import first
        self._order = order
        self._builtin: set[str] = set()
        self._entries: dict[str, Entry[T]] = {}
        self._load = load if load is not None else (self._import_builtins if builtins else None)
        self._state = "empty" if self._load is not None else "loaded"  # empty -> loading -> loaded
        self._load_lock = threading.RLock()
        self._entries_lock = threading.Lock()

    def _import_builtins(self) -> None:
        """Import every module of :attr:`builtins` (a package: each of its modules, by name)."""
        for name in self.builtins:
            module = importlib.import_module(name)
            for info in sorted(pkgutil.iter_modules(getattr(module, "__path__", [])), key=lambda m: m.name):
                importlib.import_module(f"{name}.{info.name}")

    def _is_builtin(self, value: object) -> bool:
        module = getattr(value, "__module__", "") or ""
        return any(module == b or module.startswith(b + ".") for b in self.builtins)

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

    @overload
    def register(self, value: V, /) -> V: ...

    @overload
    def register(self, value: None = None, /, *, name: str | None = None, Config: type | None = None,  # noqa: N803
                 summary: str | None = None) -> Callable[[U], U]: ...

    def register(self, value: Any = None, /, *, name: str | None = None, Config: type | None = None,  # noqa: N803
                 summary: str | None = None) -> Any:
        """Decorator: ``@REG.register`` on a class registers it by its ``name``, ``Config`` and
        ``summary``; ``@REG.register(name=..., Config=..., summary=...)`` on a class or a
        builder function gives them as keywords (a function's name defaults to its own).
        Returns what it decorates, unchanged."""
        if value is None:
            return lambda v: self._register(v, name, Config, summary)
        return self._register(value, name, Config, summary)

    def _register(self, value: Any, name: str | None, Config: type | None, summary: str | None) -> Any:  # noqa: N803
        if self.check is not None:
            self.check(value)
        key = name if name is not None else getattr(value, "name", None) or value.__name__
        self.add(key, cast(T, value), Config=Config if Config is not None else getattr(value, "Config", NoKnobs),
                 summary=summary if summary is not None else getattr(value, "summary", ""),
                 builtin=self._is_builtin(value))
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

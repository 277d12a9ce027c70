"""The one registry type: lookups, errors, lazy loading, listing order; and every registry of
the package is one, with a knob dataclass and a summary per entry."""

from __future__ import annotations

import dataclasses
import inspect
import threading

import pytest

from thinwire.algorithms.base import Method
from thinwire.algorithms.registry import METHODS
from thinwire.codecs.base import Codec
from thinwire.codecs.registry import CODECS
from thinwire.policy import PRESETS
from thinwire.registry import NoKnobs, Registry
from thinwire.tasks import TASKS
from thinwire.tasks.base import Task
from thinwire.topology import TOPOLOGIES


def _loading(calls: list[int], names: tuple[str, ...] = ("a", "b")) -> Registry[int]:
    def load() -> None:
        calls.append(1)
        for i, name in enumerate(names):
            reg.add(name, i)

    reg: Registry[int] = Registry("thing", load=load)
    return reg


def test_lookup_and_errors_name_the_rule():
    reg = _loading([])
    assert reg["b"] == 1 and reg.entry("a").Config is NoKnobs and "a" in reg and "z" not in reg
    with pytest.raises(ValueError, match=r"^unknown thing 'z'; available: a, b$"):
        reg["z"]
    with pytest.raises(ValueError, match=r"^thing 'a' registered twice$"):
        reg.add("a", 5)


def test_load_runs_once_before_the_first_lookup_and_outside_entries_come_after_it():
    calls: list[int] = []
    reg = _loading(calls)
    reg.add("mine", 9)  # a user's entry: waits for the built-in ones
    assert calls == [1] and reg.names() == ["a", "b", "mine"]
    assert len(reg) == 3 and calls == [1]


def test_concurrent_first_lookups_load_once():
    calls: list[int] = []
    gate = threading.Event()

    def slow_load() -> None:
        gate.wait(5)
        calls.append(1)
        reg.add("a", 0)

    reg: Registry[int] = Registry("thing", load=slow_load)
    seen: list[list[str]] = []
    threads = [threading.Thread(target=lambda: seen.append(reg.names())) for _ in range(4)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert calls == [1] and seen == [["a"]] * 4


def test_a_failed_load_is_tried_again():
    tries: list[int] = []

    def load() -> None:
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("first try fails")
        reg.add("a", 0)

    reg: Registry[int] = Registry("thing", load=load)
    with pytest.raises(RuntimeError):
        reg.names()
    assert reg.names() == ["a"] and len(tries) == 2


@pytest.mark.parametrize("registry, kind", [(CODECS, Codec), (METHODS, Method), (TASKS, Task)],
                         ids=["codecs", "methods", "tasks"])
def test_every_entry_is_a_class_of_its_kind_with_its_config_and_summary(registry, kind):
    for entry in registry.entries():
        assert issubclass(entry.value, kind) and entry.value.name == entry.name
        assert dataclasses.is_dataclass(entry.Config) and entry.Config is entry.value.Config, entry.name
        assert entry.summary and entry.summary == entry.value.summary, entry.name


def test_methods_implement_the_whole_contract():
    for entry in METHODS.entries():
        assert not inspect.isabstract(entry.value), f"{entry.name} leaves {entry.value.__abstractmethods__} abstract"


def test_presets_and_topologies_are_registries_too():
    for registry in (PRESETS, TOPOLOGIES):
        assert isinstance(registry, Registry) and registry.names()
        for entry in registry.entries():
            assert dataclasses.is_dataclass(entry.Config) and entry.summary and callable(entry.value)
    assert TOPOLOGIES["ring"](4).n == 4

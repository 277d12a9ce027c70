"""The one registry type: lookups, errors, lazy loading, listing order; and every registry of
the package is one, with a knob dataclass and a summary per entry."""

from __future__ import annotations

import dataclasses
import inspect
import threading

import pytest

from thinwire.algorithms.base import Method
from thinwire.algorithms.methods import METHODS
from thinwire.codecs.base import Codec
from thinwire.codecs.specs import CODECS
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


def test_a_failed_load_is_tried_again_and_keeps_what_it_registered():
    tries: list[int] = []
    a, b = object(), object()

    def load() -> None:
        tries.append(1)
        reg.add("a", a)  # registered again on the second try: the same object is no error
        if len(tries) == 1:
            raise RuntimeError("first try fails after registering a")
        reg.add("b", b)

    reg: Registry[object] = Registry("thing", load=load)
    with pytest.raises(RuntimeError, match="first try fails"):
        reg.names()
    assert reg.names() == ["a", "b"] and len(tries) == 2
    with pytest.raises(ValueError, match="thing 'a' registered twice"):
        reg.add("a", object())  # another object under a taken name


def test_an_outside_entry_may_not_shadow_another_registry_of_the_package():
    reg: Registry[int] = Registry("method", taken=lambda name: "a codec" if name == "topk" else None)
    with pytest.raises(ValueError, match=r"^method 'topk' registered twice: 'topk' is already a codec$"):
        reg.add("topk", 1)
    reg.add("mine", 2)
    assert reg.names() == ["mine"]


def test_a_built_in_module_registering_during_another_threads_load_does_not_wait_for_it():
    """The loader imports a module that another thread is importing: that thread's built-in
    registration must go through while the load holds its lock (else both wait forever)."""
    registered = threading.Event()

    def load() -> None:
        other = threading.Thread(target=lambda: (reg.add("builtin", 1, builtin=True), registered.set()))
        other.start()
        assert registered.wait(10), "a built-in registration waited for the load"
        other.join()

    reg: Registry[int] = Registry("thing", load=load)
    assert reg.names() == ["builtin"]


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


def test_a_codec_named_like_a_method_is_refused_where_it_would_be_ambiguous():
    from thinwire.algorithms.methods import kind_of
    from thinwire.codecs.identity import Identity

    class Shadow(Identity):
        name = "localsgd"
        summary = "an identity named like a method"

    CODECS.register(Shadow)
    try:
        with pytest.raises(ValueError, match=r"^'localsgd' names both a method and a codec: register one of them"):
            kind_of("localsgd")
    finally:
        CODECS.remove("localsgd")
    assert kind_of("localsgd") == "method"


def test_a_task_that_names_its_knobs_options_still_works():
    from thinwire.tasks.synthetic import Synthetic, SyntheticOptions

    class Older(Synthetic):
        name = "older"
        Options = SyntheticOptions

    assert Older.Config is SyntheticOptions and Older(seed=0, dim=8).options.dim == 8


@pytest.mark.spawns
def test_the_codec_listing_does_not_depend_on_which_codec_module_was_imported_first():
    import subprocess
    import sys

    code = ("import {first}\nfrom thinwire.codecs.specs import available\nprint(','.join(available()))")
    plain, early = (subprocess.run([sys.executable, "-c", code.format(first=m)], capture_output=True, text=True,
                                   check=True).stdout for m in ("thinwire", "thinwire.codecs.dct"))
    assert plain == early and plain.startswith("identity,")


REGISTRIES = {"codecs": CODECS, "methods": METHODS, "presets": PRESETS, "tasks": TASKS, "topologies": TOPOLOGIES}


@pytest.mark.parametrize("name", list(REGISTRIES))
def test_every_built_in_entry_comes_from_the_modules_its_registry_imports(name):
    """One way in: each registry names the modules and packages that hold its built-in entries
    (imported on the first lookup); every built-in entry is defined there."""
    registry = REGISTRIES[name]
    assert registry.builtins and all(b.startswith("thinwire.") for b in registry.builtins)
    for entry in registry.entries():
        module = entry.value.__module__
        assert any(module == b or module.startswith(b + ".") for b in registry.builtins), (entry.name, module)


def test_the_decorator_registers_a_class_by_its_attributes_and_a_function_by_keywords():
    reg: Registry[object] = Registry("thing")

    @dataclasses.dataclass(frozen=True)
    class Knobs:
        size: int = 1

    @reg.register
    class Thing:
        name, summary, Config = "thing-a", "a class", Knobs

    @reg.register(summary="a builder")
    def thing_b(n: int) -> int:
        return n

    @reg.register(name="thing-c", Config=Knobs, summary="a named builder")
    def build(n: int) -> int:
        return 2 * n

    assert reg.names() == ["thing-a", "thing_b", "thing-c"]
    assert reg.entry("thing-a").Config is Knobs and reg.entry("thing-a").summary == "a class"
    assert reg["thing_b"] is thing_b and reg.entry("thing_b").Config is NoKnobs and reg["thing-c"](3) == 6
    assert Thing.name == "thing-a"  # the decorator returns what it decorates


def test_a_check_refuses_before_registering():
    def check(value: object) -> None:
        if not getattr(value, "ok", False):
            raise ValueError(f"{value!r} is not ok")

    reg: Registry[object] = Registry("thing", check=check)

    class Bad:
        name = "bad"

    with pytest.raises(ValueError, match="is not ok"):
        reg.register(Bad)
    assert "bad" not in reg

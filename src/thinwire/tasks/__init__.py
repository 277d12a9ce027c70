"""Bundled training tasks: data, model, loss and evaluation, by name.

``get("mnist1d")(seed=0)`` builds a task; see :class:`thinwire.tasks.base.Task` for the
contract every task keeps (deterministic models, disjoint per-rank shards, fixed test set).
"""

from __future__ import annotations

from typing import Any

from thinwire.registry import Registry
from thinwire.tasks.base import Task, TaskDefaults, TaskError
from thinwire.tasks.charlm import CharLM
from thinwire.tasks.cifar10 import CIFAR10
from thinwire.tasks.mnist1d import MNIST1D
from thinwire.tasks.synthetic import Synthetic
from thinwire.tasks.text import Text

__all__ = ["TASKS", "Task", "TaskDefaults", "TaskError", "available", "get", "register"]

TASKS: Registry[type[Task]] = Registry("task")


METRICS = ("accuracy", "bpc")  # what a task's report leads with (Task.metric)


def register(cls: type[Task]) -> type[Task]:
    """Make a task available by ``cls.name`` (also usable as a class decorator). A class that
    lacks a part of the :class:`Task` contract is refused here, naming the part, so a task of
    the user's own (``--import FILE.py``) fails at its import in one line, not in a rank."""
    check_task_class(cls)
    return TASKS.register(cls)


def check_task_class(cls: Any) -> None:
    """Raise :class:`TaskError` naming the first missing or malformed part of a task class."""
    import dataclasses
    import inspect

    what = getattr(cls, "__name__", repr(cls))
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise TaskError(f"{what} is not a thinwire.tasks.Task subclass")
    name = getattr(cls, "name", None)
    if not (isinstance(name, str) and name):
        raise TaskError(f"task class {what} needs a name (a class attribute: name = 'mytask')")
    if not isinstance(getattr(cls, "defaults", None), TaskDefaults):
        raise TaskError(f"task {name} needs defaults = TaskDefaults(steps=..., batch_size=..., lr=..., ...)")
    if getattr(cls, "metric", None) not in METRICS:
        raise TaskError(f"task {name} needs metric, one of {', '.join(METRICS)} (the figure its report leads with), "
                        f"got {getattr(cls, 'metric', None)!r}")
    config = getattr(cls, "Config", None) or cls.__dict__.get("Options")
    if not (isinstance(config, type) and dataclasses.is_dataclass(config)):
        raise TaskError(f"task {name} needs Config, a dataclass of its options (an empty one when it has none)")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise TaskError(f"task {name} does not define {missing}")


for _cls in (MNIST1D, CharLM, Text, CIFAR10, Synthetic):
    register(_cls)


def available() -> dict[str, type[Task]]:
    """Registered tasks by name, in listing order."""
    return {e.name: e.value for e in TASKS.entries()}


def get(name: str) -> type[Task]:
    """The task class called ``name``; an unknown name raises TaskError listing the choices."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    return TASKS[name]

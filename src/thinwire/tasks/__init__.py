"""Bundled training tasks: data, model, loss and evaluation, by name.

``get("mnist1d")(seed=0)`` builds a task; see :class:`thinwire.tasks.base.Task` for the
contract every task keeps (deterministic models, disjoint per-rank shards, fixed test set).
"""

from __future__ import annotations

from thinwire.tasks.base import Task, TaskDefaults, TaskError
from thinwire.tasks.charlm import CharLM
from thinwire.tasks.cifar10 import CIFAR10
from thinwire.tasks.mnist1d import MNIST1D
from thinwire.tasks.synthetic import Synthetic

__all__ = ["Task", "TaskDefaults", "TaskError", "available", "get", "register"]

_TASKS: dict[str, type[Task]] = {}


def register(cls: type[Task]) -> type[Task]:
    """Make a task available by ``cls.name`` (also usable as a class decorator)."""
    if cls.name in _TASKS:
        raise ValueError(f"task {cls.name!r} registered twice")
    _TASKS[cls.name] = cls
    return cls


for _cls in (MNIST1D, CharLM, CIFAR10, Synthetic):
    register(_cls)


def available() -> dict[str, type[Task]]:
    """Registered tasks by name, in listing order."""
    return dict(_TASKS)


def get(name: str) -> type[Task]:
    """The task class called ``name``; an unknown name raises TaskError listing the choices."""
    if name not in _TASKS:
        raise TaskError(f"unknown task {name!r}; available: {', '.join(_TASKS)}")
    return _TASKS[name]

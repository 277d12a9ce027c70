"""Bundled training tasks: data, model, loss and evaluation, by name.

``get("mnist1d")(seed=0)`` builds a task; see :class:`thinwire.tasks.base.Task` for the
contract every task keeps (deterministic models, disjoint per-rank shards, fixed test set).
"""

from __future__ import annotations

from thinwire.registry import Registry
from thinwire.tasks.base import Task, TaskDefaults, TaskError
from thinwire.tasks.charlm import CharLM
from thinwire.tasks.cifar10 import CIFAR10
from thinwire.tasks.mnist1d import MNIST1D
from thinwire.tasks.synthetic import Synthetic

__all__ = ["TASKS", "Task", "TaskDefaults", "TaskError", "available", "get", "register"]

TASKS: Registry[type[Task]] = Registry("task")


def register(cls: type[Task]) -> type[Task]:
    """Make a task available by ``cls.name`` (also usable as a class decorator)."""
    return TASKS.register(cls)


for _cls in (MNIST1D, CharLM, CIFAR10, Synthetic):
    register(_cls)


def available() -> dict[str, type[Task]]:
    """Registered tasks by name, in listing order."""
    return {e.name: e.value for e in TASKS.entries()}


def get(name: str) -> type[Task]:
    """The task class called ``name``; an unknown name raises TaskError listing the choices."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    return TASKS[name]

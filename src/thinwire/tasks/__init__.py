"""Bundled training tasks: data, model, loss and evaluation, by name.

``get("mnist1d")(seed=0)`` builds a task; see :class:`thinwire.tasks.base.Task` for the
contract every task keeps (deterministic models, disjoint per-rank shards, fixed test set).
"""

from __future__ import annotations

from thinwire.tasks.base import TASKS, Task, TaskDefaults, TaskError, register

__all__ = ["TASKS", "Task", "TaskDefaults", "TaskError", "available", "get", "register"]


def available() -> dict[str, type[Task]]:
    """Registered tasks by name, in listing order."""
    return {e.name: e.value for e in TASKS.entries()}


def get(name: str) -> type[Task]:
    """The task class called ``name``; an unknown name raises TaskError listing the choices."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; available: {', '.join(TASKS)}")
    return TASKS[name]

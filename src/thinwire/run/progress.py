"""Progress on the terminal (rank 0's view): two lines per run.

The first line holds the label, the bar, the steps done, the time elapsed and the time left
(``eta 0:01:02``); the second the latest training loss and evaluation. The label is the
user's own spec (:mod:`thinwire.run.labels`), cut to what the line leaves free, so nothing
wraps or splits a word however narrow the terminal (80 columns and up).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text

from thinwire.run.config import TrainConfig
from thinwire.run.labels import short

WIDE = 120  # columns from which the bar is drawn long


class EtaColumn(TimeRemainingColumn):
    """The estimated time left, labelled: ``eta 0:01:02``."""

    def render(self, task: Task) -> Text:
        return Text("eta ", style="progress.remaining").append_text(super().render(task))


class _TwoLines(Progress):
    """The bar's line, then each task's ``fields["stats"]`` on a line of its own."""

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            yield Text("  " + task.fields.get("stats", ""), no_wrap=True, overflow="ellipsis")


def bar_label(cfg: TrainConfig, width: int) -> str:
    """``task spec xN`` in at most ``width`` columns, the spec (as typed) cut first."""
    spec = cfg.label or cfg.method
    fixed = len(cfg.task) + len(f" x{cfg.workers}") + 1
    return f"{cfg.task} {short(spec, max(8, width - fixed))} x{cfg.workers}"


class ProgressView:
    """``handle(kind, **fields)`` takes the trainer's reports: ``step`` and ``eval``."""

    def __init__(self, cfg: TrainConfig, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        steps = cfg.steps or 0
        bar = 30 if self.console.width >= WIDE else 10
        counts = 2 * len(str(steps)) + 1
        # the columns beside the label: bar, M/N, elapsed (7), eta (11), the gaps between five columns
        free = self.console.width - (bar + counts + 7 + 11 + 4)
        self.progress = _TwoLines(
            TextColumn("[bold]{task.description}", markup=True,
                       table_column=Column(no_wrap=True, overflow="ellipsis")),
            BarColumn(bar_width=bar),
            MofNCompleteColumn(table_column=Column(no_wrap=True)),
            TimeElapsedColumn(table_column=Column(no_wrap=True)),
            EtaColumn(table_column=Column(no_wrap=True)),
            console=self.console,
            transient=False,
        )
        self.loss = self.metric = ""
        self.task_id = self.progress.add_task(escape(bar_label(cfg, min(free, 60))), total=cfg.steps,
                                              stats="train loss -")

    def start(self) -> None:
        self.progress.start()

    def stop(self) -> None:
        self.progress.stop()

    def handle(self, kind: str, **fields: Any) -> None:
        if kind == "step":
            self.loss = f"{fields['loss']:.4f}"
            self.progress.update(self.task_id, completed=fields["step"], stats=self._stats())
        elif kind == "eval":
            self.metric = _metric_text(fields)
            self.progress.update(self.task_id, completed=fields["step"], stats=self._stats())
            if not self.console.is_terminal:  # logs get one line per evaluation
                self.console.print(f"step {fields['step']}: train loss {fields['train_loss']:.4f} {self.metric}",
                                   markup=False)

    def _stats(self) -> str:
        return "  ".join(x for x in (f"train loss {self.loss or '-'}", self.metric) if x)


def _metric_text(fields: dict[str, Any]) -> str:
    parts = []
    if fields.get("test_accuracy") is not None:
        parts.append(f"test acc {fields['test_accuracy']:.3f}")
    if fields.get("test_bpc") is not None:
        parts.append(f"test bpc {fields['test_bpc']:.3f}")
    if fields.get("test_loss") is not None and not parts:
        parts.append(f"test loss {fields['test_loss']:.4f}")
    return " ".join(parts)

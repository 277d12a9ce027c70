"""Progress on the terminal: a bar with loss and the latest evaluation (rank 0's view)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from thinwire.run.config import TrainConfig


class ProgressView:
    """``handle(kind, **fields)`` takes the trainer's reports: ``step`` and ``eval``."""

    def __init__(self, cfg: TrainConfig, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[metric]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.task_id = self.progress.add_task(
            f"{cfg.task} {cfg.method.split(':')[0]} x{cfg.workers}", total=cfg.steps, loss="-", metric=""
        )

    def start(self) -> None:
        self.progress.start()

    def stop(self) -> None:
        self.progress.stop()

    def handle(self, kind: str, **fields: Any) -> None:
        if kind == "step":
            self.progress.update(self.task_id, completed=fields["step"], loss=f"{fields['loss']:.4f}")
        elif kind == "eval":
            metric = _metric_text(fields)
            self.progress.update(self.task_id, completed=fields["step"], metric=metric)
            if not self.console.is_terminal:  # logs get one line per evaluation
                self.console.print(f"step {fields['step']}: train loss {fields['train_loss']:.4f} {metric}")


def _metric_text(fields: dict[str, Any]) -> str:
    parts = []
    if fields.get("test_accuracy") is not None:
        parts.append(f"test acc {fields['test_accuracy']:.3f}")
    if fields.get("test_bpc") is not None:
        parts.append(f"test bpc {fields['test_bpc']:.3f}")
    if fields.get("test_loss") is not None and not parts:
        parts.append(f"test loss {fields['test_loss']:.4f}")
    return " ".join(parts)

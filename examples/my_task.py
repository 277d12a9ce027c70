"""A task of your own for `thinwire train`, `compare` and `cost`: your model, your data.

This file is a complete task called `spirals`: points on three interleaved spiral arms, to
be told apart by a small MLP. The points are generated here (the same on every run, nothing
to download), or read from a CSV file of your own with `--option csv=FILE`. Copy the file,
rename the task and change the model and the data; docs/your_own_task.md explains the rules.

    thinwire train   --import examples/my_task.py --task spirals --out runs/spirals
    thinwire compare --import examples/my_task.py --task spirals --methods identity,topk,powersgd --out race
    thinwire cost    --import examples/my_task.py --task spirals --workers 2 --methods identity,topk
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from thinwire.tasks import Task, TaskDefaults, TaskError, register
from thinwire.tasks.base import index_batches


@dataclass(frozen=True, kw_only=True)
class SpiralsOptions:
    """The task's knobs, set with `--option key=value` (the text is converted to these types).
    A value refused here stops the command with one line and exit code 2."""

    csv: str = ""  # a CSV file: feature columns, then an integer class label per row; "" = generated spirals
    samples: int = 3000  # generated points; every fifth one is a test point
    noise: float = 0.3  # how far generated points stray from their arm; higher is harder
    hidden: int = 64  # width of the MLP's two hidden layers

    def __post_init__(self) -> None:
        if self.samples < 10 or self.hidden < 1 or self.noise < 0:
            raise ValueError(f"need samples >= 10, hidden >= 1 and noise >= 0, got {self.samples}, "
                             f"{self.hidden} and {self.noise}")


@register  # once this file is imported (--import), --task spirals names this class
class Spirals(Task):
    name = "spirals"
    summary = "points on three spiral arms (or a CSV file of your own), a 2-hidden-layer MLP"
    metric = "accuracy"  # reports lead with test accuracy, higher is better
    Config = SpiralsOptions
    # what a run uses unless told otherwise; batch_size is per worker (2 workers: 64 points a step)
    defaults = TaskDefaults(steps=300, batch_size=32, lr=3e-3, optimizer="adam", eval_every=50)
    options: SpiralsOptions

    def __init__(self, *, seed: int = 0, data_dir: str | None = None, **options: Any) -> None:
        super().__init__(seed=seed, data_dir=data_dir, **options)  # checks seed, parses options into self.options
        if data_dir is not None:
            raise TaskError("spirals takes no --data-dir; point it at a file with --option csv=FILE")
        o = self.options
        x, y = read_csv(o.csv) if o.csv else make_spirals(o.samples, o.noise)
        test = torch.arange(len(y)) % 5 == 4  # a fixed split: every fifth example is a test example
        mean, std = x[~test].mean(0), x[~test].std(0).clamp_min(1e-6)  # scale features by the training set
        x = (x - mean) / std
        self.x, self.y = x[~test], y[~test]  # (N, features) float32, (N,) int64
        self.x_test, self.y_test = x[test], y[test]
        self.classes = int(y.max()) + 1

    def build_model(self) -> nn.Module:
        # Every rank calls this and must get the same layers. Seeding from (name, seed) makes
        # the initial weights depend on --seed only, so every method in a race starts alike.
        h = self.options.hidden
        with self.seeded("model"):
            return nn.Sequential(
                nn.Linear(self.x.shape[1], h), nn.ReLU(),
                nn.Linear(h, h), nn.ReLU(),
                nn.Linear(h, self.classes),  # logits, (B, classes)
            )

    def train_batches(self, rank: int, world_size: int, batch_size: int,
                      start: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
        # Batch number b of a rank depends only on (seed, rank, b): each epoch one shuffle,
        # shared by all ranks, and each rank takes its own slice of it. `start` skips to batch
        # `start` without building the ones before, which is what makes a resume exact.
        for idx in index_batches(self.name, self.seed, len(self.y), rank, world_size, batch_size, start):
            yield self.x[idx], self.y[idx]

    def test_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        # The whole test set in a fixed order; the shared evaluate() turns it into test loss
        # (cross-entropy) and accuracy, the same on every rank.
        for i in range(0, len(self.y_test), 1000):
            yield self.x_test[i : i + 1000], self.y_test[i : i + 1000]


def make_spirals(samples: int, noise: float, classes: int = 3) -> tuple[Tensor, Tensor]:
    """`samples` 2-D points on `classes` spiral arms, drawn from a fixed seed: the data never
    change with --seed (which moves the initial weights and the shuffling)."""
    gen = torch.Generator().manual_seed(1234)
    y = torch.arange(samples) % classes  # arm of each point
    r = torch.rand(samples, generator=gen)  # distance from the centre, 0 to 1
    angle = y * (2 * math.pi / classes) + 5 * r + noise * torch.randn(samples, generator=gen)
    return torch.stack([r * angle.cos(), r * angle.sin()], 1), y


def read_csv(path: str) -> tuple[Tensor, Tensor]:
    """Feature columns and a last column of class labels 0, 1, ...; a first row that is not
    numbers is taken as a header. Problems are a TaskError: one line, exit code 2."""
    try:
        with open(path, newline="") as f:
            rows = [row for row in csv.reader(f) if row]
    except OSError as e:
        raise TaskError(f"spirals: cannot read --option csv={path}: {e.strerror}") from None
    try:
        float(rows[0][0])
    except (IndexError, ValueError):
        rows = rows[1:]  # a header
    try:
        table = torch.tensor([[float(v) for v in row] for row in rows], dtype=torch.float64)
    except ValueError as e:
        raise TaskError(f"spirals: {path} must hold numbers in equal-length rows: {e}") from None
    if table.ndim != 2 or table.shape[0] < 10 or table.shape[1] < 2:
        raise TaskError(f"spirals: {path} needs at least 10 rows of features and a label")
    labels = table[:, -1]
    if (labels < 0).any() or (labels != labels.round()).any() or labels.max() < 1:
        raise TaskError(f"spirals: the last column of {path} must be class labels 0, 1, ... (at least two classes)")
    return table[:, :-1].float(), labels.long()

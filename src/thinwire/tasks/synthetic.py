"""Synthetic classification of any size, for throughput and scaling work.

Inputs are standard normal; labels are the argmax of a random linear teacher, so the
task is learnable and accuracy means something. Data depend only on ``data_seed`` and
the size options, not on the training seed (which drives model init and shuffling).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from thinwire.tasks.base import Task, TaskDefaults, TaskError, generator, index_batches, register

EVAL_BATCH = 1024

_cache: dict[tuple, tuple[Tensor, Tensor]] = {}
_cache_lock = threading.Lock()


@dataclass(frozen=True, kw_only=True)
class SyntheticOptions:
    dim: int = 256  # input features
    hidden: int = 512  # width of every hidden layer; hidden^2 = size of the big weight matrices
    depth: int = 2  # hidden layers (each Linear + ReLU)
    classes: int = 10  # output classes
    samples: int = 8192  # training examples
    test_samples: int = 1024  # test examples
    data_seed: int = 0  # data generator seed; the task seed drives init and shuffling

    def __post_init__(self) -> None:
        for knob in ("dim", "hidden", "depth", "samples", "test_samples"):
            if getattr(self, knob) < 1:
                raise ValueError(f"{knob} must be >= 1, got {getattr(self, knob)}")
        if self.classes < 2:
            raise ValueError(f"classes must be >= 2, got {self.classes}")


@register
class Synthetic(Task):
    """Gaussian inputs, linear-teacher labels, an MLP of configurable size."""

    name: ClassVar[str] = "synthetic"
    metric: ClassVar[str] = "accuracy"
    Config: ClassVar[type] = SyntheticOptions
    summary: ClassVar[str] = "random data and an MLP of any size (dim, hidden, depth, classes, samples)"
    defaults: ClassVar[TaskDefaults] = TaskDefaults(steps=300, batch_size=64, lr=0.05, optimizer="sgd", eval_every=100)
    options: SyntheticOptions

    def __init__(self, *, seed: int = 0, data_dir: str | None = None, **options: Any) -> None:
        super().__init__(seed=seed, data_dir=data_dir, **options)
        if data_dir is not None:
            raise TaskError("synthetic generates its data; it takes no data_dir")
        o = self.options
        x, y = make_data(o.dim, o.classes, o.samples + o.test_samples, o.data_seed)
        self.x, self.y = x[: o.samples], y[: o.samples]
        self.x_test, self.y_test = x[o.samples :], y[o.samples :]

    def describe(self) -> str:
        o = self.options
        return (
            f"synthetic: {o.samples} train / {o.test_samples} test, dim {o.dim}, "
            f"MLP {o.depth}x{o.hidden}, {o.classes} classes"
        )

    def build_model(self) -> nn.Module:
        o = self.options
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        width = o.dim
        with self.seeded("model"):
            for i in range(o.depth):
                layers[f"fc{i + 1}"] = nn.Linear(width, o.hidden)  # (hidden, width) weight
                layers[f"relu{i + 1}"] = nn.ReLU()
                width = o.hidden
            layers["out"] = nn.Linear(width, o.classes)
        return nn.Sequential(layers)

    def train_batches(
        self, rank: int, world_size: int, batch_size: int, start: int = 0
    ) -> Iterator[tuple[Tensor, Tensor]]:
        for idx in index_batches(self.name, self.seed, len(self.y), rank, world_size, batch_size, start):
            yield self.x[idx], self.y[idx]  # (B, dim) float32, (B,) int64

    def test_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, len(self.y_test), EVAL_BATCH):
            yield self.x_test[start : start + EVAL_BATCH], self.y_test[start : start + EVAL_BATCH]


def make_data(dim: int, classes: int, n: int, data_seed: int) -> tuple[Tensor, Tensor]:
    """n examples: x ~ N(0, 1) of shape (n, dim), y = argmax(x @ W) for a random teacher W."""
    key = (dim, classes, n, data_seed)
    with _cache_lock:
        if key not in _cache:
            gen = generator("synthetic-data", data_seed, dim, classes)
            teacher = torch.randn(dim, classes, generator=gen)  # (dim, classes)
            x = torch.randn(n, dim, generator=gen)  # (n, dim)
            _cache.clear()  # one data set per process: sizes may be large
            _cache[key] = (x, (x @ teacher).argmax(1))
        return _cache[key]

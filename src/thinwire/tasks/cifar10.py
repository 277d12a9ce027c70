"""CIFAR-10 from the binary distribution in a local folder; ResNet-20 or a small VGG.

``data_dir`` must hold ``data_batch_1.bin`` .. ``data_batch_5.bin`` and ``test_batch.bin``
(the "CIFAR-10 binary version" archive), directly or in a ``cifar-10-batches-bin``
subfolder. Each record is 1 label byte then 3,072 pixel bytes: the 32x32 red plane, then
green, then blue, row-major. Nothing is downloaded.

Training images get a random 32x32 crop of the image zero-padded by 4 pixels and a random
horizontal flip (option ``augment``), drawn from a generator seeded by (seed, rank, batch
number); then every image is normalised with the training set's per-channel mean/std.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from thinwire.tasks.base import Task, TaskDefaults, TaskError, generator, index_batches, register
from thinwire.tasks.vision_models import resnet20, vgg_small

TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILE = "test_batch.bin"
RECORD = 1 + 3 * 32 * 32  # label byte + channel-major pixels
MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)  # per channel, pixel values in [0, 1]
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
EVAL_BATCH = 500
MODELS = {"resnet20": resnet20, "vgg": vgg_small}

_cache: dict[tuple, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
_cache_lock = threading.Lock()


@dataclass(frozen=True, kw_only=True)
class CIFAR10Options:
    model: Literal["resnet20", "vgg"] = "resnet20"  # resnet20: 0.27M params; vgg: 0.8M, one big FC layer
    augment: bool = True  # random crop (pad 4) + horizontal flip on training images


@register
class CIFAR10(Task):
    """CIFAR-10 image classification (50,000 train / 10,000 test) from local binary files."""

    name: ClassVar[str] = "cifar10"
    metric: ClassVar[str] = "accuracy"
    Config: ClassVar[type] = CIFAR10Options
    summary: ClassVar[str] = "CIFAR-10 from a local binary copy (--data-dir), ResNet-20 or small VGG"
    # A CPU-sized budget (the paper trains 64k steps of 128); accuracy at this budget is
    # not measured here: the machines this was written on hold no CIFAR-10 copy.
    defaults: ClassVar[TaskDefaults] = TaskDefaults(
        steps=2000, batch_size=64, lr=0.1, optimizer="sgd", eval_every=500, weight_decay=5e-4
    )
    options: CIFAR10Options

    def __init__(self, *, seed: int = 0, data_dir: str | None = None, **options: Any) -> None:
        super().__init__(seed=seed, data_dir=data_dir, **options)
        self.x, self.y, self.x_test, self.y_test = load(data_dir)

    def describe(self) -> str:
        return (
            f"cifar10 ({self.options.model}): {len(self.y)} train / {len(self.y_test)} test images "
            f"from {self.data_dir}"
        )

    def build_model(self) -> torch.nn.Module:
        with self.seeded("model", self.options.model):
            return MODELS[self.options.model]()

    def train_batches(
        self, rank: int, world_size: int, batch_size: int, start: int = 0
    ) -> Iterator[tuple[Tensor, Tensor]]:
        stream = index_batches(self.name, self.seed, len(self.y), rank, world_size, batch_size, start)
        for batch, idx in enumerate(stream, start):
            images = self.x[idx]  # (B, 3, 32, 32) uint8
            if self.options.augment:
                images = augment(images, generator(self.name, self.seed, "augment", rank, batch))
            yield normalize(images), self.y[idx]

    def test_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, len(self.y_test), EVAL_BATCH):
            end = start + EVAL_BATCH
            yield normalize(self.x_test[start:end]), self.y_test[start:end]


def normalize(images: Tensor) -> Tensor:
    """uint8 (B, 3, 32, 32) -> float32 with the per-channel mean/std."""
    return (images.float() / 255.0 - MEAN) / STD


def augment(images: Tensor, gen: torch.Generator) -> Tensor:
    """Random 32x32 crop of the 4-pixel zero-padded image, then a random horizontal flip."""
    b = images.shape[0]
    padded = F.pad(images, (4, 4, 4, 4))  # (B, 3, 40, 40), pad value 0 (black)
    dy, dx = (torch.randint(9, (b,), generator=gen) for _ in range(2))
    flip = torch.rand(b, generator=gen) < 0.5
    rows = dy[:, None] + torch.arange(32)  # (B, 32)
    cols = dx[:, None] + torch.arange(32)  # (B, 32)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    return padded[
        torch.arange(b)[:, None, None, None],
        torch.arange(3)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]


def resolve_dir(data_dir: str | None) -> str:
    """The folder holding the .bin files: ``data_dir`` or its ``cifar-10-batches-bin``."""
    if data_dir is None:
        raise TaskError(
            "cifar10 needs --data-dir: a folder with the CIFAR-10 binary files "
            "data_batch_1.bin..data_batch_5.bin and test_batch.bin"
        )
    if not os.path.isdir(data_dir):
        raise TaskError(f"cifar10 data dir {data_dir} does not exist or is not a folder")
    nested = os.path.join(data_dir, "cifar-10-batches-bin")
    if not os.path.exists(os.path.join(data_dir, TEST_FILE)) and os.path.isdir(nested):
        return nested
    return data_dir


def load(data_dir: str | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x, y, x_test, y_test): uint8 (N, 3, 32, 32) images and int64 labels; cached, read-only."""
    folder = resolve_dir(data_dir)
    paths = [os.path.join(folder, f) for f in (*TRAIN_FILES, TEST_FILE)]
    for path in paths:
        if not os.path.isfile(path):
            raise TaskError(f"cifar10: missing {path}; expected data_batch_1.bin..data_batch_5.bin and test_batch.bin")
    key = tuple((os.path.realpath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths)
    with _cache_lock:
        if key not in _cache:
            train = [read_batch(p) for p in paths[:-1]]
            x_test, y_test = read_batch(paths[-1])
            _cache.clear()  # keep one copy of the data set (150 MB) per process
            _cache[key] = (torch.cat([x for x, _ in train]), torch.cat([y for _, y in train]), x_test, y_test)
        return _cache[key]


def read_batch(path: str) -> tuple[Tensor, Tensor]:
    """One binary batch file -> uint8 images (N, 3, 32, 32) and int64 labels (N,)."""
    size = os.path.getsize(path)
    if size == 0 or size % RECORD:
        raise TaskError(
            f"cifar10: {path} has {size} bytes, not a positive multiple of {RECORD} "
            "(1 label byte + 3072 pixel bytes per record)"
        )
    records = np.fromfile(path, dtype=np.uint8).reshape(-1, RECORD)  # (N, 3073)
    labels = records[:, 0].astype(np.int64)
    if labels.max() > 9:
        raise TaskError(f"cifar10: {path} has label {labels.max()} outside 0..9; is it CIFAR-100 or not a CIFAR file?")
    images = np.ascontiguousarray(records[:, 1:]).reshape(-1, 3, 32, 32)
    return torch.from_numpy(images), torch.from_numpy(labels)

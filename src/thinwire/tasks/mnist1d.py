"""MNIST-1D (Greydanus 2020): 40-sample 1-D signals of 10 digit templates, a small CNN.

The data are generated offline by the ``mnist1d`` package (``make_dataset``), never
downloaded. ``size=default`` is the package's default set (seed 42: 4,000 train /
1,000 test); ``size=large`` generates 40,000 samples with seed 1234 (32,000 / 8,000),
which raises the accuracy ceiling from ~96% to ~99% for long runs (~8 s to generate).

Generating the default set takes ~5 s of CPU, in the launcher and again in every rank, so
a generated set is kept on disk (:func:`cache_dir`: ``$THINWIRE_CACHE``, else
``$XDG_CACHE_HOME/thinwire``, else ``~/.cache/thinwire``), keyed by its size, seed and the
``mnist1d`` version and :data:`CACHE_FORMAT`, written atomically; when read, its shapes,
dtypes, finiteness and labels are checked (a damaged file is regenerated; it is no defence
against someone who can write the cache directory). A cache that cannot be read or written
is regenerated or skipped, never an error.
"""

from __future__ import annotations

import os
import random
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from thinwire.tasks.base import Task, TaskDefaults, TaskError, index_batches, register

# (num_samples, generator seed) of each size; the test set is the last 20% of each.
SIZES = {"default": (5000, 42), "large": (40000, 1234)}
EVAL_BATCH = 1000

_cache: dict[tuple[int, int], tuple[Tensor, Tensor, Tensor, Tensor]] = {}
_cache_lock = threading.Lock()  # ranks run as threads in simulations; generation uses global numpy RNG


@dataclass(frozen=True, kw_only=True)
class MNIST1DOptions:
    size: Literal["default", "large"] = "default"  # large = 10x the data, higher ceiling, slower to make


@register
class MNIST1D(Task):
    """MNIST-1D classification with a 3-conv 1-D CNN (~0.21M parameters)."""

    name: ClassVar[str] = "mnist1d"
    metric: ClassVar[str] = "accuracy"
    Config: ClassVar[type] = MNIST1DOptions
    summary: ClassVar[str] = "MNIST-1D signals (generated offline), 1-D CNN, 0.21M params"
    # Measured single-process on 2 shards x 64 = 128 per step (what 2 workers average), Adam
    # 3e-3, seeds 0-2: first eval >= 90% at step 150-225, >= 95% at 300-350, 0.958-0.961 at
    # step 800 and never below 0.946 after step 400. ~17 ms CPU per 128-sample step.
    defaults: ClassVar[TaskDefaults] = TaskDefaults(steps=800, batch_size=64, lr=3e-3, optimizer="adam", eval_every=100)
    options: MNIST1DOptions

    def __init__(self, *, seed: int = 0, data_dir: str | None = None, **options: Any) -> None:
        super().__init__(seed=seed, data_dir=data_dir, **options)
        if data_dir is not None:
            raise TaskError("mnist1d generates its data offline; it takes no data_dir")
        self.x, self.y, self.x_test, self.y_test = generate(*SIZES[self.options.size])

    def describe(self) -> str:
        return f"mnist1d ({self.options.size}): {len(self.y)} train / {len(self.y_test)} test signals of length 40"

    def build_model(self) -> nn.Module:
        with self.seeded("model"):
            return cnn()

    def train_batches(
        self, rank: int, world_size: int, batch_size: int, start: int = 0
    ) -> Iterator[tuple[Tensor, Tensor]]:
        for idx in index_batches(self.name, self.seed, len(self.y), rank, world_size, batch_size, start):
            yield self.x[idx], self.y[idx]  # (B, 1, 40) float32, (B,) int64

    def test_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, len(self.y_test), EVAL_BATCH):
            yield self.x_test[start : start + EVAL_BATCH], self.y_test[start : start + EVAL_BATCH]


def cnn(channels: int = 64, hidden: int = 256, classes: int = 10) -> nn.Sequential:
    """Conv(1,64,5) → Conv(64,64,5) → pool → Conv(64,64,5) → pool → FC(640,256) → FC(256,10).

    Padding 2 keeps the length: 40 → 40 → 40 → 20 → 20 → 10, so the flat size is 64*10.
    conv2/conv3 have 20,544 parameters each and fc1 164,096: big enough that per-layer
    compression rules (min size 16,384 / 65,536) apply to them.
    """
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv1d(1, channels, 5, padding=2),  # (B, 64, 40)
            relu1=nn.ReLU(),
            conv2=nn.Conv1d(channels, channels, 5, padding=2),  # (B, 64, 40)
            relu2=nn.ReLU(),
            pool2=nn.MaxPool1d(2),  # (B, 64, 20)
            conv3=nn.Conv1d(channels, channels, 5, padding=2),  # (B, 64, 20)
            relu3=nn.ReLU(),
            pool3=nn.MaxPool1d(2),  # (B, 64, 10)
            flatten=nn.Flatten(),  # (B, 640)
            fc1=nn.Linear(channels * 10, hidden),
            relu4=nn.ReLU(),
            fc2=nn.Linear(hidden, classes),
        )
    )


def generate(num_samples: int, data_seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x, y, x_test, y_test) from ``mnist1d.make_dataset``; cached per process, read-only.

    ``make_dataset`` seeds and draws from the global numpy/``random`` RNGs; their states
    are saved and restored so generating data changes nobody else's randomness.
    """
    key = (num_samples, data_seed)
    with _cache_lock:
        if key not in _cache:
            data = _load(num_samples, data_seed)
            if data is None:
                data = _make(num_samples, data_seed)
                _store(num_samples, data_seed, data)
            _cache[key] = data
        return _cache[key]


def cache_dir() -> Path:
    """Where generated data sets are kept: ``$THINWIRE_CACHE``, else ``$XDG_CACHE_HOME/thinwire``,
    else ``~/.cache/thinwire``."""
    if os.environ.get("THINWIRE_CACHE"):
        return Path(os.environ["THINWIRE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "thinwire"


def cache_path(num_samples: int, data_seed: int) -> Path:
    try:
        from importlib.metadata import version

        made_by = version("mnist1d")
    except Exception:  # noqa: BLE001  (not installed as a distribution: a version of its own)
        made_by = "unknown"
    return cache_dir() / f"mnist1d-v{CACHE_FORMAT}-{num_samples}-{data_seed}-{made_by}.npz"


ARRAYS = ("x", "y", "x_test", "y_test")
CACHE_FORMAT = 1  # raised whenever _make changes what it returns: older cached sets are then not read


def _load(num_samples: int, data_seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """The set from the disk cache, or None when it is missing or not what it should be."""
    import numpy as np

    try:
        with np.load(cache_path(num_samples, data_seed), allow_pickle=False) as f:
            x, y, xt, yt = (f[name] for name in ARRAYS)
    except Exception:  # noqa: BLE001  (missing, truncated, not an npz, a key missing: regenerate)
        return None
    test = num_samples // 5
    shapes_ok = (x.shape == (num_samples - test, 1, 40) and xt.shape == (test, 1, 40)
                 and y.shape == (num_samples - test,) and yt.shape == (test,))
    if not (shapes_ok and x.dtype == xt.dtype == np.float32 and y.dtype == yt.dtype == np.int64
            and np.isfinite(x).all() and np.isfinite(xt).all() and y.min() >= 0 and y.max() < 10
            and yt.min() >= 0 and yt.max() < 10):
        return None
    return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(xt), torch.from_numpy(yt)


def _store(num_samples: int, data_seed: int, arrays: tuple[Tensor, Tensor, Tensor, Tensor]) -> None:
    """Keep the set in the disk cache (temporary file, then rename); skipped when it cannot be written."""
    import numpy as np

    path = cache_path(num_samples, data_seed)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            named = {name: a.numpy() for name, a in zip(ARRAYS, arrays, strict=True)}
            np.savez(f, **named)  # type: ignore[arg-type]  # numpy's stubs match **kwds against allow_pickle: bool
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def _make(num_samples: int, data_seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    try:
        import numpy as np
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as e:
        raise TaskError(f"mnist1d needs the 'mnist1d' package (pip install mnist1d): {e}") from None
    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, data_seed
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)

    def signals(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).unsqueeze(1)  # (N, 1, 40)

    def labels(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64))  # (N,)

    return signals(data["x"]), labels(data["y"]), signals(data["x_test"]), labels(data["y_test"])

"""The task protocol: data, model, loss and evaluation for one bundled training problem.

A task is what the trainer (and a user's own loop) trains; it knows nothing about
communication. Every rank builds the same task with the same seed, so:

* ``build_model`` gives bit-identical initial parameters on every rank (seeded from
  ``(name, seed)`` inside ``torch.random.fork_rng``; the global RNG is left as it was).
* ``train_batches(rank, world_size, batch_size)`` gives each rank a disjoint shard: per
  epoch, one permutation seeded from ``(name, seed, epoch)`` is shared by all ranks and
  rank ``r`` takes its own contiguous slice of it. ``batch_size`` is PER RANK. The
  stream is infinite and identical on every call with the same arguments; ``start=k``
  begins it at batch ``k`` without building the ones before, so a resumed run sees the
  same data as an uninterrupted one.
* ``evaluate`` reads a fixed test set in a fixed order: every rank gets the same numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import math
import numbers
import threading
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from thinwire.knobs import convert
from thinwire.registry import Entry, Registry


class TaskError(ValueError):
    """One-line, user-facing problem with a task or its data (missing/corrupt data dir...)."""


@dataclass(frozen=True, kw_only=True)
class TaskDefaults:
    """What ``thinwire train`` uses when the user does not say otherwise."""

    steps: int  # optimizer steps of a default run
    batch_size: int  # PER RANK: 2 workers x 64 = 128 samples per step
    lr: float  # learning rate for `optimizer`
    optimizer: str  # "adam" | "adamw" | "sgd" (sgd means momentum 0.9)
    eval_every: int  # steps between test-set evaluations
    weight_decay: float = 0.0  # L2 penalty passed to the optimizer; higher = stronger pull to 0

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "adamw", "sgd"):
            raise ValueError(f"optimizer must be adam, adamw or sgd, got {self.optimizer!r}")
        for knob in ("steps", "batch_size", "eval_every"):
            if getattr(self, knob) < 1:
                raise ValueError(f"{knob} must be >= 1, got {getattr(self, knob)}")
        if not self.lr > 0 or self.weight_decay < 0:
            raise ValueError(f"lr must be > 0 and weight_decay >= 0, got {self.lr}, {self.weight_decay}")


class Task:
    """Base class: subclasses set the class attributes and implement the data/model hooks.

    Subclasses implement ``build_model``, ``train_batches`` and ``test_batches`` (the fixed
    evaluation stream). ``loss`` (cross-entropy over the last dimension) and ``evaluate``
    are shared by every bundled task.
    """

    name: ClassVar[str]
    defaults: ClassVar[TaskDefaults]
    metric: ClassVar[str]  # "accuracy" or "bpc": the number a report leads with
    Config: ClassVar[type]  # frozen dataclass of the task's knobs (``**options``)
    summary: ClassVar[str] = ""  # one line for listings

    seed: int
    data_dir: str | None
    options: Any  # an instance of ``Config``

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Options" in cls.__dict__ and "Config" not in cls.__dict__:
            cls.Config = cls.__dict__["Options"]  # the knob class's earlier name, still accepted

    def __init__(self, *, seed: int = 0, data_dir: str | None = None, **options: Any) -> None:
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise TaskError(f"{self.name}: seed must be an integer >= 0, got {seed!r}")
        self.seed = int(seed)
        self.data_dir = data_dir
        self.options = parse_options(self.name, self.Config, options)

    # -- hooks ------------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def train_batches(
        self, rank: int, world_size: int, batch_size: int, start: int = 0
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """This rank's infinite batch stream from batch number ``start`` on (0: the first).
        Batch ``b`` is the same whatever ``start`` was, and the batches before ``start``
        are not built: a resumed run starts its stream at its step at no extra cost."""
        raise NotImplementedError

    def test_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The fixed test set, in a fixed order (same on every rank and every call)."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for logs: data sizes and options."""
        return f"{self.name} seed={self.seed} {dataclasses.asdict(self.options)}"

    def data_facts(self) -> dict | None:
        """What the run trained on, for summary.json's ``data`` (e.g. the corpus's size and
        SHA-256); None: nothing to record."""
        return None

    def progress(self, step: int, world_size: int, batch_size: int) -> dict:
        """Figures for the metrics row written after ``step`` steps of ``batch_size`` examples
        per rank on ``world_size`` ranks (e.g. the epoch); {}: none."""
        return {}

    def check_world(self, world_size: int, batch_size: int) -> None:
        """Raise :class:`TaskError` (one line naming the sizes) when the data cannot be dealt
        to ``world_size`` ranks of ``batch_size``; called before any rank starts. Default: no check."""

    # -- shared -----------------------------------------------------------------------
    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """Mean cross-entropy; ``output`` is (..., classes) logits, ``target`` (...) class ids."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    def evaluate(self, model: torch.nn.Module, max_batches: int | None = None) -> dict:
        """Test-set ``{"loss", "accuracy", "bpc"}``; loss in nats per prediction.

        ``accuracy`` is the fraction of predictions whose argmax is the target (for
        charlm: next-character accuracy). ``bpc`` is ``loss / ln 2`` for bpc tasks, else
        None. Runs in ``model.eval()`` under ``no_grad`` on the model's device and puts
        the model back in the mode it had. ``max_batches`` bounds the cost (first batches
        of the fixed order, so the estimate is the same on every rank).
        """
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        was_training = model.training
        total, correct, count = 0.0, 0, 0
        model.eval()
        try:
            with torch.no_grad():
                for i, (x, y) in enumerate(self.test_batches()):
                    if max_batches is not None and i >= max_batches:
                        break
                    out = model(x.to(device))
                    logits = out.reshape(-1, out.shape[-1]).double()  # (predictions, classes); fp64 sums
                    target = y.reshape(-1).to(device)
                    total += F.cross_entropy(logits, target, reduction="sum").item()
                    correct += int((logits.argmax(-1) == target).sum().item())
                    count += target.numel()
        finally:
            model.train(was_training)
        loss = total / count
        return {
            "loss": loss,
            "accuracy": correct / count,
            "bpc": loss / math.log(2) if self.metric == "bpc" else None,
        }

    @contextlib.contextmanager
    def seeded(self, *parts: object) -> Iterator[None]:
        """Run the block with the CPU RNG seeded from (name, seed, *parts); restore it after.
        One block at a time per process: ranks that are threads (``LocalWorld``) share the
        global generator, and two blocks interleaving would draw each other's numbers."""
        with _SEEDED_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.name, self.seed, *parts))
            yield


# -- randomness ---------------------------------------------------------------------------
_SEEDED_LOCK = threading.RLock()


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from a tuple of plain values; the same in every process (no hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def generator(*parts: object) -> torch.Generator:
    """A CPU generator owned by the caller, seeded from ``derive_seed(*parts)``."""
    gen = torch.Generator()
    gen.manual_seed(derive_seed(*parts))
    return gen


# -- sharding -----------------------------------------------------------------------------
def check_shard_args(name: str, n: int, rank: int, world_size: int, batch_size: int, start: int = 0) -> None:
    """Validate (rank, world_size, batch_size, start) against a dataset of n training examples."""
    if start < 0:
        raise TaskError(f"{name}: start must be >= 0, got {start}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise TaskError(f"{name}: need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
    if batch_size < 1:
        raise TaskError(f"{name}: batch_size must be >= 1, got {batch_size}")
    if n // world_size < 1:
        raise TaskError(f"{name}: {n} training examples cannot be split over {world_size} ranks")


def shard_indices(name: str, seed: int, n: int, rank: int, world_size: int, epoch: int) -> Tensor:
    """Rank ``rank``'s indices for one epoch: its contiguous slice of a shared permutation.

    Every rank draws the same permutation (seeded from (name, seed, epoch), not from the
    rank), so the slices are disjoint by construction. ``n % world_size`` examples, a
    different few each epoch, are left out so every rank has the same number of steps.
    """
    perm = torch.randperm(n, generator=generator(name, seed, "epoch", epoch))  # (n,)
    per_rank = n // world_size
    return perm[rank * per_rank : (rank + 1) * per_rank]


def index_batches(name: str, seed: int, n: int, rank: int, world_size: int, batch_size: int,
                  start: int = 0) -> Iterator[Tensor]:
    """Infinite stream of ``batch_size`` indices: the rank's epoch shards back to back, from
    batch number ``start`` on (only the epoch it falls in is drawn to get there).

    A batch may straddle two epochs, so no example is dropped and every batch is full.
    """
    check_shard_args(name, n, rank, world_size, batch_size, start)
    epoch, offset = divmod(start * batch_size, n // world_size)  # every epoch's shard has n // world_size
    pending = shard_indices(name, seed, n, rank, world_size, epoch)[offset:]
    epoch += 1
    while True:
        while pending.numel() < batch_size:
            pending = torch.cat([pending, shard_indices(name, seed, n, rank, world_size, epoch)])
            epoch += 1
        yield pending[:batch_size]
        pending = pending[batch_size:]


# -- options ------------------------------------------------------------------------------
def parse_options(task: str, options_cls: type, options: dict[str, Any]) -> Any:
    """Build the task's frozen options, converting CLI strings to the annotated types.

    Unknown knobs and bad values raise :class:`TaskError` naming the rule.
    """
    fields = {f.name for f in dataclasses.fields(options_cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TaskError(
            f"unknown option {unknown[0]!r} for task {task}; options: {', '.join(sorted(fields)) or 'none'}"
        )
    hints = typing.get_type_hints(options_cls)
    try:
        values = {k: convert(v, hints[k], f"{task} option {k}") for k, v in options.items()}
    except ValueError as e:
        raise TaskError(str(e)) from None
    try:
        return options_cls(**values)
    except ValueError as e:
        raise TaskError(f"{task}: {e}") from None


# -- the registry of tasks ------------------------------------------------------------------------
METRICS = ("accuracy", "bpc")  # what a task's report leads with (Task.metric)


def check_task_class(cls: Any) -> None:
    """Raise :class:`TaskError` naming the first missing or malformed part of a task class."""
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


# listing order of the bundled tasks, by module (the CLI's help, `thinwire methods`)
_LISTING = ("mnist1d", "charlm", "text", "cifar10", "synthetic")


def _listing(entry: Entry[type[Task]]) -> int:
    module = entry.value.__module__.rpartition(".")[2]
    return _LISTING.index(module) if module in _LISTING else len(_LISTING)


# the bundled tasks: the modules of thinwire.tasks, each registering its own with @register
TASKS: Registry[type[Task]] = Registry("task", builtins=("thinwire.tasks",), check=check_task_class, order=_listing)


def register(cls: type[Task]) -> type[Task]:
    """Class decorator: make a task available by ``cls.name``. A class that lacks a part of
    the :class:`Task` contract is refused here, naming the part, so a task of the user's own
    (``--import FILE.py``) fails at its import in one line, not in a rank."""
    return TASKS.register(cls)

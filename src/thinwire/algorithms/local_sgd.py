"""Local SGD: workers step on their own and average their models every ``period`` steps.

    averager = thinwire.LocalSGD(model, optimizer, period=4, warmup=100)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        averager.after_backward()   # averages gradients during the warm-up steps only
        optimizer.step()
        averager.after_step()       # every `period` steps after the warm-up: average the models

The first ``warmup`` steps are synchronous data-parallel SGD (gradients averaged through
fp32 all_reduce, as :class:`~thinwire.SyncReducer` does). After them, every ``period``-th
step ends with a blocking all_reduce of the model state (parameters, float buffers such as
BatchNorm statistics, and the optimizer's momentum with ``average_momentum``): the models
leave the step identical. ``period=1`` with plain SGD is synchronous SGD again (averaging
models after identical-start steps equals averaging the gradients). This is the baseline
that :class:`~thinwire.algorithms.dasgd.DaSGD` hides behind computation.

Every rank counts the same steps, so the ranks launch the same collectives at the same step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.aggregate import Aggregator
from thinwire.algorithms.base import PeriodicAveraging
from thinwire.algorithms.methods import METHODS
from thinwire.comm.base import Communicator
from thinwire.knobs import knob, require


@dataclass(frozen=True, kw_only=True)
class LocalSGDConfig:
    period: int = knob(4, "steps between model averages (tau); 1 = average after every step", ">= 1")
    warmup: int = knob(0, "synchronous gradient-averaging steps before local steps begin", ">= 0")
    average_momentum: bool = knob(False, "also average the optimizer's momentum at each average", "true|false")

    def __post_init__(self) -> None:
        require(self.period >= 1, f"period must be >= 1, got {self.period}")
        require(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")


@METHODS.register
class LocalSGD(PeriodicAveraging):
    """Blocking periodic model averaging after ``warmup`` synchronous steps."""

    name = "localsgd"
    summary = "local SGD: every rank steps alone, models averaged (blocking all_reduce) every period steps"
    Config = LocalSGDConfig

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: LocalSGDConfig | None = None, *,
                 bucket_mb: float = 25.0, overlap: bool = True, **knobs: Any) -> None:
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        self._flat: torch.Tensor | None = None
        self._averager: Aggregator | None = None
        self.averages = 0

    def averages_after(self, local: int) -> bool:
        return local % self.config.period == 0

    def after_local_step(self, local: int) -> None:
        """At every ``period``-th local step, average the models."""
        if local % self.config.period == 0:
            self.average()

    def average(self) -> None:
        """Blocking: every rank's model state becomes the mean over the ranks."""
        t0 = time.perf_counter()
        flat = self._flat = self.state.gather(self._flat)
        if self._averager is None:
            self._averager = self.averager(flat)
        t1 = time.perf_counter()
        self._averager.start({"model": flat}).wait()  # fp32, divided by n before the sum, in place
        t2 = time.perf_counter()
        self.state.scatter(flat)
        self.averages += 1
        self._timing.codec_seconds += (t1 - t0) + (time.perf_counter() - t2)

    def stats(self) -> dict[str, Any]:
        return {"averages": self.averages}

    def report(self) -> dict[str, Any]:
        return {"method": self.spec, "averages": self.averages, "extra_memory_bytes": 4 * self.state.numel()}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "averages": self.averages}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.averages = int(state["averages"])

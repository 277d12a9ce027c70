"""``demo``: DeMo (:class:`thinwire.optim.DeMo`) as a training method of the CLI and the suites.

DeMo is an optimizer, not a wrapper around one: the run's Adam or SGD is replaced by it
(``--optimizer`` is refused; ``--lr`` and the task's weight decay are its own), and all of
its communication happens inside ``optimizer.step()``. The method's calls around the step
do nothing; its codec and communication seconds are the optimizer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from thinwire.algorithms.base import Loss, Method
from thinwire.algorithms.methods import METHODS
from thinwire.algorithms.reporting import Reports
from thinwire.codecs.dct import DCTConfig
from thinwire.comm.base import Communicator
from thinwire.knobs import knob, require
from thinwire.optim.demo import DeMo
from thinwire.timing import Timing


@dataclass(frozen=True, kw_only=True)
class DeMoConfig:
    chunk: int = knob(64, "DCT block side (matrices in chunk x chunk blocks, vectors in chunks)",
                      "2..1024, a power of two")
    topk: int = knob(32, "coefficients of each block sent per step; lower = fewer bytes", "1..chunk*chunk")
    decay: float = knob(0.999, "momentum decay beta: m <- beta m + g, then what was sent leaves m", "[0, 1)")
    values: Literal["fp32", "bf16", "rangefloat", "sign"] = knob(
        "bf16", "how the coefficients travel: fp32 (the paper's), bf16, 8-bit range floats, or 1 bit + a scale",
        "fp32|bf16|rangefloat|sign")
    sign: bool = knob(True, "step with the sign of the averaged direction (the paper's); false: the direction itself",
                      "true|false")

    def __post_init__(self) -> None:
        require(0 <= self.decay < 1, f"decay must be in [0, 1), got {self.decay}")
        DCTConfig(chunk=self.chunk, topk=self.topk, values=self.values)  # the codec's own rules, named as its


@METHODS.register
class DeMoMethod(Method, Reports):
    """DeMo: each rank's momentum, its top DCT coefficients all_gathered, a sign step."""

    flat_only = "its momenta are the codec's residuals of whole tensors, which two levels would split by rank"

    name = "demo"
    summary = ("DeMo: an optimizer; each rank keeps its momentum, all_gathers its top chunked-DCT coefficients "
               "and steps with the sign of their mean")
    Config = DeMoConfig
    elastic_unsafe = "it is the optimizer and holds the communicator, which is not rebuilt when the quorum changes"
    replaces_optimizer = True

    @classmethod
    def make_optimizer(cls, config: DeMoConfig, params: list[torch.nn.Parameter], lr: float, weight_decay: float,
                       comm: Communicator | None) -> DeMo:
        return DeMo(params, lr, chunk=config.chunk, topk=config.topk, decay=config.decay, values=config.values,
                    weight_decay=weight_decay, sign=config.sign, comm=comm)

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: Any = None, *, bucket_mb: float = 25.0,
                 overlap: bool = True, **knobs: Any) -> None:
        if not isinstance(optimizer, DeMo):
            from thinwire.algorithms.build import optimizer_method_help

            raise ValueError(optimizer_method_help("demo"))
        if comm is not None and comm is not optimizer.comm:
            raise ValueError("demo: pass the communicator its optimizer was built with (its bytes are metered there)")
        super().__init__(model, optimizer, optimizer.comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        self.demo: DeMo = optimizer

    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """Nothing: DeMo communicates in its step. An enabled ``GradScaler`` is refused: it
        skips ``optimizer.step()`` on a rank that overflowed, alone, and the other ranks would
        wait in DeMo's all_gather for it."""
        if scaler is not None and scaler.is_enabled():
            raise ValueError("demo cannot run under an enabled GradScaler (a step skipped on one rank would leave "
                             "the others waiting in its all_gather): use bf16 autocast, which needs no scaler")
        return True

    def after_step(self) -> None:
        pass

    @property
    def timing(self) -> Timing:
        return self.demo.timing

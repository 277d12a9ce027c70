"""DiLoCo (Douillard et al., arXiv 2311.08105): ``period`` local steps of the inner optimizer,
then an outer optimizer step on the averaged pseudo-gradient.

    diloco = thinwire.DiLoCo(model, inner_optimizer, period=50)
    for x, y in loader:
        inner_optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        diloco.after_backward()   # averages gradients during the warm-up steps only
        inner_optimizer.step()
        diloco.after_step()       # every `period` steps: the outer step

Every rank keeps the outer parameters ``θ`` (the model at the start of the round, identical on
every rank). After every ``period``-th local step (H):

* each rank's pseudo-gradient ``Δ_i = θ − θ_i`` (its own progress, reversed) is averaged over
  the ranks through ``codec`` (default fp32; any thinwire codec spec, with the error feedback
  that codec's ``ef`` asks for): ``Δ = mean_i Δ_i``;
* the outer optimizer steps ``θ`` with ``Δ`` as its gradient (default: SGD, ``outer_lr`` 0.7,
  Nesterov momentum 0.9, the paper's); with plain SGD that is ``v = μ v + Δ``,
  ``θ ← θ − lr (Δ + μ v)`` (Nesterov) or ``θ ← θ − lr v``;
* every rank continues from ``θ``: the model's parameters are set to it. Floating-point
  buffers (BatchNorm statistics) are averaged in fp32; the inner optimizer's state is kept
  (with ``average_momentum``, its per-parameter tensors are averaged too).

With outer SGD at lr 1 and no momentum, ``θ − Δ`` is the mean of the ranks' models: local SGD
(up to fp32 rounding: ``θ − mean(θ − θ_i)`` against ``mean θ_i``). The first ``warmup`` steps
are synchronous data-parallel steps (fp32 gradient mean, as local SGD's), after which ``θ``
starts from the model as it is.

The outer optimizer of the spec is ``outer=sgd`` (momentum ``outer_momentum``, ``nesterov``)
or ``outer=adam`` (lr ``outer_lr``, torch's defaults otherwise); in Python any optimizer can be
given as ``outer_optimizer=lambda params: torch.optim.X(params, ...)``. Memory: the outer
parameters and the outer optimizer's state (SGD: one momentum buffer; Adam: two), the flat
pseudo-gradient, and a codec's residual when it has error feedback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.aggregate import Aggregator
from thinwire.algorithms.base import PeriodicAveraging
from thinwire.codecs.registry import build_codec
from thinwire.comm.base import Communicator
from thinwire.knobs import knob, require

OUTER = ("sgd", "adam")
OuterFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig:
    period: int = knob(50, "inner steps between outer steps (H); the paper's is 500, ours suits the bundled tasks",
                       ">= 1")
    warmup: int = knob(0, "synchronous gradient-averaging steps before the first round", ">= 0")
    outer: str = knob("sgd", "the outer optimizer", "|".join(OUTER))
    outer_lr: float = knob(0.7, "the outer optimizer's learning rate", "> 0")
    outer_momentum: float = knob(0.9, "outer SGD's momentum", "[0, 1)")
    nesterov: bool = knob(True, "Nesterov momentum for outer SGD", "true|false")
    codec: str = knob("identity", "codec of the averaged pseudo-gradients, e.g. rangefloat with bits=4; its own "
                      "knobs separated by ';' (topk:ratio=0.01;ef=true)", "a codec spec")
    average_momentum: bool = knob(False, "also average the inner optimizer's per-parameter state at each outer step",
                                  "true|false")

    def __post_init__(self) -> None:
        require(self.period >= 1, f"period must be >= 1, got {self.period}")
        require(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        require(self.outer in OUTER, f"outer must be one of {', '.join(OUTER)}, got {self.outer!r}")
        require(self.outer_lr > 0, f"outer_lr must be > 0, got {self.outer_lr}")
        require(0 <= self.outer_momentum < 1, f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        codec = build_codec(self.codec.replace(";", ","))  # refuses an unknown codec or knob, naming it
        object.__setattr__(self, "codec", codec.describe().replace(",", ";"))  # nests inside a method spec


class DiLoCo(PeriodicAveraging):
    """Local rounds of ``period`` inner steps; an outer optimizer step on the averaged
    pseudo-gradient ends each."""

    name = "diloco"
    summary = "DiLoCo: every period inner steps, an outer Nesterov SGD step on the averaged pseudo-gradient"
    Config = DiLoCoConfig

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: DiLoCoConfig | None = None, *,
                 bucket_mb: float = 25.0, overlap: bool = True, outer_optimizer: OuterFactory | None = None,
                 **knobs: Any) -> None:
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        self.codec = build_codec(self.config.codec.replace(";", ","))
        self.outer_params = [torch.nn.Parameter(p.detach().clone()) for p in self.state.params]  # θ
        self.outer = (outer_optimizer or self._outer_from_config)(self.outer_params)
        self.syncs = 0
        self._delta: torch.Tensor | None = None  # the flat pseudo-gradient, averaged in place
        self._rest: torch.Tensor | None = None  # buffers (and inner state), averaged plainly
        self._pseudo: Aggregator | None = None
        self._plain: Aggregator | None = None

    def _outer_from_config(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        cfg = self.config
        if cfg.outer == "adam":
            return torch.optim.Adam(params, lr=cfg.outer_lr)
        return torch.optim.SGD(params, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                               nesterov=cfg.nesterov and cfg.outer_momentum > 0)

    def after_step(self) -> None:
        super().after_step()
        if self.step == self.config.warmup and self.config.warmup > 0:
            self._restart()  # the rounds start from the model the warm-up trained

    def after_local_step(self, local: int) -> None:
        if local % self.config.period == 0:
            self.outer_step()

    def outer_step(self) -> None:
        """Average the pseudo-gradients, step the outer optimizer, continue from ``θ``."""
        t0 = time.perf_counter()
        params = self.state.params
        delta = self._delta = _flat(self._delta, sum(p.numel() for p in params), params[0])
        off = 0
        for theta, p in zip(self.outer_params, params):
            n = p.numel()
            torch.sub(theta.detach().reshape(-1), p.detach().reshape(-1), out=delta[off : off + n])
            off += n
        if self._pseudo is None:
            self._pseudo = self.averager(delta, self.codec)
        self._pseudo.step = self.syncs  # the codec's step (its seeds): identical on every rank
        t1 = time.perf_counter()
        self._pseudo.start({"model": delta}).wait()  # the mean pseudo-gradient
        t2 = time.perf_counter()
        off = 0
        for theta in self.outer_params:
            n = theta.numel()
            theta.grad = delta[off : off + n].view(theta.shape)  # read by the step below, never kept
            off += n
        self.outer.step()
        with torch.no_grad():
            for theta, p in zip(self.outer_params, params):
                p.copy_(theta)
        t3 = time.perf_counter()
        self._average_rest()
        self.syncs += 1
        self._timing.codec_seconds += (t1 - t0) + (t3 - t2)

    def _average_rest(self) -> None:
        """Float buffers (and, with ``average_momentum``, the inner optimizer's state): their
        plain fp32 mean, written back."""
        tensors = self.state.tensors()[len(self.state.params):]
        if not tensors:
            return
        rest = self._rest = _flat(self._rest, sum(t.numel() for t in tensors), tensors[0])
        off = 0
        for t in tensors:
            rest[off : off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()
        if self._plain is None or self._plain.buckets[0].numel != rest.numel():
            self._plain = self.averager(rest)
        self._plain.start({"model": rest}).wait()
        off = 0
        for t in tensors:
            t.copy_(rest[off : off + t.numel()].view(t.shape))
            off += t.numel()

    def _restart(self) -> None:
        """``θ`` := the model's parameters (identical on every rank after synchronous steps)."""
        with torch.no_grad():
            for theta, p in zip(self.outer_params, self.state.params):
                theta.copy_(p)

    # -- figures ----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {"outer_steps": self.syncs}

    def report(self) -> dict[str, Any]:
        outer_state = sum(t.numel() for s in self.outer.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor) and t.dim() > 0)
        return {"method": self.spec, "outer_steps": self.syncs, "outer_optimizer": type(self.outer).__name__,
                "extra_memory_bytes": 4 * (2 * self.state.numel() + outer_state)}

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "syncs": self.syncs,
                "outer_params": [t.detach().clone() for t in self.outer_params],
                "outer": self.outer.state_dict(),
                "pseudo": None if self._pseudo is None else self._pseudo.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.syncs = int(state["syncs"])
        with torch.no_grad():
            for theta, saved in zip(self.outer_params, state["outer_params"], strict=True):
                theta.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        if state["pseudo"] is not None:
            params = self.state.params
            like = self._delta = _flat(self._delta, sum(p.numel() for p in params), params[0])
            self._pseudo = self._pseudo or self.averager(like, self.codec)
            self._pseudo.load_state_dict(state["pseudo"])


def _flat(buf: torch.Tensor | None, numel: int, like: torch.Tensor) -> torch.Tensor:
    """A flat fp32 buffer of ``numel`` on ``like``'s device, ``buf`` when it fits."""
    if buf is not None and buf.numel() == numel and buf.device == like.device:
        return buf
    return torch.empty(numel, dtype=torch.float32, device=like.device)

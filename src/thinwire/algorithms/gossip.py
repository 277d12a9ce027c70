"""D-PSGD (Lian et al., NeurIPS 2017): decentralized SGD by uncompressed gossip on a graph.

    gossip = thinwire.DPSGD(model, topology="ring")
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        gossip.after_backward()   # x <- sum_j W[i, j] x_j, exchanged with the graph neighbours
        optimizer.step()          # ... minus the local update computed at the old x

Each step, after the backward pass, every worker sends its model state (trainable
parameters and floating-point buffers, one flat fp32 buffer) to each neighbour of the
topology and replaces it with the weighted mix ``sum_j W[i, j] x_j``; the optimizer then
applies the gradient computed before the mix: ``x_{t+1} = W x_t - lr * grad f_i(x_t)``, the
D-PSGD order. No all_reduce: each worker sends ``degree x model`` bytes per step,
point to point. The sum of the neighbours' contributions runs in ascending rank order
(self first), the same on every worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.algorithms.averaging import ModelState
from thinwire.algorithms.base import Gossip, Loss
from thinwire.algorithms.methods import METHODS
from thinwire.comm.base import Communicator
from thinwire.knobs import knob, require
from thinwire.topology import NAMES


@dataclass(frozen=True, kw_only=True)
class DPSGDConfig:
    topology: str = knob("ring", "the graph: ring, torus, complete, exponential, or a mixing matrix file",
                         "|".join(NAMES) + "|FILE")

    def __post_init__(self) -> None:
        require(bool(self.topology.strip()), "topology must name a graph or a mixing matrix file")


@METHODS.register
class DPSGD(Gossip):
    """Gossip of the whole model with the topology's neighbours after every backward pass."""

    name = "dpsgd"
    summary = "D-PSGD: every step, mix the model with the graph neighbours' (sum_j W_ij x_j), then step"
    Config = DPSGDConfig

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: DPSGDConfig | None = None, *,
                 bucket_mb: float = 25.0, overlap: bool = True, **knobs: Any) -> None:
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        self.state = ModelState(model)
        self._flat: torch.Tensor | None = None
        self._recv: dict[int, torch.Tensor] = {}
        self._mixed: torch.Tensor | None = None

    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """Replace the model state with its mix over this worker and its neighbours."""
        t0 = time.perf_counter()
        flat = self._flat = self.state.gather(self._flat)
        for j in self.neighbours:
            if j not in self._recv or self._recv[j].shape != flat.shape:
                self._recv[j] = torch.empty_like(flat)
        t1 = time.perf_counter()
        self.comm.exchange({j: flat for j in self.neighbours}, self._recv)
        t2 = time.perf_counter()
        rank, w = self.comm.rank, self.topology.weights
        mixed = self._mixed = torch.mul(flat, w[rank, rank].item(), out=_like(self._mixed, flat))  # self first
        for j in self.neighbours:
            mixed.add_(self._recv[j], alpha=w[rank, j].item())
        self.state.scatter(mixed)
        self.step += 1
        self._timing.codec_seconds += (t1 - t0) + (time.perf_counter() - t2)
        self._timing.comm_seconds += t2 - t1
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def _like(buf: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    return buf if buf is not None and buf.shape == ref.shape and buf.device == ref.device else torch.empty_like(ref)

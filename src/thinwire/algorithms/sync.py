"""Synchronous compressed gradient averaging: attach to any training loop.

    reducer = thinwire.SyncReducer(model, "topk:ratio=0.01")
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()
        reducer.reduce(loss)      # every rank's .grad now holds the compressed mean
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from typing import Iterable

import torch

from thinwire.aggregate import Aggregator, Timing
from thinwire.codecs.base import Codec
from thinwire.codecs.registry import build_codec
from thinwire.comm.base import Communicator


class SyncReducer:
    """Averages the gradients of ``model`` over all ranks through one codec.

    ``method`` is a codec spec (``"powersgd:rank=2"``) or a built codec. ``comm`` defaults
    to the default ``torch.distributed`` process group. Parameters are taken in
    ``named_parameters()`` order (identical on all ranks, which keeps the collectives in
    lockstep); parameters without ``requires_grad`` are left alone.
    """

    def __init__(
        self,
        model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
        method: str | Codec = "identity",
        comm: Communicator | None = None,
        *,
        bucket_mb: float = 25.0,
    ) -> None:
        named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
        self.params = [(n, p) for n, p in named if p.requires_grad]
        if not self.params:
            raise ValueError("SyncReducer needs at least one parameter with requires_grad=True")
        self.codec = build_codec(method) if isinstance(method, str) else method
        if comm is None:
            from thinwire.comm.torch_dist import TorchComm

            comm = TorchComm()
        self.comm = comm
        self.aggregator = Aggregator(self.params, lambda name, t: self.codec, comm, bucket_mb=bucket_mb)
        self._loss_sum = 0.0  # this rank's training loss summed over the current window

    @property
    def timing(self) -> Timing:
        return self.aggregator.timing

    @property
    def step(self) -> int:
        return self.aggregator.step

    def reduce(self, loss: float | torch.Tensor | None = None) -> None:
        """Replace every parameter's ``.grad`` with the mean over ranks (in place).

        A parameter whose ``.grad`` is None gets a zero gradient first, so every rank still
        issues the same collectives. ``loss``, this rank's training loss of the step, is
        required by codecs whose schedule follows the loss (``fft:schedule=recover``): at
        the end of each of their windows the ranks agree on the window's mean loss with one
        8-byte all_reduce (counted by the meter) and the codec sees it.
        """
        window = self.codec.loss_window()
        if window and loss is None:
            raise ValueError(f"{self.codec.describe()} follows the training loss: call reduce(loss=...) every step")
        grads = {}
        for name, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads[name] = p.grad
        self.aggregator.reduce_(grads)
        if window:
            self._loss_sum += float(loss)
            if self.step % window == 0:
                self._agree_loss(window)

    def _agree_loss(self, window: int) -> None:
        device = self.params[0][1].device
        total = torch.tensor([self._loss_sum], dtype=torch.float64, device=device)  # (1,)
        self.comm.all_reduce(total)  # identical on every rank, so is the codec's reaction
        self.codec.observe_loss(total.item() / (window * self.comm.world_size))
        self._loss_sum = 0.0

    # -- the trainer's interface (see algorithms/registry.py) -------------------------------
    def after_backward(self, loss: float | torch.Tensor | None = None) -> None:
        self.reduce(loss)

    def after_step(self) -> None:
        """Nothing to do after the optimizer step: the gradients were already averaged."""

    def stats(self) -> dict:
        """The codec's figures for the last step (logged in metrics.jsonl)."""
        return self.codec.stats()

    def report(self) -> dict:
        """Extra figures for summary.json: the codec each parameter got and its bytes."""
        return {"codec": self.codec.describe(), "layers": self.plan()}

    def plan(self) -> list[dict]:
        return self.aggregator.plan()

    def state_dict(self) -> dict:
        return {**self.aggregator.state_dict(), "loss_sum": self._loss_sum}

    def load_state_dict(self, state: dict) -> None:
        self.aggregator.load_state_dict(state)
        self._loss_sum = float(state.get("loss_sum", 0.0))

"""A tiny seeded classifier and its batches, for the model-averaging tests: every rank builds
the same model, and batch ``(seed)`` is the same wherever it is drawn."""

from __future__ import annotations

import torch
from torch import nn


def net(inputs: int, hidden: int, classes: int, *, bn: bool = False, act: type[nn.Module] = nn.Tanh) -> nn.Module:
    """Linear, [BatchNorm], activation, Linear; every parameter drawn from N(0, 0.25), seed 0."""
    g = torch.Generator().manual_seed(0)
    norm = [nn.BatchNorm1d(hidden)] if bn else []
    m = nn.Sequential(nn.Linear(inputs, hidden), *norm, act(), nn.Linear(hidden, classes))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def batch(seed: int, size: int, inputs: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` gaussian inputs and uniform labels from generator ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, inputs, generator=g), torch.randint(0, classes, (size,), generator=g)


def backward(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    """Rank ``rank``'s step ``step`` on a 5-input, 3-class model (``net(5, hidden, 3)``): zeroed
    gradients, then the cross-entropy's backward pass on its batch of 6 (seed ``100 step +
    rank``). The optimizer's step is the caller's."""
    x, y = batch(100 * step + rank, 6, 5, 3)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()

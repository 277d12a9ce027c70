"""A model for gradient-semantics tests: a trunk, a layer to freeze mid-run, a layer no rank
uses, and a branch only some ranks take (``use_branch``)."""

from __future__ import annotations

import torch


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(32, 64)
        self.frozen = torch.nn.Linear(64, 64)
        self.unused = torch.nn.Linear(64, 64)
        self.branch = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.relu(self.frozen(torch.relu(self.trunk(x))))
        if use_branch:
            h = h + self.branch(h)
        return self.head(h)


def branchy() -> Branchy:
    """The same initial weights on every rank and thread (drawn from a generator of its own)."""
    model = Branchy()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model

"""Error feedback (METHODS.md §0.1): what a lossy codec did not send is added back next step.

Per key (a parameter name, or a bucket key that the caller splits by parameter name):
``u = x + r``; ``payload = encode(u)``; ``r = u - decode(own payload)``. The residual is
computed from this rank's *own* payload, before any collective touches it.
"""

from __future__ import annotations

from typing import Any

import torch


class ErrorFeedback:
    """Holds one residual tensor per key; created lazily as zeros of the input's shape."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``u = x + r`` as a new tensor (``x`` is not modified). ``x`` itself when no residual yet."""
        r = self.residuals.get(key)
        if r is None:
            return x
        if r.shape != x.shape:
            raise ValueError(f"residual for {key!r} has shape {tuple(r.shape)}, tensor has {tuple(x.shape)}")
        return x + r

    def update(self, key: str, u: torch.Tensor, sent: torch.Tensor) -> None:
        """``r = u - sent``, written into the existing residual buffer (mutates it in place)."""
        r = self.residuals.get(key)
        if r is None or r.shape != u.shape:
            self.residuals[key] = u - sent
        else:
            torch.sub(u, sent, out=r)

    def state_dict(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state.items()}

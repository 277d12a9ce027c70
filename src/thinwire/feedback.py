"""Error feedback: what a lossy codec did not send is added back next step.

Per key (a parameter name): ``u = x + r``; ``payload = encode(u)``; ``r = u - decode(own
payload)``. The residual is computed from this rank's *own* payload, before any collective
touches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from thinwire.codecs.base import Codec
    from thinwire.payload import Payload


class ErrorFeedback:
    """Holds one residual tensor per key, created at the key's first update."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """``u = x + r``, computed in place in the residual buffer, which is returned (the
        buffer then holds ``u`` until :meth:`update`). ``x`` itself, unmodified, when the key
        has no residual yet."""
        r = self.residuals.get(key)
        if r is None:
            return x
        if r.shape != x.shape:
            raise ValueError(f"residual for {key!r} has shape {tuple(r.shape)}, tensor has {tuple(x.shape)}")
        if r.device != x.device:  # e.g. resumed from a checkpoint mapped to the CPU
            r = self.residuals[key] = r.to(x.device)
        return r.add_(x)

    def update(self, key: str, u: torch.Tensor, sent: torch.Tensor) -> None:
        """``r = u - sent`` (written into the residual buffer when there is one)."""
        r = self._holding(key, u)
        r.sub_(sent)

    def update_decoded(self, key: str, u: torch.Tensor, codec: Codec, payload: Payload) -> None:
        """``r = u - decode(payload)`` without a dense temporary: through ``codec.decode_sub``.

        Call it only once the payload's wire tensors have been copied out (``u`` may be the
        residual buffer itself, which this overwrites)."""
        if any(_shares_memory(t, u) for t in payload.tensors):  # e.g. identity's wire is a view of u
            self.update(key, u, codec.decode(payload).clone())
            return
        codec.decode_sub(payload, self._holding(key, u))

    def _holding(self, key: str, u: torch.Tensor) -> torch.Tensor:
        """The residual buffer for ``key``, holding ``u``."""
        r = self.residuals.get(key)
        if r is u:
            return r
        if r is None or r.shape != u.shape or r.device != u.device:
            r = self.residuals[key] = u.detach().clone()
        else:
            r.copy_(u)
        return r

    def clear(self) -> None:
        """Forget every residual: a worker that joins a running elastic job starts with none
        (the one it took from a present worker is that worker's own unsent error)."""
        self.residuals = {}

    def state_dict(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.residuals = {k: v.clone() for k, v in state.items()}


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

"""Random-k sparsification with a shared index set: only the values cross the wire.

Every rank draws the same k distinct positions from ``generator_for(seed, step, key)`` (no
rank in the seed), so position ``i`` of every rank's value vector refers to the same element
and the vectors can be summed by all_reduce: SUM, linear, ``4 * k`` bytes with
``k = max(1, ceil(ratio * N))``. The indices stay in the payload's local ``meta``.
Invariant: all ranks must run the same step, key and device type, or their sets differ.

Drawing k distinct indices (thinwire's own scheme): for ``k < N/4``, draw about
``-N ln(1 - k/N)`` uniform integers (the count expected to yield k distinct ones), keep the
distinct ones, top up in the rare case there are too few, then drop a uniformly random
surplus (drawn the same way). The distinct values of an i.i.d. uniform sequence form a
uniform random subset given their number, so the result is a uniform k-subset, at
``O(k log k)`` cost instead of the ``O(N)`` of ``randperm``, used only for ``k >= N/4``.

No ``N/k`` rescale by default: with error feedback (default on) the unsent mass is carried
over, and the rescale would only add variance. ``rescale=true`` gives the unbiased variant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from thinwire.codecs.base import Codec, generator_for
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.specs import register
from thinwire.payload import Aggregation, Payload, WireSpec


@dataclass(frozen=True, kw_only=True)
class RandomKConfig(CodecConfig):
    ef: bool = knob(True, "error feedback: what was not sent is added to the next step's tensor", "true|false")
    ratio: float = knob(0.01, "fraction of values sent, k = max(1, ceil(ratio*N)); lower = more compression", "(0, 1]")
    seed: int = knob(0, "seed of the shared index draw (the same on every rank)", "any integer")
    rescale: bool = knob(False, "multiply decoded values by N/k: unbiased, but more variance", "true|false")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.ratio <= 1, f"ratio must be in (0, 1], got {self.ratio}")


@register
class RandomK(Codec):
    """Sends k values at positions shared by all ranks; the values are all_reduced."""

    name = "randomk"
    elementwise = True
    summary = "send k = ratio*N values at seeded positions shared by all ranks (all_reduce), EF on"
    Config = RandomKConfig
    aggregation = Aggregation.SUM

    def k(self, numel: int) -> int:
        """Values sent for a tensor of ``numel`` elements (the 1e-12 absorbs float error in ratio*N)."""
        return min(numel, max(1, math.ceil(self.config.ratio * numel * (1 - 1e-12))))

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        return [((self.k(math.prod(shape)),), torch.float32)]

    def indices(self, numel: int, key: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """The sorted (k,) int64 positions for this (seed, step, key): identical on all ranks."""
        g = generator_for(self.config.seed, self.step, key, device=device)
        return _distinct(numel, self.k(numel), g, torch.device(device))

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        flat = x.reshape(-1)  # (N,) only read
        idx = self.indices(flat.numel(), key, x.device)  # (k,)
        values = flat[idx].to(torch.float32)  # (k,) a new tensor
        return Payload((values,), x.shape, x.dtype, meta={"indices": idx})

    def decode(self, payload: Payload) -> torch.Tensor:
        (values,) = payload.tensors  # (k,)
        idx = payload.meta["indices"]  # (k,)
        n = math.prod(payload.shape)
        if self.config.rescale:
            values = values * (n / max(1, idx.numel()))
        out = values.new_zeros(n, dtype=payload.dtype)  # (N,)
        out[idx] = values.to(payload.dtype)
        return out.view(payload.shape)

    def decode_add(self, payload: Payload, out: torch.Tensor) -> None:
        """``out += decode(payload)`` at the k positions only (the aggregator's decode into
        the output and the error-feedback update both come here): no dense temporary."""
        if not out.is_contiguous():
            return super().decode_add(payload, out)
        (values,) = payload.tensors  # (k,)
        idx = payload.meta["indices"]  # (k,) distinct
        if self.config.rescale:
            values = values * (math.prod(payload.shape) / max(1, idx.numel()))
        out.view(-1).index_add_(0, idx, values.to(payload.dtype).to(out.dtype))


def _distinct(n: int, k: int, g: torch.Generator, device: torch.device) -> torch.Tensor:
    """k distinct uniform positions in [0, n), sorted; a pure function of the generator state."""
    if 4 * k >= n:
        return _unique(torch.randperm(n, generator=g, device=device)[:k])
    draws = math.ceil(-n * math.log1p(-k / n) + 4 * math.sqrt(k) + 16)
    uniq = _unique(torch.randint(n, (draws,), generator=g, device=device))  # (u,)
    while uniq.numel() < k:  # rare top-up; each round adds more than the shortfall in expectation
        extra = torch.randint(n, (2 * (k - uniq.numel()) + 16,), generator=g, device=device)
        uniq = _unique(torch.cat([uniq, extra]))
    if uniq.numel() > k:  # drop a uniformly random surplus, itself drawn this way (it is small)
        uniq = _delete(uniq, _distinct(uniq.numel(), uniq.numel() - k, g, device))
    return uniq


# On CPU these two run in NumPy: with 2 threads on 2 cores shared by other ranks, torch's sort
# of 252K int64 took 170 ms (9.6 ms on 1 thread) and a boolean-mask select 43 ms, each op
# waiting on an OpenMP region; NumPy's single-threaded sort took 1.7 ms.
def _unique(values: torch.Tensor) -> torch.Tensor:
    """Sorted distinct values."""
    if values.device.type != "cpu":
        return values.unique()
    s = np.sort(values.numpy())  # (m,)
    first = np.ones(s.size, dtype=np.bool_)  # (m,) True where a new value starts
    first[1:] = s[1:] != s[:-1]
    return torch.from_numpy(s[first])


def _delete(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``values`` without the entries at ``positions`` (distinct), order kept."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.delete(values.numpy(), positions.numpy()))
    keep = torch.ones(values.numel(), dtype=torch.bool, device=values.device)
    keep[positions] = False
    return values[keep]

"""Top-k sparsification: send the k largest-magnitude values and their positions.

Wire (GATHER, fixed size): k fp32 values + k int32 indices = ``8 * k`` bytes, with
``k = max(1, ceil(ratio * N))``. Each rank sends its own positions, so the payloads cannot
be summed on the wire; every rank scatters all gathered payloads.

``exact`` is ``torch.topk`` on ``|x|``. ``sampled`` (thinwire's own scheme, the default for
big tensors) takes a threshold ``t`` from a random sample, 4 sigma of the sample count below
the target quantile, keeps every ``|x_i| >= t`` and takes the exact top-k of those. Unless
fewer than k survive (about 3 in 100,000; then the exact path runs) that IS the exact top-k.
On CPU (fp32/fp64) it runs in NumPy, chunked through reused buffers: on 25M floats, 2 shared
cores, the scan took 22 ms against 75 ms for the same torch ops, and torch ops on 2 threads
stall on OpenMP regions when ranks share cores (a chunked scan: 2.6 s). The whole encode
measured 14-19x faster than ``torch.topk`` at 1% on 25M floats there.

Under ``auto`` the tensors below ``AUTO_SAMPLED_MIN`` (most of a model's tensors) take the
exact path, on the CPU (fp32/fp64) in NumPy too: the same scan and cut from a lower bound of
the k-th largest ``|x|``, which is a sample's (as above; the set does not depend on it) or,
for small tensors or when the sample misjudges, the k-th value itself from an in-place
``partition`` of a reused buffer. Indices ascend and ties at the k-th value keep the lowest
positions. That measured 10-150x faster than ``torch.topk`` on 37K-790K values (2 shared
cores: each torch op waits on an OpenMP region), the same set. ``exact`` stays ``torch.topk``
everywhere (the reference the other modes are measured against).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from thinwire.codecs.base import Codec, distinct, generator_for, in_range, zero_
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.specs import register
from thinwire.payload import Aggregation, Payload, WireSpec

AUTO_SAMPLED_MIN = 1_000_000  # `select=auto` samples at and above this many elements
_CHUNK = 1 << 16  # CPU scan chunk: |x|, the compare and the nonzero stay in cache
_NUMPY = (torch.float32, torch.float64)  # CPU dtypes taking the NumPy path
_MIN_SAMPLE = 1024  # the sample is never smaller than this
_GUIDED_MIN = 1 << 16  # from this many values auto's exact path bounds the k-th |x| by a sample first
_MARGIN_SIGMAS = 4.0  # the threshold sits this many std devs of the sample count below target


@dataclass(frozen=True, kw_only=True)
class TopKConfig(CodecConfig):
    ef: bool = knob(True, "error feedback: what was not sent is added to the next step's tensor", "true|false")
    ratio: float = knob(0.01, "fraction of values sent, k = max(1, ceil(ratio*N)); lower = more compression", "(0, 1]")
    select: Literal["exact", "sampled", "auto"] = knob(
        "auto", "exact = torch.topk; sampled = sampled threshold first (same set); auto = sampled if N >= 1e6",
        "exact|sampled|auto",
    )
    sample: float = knob(0.005, "fraction sampled for the threshold; higher = fewer surplus candidates", "(0, 1]")
    seed: int = knob(0, "seed of the threshold sample (it never changes the selected set, ties aside)", "any integer")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.ratio <= 1, f"ratio must be in (0, 1], got {self.ratio}")
        require(0 < self.sample <= 1, f"sample must be in (0, 1], got {self.sample}")


@register
class TopK(Codec):
    """Keeps the k largest |x|; exact selection, or a sampled threshold for big tensors.

    Not thread-safe: one encode at a time per instance (it reuses CPU scan buffers).
    """

    name = "topk"
    elementwise = True
    summary = "send the k = ratio*N largest-magnitude values + int32 indices (all_gather), EF on"
    Config = TopKConfig
    aggregation = Aggregation.GATHER

    def __init__(self, config: TopKConfig) -> None:
        super().__init__(config)
        self._scan: tuple[np.ndarray, np.ndarray] | None = None  # CPU scan buffers (|x|, mask)
        self._mag: np.ndarray | None = None  # the CPU exact path's |x| (partitioned in place)

    def k(self, numel: int) -> int:
        """Values sent for a tensor of ``numel`` elements (the 1e-12 absorbs float error in ratio*N)."""
        return min(numel, max(1, math.ceil(self.config.ratio * numel * (1 - 1e-12))))

    def uses_sampling(self, numel: int) -> bool:
        return self.config.select == "sampled" or (self.config.select == "auto" and numel >= AUTO_SAMPLED_MIN)

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        k = self.k(math.prod(shape))
        return [((k,), torch.float32), ((k,), torch.int32)]

    def check_fields(self, payload: Payload) -> None:
        """Indices within the tensor, each sent once (``decode`` assigns, ``decode_add`` sums:
        a repeated index would make them disagree)."""
        idx = payload.tensors[1]
        if idx.device.type == "cpu" and idx.numel() > 1:  # ascending (as the CPU paths send them): one pass
            a = idx.detach().numpy()
            if 0 <= a[0] and a[-1] < math.prod(payload.shape) and bool((a[1:] > a[:-1]).all()):
                return
        in_range(self.name, "indices", idx, 0, math.prod(payload.shape) - 1)
        distinct(self.name, "indices", idx)

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        return Payload(self.top(x.reshape(-1), key), x.shape, x.dtype)

    def top(self, flat: torch.Tensor, key: str = "", *, ascending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 values, int32 indices) of the ``k`` largest ``|flat|``, new tensors; with
        ``ascending`` the indices come in ascending order (the CPU scan gives that for free)."""
        k = self.k(flat.numel())
        wire = self._sampled(flat, k, key, ascending) if k and self.uses_sampling(flat.numel()) else None
        if wire is None and k and self.config.select == "auto" and flat.device.type == "cpu" \
                and flat.dtype in _NUMPY:
            wire = self._exact_numpy(flat, k, key)  # the same set as torch.topk, ascending
        if wire is None:
            idx = torch.topk(flat.abs(), k, sorted=False).indices  # (k,)
            if ascending:
                idx = idx.sort().values
            wire = (flat[idx].to(torch.float32), idx.to(torch.int32))
        return wire

    def decode(self, payload: Payload) -> torch.Tensor:
        values, idx = payload.tensors  # (k,), (k,)
        out = values.new_zeros(math.prod(payload.shape), dtype=payload.dtype)  # (N,)
        out[idx.long()] = values.to(payload.dtype)
        return out.view(payload.shape)

    def decode_add(self, payload: Payload, out: torch.Tensor) -> None:
        """``out += decode(payload)`` by a sparse index_add (mutates ``out``)."""
        self._add(payload, out)

    def decode_sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        """``out = sum of decode(p)``: zeros, then each payload scattered in (the payloads are
        checked once, on entry)."""
        zero_(out)
        for p in payloads:
            self._add(p, out)

    def _add(self, payload: Payload, out: torch.Tensor) -> None:
        if not out.is_contiguous():
            out.add_(self.decode(payload))
            return
        values, idx = payload.tensors
        out.view(-1).index_add_(0, idx.long(), values.to(out.dtype))

    # -- sampled selection --------------------------------------------------------------
    def _sampled(
        self, flat: torch.Tensor, k: int, key: str, ascending: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(fp32 values, int32 indices) of the exact top-k via a sampled threshold, or None
        when the exact path must run (too few candidates, or a threshold of 0). The CPU
        path's indices always ascend."""
        t = self._threshold(flat, k, key)
        if t is None or not t > 0:  # too dense to sample, or every zero would be a candidate
            return None
        if flat.device.type == "cpu" and flat.dtype in _NUMPY:
            return self._top_numpy(flat.detach().numpy(), k, t)
        cand = (flat.abs() >= t).nonzero().squeeze(1)  # (c,) one pass off-CPU: one sync
        if cand.numel() < k:
            return None
        vals = flat[cand]  # (c,)
        keep = torch.topk(vals.abs(), k, sorted=False).indices  # (k,) into cand
        if ascending:
            keep = keep.sort().values  # cand ascends
        return vals[keep].to(torch.float32), cand[keep].to(torch.int32)

    def _threshold(self, flat: torch.Tensor, k: int, key: str) -> float | None:
        """The j-th largest |x| in a uniform sample, j a few sigma above the expected count."""
        n = flat.numel()
        m = max(math.ceil(self.config.sample * n), _MIN_SAMPLE)
        expect = k * m / n  # sample values expected above the true k-th magnitude
        j = math.ceil(expect + _MARGIN_SIGMAS * math.sqrt(expect) + 1)
        if j >= m:
            return None
        g = generator_for(self.config.seed, self.step, key, device=flat.device)
        pos = torch.randint(n, (m,), generator=g, device=flat.device)  # (m,) with replacement
        if flat.device.type == "cpu" and flat.dtype in _NUMPY:
            sample = np.abs(flat.detach().numpy()[pos.numpy()])  # (m,)
            return float(np.partition(sample, m - j)[m - j])
        return torch.kthvalue(flat[pos].abs(), m - j + 1).values.item()

    def _exact_numpy(self, flat: torch.Tensor, k: int, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``auto``'s exact path on the CPU: :meth:`_top_numpy` from any lower bound ``t`` of the
        k-th largest ``|x|`` returns the same set (every candidate ``>= t`` is ranked, the cut
        is at the true k-th value, ties to the first positions), so ``t`` may come from a
        sample (Floyd-Rivest: one scan instead of a selection over all values), with the
        k-th value itself, from an in-place ``partition`` of a reused ``|x|`` buffer, when the
        sample misjudges or the tensor is small. None with NaN among the top k (``torch.topk``
        then decides, as before)."""
        src = flat.detach().numpy()
        n = src.size
        if n >= _GUIDED_MIN:
            t = self._threshold(flat, k, key)
            found = self._top_numpy(src, k, t, refuse_nan=True) if t is not None and t > 0 else None
            if found is not None:
                return found
        if self._mag is None or self._mag.size < n or self._mag.dtype != src.dtype:
            self._mag = np.empty(n, src.dtype)
        mag = self._mag[:n]
        np.abs(src, out=mag)
        mag.partition(n - k)
        return self._top_numpy(src, k, mag[n - k])

    def _top_numpy(
        self, src: np.ndarray, k: int, t: float, refuse_nan: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The CPU path: chunked scan for ``|x| >= t``, then the exact top-k of the candidates.
        With ``refuse_nan``, None when ``src`` holds a NaN (which ``torch.topk`` ranks above
        every number, and the scan never admits)."""
        mag, mask = self._buffers(min(src.size, _CHUNK), src.dtype)
        parts = []
        for start in range(0, src.size, _CHUNK):
            part = src[start : start + _CHUNK]  # (c,) a view
            a = np.abs(part, out=mag[: part.size])
            if refuse_nan and np.isnan(a.max()):  # (max propagates NaN)
                return None
            m = np.greater_equal(a, t, out=mask[: part.size])  # (c,)
            parts.append(np.flatnonzero(m) + start)  # (hits,)
        cand = np.concatenate(parts)  # (c,) ascending
        if cand.size < k:
            return None
        vals = src[cand]  # (c,) a copy
        if cand.size > k:  # cut at the k-th largest magnitude, keeping the ascending order
            mags = np.abs(vals)  # (c,)
            kth = np.partition(mags, cand.size - k)[cand.size - k]
            keep = mags > kth  # (c,) fewer than k when kth is tied
            short = k - int(np.count_nonzero(keep))
            if short:
                keep[np.flatnonzero(mags == kth)[:short]] = True  # the first of the ties
            cand, vals = cand[keep], vals[keep]
        return torch.from_numpy(vals.astype(np.float32, copy=False)), torch.from_numpy(cand.astype(np.int32))

    def _buffers(self, size: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """CPU scan buffers, reused across calls; reallocated when too small or of another dtype."""
        if self._scan is None or self._scan[0].size < size or self._scan[0].dtype != dtype:
            self._scan = (np.empty(size, dtype=dtype), np.empty(size, dtype=np.bool_))
        return self._scan

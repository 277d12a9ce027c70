"""Exact top-k as a boolean mask, found through a sampled band instead of a sort.

:func:`top_mask` marks exactly the ``k`` largest scores. For large inputs it estimates,
from a uniform sample, two thresholds ``lo < hi`` that bracket the ``k``-th largest score
with high probability: then every score above ``hi`` is in, and only the few scores in the
band ``[lo, hi]`` need ranking. A handful of element-wise passes replace a full sort or
``torch.topk``, and the mask comes out in index order for free (positions as a bitmap, or
``nonzero`` for ascending indices). When the sample misjudges (a probability of about
``1e-4`` per call at the 4-sigma margin) the exact ``torch.topk`` path runs instead; the
result is the same set either way.

On the CPU (fp32/fp64 scores) both paths run in NumPy (:func:`top_mask_numpy` takes NumPy
arrays directly): the sampled scan chunked so that its compares stay in cache, the exact
path by ``np.partition``. Torch ops on 2 threads stall on OpenMP regions when ranks share
cores (several ms per op), and NumPy's per-call cost is a fraction of torch's, which
matters for the many small tensors of a model. The sets are the same. :func:`sampled_scan`
takes scores made on demand, chunk by chunk, so that a caller need not store them.

Ties at the ``k``-th score keep the lowest indices. NaN scores are never selected by the
sampled path; inputs with NaN belong to the caller.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

SAMPLED_MIN = 1 << 16  # below this many scores the exact path is as fast
_SAMPLE_SHARE = 1 / 128  # sample size as a share of the scores (at least _MIN_SAMPLE)
_MIN_SAMPLE = 4096
_MARGIN_SIGMAS = 4.0  # each threshold sits this many std devs of the sample count off target
_CHUNK = 1 << 16  # CPU scan chunk: the compares and the band's nonzero stay in cache
_NUMPY = (torch.float32, torch.float64)  # CPU score dtypes taking the NumPy path


def top_mask(scores: torch.Tensor, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(N,) bool mask with exactly ``k`` True: the ``k`` largest of the 1-D ``scores``."""
    n = scores.numel()
    _check_k(n, k)
    if k == 0:
        return torch.zeros(n, dtype=torch.bool, device=scores.device)
    if k == n:
        return torch.ones(n, dtype=torch.bool, device=scores.device)
    mask = _sampled(scores, k, generator) if n >= SAMPLED_MIN else None
    return mask if mask is not None else _exact(scores, k)


def top_mask_numpy(
    scores: np.ndarray, k: int, generator: torch.Generator | None = None, *, out: np.ndarray | None = None,
    sampled: bool = True,
) -> np.ndarray:
    """:func:`top_mask` for a 1-D NumPy array of fp32/fp64 scores (the same set), written into
    ``out`` (an (N,) bool array, e.g. reused scratch) when given; ``sampled=False``: the exact
    path whatever the size."""
    n = scores.size
    _check_k(n, k)
    mask = out if out is not None else np.empty(n, np.bool_)
    if k == 0 or k == n:
        mask.fill(k == n)
        return mask
    found = _sampled_np(scores, k, generator, mask) if sampled and n >= SAMPLED_MIN else None
    return found if found is not None else _exact_np(scores, k, mask)


def _check_k(n: int, k: int) -> None:
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")


def _numpy_path(scores: torch.Tensor) -> bool:
    return scores.device.type == "cpu" and scores.dtype in _NUMPY and scores.dim() == 1 and scores.is_contiguous()


def _exact(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``torch.topk``'s set, with ties at the ``k``-th score resolved to the lowest indices."""
    if _numpy_path(scores):
        return torch.from_numpy(_exact_np(scores.detach().numpy(), k, np.empty(scores.numel(), np.bool_)))
    return _exact_torch(scores, k)


def _exact_torch(scores: torch.Tensor, k: int) -> torch.Tensor:
    top = torch.topk(scores, k, sorted=False)
    kth = top.values.min()
    mask = scores > kth  # (n,)
    short = k - int(torch.count_nonzero(mask))
    if short > 0:
        mask[indices(scores == kth)[:short]] = True
    if int(torch.count_nonzero(mask)) != k:  # NaN scores (never equal to themselves): topk's own set
        mask = torch.zeros_like(mask)
        mask[top.indices] = True
    return mask


def _exact_np(s: np.ndarray, k: int, mask: np.ndarray) -> np.ndarray:
    """The exact top ``k`` of ``s`` (0 < k < n) as a bool mask, written into ``mask``.
    ``np.partition`` finds the ``k``-th largest, as ``torch.topk`` does; with NaN scores
    (which both order above every number) the set is ``torch.topk``'s own."""
    n = s.size
    kth = np.partition(s, n - k)[n - k]
    np.greater(s, kth, out=mask)
    short = k - int(np.count_nonzero(mask))
    if short > 0:
        mask[np.flatnonzero(s == kth)[:short]] = True
    if int(np.count_nonzero(mask)) != k:  # NaN among the top k
        mask[:] = _exact_torch(torch.from_numpy(s), k).numpy()
    return mask


def _ranks(n: int, k: int) -> tuple[int, int, int]:
    """(m, j_hi, j_lo): the sample size, and the 1-based ranks from the top of the sample
    whose scores bracket the ``k``-th largest of ``n`` with high probability."""
    m = min(n, max(_MIN_SAMPLE, math.ceil(n * _SAMPLE_SHARE)))
    expect = k * m / n  # sample scores expected above the k-th largest
    spread = _MARGIN_SIGMAS * math.sqrt(expect) + 1
    j_hi, j_lo = math.floor(expect - spread), math.ceil(expect + spread)  # 1-based ranks from the top
    return m, j_hi, j_lo


def _sampled(scores: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor | None:
    """The mask by the sampled band, or None when the sample misjudged (the caller then runs
    the exact path)."""
    if _numpy_path(scores):
        found = _sampled_np(scores.detach().numpy(), k, generator, np.empty(scores.numel(), np.bool_))
        return None if found is None else torch.from_numpy(found)
    n = scores.numel()
    m, j_hi, j_lo = _ranks(n, k)
    sample = scores[torch.randint(n, (m,), generator=generator, device=scores.device)]  # (m,) with replacement
    hi = sample.kthvalue(m - j_hi + 1).values if j_hi >= 1 else None  # fewer than k scores lie above hi
    lo = sample.kthvalue(m - j_lo + 1).values if j_lo <= m else None  # more than k lie at or above lo
    mask = scores > hi if hi is not None else torch.zeros(n, dtype=torch.bool, device=scores.device)  # (n,)
    need = k - int(torch.count_nonzero(mask))  # (count_nonzero is much faster than sum on bools)
    if need == 0:
        return mask
    in_band = ~mask if lo is None else (scores >= lo) ^ mask  # (n,) scores > hi lie inside scores >= lo
    where = indices(in_band)  # (b,) ascending; every score equal to the k-th largest is in the band
    band = scores[where]  # (b,) the few scores that need ranking
    if need < 0 or need > band.numel():
        return None  # the sample misjudged: the exact path
    kth = band.kthvalue(band.numel() - need + 1).values  # the k-th largest score overall
    pick = band > kth  # (b,)
    short = need - int(torch.count_nonzero(pick))  # ties at kth to take, lowest indices first
    if short:
        pick[indices(band == kth)[:short]] = True
    mask[where[pick]] = True
    return mask


def _sampled_np(s: np.ndarray, k: int, generator: torch.Generator | None, mask: np.ndarray) -> np.ndarray | None:
    """:func:`_sampled` in NumPy, chunked: the mask, written into ``mask``, or None when the
    sample misjudged."""
    return sampled_scan(s.size, k, generator, lambda pos: s[pos], lambda: lambda a, b: s[a:b], mask)


def serial(fn: Callable[[int, int], object], n: int) -> list:
    """The default ``split`` of :func:`sampled_scan`: ``[fn(0, n)]``."""
    return [fn(0, n)]


def sampled_scan(
    n: int,
    k: int,
    generator: torch.Generator | None,
    scores_at: Callable[[np.ndarray], np.ndarray],
    scorer: Callable[[], Callable[[int, int], np.ndarray]],
    mask: np.ndarray,
    chunk: int = _CHUNK,
    split: Callable[[Callable[[int, int], object], int], list] = serial,
) -> np.ndarray | None:
    """The sampled path over ``n`` scores that the caller makes on demand, so that they need
    never be stored whole: ``scores_at(pos)`` gives the scores at the (m,) positions ``pos``;
    ``scorer()`` gives a function ``scores_of(a, b)`` for the scores of ``[a, b)`` (fp32 or
    fp64, read before its next call; ``b - a`` at most ``chunk``, ``a`` a multiple of it),
    one per part of the scan. ``split(fn, n)`` runs ``fn(a, b)`` over consecutive parts of
    ``[0, n)`` (each starting at a multiple of ``chunk``), perhaps on several threads, and
    returns the results in order. Returns the mask of the top ``k``, written into the (n,)
    bool ``mask``, or None when the sample misjudged (the caller then runs the exact path).
    One scan: scores above ``hi`` go straight into the mask; the band ``[lo, hi]`` is
    collected as positions and scores and ranked on its own."""
    m, j_hi, j_lo = _ranks(n, k)
    sample = scores_at(torch.randint(n, (m,), generator=generator).numpy())  # (m,) drawn with replacement
    ranks = [r for r in (m - j_hi if j_hi >= 1 else None, m - j_lo if j_lo <= m else None) if r is not None]
    part = np.partition(sample, ranks) if ranks else sample
    hi = part[m - j_hi] if j_hi >= 1 else np.inf  # fewer than k scores lie above hi
    lo = part[m - j_lo] if j_lo <= m else -np.inf  # more than k lie at or above lo
    if np.isnan(hi) or np.isnan(lo):
        return None
    return _take_band(split(_band_scan(scorer, mask, chunk, hi, lo), n), k, mask)


_Part = tuple[int, list[np.ndarray], list[np.ndarray]]  # (scores above hi, band positions, band scores)


def _band_scan(
    scorer: Callable[[], Callable[[int, int], np.ndarray]],
    mask: np.ndarray,
    chunk: int,
    hi: np.floating[Any] | float,
    lo: np.floating[Any] | float,
) -> Callable[[int, int], _Part]:
    """The scan of one part ``[a0, a1)`` of :func:`sampled_scan`: writes ``score > hi`` into
    ``mask`` and returns (how many, positions and scores of the band ``[lo, hi]``)."""

    def scan(a0: int, a1: int) -> _Part:
        scores_of = scorer()
        above = 0
        where: list[np.ndarray] = []
        band: list[np.ndarray] = []
        inband = np.empty(min(a1 - a0, chunk), np.bool_)
        for a in range(a0, a1, chunk):
            c, mc = scores_of(a, min(a1, a + chunk)), mask[a : a + chunk]
            np.greater(c, hi, out=mc)
            b = inband[: c.size]
            np.greater_equal(c, lo, out=b)
            b ^= mc  # scores > hi lie inside scores >= lo
            at = b.nonzero()[0]
            if at.size:
                where.append(at + a)
                band.append(c[at])
            above += int(np.count_nonzero(mc))
        return above, where, band

    return scan


def _take_band(parts: list[_Part], k: int, mask: np.ndarray) -> np.ndarray | None:
    """Complete ``mask`` (holding the scores above ``hi``) from the band the parts collected:
    the top ``k`` overall, ties lowest index first; None when the sample misjudged."""
    need = k - sum(p[0] for p in parts)
    found = [w for p in parts for w in p[1]]  # the band's positions (ascending) and scores
    where = np.concatenate(found) if found else np.empty(0, np.int64)  # (b,) every score equal to
    # the k-th largest is in the band
    if need < 0 or need > where.size:
        return None  # the sample misjudged: the exact path
    if need:
        band = np.concatenate([b for p in parts for b in p[2]])  # (b,) the few scores that need ranking
        kth = np.partition(band, band.size - need)[band.size - need]  # the k-th largest score overall
        pick = band > kth
        short = need - int(np.count_nonzero(pick))  # ties at kth to take, lowest indices first
        if short:
            pick[np.flatnonzero(band == kth)[:short]] = True
        mask[where[pick]] = True
    return mask


def indices(mask: torch.Tensor) -> torch.Tensor:
    """Ascending int64 positions of the True entries of a 1-D bool mask (numpy's scan on the
    CPU, about 3x faster there than ``torch.nonzero``)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(1)

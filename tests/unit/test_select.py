"""Exact top-k masks through a sampled band: the same set as torch.topk, ties to the lowest
indices, and the exact fallback when the sample misjudges."""

import pytest
import torch

from thinwire.numerics import select


def _topk_set(scores: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[torch.topk(scores, k).indices] = True
    return mask


@pytest.mark.parametrize("share", [0.001, 0.1, 0.5, 0.93, 0.9999])
def test_sampled_mask_is_the_exact_top_k(share):
    n = 300_000  # above SAMPLED_MIN: the sampled path
    g = torch.Generator().manual_seed(7)
    scores = torch.rand(n, generator=g) ** 3  # distinct values, skewed
    k = int(share * n)
    mask = select.top_mask(scores, k, torch.Generator().manual_seed(1))
    assert mask.dtype == torch.bool and int(mask.sum()) == k
    assert torch.equal(mask, _topk_set(scores, k))


def test_every_seed_gives_the_same_set():
    scores = torch.randn(200_000, generator=torch.Generator().manual_seed(3)).abs()
    masks = [select.top_mask(scores, 1234, torch.Generator().manual_seed(s)) for s in range(5)]
    assert all(torch.equal(m, masks[0]) for m in masks)


def test_ties_at_the_kth_score_keep_the_lowest_indices():
    n, k = 100_000, 40_000
    scores = torch.zeros(n)
    scores[::10] = 2.0  # 10,000 clear winners, then 90,000 tied at 0
    mask = select.top_mask(scores, k, torch.Generator().manual_seed(0))
    assert int(mask.sum()) == k
    assert bool(mask[::10].all())
    tied_kept = (~(scores > 0)) & mask
    want = (~(scores > 0)).nonzero().squeeze(1)[: k - 10_000]
    assert torch.equal(tied_kept.nonzero().squeeze(1), want)


def test_all_equal_scores_and_small_inputs_and_edges():
    assert torch.equal(select.top_mask(torch.ones(70_000), 5), torch.arange(70_000) < 5)
    small = torch.tensor([0.5, 3.0, -1.0, 2.0])  # exact path
    assert select.top_mask(small, 2).tolist() == [False, True, False, True]
    assert not select.top_mask(small, 0).any() and select.top_mask(small, 4).all()
    with pytest.raises(ValueError, match=r"k must be in \[0, 4\], got 5"):
        select.top_mask(small, 5)


def test_a_misjudged_sample_falls_back_to_the_exact_path(monkeypatch):
    scores = torch.rand(100_000, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(select, "_sampled", lambda *a: None)  # as when the band misses the k-th score
    assert torch.equal(select.top_mask(scores, 777), _topk_set(scores, 777))


def test_indices_ascend_and_match_nonzero():
    mask = torch.rand(50_000, generator=torch.Generator().manual_seed(4)) < 0.3
    got = select.indices(mask)
    assert got.dtype == torch.int64 and torch.equal(got, mask.nonzero().squeeze(1))


def test_the_band_check_catches_misjudged_samples(monkeypatch):
    monkeypatch.setattr(select, "_MARGIN_SIGMAS", 0.0)  # a band one sample rank wide: often misses
    scores = torch.rand(100_000, generator=torch.Generator().manual_seed(5))
    want = _topk_set(scores, 5_000)
    outcomes = [select._sampled(scores, 5_000, torch.Generator().manual_seed(s)) for s in range(40)]
    assert any(m is None for m in outcomes)  # misjudged: the caller takes the exact path
    assert all(torch.equal(m, want) for m in outcomes if m is not None)
    assert torch.equal(select.top_mask(scores, 5_000, torch.Generator().manual_seed(0)), want)

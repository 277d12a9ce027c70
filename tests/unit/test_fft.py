"""FFT sparsification: Parseval selection, passthrough, spectra summed before one inverse."""

import math

import pytest
import torch

from thinwire.aggregate import Aggregator
from thinwire.codecs.fft import fast_length
from thinwire.codecs.registry import build_codec
from thinwire.comm.local import LocalWorld


def _x(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(64, 60), (1000,), (5, 9, 15), (64, 65), (7, 11, 13)])
def test_kept_energy_is_one_minus_the_relative_error_squared(shape):
    """Before quantization (bits=32), Parseval: kept weighted energy / total == 1 - ||u-û||²/||u||²
    when the length is already 5-smooth (3840, 1000: even; 675: odd). Padded lengths (4160 ->
    4320, 1001 -> 1024) drop the error that falls on the padding, so there 1 - err >= kept."""
    x = _x(shape).double().float()
    codec = build_codec("fft:theta=0.7,bits=32")
    out = codec.decode(codec.encode(x))
    length = fast_length(x.numel())
    spec = torch.fft.rfft(x.reshape(-1).double(), n=length)
    w = torch.full((spec.numel(),), 2.0, dtype=torch.float64)
    w[0] = 1
    if length % 2 == 0:
        w[-1] = 1
    energy = w * spec.abs().square()
    kept = energy.topk(math.ceil(0.3 * spec.numel())).values.sum() / energy.sum()
    err = ((x - out).double().square().sum() / x.double().square().sum()).item()
    if length == x.numel():
        assert abs(kept.item() - (1 - err)) < 1e-5
    else:
        assert 1 - err >= kept.item() - 1e-5


def test_theta_zero_full_precision_is_a_passthrough():
    x = _x((300, 17))
    codec = build_codec("fft:theta=0,bits=32")
    out = codec.decode(codec.encode(x))
    assert ((out - x).norm() / x.norm()).item() < 1e-6


def test_summed_spectra_equal_the_sum_of_each_decode():
    """One inverse FFT of the summed spectra == the sum of per-payload inverse FFTs (linearity)."""
    codec = build_codec("fft:theta=0.8")
    payloads = [codec.encode(_x((50, 40), seed=s)) for s in range(4)]
    out = torch.empty(50, 40)
    codec.decode_sum(payloads, out)
    torch.testing.assert_close(out, sum(codec.decode(p) for p in payloads), rtol=0, atol=1e-5)


def test_aggregator_mean_over_ranks_equals_the_mean_of_each_ranks_decode():
    named = [("w", torch.zeros(48, 40))]

    def fn(comm):
        codec = build_codec("fft:theta=0.8")
        g = _x((48, 40), seed=comm.rank)
        own = codec.decode(codec.encode(g, key="w"))
        Aggregator(named, lambda n, t: codec, comm).reduce_({"w": g})
        return g, own

    results = LocalWorld(3).run(fn)
    mean = sum(own for _, own in results) / 3
    for out, _ in results:
        torch.testing.assert_close(out, mean, rtol=0, atol=1e-5)


def test_positions_take_the_smaller_encoding_and_decode_the_same():
    x = _x((64, 65))
    bins = fast_length(x.numel()) // 2 + 1
    for theta, kind in [(0.99, "index"), (0.5, "bitmap")]:  # few bins kept: indices; many: a bitmap
        auto = build_codec(f"fft:theta={theta}")
        kept = math.ceil((1 - theta) * bins)
        expected = 4 * kept if kind == "index" else math.ceil(bins / 8)
        assert auto.encode(x).tensors[1].numel() * auto.encode(x).tensors[1].element_size() == expected
        forced = build_codec(f"fft:theta={theta},positions={'bitmap' if kind == 'index' else 'index'}")
        assert torch.equal(auto.decode(auto.encode(x)), forced.decode(forced.encode(x)))


def test_fast_length_is_the_next_5_smooth_number():
    def smooth(m):
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        return m == 1

    for n in list(range(1, 200)) + [25_557_032]:
        length = fast_length(n)
        assert length >= n and smooth(length)
        assert all(not smooth(m) for m in range(n, length))


@pytest.mark.parametrize("spec, rule", [
    ("fft:theta=1", r"theta must be in \[0, 1\), got 1"),
    ("fft:theta=-0.1", r"theta must be in \[0, 1\), got -0.1"),
    ("fft:bits=12", r"bits must be in 3..8, 16 or 32, got 12"),
    ("fft:exp_bits=7", r"exp_bits must be in 1..6, got 7"),
    ("fft:positions=list", r"positions must be one of auto\|bitmap\|index, got 'list'"),
])
def test_bad_knobs_state_the_rule(spec, rule):
    with pytest.raises(ValueError, match=rule):
        build_codec(spec)

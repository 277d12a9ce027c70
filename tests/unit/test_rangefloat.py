"""Range-based floats: every code round-trips, rounding matches a scalar reference, the
window saturates at the top and flushes to zero below."""

import math

import pytest
import torch

from thinwire.codecs.specs import build_codec
from thinwire.numerics import range_format


def _reference(v: float, e: int, m: int, e_max: int) -> float:
    """The format's value for ``v``, computed with Python floats one value at a time."""
    if v == 0:
        return 0.0
    a = abs(v)
    exp = math.floor(math.log2(a))
    q = round((a / 2.0**exp - 1) * 2**m)  # Python rounds ties to even, as torch.round
    if q == 2**m:
        q, exp = 0, exp + 1
    e_min = e_max - (2**e - 2)
    if exp > e_max:
        q, exp = 2**m - 1, e_max
    if exp < e_min:
        return 0.0
    return math.copysign((1 + q / 2**m) * 2.0**exp, v)


@pytest.mark.parametrize("e,m", [(e, m) for e in range(1, 5) for m in range(0, 5)] + [(5, 10)])
@pytest.mark.parametrize("e_max", [-7, 0, 5])
def test_every_code_round_trips(e, m, e_max):
    codes = torch.arange(2 ** (1 + e + m), dtype=torch.int32)
    values = range_format.decode(codes, e, m, e_max)
    again = range_format.encode(values, e, m, e_max)
    expcode = (codes >> m) & (2**e - 1)
    # every non-zero code is its own value's code; exponent code 0 is zero, which encodes as 0
    assert torch.equal(again[expcode != 0], codes[expcode != 0])
    assert torch.equal(values[expcode == 0], torch.zeros(int((expcode == 0).sum())))
    assert torch.equal(again[expcode == 0], torch.zeros(int((expcode == 0).sum()), dtype=torch.int32))


@pytest.mark.parametrize("e,m", [(2, 2), (3, 4), (4, 3)])
def test_rounding_matches_a_scalar_reference(e, m):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2000, generator=g) * torch.exp(3 * torch.randn(2000, generator=g))
    e_max = range_format.exponent_max(x)
    got = range_format.decode(range_format.encode(x, e, m, e_max), e, m, e_max)
    want = torch.tensor([_reference(v, e, m, e_max) for v in x.tolist()])
    assert torch.equal(got, want)


def test_window_saturates_at_the_top_and_flushes_below():
    e, m, e_max = 2, 2, 3  # window exponents 1..3: values 2 .. 14
    x = torch.tensor([15.9, 14.0, 2.0, 1.99, 0.5, -15.9, 0.0])
    got = range_format.decode(range_format.encode(x, e, m, e_max), e, m, e_max)
    # 15.9 rounds up to 16 = 2^4, above the window: the top code 1.75 * 2^3 = 14
    # 1.99 rounds up to 2.0 = 2^1 (a carry into the window); 0.5 lies below it
    assert got.tolist() == [14.0, 14.0, 2.0, 2.0, 0.0, -14.0, 0.0]


def test_non_finite_inputs_and_negative_zero_have_stated_codes():
    e, m = 3, 4
    x = torch.tensor([1.0, float("inf"), -float("inf"), float("nan"), -0.0, 0.25])
    e_max = range_format.exponent_max(x)
    assert e_max == 0  # the window follows the finite values only
    got = range_format.decode(range_format.encode(x, e, m, e_max), e, m, e_max)
    top = (2 - 2.0**-m) * 2.0**e_max  # the top code
    assert got.tolist() == [1.0, top, -top, 0.0, 0.0, 0.25]
    assert range_format.encode(torch.tensor([-0.0]), e, m, e_max).item() == 0


def test_relative_error_inside_the_window_is_at_most_half_an_ulp():
    e, m = 3, 4
    x = torch.linspace(1.0, 2.0**3, 5000)
    e_max = range_format.exponent_max(x)
    got = range_format.decode(range_format.encode(x, e, m, e_max), e, m, e_max)
    assert ((got - x).abs() / x).max().item() <= 2.0 ** -(m + 1)


def test_codec_payload_and_knob_rules():
    c = build_codec("rangefloat")
    x = torch.randn(33, 17)
    p = c.encode(x, key="w")
    assert p.nbytes == 4 + math.ceil(33 * 17 * 8 / 8) == c.nbytes(x.shape, x.dtype)
    assert build_codec("rangefloat:bits=16,exp_bits=5").nbytes(x.shape, x.dtype) == 4 + 2 * 33 * 17
    with pytest.raises(ValueError, match=r"bits must be in 3..8 or 16, got 12"):
        build_codec("rangefloat:bits=12")
    with pytest.raises(ValueError, match=r"exp_bits must be in 1..7, got 8"):
        build_codec("rangefloat:exp_bits=8")
    with pytest.raises(ValueError, match=r"exp_bits \+ man_bits \+ 1 must equal bits: 3 \+ 3 \+ 1 != 8"):
        build_codec("rangefloat:man_bits=3")
    assert build_codec("rangefloat:bits=6,exp_bits=2").config.man_bits == 3  # the rest, resolved


def test_four_bits_without_a_mantissa_span_seven_octaves_of_powers_of_two():
    c = build_codec("rangefloat:bits=4,exp_bits=3")  # E3M0: 1 sign and 3 exponent bits
    assert c.config.man_bits == 0
    x = torch.tensor([1.0, -0.5, 0.25, 2.0**-6, 2.0**-7, 0.3, -0.7])
    y = c.decode(c.encode(x, key="w"))
    # the window: 2^0 down to 2^-6; below it, zero; inside it, the nearest power of two
    assert y.tolist() == [1.0, -0.5, 0.25, 2.0**-6, 0.0, 0.25, -0.5]


def _hard_values(n: int, seed: int) -> torch.Tensor:
    """Values over 60 octaves, both signs, plus zeros, infinities, NaN, subnormals and fp32 extremes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 1.1754942e-38, 1.17549435e-38, 3.4e38, -3.4e38]
    return torch.cat([x, torch.tensor(special)])


@pytest.mark.parametrize("e", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("m", [0, 1, 4, 10])
def test_bit_arithmetic_path_equals_the_definition(e, m):
    x = _hard_values(3000, seed=e * 16 + m)
    lowest = -126 + (1 << e) - 2  # the e_max whose window bottom is fp32's smallest normal exponent
    for e_max in (lowest, lowest + 1, -3, 0, 29, 127):
        codes = range_format.encode(x, e, m, e_max)
        assert torch.equal(codes, range_format._encode_reference(x, e, m, e_max)), e_max
        assert torch.equal(range_format.decode(codes, e, m, e_max), range_format._decode_reference(codes, e, m, e_max))


def test_chunked_passes_cover_every_element_and_write_into_out():
    x = _hard_values(range_format._CPU_CHUNK * 2 + 12345, seed=3)  # three chunks, the last partial
    e_max = range_format.exponent_max(x)
    want = range_format._encode_reference(x, 3, 4, e_max)
    out = torch.empty(x.numel(), dtype=torch.uint8)
    assert range_format.encode(x, 3, 4, e_max, out=out) is not None
    assert torch.equal(out.to(torch.int32), want)
    values = torch.empty(x.numel())
    range_format.decode(out, 3, 4, e_max, out=values)
    assert torch.equal(values, range_format._decode_reference(want, 3, 4, e_max))
    with pytest.raises(ValueError, match="out holds 5 codes"):
        range_format.encode(x, 3, 4, e_max, out=torch.empty(5, dtype=torch.int32))


def test_windows_reaching_below_normal_floats_use_the_definition():
    e, m, e_max = 4, 3, -125  # window bottom 2^-139: subnormal fp32 values are inside it
    x = torch.tensor([2.0**-130, -(2.0**-139), 1.5 * 2.0**-126, 2.0**-140, 2.0**-125])
    got = range_format.decode(range_format.encode(x, e, m, e_max), e, m, e_max)
    want = torch.tensor([_reference(v, e, m, e_max) for v in x.tolist()])
    assert torch.equal(got, want)
    assert got[0].item() == 2.0**-130 and got[3].item() == 0.0

"""Range-based floats: every code round-trips, rounding matches a scalar reference, the
window saturates at the top and flushes to zero below."""

import math
import threading

import numpy as np
import pytest
import torch

from thinwire.codecs.specs import build_codec
from thinwire.numerics import range_format
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack


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


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 2 * 65536 + 3])
def test_byte_table_decode_equals_unpacking_then_decoding(bits, count):
    """One lookup per byte gives the values that unpacking the codes and decoding them give,
    for every layout of exponent and mantissa bits, windows below fp32's normals included."""
    g = torch.Generator().manual_seed(count + bits)
    codes = torch.randint(0, 1 << bits, (count,), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    for e in range(1, bits):
        m = bits - 1 - e
        for e_max in (-125, -3, 0, 20):
            want = range_format.decode(unpack(packed, count, bits), e, m, e_max)
            out = np.full(count, np.nan, np.float32)  # stale values: every one must be written
            range_format.decode_packed_numpy(packed.numpy(), count, bits, e, m, e_max, out)
            assert torch.equal(torch.from_numpy(out), want), (e, m, e_max)


@pytest.mark.parametrize("bits,e", [(3, 1), (4, 3), (4, 2), (5, 2), (6, 3), (7, 4), (8, 3), (16, 5)])
@pytest.mark.parametrize("n", [1, 2, 3, 2 * 65536 + 11])
def test_the_wire_on_the_cpu_is_the_definition_packed(bits, e, n):
    """Wire.encode (byte codes in kept room, NumPy packing) and Wire.decode (a table per
    byte at 4 bits) against the format's definition and the generic packer, NaN, inf and
    subnormal inputs and a window reaching below fp32's normals included; with ``out`` they
    fill the tensor given."""
    m = bits - 1 - e
    wire = range_format.Wire(bits, e, m)
    samples = [_hard_values(n, seed=bits * 7 + n)[:n], torch.tensor([2.0**-130, -(2.0**-139), 2.0**-126] * n)[:n]]
    for x in samples:
        e_max, got = wire.encode(x)
        assert e_max == range_format.exponent_max(x)
        codes = range_format._encode_reference(x, e, m, e_max)
        want = (codes - (1 << 15)).to(torch.int16) if bits == 16 else pack(codes, bits)
        assert torch.equal(got, want)
        values = range_format._decode_reference(codes, e, m, e_max)
        assert torch.equal(wire.decode(e_max, got, n), values)
        if bits == 16:
            continue
        shape, dtype = wire.spec(n)
        kept = torch.full(shape, 0x5A, dtype=dtype)
        assert wire.encode(x, out=kept)[1] is kept and torch.equal(kept, want)
        into = torch.full((n,), math.nan)
        wire.decode(e_max, kept, n, out=into)
        assert torch.equal(into, values)


def test_the_wire_refuses_an_out_of_another_shape():
    wire = range_format.Wire(4, 3, 0)
    with pytest.raises(ValueError, match=r"out must be the contiguous wire tensor of 10 values"):
        wire.encode(torch.ones(10), out=torch.empty(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out holds 9 values, need 10"):
        wire.decode(0, torch.zeros(packed_nbytes(10, 4), dtype=torch.uint8), 10, out=torch.empty(9))


@pytest.mark.parametrize("spec", ["rangefloat", "rangefloat:bits=4,exp_bits=3", "rangefloat:bits=3,exp_bits=1"])
def test_the_codecs_kept_buffers_give_what_encode_and_decode_give(spec):
    """encode_into writes encode's bytes into the buffer handed over; decode_to, decode_add
    and decode_sum are decode's values, bit for bit, into fp32 ``out`` (and through the
    generic path into a bf16 or strided one)."""
    codec = build_codec(spec)
    xs = [torch.randn(1001, generator=torch.Generator().manual_seed(s)) * 10.0**-s for s in range(3)]
    payloads = [codec.encode(x) for x in xs]
    kept: dict[tuple, torch.Tensor] = {}

    def buffer(shape, dtype):
        return kept.setdefault((tuple(shape), dtype), torch.full(shape, 7, dtype=dtype))

    for x, p in zip(xs, payloads):
        q = codec.encode_into(x, buffer)
        assert all(torch.equal(a, b) for a, b in zip(p.tensors, q.tensors))
        assert any(t.data_ptr() == b.data_ptr() for t in q.tensors for b in kept.values())
    decoded = [codec.decode(p) for p in payloads]
    total = torch.full((1001,), 3.0)
    codec.decode_sum(payloads, total)
    assert torch.equal(total, decoded[0] + decoded[1] + decoded[2])
    base = torch.randn(1001)
    added = base.clone()
    codec.decode_add(payloads[1], added)
    assert torch.equal(added, base + decoded[1])
    strided = torch.zeros(2002)[::2]
    codec.decode_to(payloads[2], strided)
    assert torch.equal(strided, decoded[2])
    low = torch.zeros(1001, dtype=torch.bfloat16)
    codec.decode_add(payloads[0], low)
    assert torch.equal(low, torch.zeros(1001, dtype=torch.bfloat16) + decoded[0].to(torch.bfloat16))


def test_decode_add_keeps_one_buffer_per_thread():
    """Two threads decoding different payloads at once through one codec each get their own."""
    codec = build_codec("rangefloat:bits=4,exp_bits=3")
    xs = [torch.randn(300_000, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    payloads = [codec.encode(x) for x in xs]
    want = [codec.decode(p) for p in payloads]
    results: list[list[bool]] = [[], []]

    def work(i: int) -> None:
        for _ in range(20):
            out = torch.zeros(300_000)
            codec.decode_add(payloads[i], out)
            results[i].append(torch.equal(out, want[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [[True] * 20, [True] * 20]

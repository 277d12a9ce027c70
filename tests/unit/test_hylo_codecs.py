"""Hylo's two codecs: ``twobit`` (a reference vector worked out by hand, layout, thresholds, the
NumPy path against the torch path) and ``kernels`` (unit selection, rate, exact residual)."""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.codecs.specs import build_codec
from thinwire.feedback import ErrorFeedback
from thinwire.numerics.bitpack import pack
from thinwire.policy import Policy


def _gaussian(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# -- twobit ---------------------------------------------------------------------------------------
GRAD = [-6.3, -2.1, 3.4, 1.2, 10.5, 5.1, -3.2, 2.0, -8.9, 0.0]
RESIDUAL_IN = [-3.1, 1.2, -1.3, 5.4, -2.1, 2.9, 3.0, -7.0, -2.9, -100.3]
DECODED = [-4.0, 0.0, 0.0, 4.0, 4.0, 4.0, 0.0, -4.0, -4.0, -4.0]
RESIDUAL_OUT = [-5.4, -0.9, 2.1, 2.6, 4.4, 4.0, -0.2, -1.0, -7.8, -96.3]


def test_twobit_reproduces_the_reference_vector():
    """Fixed threshold 4 with error feedback, as the aggregator applies it: bytes, decoded
    values and the residual worked out by hand (residual to fp32 rounding: 1e-5 absolute)."""
    codec, fb = build_codec("twobit:threshold=4"), ErrorFeedback()
    fb.residuals["w"] = torch.tensor(RESIDUAL_IN)
    u = fb.compensate("w", torch.tensor(GRAD))
    payload = codec.encode(u, key="w")
    t, packed = payload.tensors
    assert t.tolist() == [4.0]
    assert packed.tolist() == [0x83, 0xF2, 0xA0, 0x00]  # padded to one 32-bit word
    assert codec.decode(payload).tolist() == DECODED
    fb.update_decoded("w", u, codec, payload)
    torch.testing.assert_close(fb.residuals["w"], torch.tensor(RESIDUAL_OUT), rtol=0, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 4, 15, 16, 17, 33, 1001])
def test_twobit_payload_is_threshold_plus_whole_words(n):
    codec = build_codec("twobit")
    x = _gaussian(n)
    payload = codec.encode(x)
    assert payload.nbytes == 4 + 4 * math.ceil(n / 16) == codec.nbytes(x.shape, x.dtype)
    # the padding codes are zero
    bits = torch.tensor([(b >> s) & 3 for b in payload.tensors[1].tolist() for s in (6, 4, 2, 0)])
    assert (bits[n:] == 0).all()


@pytest.mark.parametrize(
    "spec, stat",
    [
        ("twobit", lambda u: u.square().mean().sqrt()),
        ("twobit:alpha=1.5", lambda u: 1.5 * u.square().mean().sqrt()),
        ("twobit:stat=mean", lambda u: u.abs().mean()),
        ("twobit:stat=mean,alpha=1.5", lambda u: 1.5 * u.abs().mean()),
        ("twobit:stat=rms", lambda u: u.square().mean().sqrt()),
        ("twobit:stat=max,alpha=0.5", lambda u: 0.5 * u.abs().max()),
        ("twobit:threshold=0.7", lambda u: torch.tensor(0.7, dtype=torch.float64)),
    ],
)
def test_twobit_threshold_travels_and_decodes(spec, stat):
    """t in the payload equals its definition (fp64 reference, fp32 rounding: rtol 1e-6); every
    value decodes to +t if u >= t, -t if u <= -t, else 0."""
    codec = build_codec(spec)
    u = _gaussian((37, 29), seed=3)
    payload = codec.encode(u)
    t = payload.tensors[0]
    torch.testing.assert_close(t.double(), stat(u.double()).reshape(1), rtol=1e-6, atol=0)
    expect = torch.where(u >= t, t, torch.where(u <= -t, -t, torch.zeros(())))
    assert torch.equal(codec.decode(payload), expect)


@pytest.mark.parametrize("n, scale", [(1001, 1.0), (600_001, 1.0), (1000, 1e20), (1000, 1e-25), (3, 0.0)])
def test_twobit_rms_threshold_in_and_out_of_fp32_squares(n, scale):
    """The CPU rms (chunked fp32 dots summed in fp64) against fp64, also where squares leave
    fp32's range (|x| > 1.8e19 or < 1e-19): relative 1e-6."""
    u = _gaussian(n, seed=n) * scale
    t = build_codec("twobit:stat=rms").threshold(u)
    want = u.double().square().mean().sqrt()
    assert math.isfinite(t.item())
    torch.testing.assert_close(t.double(), want.reshape(1), rtol=1e-6, atol=0)


def _hot_coordinates(spec: str, n: int = 640, k: int = 8, steps: int = 100) -> tuple[float, float]:
    """Error feedback through ``spec`` on a classifier-head-like gradient: ``k`` of ``n`` values
    get a steady gradient of 1, the others N(0, 0.05^2) noise. Returns the hot values' mean
    residual after ``steps`` steps and the share of their total gradient that was sent."""
    codec, fb = build_codec(spec), ErrorFeedback()
    gen = torch.Generator().manual_seed(0)
    hot = torch.zeros(n)
    hot[:k] = 1.0
    sent = 0.0
    for _ in range(steps):
        u = fb.compensate("w", hot + 0.05 * torch.randn(n, generator=gen))
        payload = codec.encode(u, key="w")
        sent += codec.decode(payload)[:k].mean().item()
        fb.update_decoded("w", u, codec, payload)
    return fb.residuals["w"][:k].mean().item(), sent / steps


def test_twobit_default_threshold_keeps_up_with_a_few_large_values():
    """A value moves by at most t per step. With t = mean|u| a few large values hold their
    residual near n/k = 80 steps of gradient before t matches them (measured 44.9 after 100
    steps, 55% of their gradient sent); the default (rms) needs about sqrt(n/k) = 9
    (measured 7.2, 93% sent). The bound is 2 * sqrt(n/k)."""
    residual, share = _hot_coordinates("twobit")
    assert residual < 2 * math.sqrt(640 / 8) and share > 0.9
    residual_mean, share_mean = _hot_coordinates("twobit:stat=mean")
    assert residual_mean > 4 * residual and share_mean < share  # what the default avoids


def test_hylo_preset_sends_twobit_with_the_rms_threshold():
    policy = Policy.preset("hylo")
    assert "stat=rms" in policy.describe()
    twobit = build_codec(policy.rules[1].codec)
    assert twobit.name == "twobit" and twobit.config.stat == "rms"
    assert build_codec(Policy.preset("hylo:stat=mean").rules[1].codec).config.stat == "mean"


def _reference_packed(u: torch.Tensor, t: float) -> torch.Tensor:
    code = ((u >= t).to(torch.uint8) * 3) | ((u <= -t).to(torch.uint8) * 2)
    packed = pack(code.reshape(-1), 2)
    out = torch.zeros(4 * math.ceil(u.numel() / 16), dtype=torch.uint8)
    out[: packed.numel()] = packed
    return out


@pytest.mark.parametrize("n", [5, 64, 70_001, 200_003])  # below, at and across the CPU chunk size
def test_twobit_numpy_path_equals_the_definition(n):
    """The chunked NumPy encode (multiply-folded bytes) and the table decode against the torch
    definition, with values exactly at +-t, across chunk boundaries and odd tails."""
    codec = build_codec("twobit:threshold=0.5")
    u = _gaussian(n, seed=n)
    u[:: 7] = 0.5
    u[3:: 11] = -0.5
    payload = codec.encode(u)
    assert torch.equal(payload.tensors[1], _reference_packed(u, 0.5))
    expect = torch.where(u >= 0.5, 0.5, torch.where(u <= -0.5, -0.5, 0.0))
    assert torch.equal(codec.decode(payload), expect)
    acc = _gaussian(n, seed=1)
    want = acc + expect
    codec.decode_add(payload, acc)
    assert torch.equal(acc, want)


def test_twobit_decode_sum_and_unaligned_outputs():
    """decode_sum over several payloads equals the sum of the decodes (exact: the same fp32
    additions in the same order), and decoding into a view at an odd offset is correct."""
    codec = build_codec("twobit")
    payloads = [codec.encode(_gaussian(300_001, seed=s)) for s in range(3)]
    want = codec.decode(payloads[0]) + codec.decode(payloads[1]) + codec.decode(payloads[2])
    out = torch.full((300_001,), 7.0)
    codec.decode_sum(payloads, out)
    assert torch.equal(out, want)
    big = torch.zeros(300_003)
    codec.decode_sum(payloads[:1], big[1:300_002])
    assert torch.equal(big[1:300_002], codec.decode(payloads[0])) and big[0] == 0 and big[-1] == 0


def test_twobit_special_inputs():
    codec = build_codec("twobit")
    zeros = codec.encode(torch.zeros(40))
    assert zeros.tensors[0].item() == 0 and not zeros.tensors[1].any()
    # an inf or NaN makes the adaptive threshold non-finite: all zeros are sent, none decode to NaN
    for bad in (math.inf, math.nan):
        x = _gaussian(40)
        x[5] = bad
        p = codec.encode(x)
        assert not p.tensors[1].any() and torch.equal(codec.decode(p), torch.zeros(40))
    # a fixed threshold: NaN travels as 0, +-inf as +-t
    fixed = build_codec("twobit:threshold=1")
    p = fixed.encode(torch.tensor([math.nan, math.inf, -math.inf, 0.5]))
    assert fixed.decode(p).tolist() == [0.0, 1.0, -1.0, 0.0]


# -- kernels --------------------------------------------------------------------------------------
def test_kernels_rate_follows_the_formula():
    codec = build_codec("kernels")  # r_max 0.25, r_min 0.01, beta 0.5, t_conv 16384
    assert codec.rate(100) == 0.25 and codec.rate(16384) == 0.25
    assert codec.rate(4 * 16384) == pytest.approx(0.125, rel=1e-12)
    assert codec.rate(16384 * 100**2) == 0.01  # 0.25 / 100 = 0.0025 -> clipped at r_min
    wide = build_codec("kernels:beta=1,r_max=0.5,r_min=0.1,t_conv=1000")
    assert wide.rate(2000) == pytest.approx(0.25, rel=1e-12) and wide.rate(10**6) == 0.1


def _top_units(u: torch.Tensor, units: int, k: int, score: str) -> list[int]:
    rows = u.reshape(units, -1).double()
    s = rows.abs().sum(1) if score == "l1" else rows.square().sum(1)
    order = sorted(range(units), key=lambda i: (-s[i].item(), i))  # ties: lowest unit first
    return sorted(order[:k])


@pytest.mark.parametrize("granularity", ["kernel", "filter"])
@pytest.mark.parametrize("score", ["l1", "l2"])
@pytest.mark.parametrize("shape", [(64, 32, 3, 3), (64, 64, 5), (7, 5, 3, 3)])
def test_kernels_send_the_top_units_whole(granularity, score, shape):
    codec = build_codec(f"kernels:granularity={granularity},score={score}")
    u = _gaussian(shape, seed=5)
    units = shape[0] * shape[1] if granularity == "kernel" else shape[0]
    k = max(1, math.ceil(codec.rate(u.numel()) * units))
    assert codec.units(u.shape) == (units, u.numel() // units) and codec.k(u.shape) == k
    payload = codec.encode(u)
    assert payload.nbytes == codec.nbytes(u.shape, u.dtype)
    sent = _top_units(u, units, k, score)
    rows = u.reshape(units, -1)
    assert torch.equal(payload.tensors[1], rows[sent].reshape(-1))
    dense = codec.decode(payload).reshape(units, -1)
    assert torch.equal(dense[sent], rows[sent])
    kept = torch.ones(units, dtype=torch.bool)
    kept[sent] = False
    assert not dense[kept].any()


@pytest.mark.parametrize("shape", [(64, 32, 3, 3), (16, 3, 3, 3), (33, 17, 5)])
def test_kernels_dense_sent_plus_residual_is_u_exactly(shape):
    """Through error feedback over three steps: decode(payload) + r == u bit for bit."""
    codec, fb = build_codec("kernels"), ErrorFeedback()
    for step in range(3):
        codec.step = step
        u = fb.compensate("w", _gaussian(shape, seed=step)).clone()
        payload = codec.encode(u, key="w")
        fb.update_decoded("w", u, codec, payload)
        assert torch.equal(codec.decode(payload) + fb.residuals["w"], u)


def test_kernels_ties_keep_the_lowest_units():
    codec = build_codec("kernels:r_max=0.25,r_min=0.25")
    u = torch.ones(4, 4, 3)  # 16 equal units: k = 4 -> units 0..3
    payload = codec.encode(u)
    dense = codec.decode(payload).reshape(16, 3)
    assert dense[:4].eq(1).all() and not dense[4:].any()


def test_kernels_positions_take_the_smaller_form():
    codec = build_codec("kernels")
    # 4096 units, k = ceil(0.2236 * 4096) = 916: a 512-byte bitmap beats 3664 bytes of indices
    assert codec.wire_spec(torch.Size([64, 64, 5]), torch.float32)[0] == ((512,), torch.uint8)
    # 2,097,152 units at r_min: k = 20972 indices (83888 bytes) beat a 262144-byte bitmap
    big = torch.Size([2048, 1024, 3, 3])
    assert codec.rate(big.numel()) == 0.01 and codec.k(big) == math.ceil(0.01 * 2048 * 1024) == 20972
    assert codec.wire_spec(big, torch.float32)[0] == ((20972,), torch.int32)
    forced = build_codec("kernels:positions=bitmap")
    assert forced.wire_spec(big, torch.float32)[0] == ((262144,), torch.uint8)
    for spec in ("kernels:positions=index", "kernels:positions=bitmap"):
        c = build_codec(spec)
        u = _gaussian((32, 16, 3, 3))
        assert torch.equal(c.decode(c.encode(u)), build_codec("kernels").decode(build_codec("kernels").encode(u)))


def test_kernels_declines_tensors_under_three_dimensions():
    codec = build_codec("kernels")
    assert codec.compresses(torch.Size([64, 64, 5]))
    assert not codec.compresses(torch.Size([256, 640])) and not codec.compresses(torch.Size([64]))
    assert not codec.compresses(torch.Size([4, 4, 4]))  # 64 < min_numel 1024

"""Property-based fuzzing of every registered codec (hypothesis), and malformed payloads.

Arbitrary shapes (0-d, empty, odd lengths, up to 4-d), dtypes (fp32, bf16, fp16) and values
(zeros, tiny, huge, subnormal, mixed magnitudes). For every codec and example: nothing
crashes; the payload has exactly the declared wire layout and ``nbytes``; the round trip has
the input's shape and dtype, is finite, and is no larger than a bound every codec meets
(``(sqrt(N) + 1) ||x||``: a quantiser can move each value by at most the tensor's norm);
the exact codecs reproduce their input; error feedback conserves ``u``: ``decode + r == u``
(exactly where the codec copies values, else within two fp32 roundings). Multi-round codecs
see the shapes the aggregator gives them (matrices they choose to compress).

Malformed payloads (wrong count, shape, dtype; indices, exponents, counts out of range) are
refused by every decoding entry point with a :class:`PayloadError` naming the rule.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from thinwire.codecs.specs import available, build_codec
from thinwire.feedback import ErrorFeedback
from thinwire.payload import Payload, PayloadError

CODECS = available()
# PowerSGD compresses matrices only (the aggregator sends the rest as fp32): min_numel 1 lets
# every fuzzed matrix through
FUZZ_SPECS = [n if CODECS[n].rounds == 1 else f"{n}:min_numel=1" for n in sorted(CODECS)] + [
    "topk:ratio=0.3", "qsgd:levels=3,bucket=8", "qsgd:levels=1000", "fft:theta=0,bits=32",
    "fft:positions=index", "rangefloat:bits=16,exp_bits=5", "kernels:positions=index",
    "randomk:rescale=true", "twobit:threshold=0.5"]
EXACT = {"identity"}
COPIES = ("identity", "bf16", "fp16", "topk", "kernels")  # decode + (u - decode) == u bit for bit
RANGE = {"fp16": 65504.0}  # the largest value a codec's wire format holds (fp16 overflows above, by design)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


@st.composite
def tensors(draw) -> torch.Tensor:
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=4)))
    dtype = draw(st.sampled_from(DTYPES))
    n = math.prod(shape)
    assume(n <= 3000)
    kind = draw(st.sampled_from(["gaussian", "zeros", "tiny", "huge", "subnormal", "mixed", "constant"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    z = torch.randn(n, generator=g, dtype=torch.float64)
    big = {torch.float32: 1e30, torch.bfloat16: 1e30, torch.float16: 1e3}[dtype]  # room to sum N of them
    small = {torch.float32: 1e-30, torch.bfloat16: 1e-30, torch.float16: 1e-4}[dtype]
    sub = {torch.float32: 1e-40, torch.bfloat16: 1e-40, torch.float16: 1e-7}[dtype]
    if kind == "zeros":
        z = torch.zeros(n, dtype=torch.float64)
    elif kind == "tiny":
        z = z * small
    elif kind == "huge":
        z = z * big / max(1.0, math.sqrt(n))
    elif kind == "subnormal":
        z = z * sub
    elif kind == "mixed":
        scale = torch.pow(10.0, torch.randint(-20, 20, (n,), generator=g).double())
        z = z * scale.clamp(max=big / max(1.0, math.sqrt(n)))
    elif kind == "constant":
        z = torch.full((n,), draw(st.floats(-100, 100)), dtype=torch.float64)
    return z.to(dtype).reshape(shape)


def _codec(spec: str, step: int = 1):
    codec = build_codec(spec)
    codec.step = step
    return codec


def _payloads(codec, x):
    out = [codec.encode(x, key="w")]
    for _ in range(1, codec.rounds):
        out.append(codec.encode_next(out[-1], key="w"))
    return out


def _fits(codec, x) -> bool:
    """Multi-round codecs only see what they compress (the aggregator sends the rest as fp32)."""
    return codec.rounds == 1 or codec.compresses(x.shape)


@pytest.mark.parametrize("spec", FUZZ_SPECS)
@FUZZ
@given(x=tensors())
def test_round_trip_never_crashes_and_keeps_its_declared_layout(spec, x):
    codec = _codec(spec)
    assume(_fits(codec, x))
    assume(x.numel() == 0 or x.abs().max().item() <= RANGE.get(codec.name, math.inf))
    payloads = _payloads(codec, x)
    for r, p in enumerate(payloads):
        layout = [(tuple(s), d) for s, d in codec.wire_spec(x.shape, x.dtype, r)]
        assert [(tuple(t.shape), t.dtype) for t in p.tensors] == layout
    assert sum(p.nbytes for p in payloads) == codec.nbytes(x.shape, x.dtype)
    out = codec.decode(payloads[-1])
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "a finite input decoded to a non-finite value"
    xd, od = x.double(), out.double()
    bound = (math.sqrt(max(1, x.numel())) + 1) * xd.norm() * 1.01 + 1e-30
    assert od.norm() <= bound, f"||x_hat|| {od.norm():.3g} > bound {bound:.3g}"
    if codec.name in EXACT:
        assert torch.equal(out, x)


@pytest.mark.parametrize("spec", [s for s in FUZZ_SPECS if CODECS[s.split(":")[0]].rounds == 1])
@FUZZ
@given(x=tensors())
def test_error_feedback_conserves_u(spec, x):
    codec, fb = _codec(spec), ErrorFeedback()
    assume(x.numel() == 0 or x.abs().max().item() <= RANGE.get(codec.name, math.inf))
    u = fb.compensate("w", x.float()).clone()
    d = codec.decode(codec.encode(u, key="w"))
    fb.update("w", u, d)
    back = d + fb.residuals["w"]
    assert torch.isfinite(fb.residuals["w"]).all()
    if codec.name in COPIES and not (codec.name == "randomk" and codec.config.rescale):
        assert torch.equal(back, u)
    else:
        tol = torch.finfo(torch.float32).eps * (u.abs() + d.abs()) + torch.finfo(torch.float32).tiny
        assert ((back - u).abs() <= tol).all()


# -- malformed payloads ---------------------------------------------------------------------------
X = torch.randn(40, 40, generator=torch.Generator().manual_seed(3))


def _good(spec: str) -> tuple:
    codec = _codec(spec)
    return codec, _payloads(codec, X)[-1]


def _with(p: Payload, i: int, t: torch.Tensor) -> Payload:
    tensors = list(p.tensors)
    tensors[i] = t
    return Payload(tuple(tensors), p.shape, p.dtype, p.meta)


@pytest.mark.parametrize("spec", FUZZ_SPECS)
def test_a_payload_with_the_wrong_layout_is_refused_by_every_decoder(spec):
    codec, p = _good(spec)
    bad = [
        Payload(p.tensors[:-1], p.shape, p.dtype, p.meta),  # a wire tensor missing
        _with(p, 0, torch.cat([p.tensors[0].reshape(-1), p.tensors[0].reshape(-1)[:1]])),  # one element too many
        _with(p, 0, p.tensors[0].to(torch.float64 if p.tensors[0].dtype != torch.float64 else torch.float32)),
    ]
    for q in bad:
        with pytest.raises(PayloadError, match=rf"{codec.name}: payload for a \[40, 40\]"):
            codec.decode(q)
        with pytest.raises(PayloadError):
            codec.decode_add(q, torch.zeros(40, 40))
        with pytest.raises(PayloadError):
            codec.decode_sum([p, q], torch.zeros(40, 40))


@pytest.mark.parametrize("spec, tensor, value, message", [
    ("topk", 1, 1600, r"indices must lie in \[0, 1599\]"),
    ("topk", 1, -1, r"indices must lie in \[0, 1599\]"),
    ("kernels:positions=index", 0, 10**6, "unit indices must lie in"),
    ("fft:positions=index", 1, 10**6, "bin indices must lie in"),
    ("fft", 0, 400, r"the exponent E_max must lie in \[-150, 127\]"),
    ("rangefloat", 0, -400, r"the exponent E_max must lie in \[-150, 127\]"),
    ("qsgd", 0, -1.0, "bucket norms must not be negative"),
    ("qsgd:levels=1000", 1, 1001, r"levels must lie in \[-1000, 1000\]"),
    ("terngrad", 0, -2.0, "scale max|x| must not be negative"),
    ("signsgd", 0, -1.0, "the scale must not be negative"),
    ("twobit", 0, -1.0, "the threshold must not be negative"),
])
def test_header_fields_out_of_range_are_refused(spec, tensor, value, message):
    codec, p = _good(spec)
    t = p.tensors[tensor].clone()
    t.view(-1)[0] = value
    with pytest.raises(PayloadError, match=message):
        codec.decode(_with(p, tensor, t))


@pytest.mark.parametrize("spec", ["fft:positions=bitmap", "kernels:positions=bitmap"])
def test_a_bitmap_marking_the_wrong_count_is_refused(spec):
    codec, p = _good(spec)
    i = 1 if codec.name == "fft" else 0
    t = p.tensors[i].clone()
    t.view(-1)[0] ^= 0x01  # one position more or fewer: the count is off by one whatever the byte held
    with pytest.raises(PayloadError, match="the bitmap marks"):
        codec.decode(_with(p, i, t))


def test_qsgd_packed_levels_above_s_are_refused():
    codec, p = _good("qsgd:levels=5")  # 3 level bits + a sign bit: codes can name levels up to 7
    codes = p.tensors[1].clone()
    codes.view(-1)[:] = 0xFF  # every code 0b1111: level 7 > 5
    with pytest.raises(PayloadError, match=r"levels must lie in \[0, 5\]"):
        codec.decode(_with(p, 1, codes))

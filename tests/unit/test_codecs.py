"""The codec contract, checked for every registered codec, plus per-method properties.

Generic checks run over ``registry.available()``, so a new codec is covered as soon as it
registers; it must also get a round-trip bound in ``BOUNDS``. Multi-round codecs
(``rounds > 1``, e.g. PowerSGD) run the contract checks as one rank would alone (each
round's payload is its own reduced payload); their round-trip error, linearity and error
feedback across ranks are tested in their own files. They see matrix shapes only: the
aggregator sends every tensor such a codec declines (1-D, empty) as fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from thinwire.codecs.specs import available, build_codec
from thinwire.feedback import ErrorFeedback
from thinwire.payload import Aggregation

CODECS = available()
SINGLE = [n for n, cls in CODECS.items() if cls.rounds == 1]
# Non-default configurations worth the generic checks (only those whose codec is registered).
VARIANTS = [
    "topk:ratio=0.1", "topk:ratio=1", "topk:select=sampled", "randomk:ratio=0.3", "randomk:rescale=true",
    "qsgd:levels=1", "qsgd:levels=3,bucket=64", "qsgd:bucket=512", "qsgd:levels=1000",
    "rangefloat:bits=16,exp_bits=5", "rangefloat:bits=4,exp_bits=2",
    "fft:theta=0,bits=32", "fft:theta=0.5,bits=16,exp_bits=5", "fft:positions=index",
    "fft:positions=bitmap,bits=4,exp_bits=2",
    "twobit:stat=rms", "twobit:stat=max,alpha=0.5", "twobit:threshold=0.5", "kernels:granularity=filter",
    "kernels:score=l2,positions=index",
    "dct:values=fp32,topk=4096", "dct:values=fp32", "dct:values=rangefloat", "dct:values=sign", "dct:chunk=8,topk=5",
    "dct:chunk=2,topk=1,values=rangefloat,bits=16,exp_bits=5",
]  # fmt: skip
SPECS = list(CODECS) + [v for v in VARIANTS if v.split(":")[0] in CODECS]
SINGLE_SPECS = [s for s in SPECS if s.split(":")[0] in SINGLE]
SHAPES = [(0,), (1,), (7,), (1001,), (1, 1), (33, 17), (16, 3, 3, 3), (8, 4, 1, 5)]  # (0,): empty tensors too
MATRIX_SHAPES = [s for s in SHAPES if len(s) >= 2]
SPEC_SHAPES = [(sp, sh) for sp in SPECS for sh in (SHAPES if sp.split(":")[0] in SINGLE else MATRIX_SHAPES)]


def roundtrip(codec, x, key="w"):
    """Every round's payload for one rank alone (world size 1: the reduced payload of a round
    is the rank's own payload); ``decode(payloads[-1])`` is the round trip."""
    payloads = [codec.encode(x, key=key)]
    for _ in range(1, codec.rounds):
        payloads.append(codec.encode_next(payloads[-1], key=key))
    return payloads


def encode_decode(codec, x, key="w"):
    return codec.decode(roundtrip(codec, x, key)[-1])


def gaussian(shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def make(spec: str, step: int = 3, rank: int = 0):
    codec = build_codec(spec)
    codec.step, codec.rank = step, rank
    return codec


def rel_err(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return ((x.double() - x_hat.double()).norm() / x.double().norm()).item()


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


X = gaussian((256, 256), seed=1234)  # the fixed tensor of the round-trip table (N = 65536)


def _topk_bound(r: float) -> float:
    """sqrt of the energy a standard gaussian keeps outside its top-r quantile of |z|.

    With q = Phi^-1(1 - r/2): E[z^2; |z| > q] = 2 (q phi(q) + r/2). Slack +0.008 for N = 65536.
    """
    q = math.sqrt(2) * torch.erfinv(torch.tensor(1 - r, dtype=torch.float64)).item()
    kept = 2 * (q * math.exp(-q * q / 2) / math.sqrt(2 * math.pi) + r / 2)
    return math.sqrt(1 - kept) + 0.008


def _qsgd_bound(s: int, d: int) -> float:
    """Lemma 3.1 of QSGD: E||x_hat - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2 per bucket of d
    values; 5% slack for the realized error (a sum of 65536 independent bounded terms)."""
    return 1.05 * math.sqrt(min(d / s**2, math.sqrt(d) / s))


def _dct_blocks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """(blocks, chunk * chunk) fp64 orthonormal DCT-II coefficients of the square matrix ``x``
    (a multiple of ``chunk`` per side), from the definition: the reference of the codec's."""
    n = torch.arange(chunk, dtype=torch.float64)
    d = torch.cos(math.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * chunk)) * math.sqrt(2 / chunk)
    d[0] /= math.sqrt(2)
    p, q = x.shape[0] // chunk, x.shape[1] // chunk
    blocks = x.double().reshape(p, chunk, q, chunk).transpose(1, 2)
    return (d @ blocks @ d.T).reshape(p * q, chunk * chunk)


def _dct_bound(x: torch.Tensor, chunk: int, k: int, rel: float = 0.0, *, window: int | None = None,
               sign: bool = False) -> float:
    """sqrt(dropped energy + the kept coefficients' value error) / ||x||, + 1e-5 float slack:
    each kept value off by at most ``rel`` of itself (``window``: range floats, values below
    the window's floor become zero), or, with ``sign``, replaced by +-(their mean magnitude)."""
    c = _dct_blocks(x, chunk)
    kept = c.abs().topk(k, dim=1).values  # (blocks, k) magnitudes
    dropped = c.square().sum() - kept.square().sum()
    if sign:
        err = (kept - kept.mean()).square().sum()
    else:
        err = (rel * kept).square().sum()
        if window is not None:  # below 2^(E_max - 2^e + 2) a value becomes zero: its whole size
            floor = 2.0 ** (math.floor(math.log2(kept.max().item())) - 2**window + 2)
            err += kept[kept < floor].square().sum()
    return math.sqrt((dropped + err).item()) / x.double().norm().item() + 1e-5


# Max ||x - x_hat|| / ||x|| on X, per spec, each with its reason. A float, or a function of x.
BOUNDS: dict[str, float | Callable[[torch.Tensor], float]] = {
    "identity": 0.0,  # lossless
    "bf16": 2.0**-8,  # round-to-nearest with 8 significant bits: |fl(x) - x| <= 2^-8 |x|
    "fp16": 2.0**-11 + 2.0**-24,  # 11 significant bits; values below 2^-14 (subnormal) add <= 2^-25 each
    "topk": _topk_bound(0.01),  # ~0.957: the top 1% of a gaussian holds ~8.5% of its energy
    "topk:ratio=0.1": _topk_bound(0.1),  # ~0.749
    "topk:ratio=1": 0.0,  # everything is sent
    "topk:select=sampled": _topk_bound(0.01),  # sampled selection returns the exact top-k set
    # random-k without rescale drops a random (1 - r) of the energy: sqrt(1 - r) in expectation.
    # The kept energy of k = 656 random gaussians is r * (1 +- 0.055 per sigma); allow r/2.
    "randomk": math.sqrt(1 - 0.01 / 2),
    "randomk:ratio=0.3": math.sqrt(1 - 0.3 * 0.9),
    # rescale by 1/r: error^2 = (1/r - 1)^2 kept + (1 - kept) = (1 - r)/r in expectation (~9.95);
    # 1.15 covers a 32% excess of the kept energy (~5.8 sigma for k = 656).
    "randomk:rescale=true": 1.15 * math.sqrt(0.99 / 0.01),
    "qsgd": _qsgd_bound(127, 65536),  # ~1.49: per-tensor QSGD is noisy for big tensors
    "qsgd:levels=1": _qsgd_bound(1, 65536),
    "qsgd:levels=3,bucket=64": _qsgd_bound(3, 64),
    "qsgd:bucket=512": _qsgd_bound(127, 512),  # ~0.187: the paper's bucketing
    "qsgd:levels=1000": _qsgd_bound(1000, 65536),  # int16 words
    # scaled sign, m = ||x||_1/N: ||x - m sign x||^2 = ||x||^2 - N m^2, exactly; float slack 1e-4.
    "signsgd": lambda x: math.sqrt(1 - x.abs().sum().item() ** 2 / (x.numel() * x.square().sum().item())) + 1e-4,
    # TernGrad: E||x_hat - x||^2 = sum (s|x_i| - x_i^2) = s ||x||_1 - ||x||^2, s = max|x|; 5% slack.
    "terngrad": lambda x: 1.05 * math.sqrt(x.abs().max().item() * x.abs().sum().item() / x.square().sum().item() - 1),
    # range float: inside the window each value is off by <= 2^-(m+1) of itself; values below
    # the window's floor 2^(E_max - 2^e + 2) become zero
    "rangefloat": lambda x: _rangefloat_bound(x, exp_bits=3, man_bits=4),
    "rangefloat:bits=16,exp_bits=5": lambda x: _rangefloat_bound(x, exp_bits=5, man_bits=10),
    "rangefloat:bits=4,exp_bits=2": lambda x: _rangefloat_bound(x, exp_bits=2, man_bits=1),
    # FFT: by Parseval the dropped bins' weighted energy is the sparsification error; the kept
    # real/imag parts then carry the range-float bound (relative 2^-(m+1), zero below the window)
    "fft": lambda x: _fft_bound(x, theta=0.9, exp_bits=3, man_bits=4),
    "fft:theta=0,bits=32": 1e-6,  # passthrough: rfft + irfft in fp32
    "fft:theta=0.5,bits=16,exp_bits=5": lambda x: _fft_bound(x, theta=0.5, exp_bits=5, man_bits=10),
    "fft:positions=bitmap,bits=4,exp_bits=2": lambda x: _fft_bound(x, theta=0.9, exp_bits=2, man_bits=1),
    # 2-bit: every value becomes the nearest of {-t, 0, +t} on its side of +-t, so the error is
    # exactly sum_{|x| >= t} (|x| - t)^2 + sum_{|x| < t} x^2 (float slack 1e-6)
    "twobit": lambda x: _twobit_error(x, x.square().mean().sqrt().item()),  # default stat: rms
    "twobit:stat=mean": lambda x: _twobit_error(x, x.abs().mean().item()),
    "twobit:stat=max,alpha=0.5": lambda x: _twobit_error(x, 0.5 * x.abs().max().item()),
    "twobit:threshold=0.5": lambda x: _twobit_error(x, 0.5),
    # kernels on a matrix: one element per kernel unit, rate(65536) = 0.25 * (16384/65536)^0.5 =
    # 0.125, so it is exact top-12.5%; by filter (rows), the energy outside the 32 best rows
    "kernels": _topk_bound(0.125),
    "kernels:granularity=filter": lambda x: _rows_error(x, 32, "l1"),
    "kernels:score=l2,positions=index": _topk_bound(0.125),
    # chunked DCT: by Parseval (per block, the basis is orthonormal) the dropped coefficients'
    # energy is the sparsification error; the kept ones carry their value format's error
    "dct": lambda x: _dct_bound(x, 64, 32, 2.0**-8),
    "dct:values=fp32,topk=4096": 1e-6,  # every coefficient sent: the two transforms' fp32 rounding
    "dct:values=fp32": lambda x: _dct_bound(x, 64, 32, 0.0),
    "dct:values=rangefloat": lambda x: _dct_bound(x, 64, 32, 2.0**-5, window=3),
    "dct:values=sign": lambda x: _dct_bound(x, 64, 32, sign=True),
    "dct:chunk=8,topk=5": lambda x: _dct_bound(x, 8, 5, 2.0**-8),
    "dct:chunk=2,topk=1,values=rangefloat,bits=16,exp_bits=5": lambda x: _dct_bound(x, 2, 1, 2.0**-11, window=5),
}


def _twobit_error(x: torch.Tensor, t: float) -> float:
    x = x.double()
    big = x.abs() >= t
    err2 = (x.abs()[big] - t).square().sum() + x[~big].square().sum()
    return math.sqrt(err2.item()) / x.norm().item() + 1e-6


def _rows_error(x: torch.Tensor, k: int, score: str) -> float:
    rows = x.double().reshape(x.shape[0], -1)
    s = rows.abs().sum(1) if score == "l1" else rows.square().sum(1)
    kept = rows[s.topk(k).indices].square().sum()
    return math.sqrt(1 - kept.item() / rows.square().sum().item()) + 1e-6


def _fft_bound(x: torch.Tensor, theta: float, exp_bits: int, man_bits: int) -> float:
    from test_fft import spectrum

    spec, w, energy, length = spectrum(x)
    kept = math.ceil((1 - theta) * spec.numel())
    top = energy.topk(kept).indices
    parts = torch.view_as_real(spec[top])  # (K, 2) real and imaginary parts
    weights = w[top].unsqueeze(1)
    e_max = math.floor(math.log2(parts.abs().max().item()))
    below = parts.abs() < 2.0 ** (e_max - 2**exp_bits + 2)
    quant = (2.0 ** (-2 * (man_bits + 1)) * parts.square() * ~below + parts.square() * below) * weights
    err2 = (energy.sum() - energy[top].sum() + quant.sum()) / length  # Parseval, padded length
    return math.sqrt(err2.item()) / x.double().norm().item() + 1e-6


def _rangefloat_bound(x: torch.Tensor, exp_bits: int, man_bits: int) -> float:
    x = x.double()
    e_max = math.floor(math.log2(x.abs().max().item()))
    floor = 2.0 ** (e_max - 2**exp_bits + 2)
    below = x.abs() < floor
    err2 = 2.0 ** (-2 * (man_bits + 1)) * x[~below].square().sum() + x[below].square().sum()
    return math.sqrt(err2.item()) / x.norm().item() + 1e-7


def bound_for(spec: str, x: torch.Tensor) -> float:
    b = BOUNDS[spec]
    return b(x) if callable(b) else b


def ef_is_exact(codec) -> bool:
    """decode(payload) + (u - decode(payload)) == u bit for bit: sparse codecs copy values
    exactly; casts satisfy Sterbenz (fl(u) is within a factor 2 of u, so u - fl(u) is exact)."""
    return codec.name in ("identity", "bf16", "fp16", "topk", "kernels") or (
        codec.name == "randomk" and not codec.config.rescale
    )


# -- generic contract -----------------------------------------------------------------------
def test_every_single_round_codec_has_a_round_trip_bound():
    missing = [n for n in SINGLE if n not in BOUNDS]
    assert not missing, f"add a round-trip bound for {missing} to BOUNDS in tests/unit/test_codecs.py"


@pytest.mark.parametrize("spec, shape", SPEC_SHAPES, ids=str)
def test_nbytes_and_wire_spec_match_the_payload(spec, shape):
    codec = make(spec)
    x = gaussian(shape)
    payloads = roundtrip(codec, x)
    assert sum(p.nbytes for p in payloads) == codec.nbytes(torch.Size(shape), x.dtype)
    for r, payload in enumerate(payloads):
        got = [(tuple(t.shape), t.dtype) for t in payload.tensors]
        assert got == [(tuple(s), d) for s, d in codec.wire_spec(torch.Size(shape), x.dtype, r)]
        assert payload.shape == x.shape and payload.dtype == x.dtype


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_decode_has_input_shape_and_dtype(spec, dtype):
    codec = make(spec)
    x = gaussian((16, 3, 3, 3), dtype=dtype)
    out = encode_decode(codec, x)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("spec", [s for s in BOUNDS if s.split(":")[0] in SINGLE])
def test_round_trip_error_within_bound(spec):
    codec = make(spec)
    err = rel_err(X, codec.decode(codec.encode(X, key="w")))
    assert err <= bound_for(spec, X), f"{spec}: relative error {err:.5f} > bound {bound_for(spec, X):.5f}"


@pytest.mark.parametrize("spec", SINGLE_SPECS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_input_round_trip(spec, dtype):
    """Same bound as fp32, widened by the rounding of the output to ``dtype`` (2 unit roundoffs)."""
    codec = make(spec)
    x = X.to(dtype)
    out = codec.decode(codec.encode(x, key="w"))
    u = unit_roundoff(dtype)
    b = bound_for(spec, x.float()) if spec in BOUNDS else bound_for(spec.split(":")[0], x.float())
    assert rel_err(x, out) <= b * (1 + u) + 2 * u


@pytest.mark.parametrize("spec", [s for s in SINGLE_SPECS if CODECS[s.split(":")[0]].aggregation is Aggregation.SUM])
def test_sum_codecs_are_linear(spec):
    """decode(a) + decode(b) == decode(a + b on the wire). Exact for identity and randomk (the
    same fp32 additions happen in both orders); otherwise within one rounding of the wire
    dtype: |diff| <= eps(wire) * (|decode a| + |decode b|) element-wise."""
    codec = make(spec)
    a, b = gaussian((33, 17), seed=1), gaussian((33, 17), seed=2)
    pa, pb = codec.encode(a, key="w"), codec.encode(b, key="w")
    summed = pa.with_tensors(tuple(ta + tb for ta, tb in zip(pa.tensors, pb.tensors)))
    da, db = codec.decode(pa), codec.decode(pb)
    diff = (codec.decode(summed) - (da + db)).abs()
    exact = codec.name == "identity" or (codec.name == "randomk" and not codec.config.rescale)
    eps = 0.0 if exact else max(torch.finfo(t.dtype).eps for t in pa.tensors)
    assert (diff <= eps * (da.abs() + db.abs())).all(), f"max diff {diff.max().item()}"


@pytest.mark.parametrize("spec", SINGLE_SPECS)
def test_error_feedback_identity(spec):
    """u == decode(payload) + r with r = u - decode(payload) (METHODS §0.1), over 3 steps so the
    residual is live. atol 0 where ``ef_is_exact``; otherwise two fp32 roundings:
    |d + r - u| <= eps32 * (|u| + |d|) element-wise."""
    codec, fb = make(spec, step=0), ErrorFeedback()
    for step in range(3):
        codec.step = step
        u = fb.compensate("w", gaussian((64, 65), seed=step)).clone()  # the buffer is reused by update
        d = codec.decode(codec.encode(u, key="w"))
        fb.update("w", u, d)
        back = d + fb.residuals["w"]
        if ef_is_exact(codec):
            assert torch.equal(back, u)
        else:
            tol = torch.finfo(torch.float32).eps * (u.abs() + d.abs())
            assert ((back - u).abs() <= tol).all()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_zero_input_decodes_to_zero(spec, dtype):
    codec = make(spec)
    x = torch.zeros(33, 17, dtype=dtype)
    out = encode_decode(codec, x)
    assert torch.isfinite(out).all() and torch.equal(out, torch.zeros_like(x))


@pytest.mark.parametrize("spec", SPECS)
def test_non_contiguous_input_equals_its_contiguous_copy(spec):
    for x in (gaussian((33, 17)).t(), gaussian((8, 3, 3, 4)).permute(0, 3, 1, 2)):
        assert not x.is_contiguous()
        p, q = roundtrip(make(spec), x)[-1], roundtrip(make(spec), x.contiguous())[-1]
        assert all(torch.equal(a, b) for a, b in zip(p.tensors, q.tensors))
        assert torch.equal(make(spec).decode(p), make(spec).decode(q))
        assert make(spec).decode(p).shape == x.shape


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("view", ["contiguous", "transposed", "bf16"])
def test_encode_does_not_modify_input(spec, view):
    x = {"contiguous": gaussian((33, 17)), "transposed": gaussian((33, 17)).t()}.get(view)
    x = gaussian((33, 17), dtype=torch.bfloat16) if x is None else x
    before = x.clone()
    codec = make(spec)
    codec.decode(roundtrip(codec, x)[-1])
    assert torch.equal(x, before)  # (identity's wire tensor may alias a contiguous fp32 x, by design)


@pytest.mark.parametrize("spec", SPECS)
def test_same_seed_step_key_rank_gives_same_payload(spec):
    x = gaussian((64, 65))
    p = roundtrip(make(spec, step=7, rank=2), x, key="layer.w")[-1]
    q = roundtrip(make(spec, step=7, rank=2), x, key="layer.w")[-1]
    assert all(torch.equal(a, b) for a, b in zip(p.tensors, q.tensors))


@pytest.mark.parametrize("spec", SPECS)
def test_decode_add_equals_dense_add(spec):
    codec = make(spec)
    payload = roundtrip(codec, gaussian((33, 17)))[-1]
    out = gaussian((33, 17), seed=5)
    expected = out + codec.decode(payload)
    codec.decode_add(payload, out)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS)
def test_decode_sub_equals_dense_subtraction(spec):
    """Error feedback's update ``r = u − decode(payload)``, in place: the dense subtraction,
    bit for bit wherever ``decode_add`` is the dense addition bit for bit (the default negates
    around ``decode_add``, and negation is exact)."""
    codec = make(spec)
    payload = roundtrip(codec, gaussian((33, 17)))[-1]
    out = gaussian((33, 17), seed=5)
    decoded = codec.decode(payload)
    added = out.clone()
    codec.decode_add(payload, added)
    exact = torch.equal(added, out + decoded)
    expected = out - decoded
    codec.decode_sub(payload, out)
    if exact:
        assert torch.equal(out, expected)
    else:  # e.g. PowerSGD's outer product, accumulated as decode_add computes it
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS)
def test_decode_to_writes_exactly_what_decode_returns(spec):
    codec = make(spec)
    payload = roundtrip(codec, gaussian((33, 17)))[-1]
    out = gaussian((33 * 17,), seed=5)  # any shape of the same numel: a flat bucket's view
    codec.decode_to(payload, out)
    assert torch.equal(out, codec.decode(payload).reshape(-1))


def test_only_stateless_one_round_sum_codecs_launch_in_backward():
    from thinwire.aggregate import pipelines
    from thinwire.codecs.specs import available

    launched = {name for name in available() if pipelines(make(name))}
    assert launched == {"identity", "bf16", "fp16"}
    assert not pipelines(make("bf16:ef=true"))  # a residual per tensor is state


# -- knobs and defaults ---------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_describe_rebuilds_the_same_config(spec):
    codec = make(spec)
    assert build_codec(codec.describe()).config == codec.config


@pytest.mark.parametrize(
    "spec, rule",
    [
        ("topk:ratio=0", r"ratio must be in \(0, 1\], got 0"),
        ("topk:ratio=1.5", r"ratio must be in \(0, 1\], got 1.5"),
        ("topk:sample=0", r"sample must be in \(0, 1\], got 0"),
        ("topk:select=fast", r"select must be one of exact\|sampled\|auto, got 'fast'"),
        ("randomk:ratio=0", r"ratio must be in \(0, 1\], got 0"),
        ("randomk:ratio=-0.1", r"ratio must be in \(0, 1\], got -0.1"),
        ("qsgd:levels=0", r"levels must be in 1..32767, got 0"),
        ("qsgd:levels=40000", r"levels must be in 1..32767, got 40000"),
        ("qsgd:bucket=-1", r"bucket must be >= 0 \(0 = whole tensor\), got -1"),
        ("terngrad:seed=x", r"seed must be an integer, got 'x'"),
        ("twobit:alpha=0", r"alpha must be > 0, got 0"),
        ("twobit:alpha=-1", r"alpha must be > 0, got -1"),
        ("twobit:threshold=0", r"threshold must be > 0, got 0"),
        ("twobit:stat=median", r"stat must be one of mean\|rms\|max, got 'median'"),
        ("kernels:r_max=1.5", r"r_max must be in \(0, 1\], got 1.5"),
        ("kernels:r_min=0", r"r_min must be in \(0, 1\], got 0"),
        ("kernels:r_min=0.5", r"r_min must be <= r_max, got r_min=0.5 > r_max=0.25"),
        ("kernels:beta=-1", r"beta must be >= 0, got -1"),
        ("kernels:granularity=channel", r"granularity must be one of kernel\|filter, got 'channel'"),
        ("fft:theta=1", r"theta must be in \[0, 1\), got 1"),
        ("fft:theta_min=1", r"theta_min must be in \[0, 1\), got 1"),
        ("fft:schedule=exp", r"schedule must be one of constant\|linear\|cosine\|step\|recover, got 'exp'"),
        ("fft:factor=1", r"factor must be > 1, got 1"),
        ("fft:bits=8,exp_bits=3,man_bits=3", r"exp_bits \+ man_bits \+ 1 must equal bits: 3 \+ 3 \+ 1 != 8"),
        ("fft:horizon=0", r"horizon must be >= 1, got 0"),
        ("fft:theta=-0.1", r"theta must be in \[0, 1\), got -0.1"),
        ("fft:bits=12", r"bits must be in 3..8, 16 or 32, got 12"),
        ("fft:exp_bits=8", r"exp_bits must be in 1..7, got 8"),
        ("fft:positions=list", r"positions must be one of auto\|bitmap\|index, got 'list'"),
    ],
)
def test_bad_knobs_raise_with_the_rule(spec, rule):
    with pytest.raises(ValueError, match=rule):
        build_codec(spec)


@pytest.mark.parametrize(
    "name, ef", [("topk", True), ("randomk", True), ("signsgd", True), ("qsgd", False), ("terngrad", False),
                 ("twobit", True), ("kernels", True)]
)
def test_error_feedback_defaults(name, ef):
    assert build_codec(name).config.ef is ef


@pytest.mark.parametrize(
    "name, kind",
    [("topk", "GATHER"), ("randomk", "SUM"), ("qsgd", "GATHER"), ("signsgd", "GATHER"), ("terngrad", "GATHER"),
     ("twobit", "GATHER"), ("kernels", "GATHER")],
)
def test_aggregation_kinds(name, kind):
    assert CODECS[name].aggregation is Aggregation[kind]


# -- topk -----------------------------------------------------------------------------------
def true_topk_set(x: torch.Tensor, k: int) -> set[int]:
    return set(x.reshape(-1).abs().argsort(descending=True)[:k].tolist())


def heavy_tailed(n: int, seed: int) -> torch.Tensor:
    """Cauchy-like: a ratio of gaussians (no finite variance)."""
    return gaussian((n,), seed) / gaussian((n,), seed + 1)


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.5])
def test_topk_exact_path_picks_the_true_top_k(ratio):
    codec = make(f"topk:ratio={ratio},select=exact")
    x = gaussian((100, 101))
    values, idx = codec.encode(x, key="w").tensors
    k = codec.k(x.numel())
    assert k == max(1, math.ceil(ratio * x.numel())) and idx.numel() == k
    assert set(idx.tolist()) == true_topk_set(x, k)
    assert torch.equal(values, x.reshape(-1)[idx.long()])


def test_topk_k_is_robust_to_float_error_in_ratio_times_n():
    assert make("topk:ratio=0.07").k(100) == 7  # 0.07 * 100 == 7.000000000000001 in floats
    assert make("topk:ratio=0.01").k(101) == 2 and make("topk:ratio=0.01").k(1) == 1


def test_topk_auto_samples_only_big_tensors():
    auto, exact, sampled = make("topk"), make("topk:select=exact"), make("topk:select=sampled")
    assert not auto.uses_sampling(999_999) and auto.uses_sampling(1_000_000)
    assert not exact.uses_sampling(10**8) and sampled.uses_sampling(10)


@pytest.mark.parametrize("tensor", ["gaussian", "heavy_tailed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)  # NumPy, NumPy, torch path
def test_topk_sampled_path_is_exact_top_k_within_5_percent(tensor, dtype):
    """The sampled path returns exactly k entries; its error is within 5% of exact top-k's
    (by construction it is the same set whenever it does not fall back)."""
    x = (gaussian((300_000,), 3) if tensor == "gaussian" else heavy_tailed(300_000, 3)).to(dtype)
    sampled, exact = make("topk:select=sampled"), make("topk:select=exact")
    ps, pe = sampled.encode(x, key="w"), exact.encode(x, key="w")
    assert ps.tensors[1].numel() == sampled.k(x.numel()) == 3000
    if dtype == torch.bfloat16:  # many ties: compare the magnitudes picked, not positions
        assert torch.equal(ps.tensors[0].abs().sort().values, pe.tensors[0].abs().sort().values)
    else:
        assert set(ps.tensors[1].tolist()) == set(pe.tensors[1].tolist())
    assert rel_err(x, sampled.decode(ps)) <= 1.05 * rel_err(x, exact.decode(pe))


def test_topk_sampled_threshold_rarely_falls_back():
    """The threshold sits 4 sigma below the target, so >= k candidates almost always survive."""
    codec = make("topk:select=sampled")
    x = gaussian((200_000,), 9)
    k = codec.k(x.numel())
    fallbacks = 0
    for step in range(20):
        codec.step = step
        fallbacks += codec._sampled(x, k, f"w{step}") is None
    assert fallbacks == 0


def test_topk_sampled_falls_back_to_exact_when_too_few_candidates(monkeypatch):
    codec = make("topk:select=sampled")
    x = gaussian((50_000,), 4)
    monkeypatch.setattr(codec, "_threshold", lambda flat, k, key: 1e9)  # nothing survives
    idx = codec.encode(x, key="w").tensors[1]
    assert set(idx.tolist()) == true_topk_set(x, codec.k(x.numel()))


def test_topk_sampled_handles_sparse_input():
    """Fewer nonzeros than k: the sampled threshold is 0, so the exact path fills k slots."""
    x = torch.zeros(100_000)
    x[::1000] = gaussian((100,), 6)  # 100 nonzeros, k = 1000
    codec = make("topk:select=sampled")
    payload = codec.encode(x, key="w")
    assert payload.tensors[1].numel() == 1000 and torch.equal(codec.decode(payload), x)


# -- randomk --------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.01, 0.3])  # the draw-and-dedupe path and the randperm path
def test_randomk_indices_are_the_same_on_every_rank(ratio):
    x = gaussian((100, 100))
    payloads = [make(f"randomk:ratio={ratio}", step=4, rank=r).encode(x + r, key="w") for r in range(4)]
    idx = payloads[0].meta["indices"]
    for p in payloads[1:]:
        assert torch.equal(p.meta["indices"], idx)
    assert idx.numel() == math.ceil(ratio * 10_000) and idx.unique().numel() == idx.numel()
    assert 0 <= idx.min() and idx.max() < 10_000
    assert not torch.equal(make(f"randomk:ratio={ratio}", step=5).encode(x, key="w").meta["indices"], idx)
    assert not torch.equal(make(f"randomk:ratio={ratio}", step=4).encode(x, key="v").meta["indices"], idx)


@pytest.mark.parametrize("ratio", [0.1, 0.5])
def test_randomk_selects_positions_uniformly(ratio):
    """Each of N = 200 positions is picked with probability ratio per step: over T = 1000 steps
    its count is Binomial(T, ratio); all 200 counts must lie within 5 sigma."""
    codec, n, steps = make(f"randomk:ratio={ratio}"), 200, 1000
    counts = torch.zeros(n)
    for step in range(steps):
        codec.step = step
        counts[codec.indices(n, "w")] += 1
    sigma = math.sqrt(steps * ratio * (1 - ratio))
    assert (counts - steps * ratio).abs().max() <= 5 * sigma


def test_randomk_rescale_is_unbiased_scaling():
    x = gaussian((50, 40))
    plain, scaled = make("randomk:ratio=0.1"), make("randomk:ratio=0.1,rescale=true")
    d_plain, d_scaled = plain.decode(plain.encode(x, key="w")), scaled.decode(scaled.encode(x, key="w"))
    torch.testing.assert_close(d_scaled, d_plain * 10.0)


# -- unbiased stochastic codecs -------------------------------------------------------------
@pytest.mark.parametrize("spec", ["qsgd", "qsgd:levels=1", "qsgd:levels=3,bucket=16", "terngrad"])
def test_stochastic_codecs_are_unbiased(spec):
    """Mean of T = 2000 decodes vs x. Per element the decoded value takes two adjacent values
    a gap g apart (QSGD: g = norm/s; TernGrad: g = max|x|), so its std is <= g/2 and the std of
    the mean <= g / (2 sqrt(T)); every element must be within 6 of those (N = 200)."""
    x, steps = gaussian((200,), 11), 2000
    codec = make(spec, rank=1)
    total = torch.zeros(200, dtype=torch.float64)
    for step in range(steps):
        codec.step = step
        total += codec.decode(codec.encode(x, key="w")).double()
    gap = x.norm().item() / codec.config.levels if codec.name == "qsgd" else x.abs().max().item()
    tol = 6 * gap / (2 * math.sqrt(steps))
    assert (total / steps - x.double()).abs().max().item() <= tol


@pytest.mark.parametrize("spec", ["qsgd", "terngrad"])
def test_stochastic_codecs_round_independently_per_rank(spec):
    x = gaussian((64, 65))
    p0, p1 = make(spec, rank=0).encode(x, key="w"), make(spec, rank=1).encode(x, key="w")
    assert torch.equal(p0.tensors[0], p1.tensors[0])  # the scale is deterministic
    assert not torch.equal(p0.tensors[1], p1.tensors[1])  # the rounding is not


@pytest.mark.parametrize("levels, bits", [(1, 2), (3, 3), (7, 4), (127, 8), (128, 16), (1000, 16)])
def test_qsgd_bits_per_value(levels, bits):
    codec, n = make(f"qsgd:levels={levels}"), 1001
    assert codec.nbytes(torch.Size([n]), torch.float32) == 4 + math.ceil(n * bits / 8)


# -- signsgd / terngrad wire size -----------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001, 4096])
def test_signsgd_sends_one_bit_per_value_plus_scale(n):
    assert make("signsgd").nbytes(torch.Size([n]), torch.float32) == math.ceil(n / 8) + 4
    assert make("terngrad").nbytes(torch.Size([n]), torch.float32) == math.ceil(n / 4) + 4


def test_signsgd_decodes_to_scaled_signs_with_zero_as_plus():
    x = torch.tensor([[-2.0, 0.0, 1.0], [3.0, -0.5, 0.0]])
    codec = make("signsgd")
    out = codec.decode(codec.encode(x, key="w"))
    m = x.abs().mean()
    assert torch.equal(out, torch.tensor([[-1.0, 1, 1], [1, -1, 1]]) * m)


# -- CPU paths: NumPy over chunks, the torch paths' bits ----------------------------------------
# sizes around the 65,536-value chunk, buckets that straddle chunks, empty and tiny tensors
CPU_SHAPES = [(0,), (7,), (33, 17), (3, 65541), (131075,)]


def _torch_path(monkeypatch, codec) -> None:
    """Send ``codec`` down its torch path (the one other devices take)."""
    monkeypatch.setattr(type(codec), "numpy_path", lambda self, t: False)


@pytest.mark.parametrize("spec", ["qsgd", "qsgd:levels=1", "qsgd:levels=3,bucket=64", "qsgd:levels=15,bucket=70000",
                                  "qsgd:bucket=512", "qsgd:levels=1000", "terngrad"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
def test_stochastic_codecs_cpu_path_gives_the_torch_paths_bits(spec, shape, monkeypatch):
    """Payloads (the same noise stream, drawn chunk by chunk), decodes, ``decode_add`` and
    ``decode_sum`` of the NumPy path equal the torch path's."""
    xs = [gaussian(shape, seed=s) for s in (3, 4)]
    fast = [make(spec, rank=r) for r in (0, 1)]
    ps = [c.encode(x, key="w") for c, x in zip(fast, xs)]
    dec, acc, total = fast[0].decode(ps[1]), gaussian(shape, seed=5), torch.full(shape, 7.0)
    fast[0].decode_add(ps[1], acc)
    fast[0].decode_sum(ps, total)
    _torch_path(monkeypatch, fast[0])
    slow = [make(spec, rank=r) for r in (0, 1)]
    qs = [c.encode(x, key="w") for c, x in zip(slow, xs)]
    for p, q in zip(ps, qs):
        assert [(t.dtype, t.shape) for t in p.tensors] == [(t.dtype, t.shape) for t in q.tensors]
        assert all(torch.equal(a, b) for a, b in zip(p.tensors, q.tensors))
    acc_slow, total_slow = gaussian(shape, seed=5), torch.full(shape, 7.0)
    slow[0].decode_add(qs[1], acc_slow)
    slow[0].decode_sum(qs, total_slow)
    assert torch.equal(dec, slow[0].decode(qs[1])) and torch.equal(acc, acc_slow) and torch.equal(total, total_slow)


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
def test_signsgd_cpu_path_sends_the_same_signs_and_an_accurate_scale(shape, monkeypatch):
    """The signs are the torch path's; the scale is the mean |u| within 1e-6 (pairwise fp32
    sums per chunk, fp64 across them; the torch path's fp32 norm measured up to 1.4e-5 off on
    real gradients); decoding a payload gives the torch path's values."""
    x = gaussian(shape, seed=3)
    codec = make("signsgd")
    p = codec.encode(x, key="w")
    mean = x.double().abs().sum().item() / max(1, x.numel())
    assert abs(p.tensors[0].item() - mean) <= 1e-6 * mean
    others = [p, make("signsgd").encode(gaussian(shape, seed=4), key="w")]
    dec, acc, total = codec.decode(p), gaussian(shape, seed=5), torch.full(shape, 7.0)
    codec.decode_add(p, acc)
    codec.decode_sum(others, total)
    _torch_path(monkeypatch, codec)
    q = make("signsgd").encode(x, key="w")
    assert torch.equal(p.tensors[1], q.tensors[1])
    acc_slow, total_slow = gaussian(shape, seed=5), torch.full(shape, 7.0)
    codec.decode_add(p, acc_slow)
    codec.decode_sum(others, total_slow)
    assert torch.equal(dec, codec.decode(p)) and torch.equal(acc, acc_slow) and torch.equal(total, total_slow)


@pytest.mark.parametrize("spec", ["topk", "topk:ratio=0.3", "randomk", "qsgd", "qsgd:bucket=512", "qsgd:levels=3",
                                  "terngrad", "signsgd", "twobit", "kernels", "kernels:positions=index", "rangefloat",
                                  "rangefloat:bits=4,exp_bits=3"])
def test_decode_sum_equals_the_sum_of_decodes_exactly(spec):
    """``decode_sum`` overwrites ``out`` with decode(p0) + decode(p1) + decode(p2), in that
    order, bit for bit (a SUM codec's payloads: ``decode_add`` onto zeros)."""
    shape = (16, 8, 3, 3)
    payloads = [make(spec, rank=r).encode(gaussian(shape, seed=r), key="w") for r in range(3)]
    codec = make(spec)
    want = codec.decode(payloads[0]) + codec.decode(payloads[1]) + codec.decode(payloads[2])
    out = torch.full(shape, 7.0)
    if codec.aggregation is Aggregation.GATHER:
        codec.decode_sum(payloads, out)
    else:
        out.zero_()
        for p in payloads:
            codec.decode_add(p, out)
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", ["randomk", "randomk:rescale=true"])
def test_randomk_decode_add_touches_only_the_k_positions(spec, dtype):
    """``out += decode(payload)`` exactly (the decode rounded to the payload's dtype first),
    without a dense temporary: the other positions keep their bits."""
    codec = make(spec)
    payload = codec.encode(gaussian((50, 40), dtype=dtype), key="w")
    out = gaussian((50, 40), seed=5)
    want = out + codec.decode(payload)
    codec.decode_add(payload, out)
    assert torch.equal(out, want)


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1, 0.5])
def test_topk_auto_picks_the_true_top_k_below_the_sampling_size(ratio):
    """``auto`` under 1M values on the CPU: the exact set, indices ascending, as ``exact``."""
    codec = make(f"topk:ratio={ratio}")
    x = gaussian((300, 301))
    assert not codec.uses_sampling(x.numel())
    values, idx = codec.encode(x, key="w").tensors
    k = codec.k(x.numel())
    assert idx.numel() == k and bool((idx[1:] > idx[:-1]).all())
    exact = make(f"topk:ratio={ratio},select=exact").encode(x).tensors[1]
    assert set(idx.tolist()) == true_topk_set(x, k) == set(exact.tolist())
    assert torch.equal(values, x.reshape(-1)[idx.long()])


def test_topk_auto_ties_keep_the_lowest_positions_and_nan_falls_back():
    codec = make("topk:ratio=0.1")
    assert codec.encode(torch.ones(50, 100)).tensors[1].tolist() == list(range(500))
    x = gaussian((50, 100))
    x.view(-1)[::9] = math.nan  # NaN orders above every number, as torch.topk has it
    values, idx = codec.encode(x).tensors
    want = make("topk:ratio=0.1,select=exact").encode(x).tensors[1]
    assert idx.numel() == 500 and set(idx.tolist()) == set(want.tolist())


def test_kernels_bitmap_padding_bits_are_ignored():
    """Only the first U bits of the bitmap name units (as before): set padding bits change
    neither the count check nor the decode."""
    codec = make("kernels")
    x = gaussian((3, 4, 3, 3))  # 12 units: a 2-byte bitmap, 4 padding bits
    p = codec.encode(x, key="w")
    assert p.tensors[0].dtype == torch.uint8 and p.tensors[0].numel() == 2
    padded = p.tensors[0].clone()
    padded[1] |= 0x0F
    q = p.with_tensors((padded, p.tensors[1]))
    assert torch.equal(codec.decode(q), codec.decode(p))

"""PowerSGD codec: the two-round contract against a plain-torch reference, simulated on n ranks.

The caller's protocol (thinwire.aggregate) is replayed by hand: one codec instance per rank,
``encode`` -> divide by n and sum (the all_reduce) -> ``encode_next`` -> the same -> ``decode``
and ``update``. Tolerances are stated per test; fp32 throughout unless said.
"""

from __future__ import annotations

import io

import pytest
import torch

from thinwire.codecs.base import generator_for
from thinwire.codecs.powersgd import PowerSGD, PowerSGDConfig
from thinwire.codecs.specs import build_codec
from thinwire.feedback import ErrorFeedback
from thinwire.payload import Aggregation, Payload, PayloadError


def make(n_ranks: int = 1, **knobs) -> list[PowerSGD]:
    codecs = [PowerSGD(PowerSGDConfig(**knobs)) for _ in range(n_ranks)]
    for rank, c in enumerate(codecs):
        c.rank = rank
    return codecs


def all_reduce_mean(payloads: list[Payload]) -> list[Payload]:
    """What the caller does: divide every wire tensor by n, SUM in place, keep the meta."""
    n = len(payloads)
    for i in range(len(payloads[0].tensors)):
        for p in payloads:
            p.tensors[i].div_(n)
        total = sum(p.tensors[i] for p in payloads)  # one summation order: the same bits everywhere
        for p in payloads:
            p.tensors[i].copy_(total)
    return [p.with_tensors(p.tensors) for p in payloads]


def step(codecs: list[PowerSGD], xs: list[torch.Tensor], t: int, key: str = "w", own: list | None = None):
    """One step of the caller's protocol on every rank; returns each rank's result."""
    for c in codecs:
        c.step = t
    p0 = [c.encode(x, key=key) for c, x in zip(codecs, xs)]
    p1 = [c.encode_next(r, key=key) for c, r in zip(codecs, all_reduce_mean(p0))]
    if own is not None:
        own.extend(c.decode(p) for c, p in zip(codecs, p1))  # before the collective, as EF does
    reduced = all_reduce_mean(p1)
    out = [c.decode(r) for c, r in zip(codecs, reduced)]
    for c, r in zip(codecs, reduced):
        c.update(key, r)
    return out


def reference(ms: list[torch.Tensor], q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, fp64: P = mean(M_i Q); P̂ = orth(P); Q̄ = mean(M_iᵀ P̂); result P̂ Q̄ᵀ."""
    ms = [m.double() for m in ms]
    p = torch.stack([m @ q.double() for m in ms]).mean(0)
    p_hat = torch.linalg.qr(p).Q
    q_bar = torch.stack([m.t() @ p_hat for m in ms]).mean(0)
    return p_hat @ q_bar.t(), q_bar


def first_q(key: str, shape: tuple[int, ...], t: int = 0, **knobs) -> torch.Tensor:
    """The codec's initial Q, read back from a probe: P = M Q with M = I (square shapes only)."""
    (c,) = make(**knobs)
    c.step = t
    n = shape[0]
    return c.encode(torch.eye(n).reshape(shape), key=key).tensors[0].clone()


# -- the contract against the reference -------------------------------------------------------


@pytest.mark.parametrize("shape,rank", [((24, 16), 2), ((12, 3, 2, 2), 3), ((40, 9), 1), ((10, 30), 8)])
def test_multi_rank_matches_reference_over_warm_started_steps(shape, rank):
    torch.manual_seed(0)
    codecs = make(3, rank=rank)
    m = shape[0]
    cols = torch.Size(shape).numel() // m
    r = min(rank, m, cols)
    q = torch.randn(r, cols, generator=generator_for(0, 0, "w")).t()  # what the codec draws
    for t in range(3):
        xs = [torch.randn(shape) for _ in codecs]
        out = step(codecs, xs, t)
        want, q = reference([x.reshape(m, -1) for x in xs], q)
        scale = max(x.abs().max().item() for x in xs)
        for o in out:  # tolerance: 1e-5 of the inputs' magnitude (fp32 vs the fp64 reference)
            torch.testing.assert_close(o.reshape(m, -1).double(), want, rtol=0, atol=1e-5 * scale)
        assert all(torch.equal(o, out[0]) for o in out)  # every rank holds the same bits


def test_initial_q_identical_across_ranks_and_depends_on_seed_step_key():
    a, b = make(2)
    b.rank = 5
    x = torch.randn(16, 8)
    assert torch.equal(a.encode(x, key="w").tensors[0], b.encode(x, key="w").tensors[0])
    base = first_q("w", (8, 8), rank=2)
    assert torch.equal(base, first_q("w", (8, 8), rank=2))
    others = [first_q("v", (8, 8), rank=2), first_q("w", (8, 8), t=1, rank=2), first_q("w", (8, 8), rank=2, seed=1)]
    assert not any(torch.equal(base, other) for other in others)


@pytest.mark.parametrize("shape,rank", [((6, 10), 6), ((10, 4), 8), ((5, 2, 3), 5), ((7, 7), 7)])
def test_full_rank_reconstructs_the_mean_exactly(shape, rank):
    # r' = min(m, n): P̂ is an orthonormal basis of the column space of the mean, so P̂ P̂ᵀ M̄ = M̄.
    torch.manual_seed(1)
    xs = [torch.randn(shape) for _ in range(2)]
    out = step(make(2, rank=rank), xs, 0)
    torch.testing.assert_close(out[0], (xs[0] + xs[1]) / 2, rtol=0, atol=1e-5)  # fp32, |x| ~ 3


def test_warm_start_converges_on_a_fixed_low_rank_matrix():
    # Rank-1 codec on M = U diag(10, 8, 1) Vᵀ: each step is one power iteration, so the error
    # ||M - P̂ P̂ᵀ M|| cannot grow and tends to the best rank-1 error sqrt(8² + 1²).
    g = torch.Generator().manual_seed(2)
    u = torch.linalg.qr(torch.randn(30, 3, generator=g)).Q
    v = torch.linalg.qr(torch.randn(20, 3, generator=g)).Q
    mat = u @ torch.diag(torch.tensor([10.0, 8.0, 1.0])) @ v.t()
    codecs = make(1, rank=1)
    errors = [(mat - step(codecs, [mat], t)[0]).norm().item() for t in range(40)]
    assert all(b <= a + 1e-4 for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < errors[0]
    assert errors[-1] == pytest.approx((8.0**2 + 1.0) ** 0.5, abs=1e-3)
    cold = [(mat - step(make(1, rank=1, warm_start=False), [mat], t)[0]).norm().item() for t in range(40)]
    assert sum(cold) / len(cold) > errors[-1] + 0.1  # a cold start is one power step: worse on average


def test_warm_start_false_result_depends_only_on_step():
    x = torch.randn(12, 9)
    (seasoned,) = make(rank=2, warm_start=False)
    for t in range(3):
        step([seasoned], [torch.randn(12, 9)], t)
    fresh = make(rank=2, warm_start=False)
    assert torch.equal(step([seasoned], [x], 3)[0], step(fresh, [x], 3)[0])
    assert seasoned.state_dict() == {}


# -- error feedback, numerics, inputs --------------------------------------------------------


def test_error_feedback_identity_and_residual_orthogonal_to_p_hat():
    torch.manual_seed(3)
    (c,) = make(rank=2)
    ef = ErrorFeedback()
    for t in range(4):
        c.step = t
        u = ef.compensate("w", torch.randn(20, 15)).clone()  # the buffer is reused by update
        p1 = c.encode_next(c.encode(u, key="w"), key="w")
        sent = c.decode(p1)
        ef.update("w", u, sent)
        r = ef.residuals["w"]
        # u == decode(own p1) + r: exact up to one fp32 rounding of the subtraction (2 ulp of |u|max)
        eps = torch.finfo(torch.float32).eps
        torch.testing.assert_close(sent + r, u, rtol=0, atol=2 * eps * u.abs().max().item())
        # r = (I - P̂ P̂ᵀ) M, so P̂ᵀ r = 0 (to 1e-5 of |u|)
        assert (p1.meta["p_hat"].t() @ r).abs().max() < 1e-5 * u.abs().max()
        c.update("w", p1)


@pytest.mark.parametrize("rank", [1, 3])
def test_zero_input_gives_zero_without_nan_and_recovers(rank):
    codecs = make(2, rank=rank)
    zero = [torch.zeros(16, 12)] * 2
    for t in range(2):  # the second step starts from Q̄ = 0
        out = step(codecs, zero, t)
        assert all(torch.equal(o, torch.zeros(16, 12)) for o in out)
    xs = [torch.randn(16, 12) for _ in codecs]
    out = step(codecs, xs, 2)  # a zero warm start still yields an orthonormal P̂: no NaN, no stall
    assert torch.isfinite(out[0]).all() and out[0].abs().max() > 0


def test_non_contiguous_input_equals_contiguous():
    torch.manual_seed(4)
    base = torch.randn(8, 6, 3, 3)
    for x in (base.to(memory_format=torch.channels_last), base.transpose(0, 1).contiguous().transpose(0, 1)):
        assert not x.is_contiguous()
        before = x.clone()
        got = step(make(rank=2), [x], 0)[0]
        assert torch.equal(got, step(make(rank=2), [base], 0)[0])
        assert torch.equal(x, before)  # encode does not modify its input


def test_bf16_input_is_computed_in_fp32_and_returned_as_bf16():
    torch.manual_seed(5)
    x = torch.randn(16, 10).to(torch.bfloat16)
    (c,) = make(rank=2)
    p0 = c.encode(x, key="w")
    assert p0.tensors[0].dtype == torch.float32
    p1 = c.encode_next(p0, key="w")
    got = c.decode(p1)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    want = step(make(rank=2), [x.float()], 0)[0].to(torch.bfloat16)
    assert torch.equal(got, want)
    assert c.nbytes(x.shape, x.dtype) == p0.nbytes + p1.nbytes


@pytest.mark.parametrize("shape,rank", [((64, 32, 3, 3), 4), ((100, 7), 2), ((3, 50), 8), ((16, 16), 1)])
def test_payload_bytes_and_wire_layout_match_the_spec(shape, rank):
    (c,) = make(rank=rank)
    x = torch.randn(shape)
    p0 = c.encode(x, key="w")
    p1 = c.encode_next(p0, key="w")
    m, n = shape[0], x[0].numel()
    r = min(rank, m, n)
    assert c.nbytes(x.shape, x.dtype) == p0.nbytes + p1.nbytes == 4 * (m + n) * r
    for round, p in enumerate((p0, p1)):
        assert [(tuple(t.shape), t.dtype) for t in p.tensors] == c.wire_spec(x.shape, x.dtype, round)
        assert all(t.is_contiguous() for t in p.tensors)  # the caller all_reduces them in place


def test_decode_is_pure_linear_and_decode_add_agrees():
    torch.manual_seed(6)
    (c,) = make(rank=3)
    x = torch.randn(20, 12)
    p1 = c.encode_next(c.encode(x, key="w"), key="w")
    q = p1.tensors[0].clone()
    a, b = c.decode(p1), c.decode(p1)
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr() and torch.equal(p1.tensors[0], q)
    other = torch.randn_like(q)
    summed = c.decode(p1.with_tensors((q + other,)))
    torch.testing.assert_close(summed, a + c.decode(p1.with_tensors((other,))), rtol=0, atol=1e-5)
    out = torch.ones(20, 12)
    c.decode_add(p1, out)
    torch.testing.assert_close(out, 1 + a, rtol=0, atol=1e-6)
    strided = torch.ones(12, 20).t()  # not contiguous: the generic out += decode path
    c.decode_add(p1, strided)
    torch.testing.assert_close(strided, 1 + a, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="round-1"):
        c.decode(c.encode(x, key="w"))


def test_rank_one_outer_product_decode_agrees_with_decode_add_and_the_matrix_product():
    torch.manual_seed(8)
    (c,) = make(rank=1)
    x = torch.randn(20, 3, 4)
    p1 = c.encode_next(c.encode(x, key="w"), key="w")
    p_hat, q = p1.meta["p_hat"], p1.tensors[0]
    got = c.decode(p1)
    torch.testing.assert_close(got, (p_hat @ q.t()).view(x.shape), rtol=0, atol=1e-6)
    out = torch.ones(20, 3, 4)
    c.decode_add(p1, out)
    torch.testing.assert_close(out, 1 + got, rtol=0, atol=1e-6)
    strided = torch.ones(3, 4, 20).permute(2, 0, 1)  # not contiguous: the generic out += decode path
    c.decode_add(p1, strided)
    torch.testing.assert_close(strided, out, rtol=0, atol=1e-6)


def test_check_of_an_encoded_shape_still_refuses_malformed_payloads():
    # check() answers shapes it has encoded from a cache: the cache must refuse what the full check does
    (c,) = make(rank=2)
    x = torch.randn(20, 12)
    p1 = c.encode_next(c.encode(x, key="w"), key="w")
    c.decode(p1)  # well-formed: passes
    bad = [
        p1.with_tensors((torch.zeros(20, 2),)),  # a P-shaped tensor is fine for the layout...
        p1.with_tensors((torch.zeros(13, 2),)),
        p1.with_tensors((torch.zeros(12, 2, dtype=torch.float16),)),
        p1.with_tensors((torch.zeros(12, 2), torch.zeros(20, 2))),
        Payload((torch.zeros(12, 2),), x.shape, torch.complex64, p1.meta),
        Payload((torch.zeros(12, 2),), x.shape, torch.int32, p1.meta),
    ]
    c.check(bad[0])  # ...(round 0's layout), so only the others are refused
    for p in bad[1:]:
        with pytest.raises(PayloadError):
            c.decode(p)
        with pytest.raises(PayloadError):
            c.decode_add(p, torch.zeros(20, 12))


# -- which tensors, state, config ------------------------------------------------------------

SHAPES = [(10,), (4, 4), (8, 8), (9, 8), (64, 3, 3, 3), (10, 1000), (1000, 10), (3, 3), (2, 100), (16, 1, 1, 1)]


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("rate", [0.5, 2.0, 4.0])
def test_compresses_matches_torch_should_compress(rank, rate):
    hook = pytest.importorskip("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    (c,) = make(rank=rank, min_compression_rate=rate)
    for shape in SHAPES:
        if len(shape) < 2:
            assert not c.compresses(torch.Size(shape))
            continue
        m, n = shape[0], torch.Size(shape).numel() // shape[0]
        want = hook._should_compress(m, n, min(m, n, rank), rate)[0]
        assert c.compresses(torch.Size(shape)) == want, (shape, rank, rate)
    (c,) = make(rank=1, min_numel=1000)
    assert c.compresses(torch.Size((10, 100))) and not c.compresses(torch.Size((10, 99)))


def test_state_dict_round_trip_resumes_exactly():
    torch.manual_seed(7)
    xs = [[torch.randn(18, 4, 2) for _ in range(2)] for _ in range(4)]
    a = make(2, rank=2)
    for t in range(3):
        step(a, xs[t], t, key="layer.weight")
    saved = []
    for c in a:
        buf = io.BytesIO()
        torch.save(c.state_dict(), buf)
        saved.append(torch.load(io.BytesIO(buf.getvalue())))
    assert list(saved[0]) == ["layer.weight"] and saved[0]["layer.weight"].shape == (8, 2)
    b = make(2, rank=2)
    for c, s in zip(b, saved):
        c.load_state_dict(s)
    want, got = step(a, xs[3], 3, key="layer.weight"), step(b, xs[3], 3, key="layer.weight")
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    snapshot = a[0].state_dict()["layer.weight"].clone()
    step(a, xs[0], 4, key="layer.weight")
    assert not torch.equal(snapshot, a[0].state_dict()["layer.weight"])  # state_dict returns copies


def test_protocol_attributes_and_defaults():
    c = build_codec("powersgd")
    assert (c.name, c.aggregation, c.rounds) == ("powersgd", Aggregation.SUM, 2)
    cfg = c.config
    assert (cfg.rank, cfg.warm_start, cfg.min_compression_rate, cfg.seed, cfg.ef, cfg.min_numel) == (
        1, True, 2.0, 0, True, 0,
    )
    c = build_codec("powersgd:rank=4,warm_start=false,seed=3,min_compression_rate=1.5")
    assert (c.config.rank, c.config.warm_start, c.config.seed, c.config.min_compression_rate) == (4, False, 3, 1.5)
    assert build_codec(c.describe()).config == c.config


@pytest.mark.parametrize(
    "knobs,message",
    [
        ({"rank": 0}, "rank must be an integer >= 1, got 0"),
        ({"rank": -2}, "rank must be an integer >= 1, got -2"),
        ({"rank": 1.5}, "rank must be an integer >= 1, got 1.5"),
        ({"min_compression_rate": 0.0}, "min_compression_rate must be > 0, got 0.0"),
        ({"min_compression_rate": -1.0}, "min_compression_rate must be > 0, got -1.0"),
        ({"min_numel": -1}, "min_numel must be >= 0, got -1"),
    ],
)
def test_config_errors_state_the_rule(knobs, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        PowerSGDConfig(**knobs)


def test_spec_errors():
    with pytest.raises(ValueError, match="rank must be an integer >= 1, got 0"):
        build_codec("powersgd:rank=0")
    with pytest.raises(ValueError, match="unknown knob 'ranks'"):
        build_codec("powersgd:ranks=2")
    with pytest.raises(ValueError, match="rounds 0 and 1"):
        make()[0].wire_spec(torch.Size((4, 4)), torch.float32, 2)

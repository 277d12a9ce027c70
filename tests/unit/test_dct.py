"""The chunked DCT and the ``dct`` codec: an orthonormal transform (exact round trip to fp32
tolerance, Parseval) equal to the DCT-II's definition, exactly k kept per block, the value
formats against their references, the lossless case, exact wire sizes, GATHER's sum in the
transform domain, and the knobs' and payloads' errors."""

from __future__ import annotations

import math

import pytest
import torch

from thinwire.codecs.dct import position_dtype
from thinwire.codecs.specs import build_codec
from thinwire.numerics import dct_basis, range_format
from thinwire.payload import Payload, PayloadError

SHAPES = [(1,), (10,), (130,), (7, 9), (64, 60), (200, 65), (3, 5, 7), (16, 3, 3, 3)]


def _x(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _definition(x: torch.Tensor, t: dct_basis.Tiling) -> torch.Tensor:
    """(chunks, size) fp64 coefficients by the DCT-II's definition, block by block, on the
    zero-padded matrix: X[k1, k2] = s_k1 s_k2 sum x[n1, n2] cos(pi (2 n1 + 1) k1 / 2 b1) cos(...)."""
    def d(b):
        n = torch.arange(b, dtype=torch.float64)
        s = torch.full((b,), math.sqrt(2 / b), dtype=torch.float64)
        s[0] = math.sqrt(1 / b)
        return s[:, None] * torch.cos(math.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * b))

    p, q = t.grid
    m = torch.zeros(p * t.b1, q * t.b2, dtype=torch.float64)
    m[: t.rows, : t.cols] = x.double().reshape(t.rows, t.cols)
    rows = []
    for i in range(p):
        for j in range(q):
            block = m[i * t.b1 : (i + 1) * t.b1, j * t.b2 : (j + 1) * t.b2]
            rows.append((d(t.b1) @ block @ d(t.b2).T).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("chunk", [2, 8, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_transform_is_the_definition_orthonormal_and_round_trips(shape, chunk):
    x = _x(shape)
    t = dct_basis.tiling(shape, chunk)
    c = dct_basis.forward(x, t)
    assert c.shape == (t.chunks, t.size) and t.b2 <= chunk and t.b1 <= chunk
    torch.testing.assert_close(c.double(), _definition(x, t), rtol=0, atol=2e-6 * max(1.0, x.abs().max().item()))
    # Parseval: the padding adds zeros, so the coefficients hold exactly the tensor's energy
    assert c.double().norm().item() == pytest.approx(x.double().norm().item(), rel=1e-6)
    back = dct_basis.inverse(c, t)
    assert back.shape == x.shape
    torch.testing.assert_close(back, x, rtol=0, atol=2e-6 * max(1.0, x.abs().max().item()))


@pytest.mark.parametrize("b", [1, 2, 16, 64, 256])
def test_the_basis_is_orthogonal(b):
    d = dct_basis.basis(b).double()
    torch.testing.assert_close(d @ d.T, torch.eye(b, dtype=torch.float64), rtol=0, atol=1e-6)


def test_block_sides_shrink_to_small_tensors_and_pad_to_whole_blocks():
    assert dct_basis.tiling((10,), 64) == dct_basis.Tiling((10,), 1, 10, 1, 16)  # 16: the next power of two
    t = dct_basis.tiling((200, 65), 64)
    assert (t.b1, t.b2, t.grid, t.chunks, t.size) == (64, 64, (4, 2), 8, 4096)
    t = dct_basis.tiling((16, 3, 3, 3), 64)  # a conv weight: 16 x 27
    assert (t.rows, t.cols, t.b1, t.b2, t.chunks) == (16, 27, 16, 32, 1)


@pytest.mark.parametrize("k", [1, 5, 64])
def test_top_per_chunk_keeps_exactly_k_of_each_row_the_largest(k):
    c = _x((9, 64), seed=3)
    pos, vals = dct_basis.top_per_chunk(c, k)
    assert pos.shape == vals.shape == (9, k)
    assert bool((pos[:, 1:] > pos[:, :-1]).all())  # ascending, so distinct
    assert torch.equal(vals, c.gather(1, pos))
    want = c.abs().sort(dim=1, descending=True).values[:, :k]
    assert torch.equal(vals.abs().sort(dim=1, descending=True).values, want)


@pytest.mark.parametrize("k", [1, 7, 64, 200])
def test_top_positions_are_torch_topks_on_the_floats_ties_and_padding_included(k):
    g = torch.Generator().manual_seed(11)
    mags = torch.randint(0, 6, (300, 256), generator=g).float() * 0.25  # many ties, zeros among them
    mags[::3] = torch.rand(100, 256, generator=g)  # and rows of distinct values
    mags[5, 100:] = -1.0  # a padded block: its padding after every real entry
    mags[7, 3] = float("inf")
    want = torch.topk(mags, k, dim=1, sorted=False).indices.sort(dim=1).values
    got = dct_basis.top_positions(mags, k)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)
    assert not bool((mags[5].gather(0, got[5]) < 0).any()) or k > 100
    mags[9, 17] = float("nan")  # ranked above every number, as torch.topk ranks it
    assert int(dct_basis.top_positions(mags, 1)[9, 0]) == 17


def test_fp32_values_with_every_coefficient_kept_are_lossless():
    codec = build_codec("dct:chunk=16,topk=256,values=fp32")
    for shape in SHAPES:
        x = _x(shape, seed=len(shape))
        torch.testing.assert_close(codec.decode(codec.encode(x)), x, rtol=0, atol=2e-6 * x.abs().max().item())


def _kept(codec, x):
    t = codec.tiling(x.shape)
    return dct_basis.top_per_chunk(dct_basis.forward(x, t), codec.kept(t))


def test_each_value_format_decodes_to_its_reference():
    x = _x((100, 70), seed=5)
    pos, vals = _kept(build_codec("dct"), x)
    flat = vals.reshape(-1)
    refs = {
        "fp32": flat,
        "bf16": flat.to(torch.bfloat16).float(),
        "rangefloat": range_format.decode(range_format.encode(flat, 3, 4, range_format.exponent_max(flat)), 3, 4,
                                        range_format.exponent_max(flat)),
        "sign": flat.abs().mean() * torch.where(flat < 0, -1.0, 1.0),  # one bit each, the mean magnitude
    }
    for values, want in refs.items():
        codec = build_codec(f"dct:values={values}")
        got_pos, got = codec.coefficients(codec.encode(x))
        assert torch.equal(got_pos, pos), values
        assert torch.equal(got.reshape(-1), want), values
        dense = torch.zeros(8 // 2, 4096)
        dense.scatter_(1, pos, want.view(pos.shape))
        torch.testing.assert_close(codec.decode(codec.encode(x)), dct_basis.inverse(dense, codec.tiling(x.shape)))


@pytest.mark.parametrize("spec,shape,layout,nbytes", [
    ("dct", (100, 70), [((4, 32), torch.int16), ((128,), torch.bfloat16)], 4 * 32 * 2 + 128 * 2),
    ("dct:values=fp32", (1000,), [((16, 32), torch.uint8), ((512,), torch.float32)], 512 + 2048),
    ("dct:values=rangefloat,bits=4,exp_bits=2", (100, 70),
     [((1,), torch.int32), ((4, 32), torch.int16), ((64,), torch.uint8)], 4 + 256 + 64),
    ("dct:values=sign,chunk=16,topk=3", (40, 40),
     [((1,), torch.float32), ((9, 3), torch.uint8), ((4,), torch.uint8)], 4 + 27 + 4),
    ("dct:chunk=256,topk=10", (300, 300), [((4, 10), torch.int32), ((40,), torch.bfloat16)], 160 + 80),
])  # fmt: skip
def test_the_wire_layout_and_bytes_are_exact(spec, shape, layout, nbytes):
    codec = build_codec(spec)
    assert [(tuple(s), d) for s, d in codec.wire_spec(torch.Size(shape), torch.float32)] == layout
    p = codec.encode(_x(shape))
    assert [(tuple(t.shape), t.dtype) for t in p.tensors] == layout
    assert p.nbytes == codec.nbytes(torch.Size(shape), torch.float32) == nbytes


def test_position_dtypes_are_the_smallest_that_hold_a_block_index():
    assert [position_dtype(s) for s in (2, 256, 257, 32768, 32769)] == [
        torch.uint8, torch.uint8, torch.int16, torch.int16, torch.int32]


def test_gather_sums_the_ranks_coefficients_then_inverts_once():
    codec = build_codec("dct:chunk=8,topk=4,values=fp32")
    xs = [_x((20, 12), seed=s) for s in range(3)]
    payloads = [codec.encode(x) for x in xs]
    out = torch.empty(20, 12)
    codec.decode_sum(payloads, out)
    torch.testing.assert_close(out, sum(codec.decode(p) for p in payloads), rtol=0, atol=1e-5)


@pytest.mark.parametrize("values", ["fp32", "bf16", "rangefloat", "sign"])
@pytest.mark.parametrize("shape", [(16, 24), (32,), (3, 8, 2, 2), (20, 12), (10,)])
def test_error_feedback_in_the_transform_domain_is_the_tensors_own_up_to_rounding(shape, values):
    """``encode_feedback`` over five steps against error feedback written out in the
    tensor's domain (``u = x + r``, ``r = u - decode(own payload)``): the same positions
    sent, values within rounding, and a residual that is the reference's coefficients where
    the blocks tile the tensor (kept under ``key#dct``), the reference itself where they pad."""
    from thinwire.feedback import ErrorFeedback

    codec = build_codec(f"dct:chunk=8,topk=5,values={values},ef=true")
    t = dct_basis.tiling(shape, 8)
    ours, r = ErrorFeedback(), torch.zeros(shape)
    for step in range(5):
        x = _x(shape, seed=step)
        got = codec.encode_feedback(x, ours, key="w")
        u = x + r
        want = codec.encode(u)
        r = u - codec.decode(want)
        assert torch.equal(got.tensors[-2], want.tensors[-2])  # positions
        torch.testing.assert_close(codec.decode(got), codec.decode(want), rtol=0, atol=1e-4)
    if t.whole:
        assert list(ours.residuals) == ["w#dct"]
        torch.testing.assert_close(ours.residuals["w#dct"], dct_basis.forward(r, t), rtol=0, atol=1e-5)
    else:
        assert list(ours.residuals) == ["w"]
        torch.testing.assert_close(ours.residuals["w"], r, rtol=0, atol=1e-5)


def test_a_residual_kept_in_the_tensors_domain_continues_in_the_transform_domain():
    """A whole-block tensor's residual saved by an earlier version (tensor-shaped, under its
    own key) is taken over as its coefficients on the next step."""
    from thinwire.feedback import ErrorFeedback

    codec = build_codec("dct:chunk=8,topk=5,values=fp32,ef=true")
    t = dct_basis.tiling((16, 16), 8)
    r, x = _x((16, 16), seed=1), _x((16, 16), seed=2)
    fb = ErrorFeedback()
    fb.residuals["w"] = r.clone()
    got = codec.encode_feedback(x, fb, key="w")
    want = codec.encode(x + r)
    assert list(fb.residuals) == ["w#dct"] and torch.equal(got.tensors[0], want.tensors[0])
    torch.testing.assert_close(fb.residuals["w#dct"], dct_basis.forward(x + r - codec.decode(want), t),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec,needle", [
    ("dct:chunk=1", "chunk must be >= 2"), ("dct:chunk=48", "chunk must be a power of two"),
    ("dct:chunk=2048", "chunk must be <= 1024"), ("dct:topk=0", "topk must be in 1..4096"),
    ("dct:chunk=8,topk=65", "topk must be in 1..64"), ("dct:values=fp8", "values must be one of"),
    ("dct:values=rangefloat,bits=2", "bits must be in 3..8 or 16"),
])  # fmt: skip
def test_bad_knobs_name_the_rule(spec, needle):
    with pytest.raises(ValueError, match=needle):
        build_codec(spec)


def test_malformed_positions_and_scales_are_refused():
    codec = build_codec("dct:chunk=8,topk=4,values=sign")
    p = codec.encode(_x((16, 16)))
    scale, pos, bits = p.tensors
    bad = [
        (pos.flip(1).contiguous(), "ascend"),
        (pos.masked_fill(pos == pos.max(), 64), "positions must lie in"),
    ]
    for wrong, needle in bad:
        with pytest.raises(PayloadError, match=needle):
            codec.decode(Payload((scale, wrong, bits), p.shape, p.dtype))
    with pytest.raises(PayloadError, match="scale must not be negative"):
        codec.decode(Payload((-scale, pos, bits), p.shape, p.dtype))

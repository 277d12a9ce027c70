"""Payload rules every decoding entry point enforces beyond the wire layout: the declared
tensor is real floating point with no negative dimension, and explicit indices name each
position at most once (else ``decode``'s assignment and ``decode_add``'s sum disagree)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from thinwire.codecs.base import distinct
from thinwire.codecs.specs import available, build_codec
from thinwire.payload import Payload, PayloadError

CODECS = available()
X = torch.randn(40, 40, generator=torch.Generator().manual_seed(3))
CONV = torch.randn(8, 4, 3, 3, generator=torch.Generator().manual_seed(4))


def _encoded(spec: str, x: torch.Tensor = X):
    """(codec, its final-round payload of ``x``)."""
    codec = build_codec(spec)
    codec.step = 1
    p = codec.encode(x, key="w")
    for _ in range(1, codec.rounds):
        p = codec.encode_next(p, key="w")
    return codec, p


def _spec(name: str) -> str:
    return name if CODECS[name].rounds == 1 else f"{name}:min_numel=1"  # multi-round: compress any matrix


def _refused_everywhere(codec, bad: Payload, good: Payload, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        codec.decode(bad)
    with pytest.raises(PayloadError, match=match):
        codec.decode_add(bad, torch.zeros(40, 40))
    with pytest.raises(PayloadError, match=match):
        codec.decode_sum([good, bad], torch.zeros(40, 40))
    with pytest.raises(PayloadError, match=match):
        codec.decode_to(bad, torch.zeros(40, 40))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_declared_dtype_that_is_not_real_floating_point_is_refused(name, dtype):
    codec, p = _encoded(_spec(name))
    bad = dataclasses.replace(p, dtype=dtype)  # meta kept: only the declared dtype is wrong
    _refused_everywhere(codec, bad, p, rf"{codec.name}: .*{str(dtype).replace('torch.', '')}.*real floating point")


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_declared_shape_with_a_negative_dimension_is_refused(name):
    codec, p = _encoded(_spec(name))
    bad = dataclasses.replace(p, shape=torch.Size([-40, -40]))  # same element count
    _refused_everywhere(codec, bad, p, rf"{codec.name}: .*negative dimension")


# -- distinct indices ----------------------------------------------------------------------------
INDEXED = [("topk", X, 1), ("topk:select=sampled", X, 1), ("fft:positions=index", X, 1),
           ("kernels:positions=index", CONV, 0)]


def _with(p: Payload, i: int, t: torch.Tensor) -> Payload:
    tensors = list(p.tensors)
    tensors[i] = t
    return dataclasses.replace(p, tensors=tuple(tensors))


@pytest.mark.parametrize("spec, x, i", INDEXED)
@pytest.mark.parametrize("where", ["first two", "last two", "far apart"])
def test_a_repeated_index_is_refused_by_every_decoder(spec, x, i, where):
    codec, p = _encoded(spec, x)
    idx = p.tensors[i].clone()
    a, b = {"first two": (0, 1), "last two": (-2, -1), "far apart": (0, -1)}[where]
    idx[b] = idx[a]
    out = torch.zeros_like(x)
    bad = _with(p, i, idx)
    for decode in (lambda: codec.decode(bad), lambda: codec.decode_add(bad, out),
                   lambda: codec.decode_sum([p, bad], out)):
        with pytest.raises(PayloadError, match=rf"{codec.name}: .*indices must be distinct, index {int(idx[a])} "
                                               "appears 2 times"):
            decode()


@pytest.mark.parametrize("spec, x, i", INDEXED)
def test_distinct_indices_in_any_order_decode_as_before(spec, x, i):
    codec, p = _encoded(spec, x)
    if codec.name == "topk":  # the scatter, by hand; the order of the pairs does not matter
        expect = torch.zeros(x.numel())
        expect[p.tensors[1].long()] = p.tensors[0]
        expect = expect.view(x.shape)
        order = torch.randperm(p.tensors[1].numel(), generator=torch.Generator().manual_seed(0))
        shuffled = Payload((p.tensors[0][order], p.tensors[1][order]), p.shape, p.dtype)
        assert torch.equal(codec.decode(shuffled), expect)
    else:  # the same selection named by a bitmap decodes to the same tensor
        other, q = _encoded(spec.replace("positions=index", "positions=bitmap"), x)
        expect = other.decode(q)
    assert torch.equal(codec.decode(p), expect)
    out = torch.zeros_like(x)
    codec.decode_add(p, out)
    assert torch.allclose(out, expect, rtol=0, atol=1e-6)
    codec.decode_sum([p], out)
    assert torch.allclose(out, expect, rtol=0, atol=1e-6)


@pytest.mark.parametrize("values", [[], [5], [0, 1, 2, 9], [9, 2, 0, 1], [2**31 - 1, -3, 0]])
def test_distinct_accepts_indices_that_never_repeat(values):
    distinct("c", "indices", torch.tensor(values, dtype=torch.int32))


@pytest.mark.parametrize("values, repeated, times", [
    ([0, 1, 1, 2], 1, 2), ([3, 0, 3], 3, 2), ([7, 7, 7], 7, 3), ([4, 2, 9, 2, 4], 2, 2), ([5, 5], 5, 2)])
def test_distinct_names_the_smallest_repeated_index(values, repeated, times):
    with pytest.raises(PayloadError, match=rf"^c: indices must be distinct, index {repeated} appears {times} times$"):
        distinct("c", "indices", torch.tensor(values, dtype=torch.int32))

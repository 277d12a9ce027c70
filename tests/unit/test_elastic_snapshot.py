"""The copy an elastic worker keeps to undo a failed step (``copy_state``): deepcopy's values,
written into the last step's copy where it fits."""

from __future__ import annotations

import collections
import copy

import torch

from thinwire.elastic.worker import copy_state


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"feedback": collections.OrderedDict(w=torch.randn(4, 3, generator=g), b=torch.randn(3, generator=g)),
            "step": seed, "q": [torch.randn(2, 2, generator=g), None, ("ab", 1.5)],
            "half": torch.randn(5, generator=g).to(torch.bfloat16), "t": torch.randn(6, 4, generator=g).t()}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and torch.equal(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_copy_equals_deepcopys_and_is_independent_of_its_source():
    s = state(0)
    got = copy_state(s)
    assert same(got, copy.deepcopy(s))
    s["feedback"]["w"].add_(1.0)
    s["q"][0].zero_()
    assert same(got, copy.deepcopy(state(0)))  # the source changed, the copy did not


def test_the_next_copy_writes_into_the_last_ones_tensors_where_they_fit():
    first = copy_state(state(0))
    where = {k: first["feedback"][k].data_ptr() for k in ("w", "b")}
    half, q0 = first["half"].data_ptr(), first["q"][0].data_ptr()
    s1 = state(1)
    s1["feedback"]["b"] = torch.randn(7)  # another shape: a tensor of its own
    second = copy_state(s1, first)
    assert same(second, copy.deepcopy(s1))
    assert second["feedback"]["w"].data_ptr() == where["w"] and second["half"].data_ptr() == half
    assert second["q"][0].data_ptr() == q0
    assert second["feedback"]["b"].data_ptr() != where["b"]
    # a dtype or stride that differs is not written into either
    s2 = state(2)
    s2["half"] = s2["half"].float()
    s2["t"] = s2["t"].contiguous()
    third = copy_state(s2, second)
    assert same(third, copy.deepcopy(s2)) and third["half"].data_ptr() != half

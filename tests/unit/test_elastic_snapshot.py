"""The copy an elastic worker keeps to undo a failed step (``copy_state``): deepcopy's values,
written into the last step's copy where it fits; and its commit vote, decided locally in a
replica group of one rank (``_vote_locally``)."""

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


class _Client:
    """A stand-in for torchft's manager client: counts the votes it is asked for."""

    def __init__(self) -> None:
        self.votes = 0

    def should_commit(self, group_rank, step, should_commit, timeout=None):
        self.votes += 1
        return should_commit

    def _quorum(self, **kwargs):
        return ("quorum", kwargs)


class _Manager:
    def __init__(self, group_world_size: int) -> None:
        self._client, self._group_world_size = _Client(), group_world_size


def test_a_replica_group_of_one_rank_decides_its_vote_without_asking_its_server():
    from thinwire.elastic.worker import _vote_locally

    manager = _Manager(1)
    real = manager._client
    _vote_locally(manager)
    _vote_locally(manager)  # once is enough: not wrapped twice
    assert manager._client is not real and manager._client._client is real
    assert manager._client.should_commit(0, 7, True) is True
    assert manager._client.should_commit(0, 7, False) is False
    assert real.votes == 0  # the vote never reached the server
    assert manager._client._quorum(step=3) == ("quorum", {"step": 3})  # everything else does


def test_a_replica_group_of_several_ranks_keeps_asking_its_server():
    from thinwire.elastic.worker import _vote_locally

    manager = _Manager(2)
    real = manager._client
    _vote_locally(manager)
    assert manager._client is real  # the group's ranks must agree through the server

"""LocalWorld: in-process ranks on threads (collectives, exchange, subgroups, failures)."""

import threading
import time

import pytest
import torch

from thinwire.comm.base import Communicator
from thinwire.comm.local import LocalWorld, RankAborted


def _inputs(rank: int, shape=(5, 3), dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_all_reduce_sums_in_rank_order(n):
    def fn(comm: Communicator):
        t = _inputs(comm.rank)
        comm.all_reduce(t)
        return t

    out = LocalWorld(n).run(fn)
    ref = _inputs(0)
    for r in range(1, n):
        ref = ref + _inputs(r)
    for t in out:
        assert torch.equal(t, ref)  # atol 0: same order on every rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8])
def test_all_reduce_dtypes_and_async(dtype):
    def fn(comm):
        t = torch.full((4,), comm.rank + 1, dtype=dtype)
        h = comm.all_reduce(t, async_op=True)
        h.wait()
        assert h.is_completed()
        return t

    for t in LocalWorld(4).run(fn):
        assert torch.equal(t, torch.full((4,), 10, dtype=dtype))


def test_all_gather_and_broadcast():
    def fn(comm):
        t = torch.arange(6, dtype=torch.uint8).reshape(2, 3) + 10 * comm.rank
        out = torch.empty((comm.world_size, 2, 3), dtype=torch.uint8)
        comm.all_gather(t, out, async_op=True).wait()
        b = torch.full((3,), float(comm.rank))
        comm.broadcast(b, src=2)
        return out, b

    for out, b in LocalWorld(3).run(fn):
        ref = torch.stack([torch.arange(6, dtype=torch.uint8).reshape(2, 3) + 10 * r for r in range(3)])
        assert torch.equal(out, ref)
        assert torch.equal(b, torch.full((3,), 2.0))


def test_in_place_through_views():
    def fn(comm):
        base = torch.zeros(4, 4)
        col = base[:, 1]  # a non-contiguous view: the write lands in ``base``
        col.fill_(comm.rank + 1.0)
        comm.all_reduce(col)
        return base

    for base in LocalWorld(2).run(fn):
        assert torch.equal(base[:, 1], torch.full((4,), 3.0)) and base[:, 0].eq(0).all()


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_exchange_on_a_ring(n):
    def fn(comm):
        left, right = (comm.rank - 1) % n, (comm.rank + 1) % n
        peers = {left, right}
        sends = {p: torch.tensor([comm.rank * 10.0 + p]) for p in peers}
        recvs = {p: torch.empty(1) for p in peers}
        comm.exchange(sends, recvs, async_op=True).wait()
        return {p: recvs[p].item() for p in peers}

    for rank, got in enumerate(LocalWorld(n).run(fn)):
        for p, v in got.items():
            assert v == p * 10.0 + rank  # what p sent to this rank


def test_repeated_exchanges_match_in_order():
    def fn(comm):
        peer = 1 - comm.rank
        got = []
        for step in range(5):
            r = torch.empty(2)
            comm.exchange({peer: torch.tensor([step, comm.rank], dtype=torch.float32)}, {peer: r})
            got.append(r.tolist())
        return got

    out = LocalWorld(2).run(fn)
    assert out[0] == [[s, 1.0] for s in range(5)] and out[1] == [[s, 0.0] for s in range(5)]


def test_subgroups_have_their_own_rendezvous_and_share_the_meter():
    def fn(comm):
        pair = [0, 1] if comm.rank < 2 else [2, 3]
        a = comm.subgroup([0, 1])
        b = comm.subgroup([2, 3])
        sub = a if comm.rank < 2 else b
        assert (a is None) == (comm.rank >= 2) and (b is None) == (comm.rank < 2)
        assert sub.world_size == 2 and sub.rank == pair.index(comm.rank)
        t = torch.tensor([float(comm.rank)])
        sub.all_reduce(t)
        odd = comm.subgroup([3, 1])  # ranks are positions in the list: global 3 is rank 0
        gathered = None
        if odd is not None:
            gathered = torch.empty(2, 1)
            odd.all_gather(torch.tensor([float(comm.rank)]), gathered)
            assert odd.rank == [3, 1].index(comm.rank)
        comm.barrier()
        return t.item(), gathered, sub.meter is comm.meter, comm.meter.bytes_sent

    out = LocalWorld(4).run(fn)
    assert [o[0] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert torch.equal(out[1][1], torch.tensor([[3.0], [1.0]])) and torch.equal(out[3][1], torch.tensor([[3.0], [1.0]]))
    assert out[0][1] is None and all(o[2] for o in out)
    assert out[0][3] == 4.0  # subgroup all_reduce of 4 bytes over 2 ranks: 2(n-1)/n * 4
    assert out[1][3] == 8.0  # plus all_gather of 4 bytes over 2 ranks: (n-1) * 4


def _wait_until_blocked(comm, waiting: int, timeout: float = 60) -> None:
    """Return once ``waiting`` ranks sit in the current rendezvous of ``comm``'s group. Reads
    LocalWorld's internals: a rank counts its arrival and enters ``Condition.wait`` without
    releasing the group's lock in between, so a count seen under that lock means they are all
    blocked there (and they stay in the wait loop until the round completes or a check fails)."""
    group = comm._group
    deadline = time.monotonic() + timeout  # a guard against a hang only
    while True:
        with group.cond:
            if group.arrived == waiting:
                return
        assert time.monotonic() < deadline, f"{waiting} ranks never arrived"
        time.sleep(0.005)


def test_a_failing_rank_raises_and_releases_the_others():
    released = {}

    def fn(comm):
        if comm.rank == 2:
            _wait_until_blocked(comm, 3)  # ranks 0, 1 and 3 are blocked in all_reduce, waiting for rank 2
            raise KeyError("boom on 2")
        try:
            comm.all_reduce(torch.ones(3))
        except BaseException as e:
            released[comm.rank] = e
            raise
        return comm.rank

    # released by rank 2's failure, not by the timeout (a wait that ran out would end in TimeoutError)
    with pytest.raises(KeyError, match="boom on 2"):
        LocalWorld(4, timeout_s=30).run(fn)
    assert sorted(released) == [0, 1, 3]
    for rank, e in released.items():
        assert isinstance(e, RankAborted), (rank, e)
        assert f"rank {rank}: gave up waiting in all_reduce because rank 2 failed" in str(e)


def test_a_failing_rank_releases_a_blocked_receiver():
    def fn(comm):
        if comm.rank == 0:
            raise ValueError("no send today")
        r = torch.empty(1)
        comm.exchange({}, {0: r})
        return r

    with pytest.raises(ValueError, match="no send today"):
        LocalWorld(2, timeout_s=30).run(fn)


def test_mismatched_collectives_fail_fast():
    def fn(comm):
        if comm.rank == 0:
            comm.all_reduce(torch.ones(1))  # rank 1 never joins: it returns instead
        return comm.rank

    # ended by noticing that rank 1 returned, not by the timeout (that would be a TimeoutError)
    with pytest.raises(RuntimeError, match=r"rank 0: all_reduce waits for rank\(s\) \[1\], which already returned"):
        LocalWorld(2, timeout_s=30).run(fn)


def test_shape_mismatch_and_timeout():
    def mismatch(comm):
        comm.all_reduce(torch.ones(comm.rank + 1))

    with pytest.raises(ValueError, match="different tensors"):
        LocalWorld(2).run(mismatch)

    gave_up = threading.Event()  # rank 0's barrier ended

    def slow(comm):
        if comm.rank == 0:
            try:
                comm.barrier()
            finally:
                gave_up.set()
        else:  # alive but absent (returning would be a mismatch, not a timeout) until rank 0 gave up
            assert gave_up.wait(60), "rank 0's barrier did not time out"

    with pytest.raises(TimeoutError, match=r"rank 0: barrier waited 0.1 s for rank\(s\) \[1\]"):
        LocalWorld(2, timeout_s=0.1).run(slow)


def test_aborted_ranks_are_not_the_reported_error():
    def fn(comm):
        if comm.rank == 1:
            raise OSError("disk")
        comm.barrier()

    with pytest.raises(OSError):
        LocalWorld(3).run(fn)
    assert issubclass(RankAborted, RuntimeError)


def test_validation():
    with pytest.raises(ValueError, match="n >= 1"):
        LocalWorld(0)

    def bad_peer(comm):
        comm.exchange({comm.rank: torch.ones(1)}, {})

    with pytest.raises(ValueError, match="peer must be another rank"):
        LocalWorld(2).run(bad_peer)

"""The state a joining elastic worker takes (thinwire.elastic.transport) between two gloo ranks:
sealed with the job secret and checked before a byte of it is unpickled; one byte changed on
the way, or a joiner without the secret, is refused and named."""

from __future__ import annotations

from datetime import timedelta

import pytest

from spawn import run_ranks

pytestmark = [pytest.mark.timeout(120), pytest.mark.spawns]

KEY = b"0123456789abcdef0123456789abcdef"


def _transfer(rank: int, world: int, receiver_key: bytes, tamper: bool) -> dict:
    import torch
    import torch.distributed as dist

    from thinwire.elastic import transport

    pg = dist.distributed_c10d._get_default_group()
    t = transport.SignedTransport(pg, KEY if rank == 0 else receiver_key, lambda: 7, lambda r: f"worker {10 + r}")
    state = {"user": {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "steps": 12}, "torchft": {"step": 3}}
    timeout = timedelta(seconds=20)
    if rank == 0:
        if tamper:  # the source changes one byte of the state after sealing it
            send = t._send

            def altered(peer, tensor, tag, timeout):
                if tag == transport.TAG + 4:
                    tensor = tensor.clone()
                    tensor[-1] ^= 1
                send(peer, tensor, tag, timeout)

            t._send = altered
        try:
            t.send_checkpoint([1], 3, state, timeout)
        except transport.StateRefused as e:
            return {"refused": str(e), "ranks": e.ranks}
        return {"sent": True}
    loads = []
    real_load = torch.load
    torch.load = lambda *a, **k: loads.append(1) or real_load(*a, **k)  # count what would be unpickled
    try:
        got = t.recv_checkpoint(0, t.metadata(), 3, timeout)
    except transport.StateRefused as e:
        return {"refused": str(e), "ranks": e.ranks, "mine": e.mine, "loads": len(loads)}
    finally:
        torch.load = real_load
    return {"equal": torch.equal(got["user"]["model"]["w"], state["user"]["model"]["w"]) and got["torchft"] == {
        "step": 3} and got["user"]["steps"] == 12, "loads": len(loads)}


def test_the_state_arrives_whole_and_is_loaded_once():
    source, joiner = run_ranks(_transfer, 2, KEY, False)
    assert source == {"sent": True} and joiner == {"equal": True, "loads": 1}


def test_one_byte_changed_after_sealing_is_refused_naming_the_source_and_nothing_is_unpickled():
    source, joiner = run_ranks(_transfer, 2, KEY, True)
    assert source == {"sent": True}  # the source's half of the exchange went through
    assert joiner["loads"] == 0 and joiner["ranks"] == [0] and not joiner["mine"]
    assert joiner["refused"] == ("the state sent by worker 10 failed its authentication (another job secret, or "
                                 "changed on the way): refused, nothing of it loaded")


@pytest.mark.parametrize("key", [b"another secret of thirty-two byte", b""])
def test_a_joiner_without_the_secret_is_sent_nothing_and_both_name_the_other(key):
    source, joiner = run_ranks(_transfer, 2, key, False)
    assert source == {"refused": "sent no state to worker 11: it did not prove it holds the job's secret",
                      "ranks": [1]}
    assert joiner["loads"] == 0 and joiner["mine"] and joiner["ranks"] == [0]
    assert joiner["refused"].startswith("worker 10 sent no state: it refused this worker's proof")

"""TorchComm on spawned gloo ranks (CPU), with the emulated link. Few spawns: each costs seconds.

Rank functions are module-level (spawn pickles them) and assert inside the rank, so a
failure surfaces as that rank's traceback.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from spawn import free_port, run_ranks
from thinwire.comm.link import EmulatedLink, Link
from thinwire.comm.meter import sent_bytes
from thinwire.comm.torch_dist import TorchComm, init_from_env

pytestmark = pytest.mark.timeout(120)


def _inputs(rank: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _collectives(rank: int, world: int) -> dict:
    comm = TorchComm()
    assert (comm.rank, comm.world_size) == (rank, world)
    expected_bytes = 0.0

    # all_reduce: exact for integer-valued floats in any summation order; rtol for random ones
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8):
        t = torch.arange(12, dtype=torch.int32).to(dtype) + rank
        comm.all_reduce(t)
        ref = sum(torch.arange(12, dtype=torch.int32) + r for r in range(world)).to(dtype)
        assert torch.equal(t, ref), (dtype, t, ref)
        expected_bytes += sent_bytes("all_reduce", t.numel() * t.element_size(), world)
    t = _inputs(rank, 1000)
    comm.all_reduce(t)
    ref = sum(_inputs(r, 1000).double() for r in range(world))
    torch.testing.assert_close(t.double(), ref, rtol=1e-6, atol=1e-6)
    expected_bytes += sent_bytes("all_reduce", 4000, world)

    # non-contiguous in place: the write lands in the base tensor
    base = torch.zeros(4, 3)
    base[:, 1] = rank + 1.0
    comm.all_reduce(base[:, 1])
    assert torch.equal(base[:, 1], torch.full((4,), world * (world + 1) / 2)) and base[:, 0].eq(0).all()
    expected_bytes += sent_bytes("all_reduce", 16, world)

    # all_gather of uint8 and fp32 (a non-contiguous input and a non-contiguous output)
    u8 = (torch.arange(10, dtype=torch.uint8) + 20 * rank).reshape(2, 5)
    out = torch.empty(world, 2, 5, dtype=torch.uint8)
    comm.all_gather(u8, out)
    ref = torch.stack([(torch.arange(10, dtype=torch.uint8) + 20 * r).reshape(2, 5) for r in range(world)])
    assert torch.equal(out, ref)
    f = _inputs(rank, 6).reshape(3, 2).t()  # (2, 3), non-contiguous
    out_f = torch.empty(2, 3, world).permute(2, 0, 1)  # (world, 2, 3), non-contiguous
    comm.all_gather(f, out_f)
    assert torch.equal(out_f, torch.stack([_inputs(r, 6).reshape(3, 2).t() for r in range(world)]))
    expected_bytes += sent_bytes("all_gather", 10, world) + sent_bytes("all_gather", 24, world)

    # async: several in flight at once, waited in reverse order
    a, b = torch.full((100,), float(rank)), torch.full((7,), rank, dtype=torch.int32)
    g_out = torch.empty(world, 3)
    h1 = comm.all_reduce(a, async_op=True)
    h2 = comm.all_reduce(b, async_op=True)
    h3 = comm.all_gather(torch.full((3,), float(rank)), g_out, async_op=True)
    for h in (h3, h2, h1):
        h.wait()
        assert h.is_completed()
    s = world * (world - 1) // 2
    assert a.eq(s).all() and b.eq(s).all() and torch.equal(g_out[:, 0], torch.arange(world, dtype=torch.float32))
    expected_bytes += sent_bytes("all_reduce", 400, world) + sent_bytes("all_reduce", 28, world)
    expected_bytes += sent_bytes("all_gather", 12, world)

    # exchange on a ring: each rank sends to both neighbours (one peer when world == 2)
    peers = sorted({(rank - 1) % world, (rank + 1) % world})
    for step in range(3):  # repeated rounds match in order
        sends = {p: torch.tensor([1000.0 * step + 10 * rank + p]) for p in peers}
        recvs = {p: torch.empty(1) for p in peers}
        h = comm.exchange(sends, recvs, async_op=step > 0)
        h.wait()
        assert {p: recvs[p].item() for p in peers} == {p: 1000.0 * step + 10 * p + rank for p in peers}
        expected_bytes += 4 * len(peers)

    # broadcast from the last rank (counted on the root only), barrier
    bt = torch.full((5,), float(rank))
    comm.broadcast(bt, src=world - 1)
    assert bt.eq(world - 1).all()
    if rank == world - 1:
        expected_bytes += sent_bytes("broadcast", 20, world)
    comm.barrier()

    assert comm.meter.bytes_sent == pytest.approx(expected_bytes, rel=1e-12)
    return comm.meter.snapshot()


class _VirtualClock:
    """The emulated link's clock in one rank: it moves only when the link sleeps or the rank
    "computes", so the waits the link asks for are recorded, not measured (load cannot move them)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def _emulated(rank: int, world: int) -> dict:
    from thinwire.comm import link as link_module

    clock = _VirtualClock()  # patched here, in the rank's own process
    saved = link_module._now, link_module._sleep
    link_module._now, link_module._sleep = clock.now, clock.sleep
    try:
        comm = TorchComm()
        link = Link.parse("100mbit,50us")
        em = EmulatedLink(comm, link)
        t = torch.full((250_000,), float(rank))  # 1 MB
        modeled = link.all_reduce_time(t.numel() * 4, world)  # 2*50us + 1e6/12.5e6 = 80.1 ms
        t0 = clock.now()
        em.all_reduce(t)  # the real gloo collective, then the link's wait
        blocking = clock.now() - t0
        assert t.eq(world * (world - 1) / 2).all()
        assert comm.meter.bytes_sent == sent_bytes("all_reduce", 1_000_000, world)  # once, not twice

        # two async ops queue on the link (done at 1 and 2 modeled times) while 'compute' runs for 1.5
        x, y = torch.ones(250_000), torch.ones(250_000)
        t0 = clock.now()
        h1, h2 = em.all_reduce(x, async_op=True), em.all_reduce(y, async_op=True)
        issued = clock.slept[:]  # issuing async waits for nothing
        clock.t += 1.5 * modeled  # real work would run here while the link is busy
        h1.wait()  # done during the compute: no wait
        h2_early = h2.is_completed()
        h2.wait()  # the rest of h2: 0.5 modeled
        overlapped = clock.now() - t0
        assert x.eq(world).all() and y.eq(world).all()
        sub = em.subgroup([1, 0])
        assert isinstance(sub, EmulatedLink) and sub.rank == 1 - rank and sub.meter is comm.meter
    finally:
        link_module._now, link_module._sleep = saved
    return dict(modeled=modeled, blocking=blocking, issued=issued, slept=clock.slept, overlapped=overlapped,
                h2_early=h2_early, total=em.modeled_seconds)


def _subgroups(rank: int, world: int) -> dict:
    comm = TorchComm()
    low, high = comm.subgroup([0, 1]), comm.subgroup([2, 3])  # collective: every rank calls both
    pair = low if rank < 2 else high
    assert (low is None) == (rank >= 2) and (high is None) == (rank < 2)
    assert pair.world_size == 2 and pair.rank == rank % 2 and pair.meter is comm.meter
    t = torch.tensor([float(rank)])
    pair.all_reduce(t)
    assert t.item() == (1.0 if rank < 2 else 5.0)
    out = torch.empty(2, 2, dtype=torch.uint8)
    pair.all_gather(torch.tensor([rank, rank], dtype=torch.uint8), out)
    base = 0 if rank < 2 else 2
    assert out[:, 0].tolist() == [base, base + 1]
    r = torch.empty(1)
    pair.exchange({1 - pair.rank: torch.tensor([float(rank)])}, {1 - pair.rank: r})
    assert r.item() == float(rank ^ 1)
    b = torch.tensor([float(rank)])
    pair.broadcast(b, src=1)  # subgroup rank 1 = global 1 or 3
    assert b.item() == float(base + 1)
    pair.barrier()

    # positions, not sorted order: global 3 is rank 0 of [3, 1, 2]
    odd = comm.subgroup([3, 1, 2])
    if rank == 0:
        assert odd is None
    else:
        assert odd.rank == [3, 1, 2].index(rank)
        g = torch.empty(3, 1)
        odd.all_gather(torch.tensor([float(rank)]), g)
        assert g.flatten().tolist() == [3.0, 1.0, 2.0]
        x = torch.empty(1)
        nxt, prv = (odd.rank + 1) % 3, (odd.rank - 1) % 3
        odd.exchange({nxt: torch.tensor([float(rank)])}, {prv: x})
        assert x.item() == float([3, 1, 2][prv])
        with pytest.raises(NotImplementedError, match="all processes"):
            odd.subgroup([0, 1])
    comm.barrier()
    # meter: subgroup traffic counted once, on the parent's meter
    return comm.meter.snapshot()


def _two_ranks(rank: int, world: int) -> dict:
    return dict(collectives=_collectives(rank, world), emulated=_emulated(rank, world))


def _four_ranks(rank: int, world: int) -> dict:
    return dict(collectives=_collectives(rank, world), subgroups=_subgroups(rank, world))


def test_collectives_and_emulated_link_on_two_ranks():
    results = run_ranks(_two_ranks, 2, timeout=90)
    for r in results:
        em = r["emulated"]
        m = em["modeled"]
        assert m == pytest.approx(2 * 50e-6 + 1e6 / 12.5e6)
        assert em["blocking"] == pytest.approx(m, abs=1e-12), em  # a blocking call waits its modeled time
        assert em["issued"] == [pytest.approx(m, abs=1e-12)], em  # only the blocking call's wait so far
        # the second op queues behind the first and finishes at 2m: after compute (1.5m) it waits 0.5m;
        # serial compute + comm would take 3.5m
        assert not em["h2_early"] and em["slept"] == [pytest.approx(m, abs=1e-12), pytest.approx(0.5 * m, abs=1e-12)]
        assert em["overlapped"] == pytest.approx(2 * m, abs=1e-12), em
        assert em["total"] == pytest.approx(3 * m)


def test_collectives_ring_and_subgroups_on_four_ranks():
    results = run_ranks(_four_ranks, 4, timeout=90)
    for rank, r in enumerate(results):
        sub = r["subgroups"]
        assert sub["all_reduce"]["calls"] == 1 and sub["all_reduce"]["bytes"] == 4.0  # 2(n-1)/n * 4, n = 2
        assert sub["send"]["bytes"] == (4.0 if rank == 0 else 8.0)  # ranks 1-3 also sent in [3, 1, 2]
        assert r["collectives"]["send"]["calls"] == 3 * 2  # 3 rounds, two ring neighbours


_INIT_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    import torch.distributed as dist
    from thinwire.comm.torch_dist import init_from_env
    comm = init_from_env(timeout_s=1.5)
    t = torch.full((3,), float(comm.rank) + 1)
    comm.all_reduce(t)
    assert t.tolist() == [3.0] * 3, t
    print("backend", dist.get_backend(), "world", comm.world_size, flush=True)
    gave_up = os.environ["GAVE_UP_FILE"]
    if comm.rank == 1:  # a stuck peer, alive (its sockets open) until rank 0 has given up on it
        for _ in range(600):  # a guard against a hang only
            if os.path.exists(gave_up):
                break
            time.sleep(0.1)
        sys.exit(0)
    t0 = time.monotonic()
    try:
        comm.all_reduce(t)
    except Exception as e:
        print(f"timed out after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
    finally:
        open(gave_up, "w").close()
    print("no timeout", flush=True)
    """
)


def test_init_from_env_and_collective_timeout(tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1",
               GAVE_UP_FILE=str(tmp_path / "gave_up"))
    env.pop("LOCAL_RANK", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _INIT_SCRIPT],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "backend gloo world 2" in outs[0] and "backend gloo world 2" in outs[1], outs
    # non-zero either way (gloo may abort at interpreter exit with an op still pending)
    assert procs[0].returncode != 0 and "timed out after" in outs[0], outs
    waited = float(outs[0].split("timed out after ")[1].split(" s")[0])
    assert waited >= 1.0, outs[0]  # not before the timeout (1.5 s; printed to 0.1 s); load can only add to it
    # gloo's own timeout with the configured 1.5 s, not a connection dropped by the peer (it was still alive)
    assert "RuntimeError" in outs[0] and "timed out waiting 1500ms" in outs[0].lower(), outs[0]


def test_init_from_env_names_missing_variables(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="missing WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_from_env()


def test_torch_comm_needs_an_initialised_world():
    with pytest.raises(RuntimeError, match="not initialised"):
        TorchComm()


def test_collectives_launch_without_the_python_context_backward_stashes():
    # a gloo work keeps the thread-local state it was created in; the context object that
    # backward() stashes there must not ride along (gloo's thread may drop the last reference
    # to the work while the interpreter shuts down, when releasing a Python object aborts)
    from thinwire.comm.torch_dist import _launching

    seen = []

    def hook(p):
        seen.append(torch._C._is_key_in_tls("context"))
        with _launching():
            seen.append(torch._C._is_key_in_tls("context"))
        seen.append(torch._C._is_key_in_tls("context"))

    w = torch.zeros(3, requires_grad=True)
    w.register_post_accumulate_grad_hook(hook)
    (2 * w).sum().backward()
    assert seen == [True, False, True]  # removed for the launch, put back for the rest of backward
    assert not torch._C._is_key_in_tls("context")  # and backward still clears it at its end


def _environment(rank: int, world: int) -> tuple:
    import signal

    return os.environ.get("THINWIRE_TEST_MARK"), signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, os.getpid()


def test_ranks_start_with_the_callers_environment_of_the_call_and_the_default_sigterm(monkeypatch):
    # the ranks start from a fork server, which started with the first call's environment: each
    # call's ranks still hold the caller's environment of that call, and SIGTERM's default
    # (the server ignores it)
    from thinwire.run.spawn import rank_context

    assert rank_context().get_start_method() == "forkserver"  # Linux
    monkeypatch.setenv("THINWIRE_TEST_MARK", "first")
    first = run_ranks(_environment, 2)
    monkeypatch.setenv("THINWIRE_TEST_MARK", "second")
    second = run_ranks(_environment, 2)
    assert [r[:2] for r in first] == [("first", True)] * 2 and [r[:2] for r in second] == [("second", True)] * 2
    assert len({r[2] for r in first + second} | {os.getpid()}) == 5  # four processes of their own

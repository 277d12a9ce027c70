"""thinwire's DDP comm hook against DDP's default and PyTorch's own compress hooks."""

import gc

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from spawn import run_ranks


def _net() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m


def _grads(rank, setup, cap_mb=None, iterations=2, collect=True) -> list[torch.Tensor]:
    """Gradients after ``iterations`` steps of DDP (buckets of ``cap_mb``; None: DDP's
    default) with ``setup(model)`` applied: from the second on, DDP's rebuilt buckets.
    ``collect=False`` leaves the wrapper's collection to the caller (a ``gc.collect()`` costs
    about 0.1 s)."""
    model = DDP(_net(), **({} if cap_mb is None else {"bucket_cap_mb": cap_mb}))
    setup(model)
    g = torch.Generator().manual_seed(7 + rank)
    x, y = torch.randn(16, 30, generator=g), torch.randint(0, 4, (16,), generator=g)
    for _ in range(iterations):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    del model
    if collect:
        gc.collect()  # each DDP wrapper goes now, while its process group lives (not at interpreter exit)
    return grads


def _bf16_reference_hook(state, bucket):
    t = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size())
    dist.all_reduce(t)
    bucket.buffer().copy_(t.to(torch.float32))
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _compare(rank, world):
    import thinwire.integrations.ddp as tw_ddp

    out = {}
    default = _grads(rank, lambda m: None)
    ours = _grads(rank, lambda m: tw_ddp.register(m, "identity"))
    out["identity"] = max((a - b).abs().max().item() for a, b in zip(default, ours))
    torch_fp16 = _grads(rank, lambda m: m.register_comm_hook(None, default_hooks.fp16_compress_hook))
    ours = _grads(rank, lambda m: tw_ddp.register(m, "fp16"))
    out["fp16"] = max((a - b).abs().max().item() for a, b in zip(torch_fp16, ours))
    ref_bf16 = _grads(rank, lambda m: m.register_comm_hook(None, _bf16_reference_hook))
    ours = _grads(rank, lambda m: tw_ddp.register(m, "bf16"))
    out["bf16"] = max((a - b).abs().max().item() for a, b in zip(ref_bf16, ours))
    out["bf16_vs_fp32"] = max((a - b).abs().max().item() for a, b in zip(default, ours))
    out["scale"] = max(a.abs().max().item() for a in default)
    ours = _grads(rank, lambda m: tw_ddp.register(m, "powersgd:rank=2"))
    out["powersgd_finite"] = all(torch.isfinite(a).all().item() for a in ours)
    return out


@pytest.mark.timeout(180)
def test_ddp_hook_matches_ddp_default_and_torch_compress_hooks():
    for r in run_ranks(_compare, 2):
        assert r["identity"] == 0.0  # exact: the same division and all_reduce as DDP's default
        assert r["fp16"] == 0.0  # exact: cast, divide in fp16, sum in fp16, as fp16_compress_hook
        # bf16 against cast/all_reduce/cast-back: same operations, so exact as well
        assert r["bf16"] == 0.0
        # and bf16 is a real compression: off from fp32 by about bf16's 2^-8 relative precision
        assert 0 < r["bf16_vs_fp32"] <= 2 * 2**-8 * r["scale"]
        assert r["powersgd_finite"]


def _overlap_equals_in_hook(rank, world):
    import thinwire.integrations.ddp as tw_ddp
    from thinwire.codecs.specs import available

    differs = []
    # every codec on two ranks; on four (where gloo's sum order follows a value's place in the
    # buffer) one of each kind: launched from the hook (identity, bf16), a two-round SUM codec,
    # GATHER codecs, a policy
    specs = ([*available(), "powersgd:rank=2", "topk:ratio=0.05", "hylo"] if world == 2
             else ["identity", "bf16", "powersgd:rank=2", "topk:ratio=0.05", "fft", "hylo"])
    for spec in specs:
        for cap in (None, 0.002):  # one bucket; a bucket per tensor or two
            # three iterations: the last two on rebuilt buckets, with codec state carried over
            a = _grads(rank, lambda m, spec=spec: tw_ddp.register(m, spec, overlap=True), cap, 3, collect=False)
            b = _grads(rank, lambda m, spec=spec: tw_ddp.register(m, spec, overlap=False), cap, 3, collect=False)
            if not all(torch.equal(x, y) for x, y in zip(a, b)):
                differs.append((spec, cap))
        gc.collect()  # the spec's four DDP wrappers go while the process group lives
    return differs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_the_overlapping_hook_averages_bit_identically_to_averaging_in_the_hook(world):
    for r in run_ranks(_overlap_equals_in_hook, world):
        assert r == []


def _collective_after_backward_went_on(rank, world):
    import threading

    import thinwire.integrations.ddp as tw_ddp
    from thinwire.comm.torch_dist import TorchComm

    seen = {}
    # identity launches from the hook and lands on the worker; topk runs wholly on the worker
    for spec in ("identity", "topk:ratio=0.5"):
        reached = threading.Event()  # the backward pass reached the first layer: its last gradient

        class Late:
            """A collective's handle that completes only once the backward pass has reached the
            first layer and records whether it had. A hook that waits for its bucket's
            collective before returning blocks the backward pass, so it waits in vain (until
            the guard, 60 s, well inside the test's timeout: a loaded machine cannot make a
            correct hook look like a blocking one)."""

            event = reached  # this iteration's event

            def __init__(self, inner):
                self.inner = inner

            def wait(self):
                Watching.seen.append(self.event.wait(60.0))
                self.inner.wait()

            def is_completed(self):
                return self.event.is_set() and self.inner.is_completed()

        class Watching(TorchComm):
            """Buckets' collectives complete late; set-up ones (the meter paused: register's
            check that the ranks hold the same parameters) at once."""

            seen: list = []

            def _all_reduce(self, t, async_op):
                handle = super()._all_reduce(t, async_op)
                return Late(handle) if self.meter.enabled else handle

            def _all_gather(self, t, out, async_op):
                handle = super()._all_gather(t, out, async_op)
                return Late(handle) if self.meter.enabled else handle

        model = DDP(_net(), bucket_cap_mb=0.002)  # the last layer's bucket is ready long before the first layer's
        first = next(model.module.parameters())
        first.register_post_accumulate_grad_hook(lambda p, reached=reached: reached.set())
        tw_ddp.register(model, spec, Watching())
        g = torch.Generator().manual_seed(7 + rank)
        x, y = torch.randn(16, 30, generator=g), torch.randint(0, 4, (16,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()  # DDP's first buckets: one, capped at 1 MB
        reached.clear()
        Watching.seen.clear()
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()  # rebuilt: a bucket per 0.002 MB
        seen[spec] = list(Watching.seen)
        del model
        gc.collect()
    return seen


@pytest.mark.timeout(120)
def test_the_hook_returns_before_its_collective_so_backward_goes_on():
    for by_spec in run_ranks(_collective_after_backward_went_on, 2):
        for spec, seen in by_spec.items():
            # every collective completed only after the backward pass went on past its hook
            assert len(seen) >= 2 and all(seen), (spec, seen)


def _unused_run(rank, world, spec):
    import torch.nn.functional as F

    import thinwire.integrations.ddp as tw_ddp
    from branchy import branchy

    model = branchy()
    net = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.01)  # several buckets, and DDP's used-map all_reduce
    if spec is not None:
        tw_ddp.register(net, spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        opt.zero_grad()
        x = torch.randn(32, 32, generator=g)
        F.cross_entropy(net(x, use_branch=rank == 1), x[:, :4].argmax(1)).backward()
        opt.step()
    out = [p.detach().clone() for p in model.parameters()]
    del net
    gc.collect()
    return out


def _unused_versus_ddp(rank, world):
    return _unused_run(rank, world, None), _unused_run(rank, world, "identity")


@pytest.mark.timeout(120)
def test_the_overlapping_hook_keeps_ddps_own_collectives_in_order_with_unused_parameters():
    # DDP all_reduces its map of used parameters right after the last bucket's hook returns: the
    # hook's buckets must all be on the wire before, on every rank, or the collectives cross
    for ddp, ours in run_ranks(_unused_versus_ddp, 2):
        assert all(torch.equal(a, b) for a, b in zip(ddp, ours))


def _one_rank_collectives(rank, world):
    """The collectives torch.distributed saw for two steps of the hook on one rank, for a SUM
    codec (identity, launched from the hook) and a GATHER one (topk), without and with
    ``one_rank_collectives``; and whether the gradients matched DDP's own either way."""
    import thinwire.comm.torch_dist as td
    import thinwire.integrations.ddp as tw_ddp
    from thinwire.comm.torch_dist import TorchComm

    calls: list[str] = []
    all_reduce, gather = dist.all_reduce, td._all_gather_flat

    def counted_all_reduce(*a, **k):
        calls.append("all_reduce")
        return all_reduce(*a, **k)

    def counted_gather(*a, **k):
        calls.append("all_gather")
        return gather(*a, **k)

    dist.all_reduce, td._all_gather_flat = counted_all_reduce, counted_gather
    try:
        default = _grads(rank, lambda m: None)
        out = {}
        for spec in ("identity", "topk:ratio=0.05"):
            for forced in (False, True):
                calls.clear()
                grads = _grads(rank, lambda m, spec=spec, forced=forced: tw_ddp.register(
                    m, spec, TorchComm(m.process_group, one_rank_collectives=forced)))
                same = all(torch.equal(a, b) for a, b in zip(default, grads)) if spec == "identity" else None
                out[(spec, forced)] = (list(calls), same)
    finally:
        dist.all_reduce, td._all_gather_flat = all_reduce, gather
    return out


@pytest.mark.timeout(120)
def test_one_rank_collectives_issues_the_hook_s_collectives_on_a_one_rank_group():
    # one rank skips its collectives (there is no one to send to); told to, it issues them as DDP
    # does on one rank, so the hook's own cost can be set against DDP's (benchmarks/bench_gpu.py)
    (out,) = run_ranks(_one_rank_collectives, 1)
    assert out[("identity", False)] == ([], True)  # nothing issued, the same gradients as DDP's
    calls, same = out[("identity", True)]
    assert calls.count("all_reduce") >= 2 and same  # a bucket each step, the same gradients
    assert "all_gather" not in out[("topk:ratio=0.05", False)][0]
    assert out[("topk:ratio=0.05", True)][0].count("all_gather") >= 2  # its compressed bucket, each step

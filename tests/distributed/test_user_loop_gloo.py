"""A user's own loop on real gloo ranks: thinwire against plain DDP for frozen, unused and
disagreeing parameters, the DDP hook under a GradScaler overflow, and the examples for
every method ``thinwire methods`` lists."""

from __future__ import annotations

import gc
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from branchy import branchy
from spawn import run_ranks

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _branchy_run(rank: int, with_ddp: bool) -> list[torch.Tensor]:
    import thinwire

    model = branchy()
    net = DDP(model, find_unused_parameters=True) if with_ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    reducer = None if with_ddp else thinwire.SyncReducer(model, "identity", find_unused_parameters=True)
    g = torch.Generator().manual_seed(rank)
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    for step in range(20):
        if step == 10:
            model.frozen.requires_grad_(False)
        opt.zero_grad()
        x = torch.randn(32, 32, generator=g)
        F.cross_entropy(net(x, use_branch=rank == 1), (x @ w).argmax(1)).backward()
        if reducer is not None:
            reducer.reduce()
        opt.step()
    out = [p.detach().clone() for p in model.parameters()]
    del net
    gc.collect()
    return out


def _versus_ddp(rank: int, world: int):
    return _branchy_run(rank, True), _branchy_run(rank, False), [p.detach().clone() for p in branchy().parameters()]


@pytest.mark.timeout(120)
def test_frozen_unused_and_disagreeing_parameters_match_ddp_with_find_unused_parameters():
    names = [n for n, _ in branchy().named_parameters()]
    for ddp, ours, init in run_ranks(_versus_ddp, 2):
        for name, a, b, p0 in zip(names, ddp, ours, init):
            if name.startswith(("frozen", "unused")):
                assert torch.equal(a, b), name  # bit-identical: left exactly where plain DDP leaves them
            else:
                torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=name)
            if name.startswith("unused"):
                assert torch.equal(b, p0)


def _hook_amp(rank: int, world: int, method: str, overflow_at: int | None):
    import thinwire

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)))
    scaler = torch.amp.GradScaler("cpu", growth_interval=10**6)
    state = thinwire.ddp.register(model, method, scaler=scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1234 + rank)
    w = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    for step in range(150):
        x = torch.randn(64, 32, generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), (x @ w).argmax(1))
        if step == overflow_at and rank == 0:
            loss = loss * float("inf")  # this rank's gradients overflow
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    tx = torch.randn(2000, 32, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        acc = (model.module(tx).argmax(1) == (tx @ w).argmax(1)).float().mean().item()
    out = acc, scaler.get_scale(), state.skipped, state.step
    del model
    gc.collect()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["topk:ratio=0.01", "powersgd:rank=2"])
def test_the_ddp_hook_skips_a_scaler_overflow_on_every_rank_and_recovers(method):
    clean = run_ranks(_hook_amp, 2, method, None)
    hit = run_ranks(_hook_amp, 2, method, 20)
    for (acc, scale, skipped, steps), (acc0, scale0, _, _) in zip(hit, clean):
        assert scale == scale0 / 2  # one back-off: nothing non-finite survives in a residual
        assert skipped == 1 and steps == 149  # the skipped step is not counted
        assert abs(acc - acc0) <= 0.01 and acc > 0.8, (acc, acc0)


def _one_bucket_overflows(rank: int, world: int):
    """Small buckets (one parameter each); at step 3 only the first layer's gradient overflows,
    on rank 0 only: no bucket's residual, nor the step counter, may change."""
    import thinwire

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 4))
    model = DDP(net, bucket_cap_mb=0.001)
    scaler = torch.amp.GradScaler("cpu", growth_interval=10**6)
    state = thinwire.ddp.register(model, "topk:ratio=0.05,min_numel=256", scaler=scaler)
    poison = {"on": False}
    net[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if poison["on"] else g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    out = []
    for step in range(5):
        poison["on"] = step == 3 and rank == 0
        before = state.state_dict()
        x = torch.randn(16, 32, generator=g)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(x), torch.randint(0, 4, (16,), generator=g))).backward()
        after = state.state_dict()
        finite = [bool(p.grad.isfinite().all()) for p in net.parameters()]
        scaler.step(opt)
        scaler.update()
        same = set(before["feedback"]) == set(after["feedback"]) and all(
            torch.equal(before["feedback"][k], after["feedback"][k]) for k in before["feedback"])
        out.append((before["step"], after["step"], same, finite, len(state.aggregators)))
    del model
    gc.collect()
    return out


@pytest.mark.timeout(120)
def test_under_a_scaler_an_overflow_in_one_bucket_changes_no_bucket_state():
    for steps in run_ranks(_one_bucket_overflows, 2):
        assert steps[-1][4] >= 3, [s[4] for s in steps]  # the parameters sit in several buckets (after the rebuild)
        for k, (before, after, same, finite, _) in enumerate(steps):
            if k == 3:
                assert after == before and same  # nothing moved, in any bucket
                assert not any(finite)  # every bucket came back NaN on this rank too
            else:
                assert after == before + 1 and all(finite)
                assert k == 0 or not same  # ordinary steps do update the residuals


def _refusals(rank: int, world: int):
    import thinwire

    out = []
    emb = DDP(torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 2)))
    for model, spec in ((emb, "topk"), (DDP(torch.nn.Linear(4, 4)), "dasgd:period=4"), (torch.nn.Linear(4, 4), "topk")):
        try:
            thinwire.ddp.register(model, spec)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    del emb
    gc.collect()
    return out


@pytest.mark.timeout(120)
def test_the_ddp_hook_refuses_sparse_gradients_schedules_and_plain_models_naming_the_alternative():
    for sparse, schedule, plain in run_ranks(_refusals, 2):
        assert "'0.weight' gets sparse gradients" in sparse and "sparse=False" in sparse
        assert "thinwire.attach(model, optimizer, 'dasgd:period=4')" in schedule
        assert "needs a DistributedDataParallel model" in plain and "thinwire.attach" in plain


def _every_method(rank: int, world: int, methods: list[str], amp: bool):
    plain_loop = _example("plain_loop")
    out = {}
    for spec in methods:
        try:
            r = plain_loop.train(spec, steps=4, amp=amp, log_every=0)
            out[spec] = ("ok", r["loss"], r["bytes_sent"], r["checkpoint_keys"], r["lr_factor"])
        except ValueError as e:
            out[spec] = ("refused", str(e))
        gc.collect()
    return out


@pytest.mark.timeout(300)
def test_the_plain_loop_example_runs_every_listed_method_on_two_ranks():
    from thinwire.algorithms.methods import method_names

    methods = method_names()
    assert {"dasgd", "hylo", "ab", "localsgd", "torch-ddp", "powergossip"} <= set(methods)
    results = run_ranks(_every_method, 2, methods, False, timeout=280)
    for spec in methods:
        got = results[0][spec]
        if spec == "torch-bf16":  # PyTorch allows its bf16 hook only with CUDA and NCCL
            assert got[0] == "refused" and "unavailable here" in got[1]
            continue
        assert got[0] == "ok", (spec, got)
        assert got[1] == got[1] and got[3] == ["method", "model", "optimizer"]  # a finite loss
        # the example's own torch scheduler ran under every method: after 4 steps its cosine is at its floor
        assert got[4] == pytest.approx(0.1, rel=1e-12), (spec, got[4])
        assert results[1][spec][0] == "ok"


@pytest.mark.timeout(180)
def test_the_examples_run_with_mixed_precision():
    methods = ["topk:ratio=0.01", "hylo", "dasgd:period=2,warmup=2", "torch-ddp"]
    for result in run_ranks(_every_method, 2, methods, True):
        for spec in methods:
            assert result[spec][0] == "ok", (spec, result[spec])
    for loss, sent in run_ranks(_ddp_example, 2):
        assert loss < 1.0 and sent > 0


def _ddp_example(rank: int, world: int):
    r = _example("ddp_hook").train("topk:ratio=0.01", steps=60, amp=True, log_every=0)
    assert set(r["checkpoint"]["hook"]) >= {"step", "feedback", "codec_state"}
    gc.collect()
    return r["loss"], r["bytes_sent"]


def _accumulate(rank: int, world: int):
    """Two micro-batches per optimizer step: plain DDP with no_sync, thinwire's hook with
    no_sync, and a plain loop calling reduce() once per step."""
    import contextlib

    import thinwire

    def run(kind: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        model = DDP(net) if kind != "reducer" else net
        hook = thinwire.ddp.register(model, "identity") if kind == "hook" else None
        reducer = thinwire.SyncReducer(net, "identity") if kind == "reducer" else None
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        w = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        for _ in range(5):
            opt.zero_grad()
            for micro in range(2):
                x = torch.randn(16, 32, generator=g)
                quiet = model.no_sync() if kind != "reducer" and micro == 0 else contextlib.nullcontext()
                with quiet:
                    F.cross_entropy(model(x), (x @ w).argmax(1)).backward()
            if reducer is not None:
                reducer.reduce()
            opt.step()
        out = [p.detach().clone() for p in net.parameters()]
        steps = hook.step if hook is not None else reducer.step if reducer is not None else 5
        del model
        gc.collect()
        return out, steps

    return run("ddp"), run("hook"), run("reducer")


@pytest.mark.timeout(120)
def test_gradient_accumulation_matches_ddp_with_no_sync():
    for (ddp, _), (hook, hook_steps), (reducer, reducer_steps) in run_ranks(_accumulate, 2):
        assert hook_steps == reducer_steps == 5  # one averaging per optimizer step
        for a, b, c in zip(ddp, hook, reducer):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
            torch.testing.assert_close(c, a, rtol=0, atol=1e-6)

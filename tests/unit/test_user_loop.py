"""thinwire in a user's own loop behaves as DDP would: mixed precision with a GradScaler,
frozen and unused parameters, ranks that disagree about gradients, sparse gradients, and
one entry point (``thinwire.attach``) for every method. In-process ranks (comm.local)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import thinwire
from branchy import branchy
from thinwire.comm.local import LocalWorld
from thinwire.comm.meter import sent_bytes

W_TRUE = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
TEST_X = torch.randn(2000, 32, generator=torch.Generator().manual_seed(99))
TEST_Y = (TEST_X @ W_TRUE).argmax(1)


def _fresh() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))


torch.manual_seed(0)
INIT = _fresh().state_dict()  # drawn once: ranks are threads, and the global RNG is shared by them


def _net() -> torch.nn.Module:
    model = _fresh()
    model.load_state_dict(INIT)
    return model


def _batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 32, generator=g)
    return x, (x @ W_TRUE).argmax(1)


def _accuracy(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return (model(TEST_X).argmax(1) == TEST_Y).float().mean().item()


def _amp_run(method: str, steps: int, overflow_at: int | None, init_scale: float = 2.0**16,
             autocast: torch.dtype | None = None):
    """2 ranks, SGD with a GradScaler; at ``overflow_at`` rank 0's gradient gets an inf."""

    def fn(comm):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        reducer = thinwire.SyncReducer(model, method, comm)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=10**6)
        g = torch.Generator().manual_seed(1234 + comm.rank)
        outcomes = []
        for step in range(steps):
            x, y = _batch(g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if step == overflow_at and comm.rank == 0:
                model[0].weight.grad[0, 0] = float("inf")
            outcomes.append(reducer.reduce(loss, scaler=scaler))
            scaler.step(opt)
            scaler.update()
        return _accuracy(model), scaler.get_scale(), outcomes, reducer.skipped

    return LocalWorld(2).run(fn)


@pytest.mark.parametrize("method", ["identity", "topk:ratio=0.01", "powersgd:rank=2"])
def test_one_scaler_overflow_is_skipped_on_every_rank_and_the_run_recovers(method):
    clean = _amp_run(method, 150, None)
    hit = _amp_run(method, 150, 20)
    for rank in range(2):
        acc, scale, outcomes, skipped = hit[rank]
        assert outcomes[20] is False and outcomes.count(False) == 1 and skipped == 1  # agreed by both ranks
        assert scale == 2.0**15  # backed off once, never again: no inf/NaN left in any residual
        assert abs(acc - clean[rank][0]) <= 0.01, (method, acc, clean[rank][0])
        assert acc > 0.8


def test_residuals_and_weights_do_not_depend_on_the_loss_scale():
    """Gradients are unscaled before encoding: a power-of-two loss scale leaves every residual
    and weight bitwise identical to a run without a scaler (atol 0)."""

    def run(scale: float | None):
        def fn(comm):
            model = _net()
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            reducer = thinwire.SyncReducer(model, "topk:ratio=0.01", comm)
            scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, growth_interval=10**6,
                                          enabled=scale is not None)
            g = torch.Generator().manual_seed(1234 + comm.rank)
            for _ in range(12):
                x, y = _batch(g)
                opt.zero_grad()
                scaler.scale(F.cross_entropy(model(x), y)).backward()
                reducer.reduce(scaler=scaler)
                scaler.step(opt)
                scaler.update()
            residuals = reducer.state_dict()["feedback"]
            return [p.detach().clone() for p in model.parameters()], residuals

        return LocalWorld(2).run(fn)

    plain, scaled = run(None), run(2.0**12)
    for (pw, pr), (sw, sr) in zip(plain, scaled):
        assert set(pr) == set(sr) and len(pr) == 2  # both weight matrices carry a residual
        for k in pr:
            assert torch.equal(pr[k], sr[k]), k
        for a, b in zip(pw, sw):
            assert torch.equal(a, b)


def test_an_overflow_step_changes_no_residual_codec_state_or_step():
    def fn(comm):
        model = _net()
        reducer = thinwire.SyncReducer(model, "powersgd:rank=2", comm)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        g = torch.Generator().manual_seed(7 + comm.rank)
        for step in range(4):
            model.zero_grad()
            x, y = _batch(g)
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            if step == 3:
                before = reducer.state_dict()
                if comm.rank == 1:
                    model[2].bias.grad[0] = float("nan")
            ok = reducer.reduce(scaler=scaler)
        after = reducer.state_dict()
        grads_nan = all(bool(p.grad.isnan().all()) for p in model.parameters())
        return ok, before, after, grads_nan

    for ok, before, after, grads_nan in LocalWorld(2).run(fn):
        assert ok is False and grads_nan  # every gradient NaN on every rank: each scaler skips
        assert after["step"] == before["step"] == 3
        assert set(after["feedback"]) == set(before["feedback"]) and after["feedback"]
        for k in before["feedback"]:
            assert torch.equal(after["feedback"][k], before["feedback"][k])
        for b, a in zip(before["codec_states"], after["codec_states"]):
            assert b.keys() == a.keys()
            for k in b:
                assert torch.equal(torch.as_tensor(b[k]), torch.as_tensor(a[k])) if not isinstance(b[k], dict) else \
                    all(torch.equal(b[k][j], a[k][j]) for j in b[k])
        assert after["sent_bytes"] == before["sent_bytes"]  # nothing sent for the skipped step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_with_a_scaler_trains_through_a_compressing_codec(dtype):
    fp32 = _amp_run("identity", 150, None)
    for method in ("identity", "topk:ratio=0.01", "powersgd:rank=2"):
        for acc, scale, outcomes, _skipped in _amp_run(method, 150, None, autocast=dtype):
            assert all(outcomes) and scale == 2.0**16
            assert acc >= fp32[0][0] - 0.05, (method, acc, fp32[0][0])


def test_unscale_before_averaging_is_refused():
    def fn(comm):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        reducer = thinwire.SyncReducer(model, "topk", comm)
        scaler = torch.amp.GradScaler("cpu")
        x, y = _batch(torch.Generator().manual_seed(0))
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.unscale_(opt)
        with pytest.raises(ValueError, match=r"unscale_\(optimizer\) was called before the gradients were averaged"):
            reducer.reduce(scaler=scaler)

    LocalWorld(1).run(fn)


# -- frozen, unused, disagreeing, sparse -------------------------------------------------------
def test_frozen_and_unused_parameters_stay_put_and_cost_nothing():
    def fn(comm):
        model = branchy()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        reducer = thinwire.SyncReducer(model, "identity", comm)
        g = torch.Generator().manual_seed(comm.rank)
        unused0 = [p.detach().clone() for p in model.unused.parameters()]
        for step in range(20):
            if step == 10:
                model.frozen.requires_grad_(False)
                frozen10 = [p.detach().clone() for p in model.frozen.parameters()]
            opt.zero_grad()
            x, y = _batch(g)
            F.cross_entropy(model(x), y).backward()
            reducer.reduce()
            opt.step()
        assert all(p.grad is None for p in model.unused.parameters())
        for p, p0 in zip(model.unused.parameters(), unused0):
            assert torch.equal(p, p0)
        for p, p10 in zip(model.frozen.parameters(), frozen10):
            assert torch.equal(p, p10)
        return reducer.reducer.sent_bytes

    n = sum(p.numel() for p in branchy().parameters())
    for sent in LocalWorld(2).run(fn):
        assert sent["unused.weight"] == sent["unused.bias"] == sent["branch.weight"] == 0
        assert sent["frozen.weight"] == 10 * sent_bytes("all_reduce", 4 * 64 * 64, 2)  # its 10 trained steps
        assert sent["trunk.weight"] == 20 * sent_bytes("all_reduce", 4 * 64 * 32, 2) and n > 0


def test_ranks_that_disagree_average_as_ddp_with_find_unused_parameters():
    """Rank 1 takes the branch, rank 0 does not: the branch's mean is rank 1's gradient over
    2 on both ranks (rank 0 receives it in a new .grad); a layer no rank used stays None."""

    def fn(comm):
        model = branchy()
        reducer = thinwire.SyncReducer(model, "identity", comm, find_unused_parameters=True)
        x, y = _batch(torch.Generator().manual_seed(comm.rank))
        F.cross_entropy(model(x, use_branch=comm.rank == 1), y).backward()
        own = model.branch.weight.grad.clone() if model.branch.weight.grad is not None else None
        reducer.reduce()
        return own, model.branch.weight.grad, model.unused.weight.grad, comm.meter.bytes_sent

    (own0, g0, u0, b0), (own1, g1, u1, b1) = LocalWorld(2).run(fn)
    assert own0 is None and own1 is not None and u0 is None and u1 is None
    torch.testing.assert_close(g0, own1 / 2, rtol=0, atol=0)
    assert torch.equal(g0, g1)
    used = sum(p.numel() for n, p in branchy().named_parameters() if not n.startswith("unused"))
    # the agreement: float64 [flag, h, h^2] and one entry per parameter (10)
    assert b0 == b1 == sent_bytes("all_reduce", 4 * used, 2) + sent_bytes("all_reduce", 8 * (3 + 10), 2)


def test_ranks_that_disagree_without_find_unused_parameters_are_told_on_every_rank():
    """Under a scaler the agreement carries a fingerprint of each rank's set: a mismatch is
    named on every rank, instead of mismatched collectives."""

    def fn(comm):
        model = branchy()
        reducer = thinwire.SyncReducer(model, "identity", comm)
        x, y = _batch(torch.Generator().manual_seed(comm.rank))
        F.cross_entropy(model(x, use_branch=comm.rank == 1), y).backward()
        with pytest.raises(ValueError,
                           match=r"ranks hold gradients for different parameters.*find_unused_parameters=True"):
            reducer.reduce(scaler=torch.amp.GradScaler("cpu"))

    LocalWorld(2).run(fn)


def test_plain_fp16_stays_in_the_scalers_units():
    """fp16 keeps no state: it is sent scaled, where loss scaling keeps small gradients out of
    fp16's subnormals (as PyTorch's fp16_compress_hook sees them)."""

    def fn(comm):
        w = torch.nn.Parameter(torch.zeros(4096))
        g = torch.Generator().manual_seed(comm.rank)
        true = torch.randn(4096, generator=g) * 1e-6
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        reducer = thinwire.SyncReducer([("w", w)], "fp16", comm)
        w.grad = true * scaler.get_scale()
        reducer.reduce(scaler=scaler)
        return w.grad / scaler.get_scale(), true

    (m0, t0), (m1, t1) = LocalWorld(2).run(fn)
    mean = (t0 + t1) / 2
    assert torch.equal(m0, m1)
    assert ((m0 - mean).norm() / mean.norm()).item() < 1e-3  # unscaled first it would be ~2e-2


def test_sparse_gradients_are_refused_naming_the_parameter():
    model = torch.nn.Sequential(torch.nn.Embedding(100, 8, sparse=True), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError,
                       match=r"parameter '0\.weight' gets sparse gradients \(Embedding\(sparse=True\)\).*sparse=False"):
        LocalWorld(1).run(lambda comm: thinwire.SyncReducer(model, "topk", comm))

    def late(comm):  # named parameters only (no module to inspect): refused at the first reduce
        emb = torch.nn.Embedding(100, 8, sparse=True)
        reducer = thinwire.SyncReducer([("emb.weight", emb.weight)], "identity", comm)
        emb(torch.tensor([1, 2])).sum().backward()
        reducer.reduce()

    with pytest.raises(ValueError, match=r"parameter 'emb\.weight' has a sparse gradient.*sparse=False"):
        LocalWorld(1).run(late)


# -- one entry point ------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["dasgd", "ab:group_size=1", "localsgd:period=2", "torch-ddp"])
def test_a_method_with_a_schedule_in_a_reducer_names_attach(spec):
    with pytest.raises(ValueError, match=r"not a gradient codec.*thinwire\.attach\(model, optimizer, "):
        LocalWorld(1).run(lambda comm: thinwire.SyncReducer(_net(), spec, comm))


def test_attach_needs_the_optimizer_for_a_schedule_and_names_bad_specs():
    with pytest.raises(ValueError, match=r"pass the optimizer, thinwire\.attach\(model, optimizer, 'dasgd'\)"):
        LocalWorld(1).run(lambda comm: thinwire.attach(_net(), None, "dasgd", comm))
    with pytest.raises(ValueError, match=r"unknown method 'nosuch'"):
        LocalWorld(1).run(lambda comm: thinwire.attach(_net(), None, "nosuch", comm))


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "hylo", "localsgd:period=2,warmup=2",
                                  "dasgd:period=2,delay=1,warmup=2", "dpsgd", "powergossip"])
def test_attach_trains_any_method_with_the_same_calls(spec):
    """In-process: the loss falls and the state round-trips (the gloo test runs every method)."""

    def fn(comm):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        run = thinwire.attach(model, opt, spec, comm)
        g = torch.Generator().manual_seed(comm.rank)
        first = None
        for _ in range(40):
            opt.zero_grad()
            x, y = _batch(g)
            loss = F.cross_entropy(run.model(x), y)
            loss.backward()
            assert run.after_backward(loss) is True
            opt.step()
            run.after_step()
            first = loss.item() if first is None else first
        run.finish()
        with pytest.raises(RuntimeError, match="was finished"):
            run.after_step()
        return first, loss.item(), run.state_dict(), run.spec

    for first, last, state, resolved in LocalWorld(2).run(fn):
        assert last < 0.7 * first, (spec, first, last)
        assert isinstance(state, dict) and resolved.split(":")[0] == spec.split(":")[0]


def test_a_scaler_with_find_unused_parameters_gives_every_rank_the_same_mean():
    """Rank 1 alone uses the branch: rank 0 receives the branch's mean in its own new .grad,
    scaled back like rank 1's (both in the scaler's units), under a compressing codec."""

    def fn(comm):
        model = branchy()
        reducer = thinwire.SyncReducer(model, "topk:ratio=0.5", comm, find_unused_parameters=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        x, y = _batch(torch.Generator().manual_seed(comm.rank))
        scaler.scale(F.cross_entropy(model(x, use_branch=comm.rank == 1), y)).backward()
        assert reducer.reduce(scaler=scaler)
        return model.branch.weight.grad, model.unused.weight.grad

    (g0, u0), (g1, u1) = LocalWorld(2).run(fn)
    assert u0 is None and u1 is None
    assert torch.equal(g0, g1) and g0.abs().max() > 0

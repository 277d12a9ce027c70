"""Local SGD and DaSGD on the in-process communicator: the exact equivalences DaSGD
must meet (d = 0 vs local SGD, one worker vs SGD, identical data vs single-worker SGD, tau = 1 vs
synchronous averaging), the merge identity, warm-up, BN buffers, momentum, the delta codec,
the agreed automatic delay and exact resumption."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tiny
from thinwire.algorithms.dasgd import DaSGD, DaSGDConfig
from thinwire.algorithms.local_sgd import LocalSGD, LocalSGDConfig
from thinwire.algorithms.sync import SyncReducer
from thinwire.comm.local import LocalWorld

BASE, BASE_BN = tiny.net(6, 16, 3, act=nn.ReLU), tiny.net(6, 16, 3, bn=True, act=nn.ReLU)


def _batch(rank: int, step: int, same: bool = False):
    return tiny.batch(1000 * step + (0 if same else rank + 1), 8, 6, 3)


def _train(comm, make, steps: int, *, same=False, bn=False, lr=0.1, momentum=0.0, hook=None):
    """Train a copy of the base model on this rank; returns the flat parameters (and buffers)."""
    model = copy.deepcopy(BASE_BN if bn else BASE)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    method = make(model, opt, comm) if make is not None else None
    for step in range(steps):
        tiny.step(model, opt, method, *_batch(comm.rank if comm is not None else 0, step, same))
        if hook is not None:
            hook(step, model, method)
    return tiny.flat(model), method


def dasgd(**knobs):
    return lambda model, opt, comm: DaSGD(model, opt, comm, DaSGDConfig(**knobs))


def localsgd(**knobs):
    return lambda model, opt, comm: LocalSGD(model, opt, comm, LocalSGDConfig(**knobs))


def _run(n, make, steps, **kw):
    return LocalWorld(n).run(lambda comm: _train(comm, make, steps, **kw)[0])


@pytest.mark.parametrize("period, warmup", [(1, 0), (3, 0), (4, 2)])
def test_delay_zero_is_bit_identical_to_local_sgd(period, warmup):
    for n in (2, 3):
        a = _run(n, dasgd(period=period, delay="0", warmup=warmup), 13, bn=True, momentum=0.9)
        b = _run(n, localsgd(period=period, warmup=warmup), 13, bn=True, momentum=0.9)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("make", [dasgd(period=3, delay="2", warmup=0), dasgd(period=4, delay="4", warmup=3),
                                  localsgd(period=2)], ids=["d2", "d4-warmup", "localsgd"])
def test_one_worker_is_plain_sgd(make):
    ours = _run(1, make, 11, momentum=0.9)[0]
    plain = _train(None, None, 11, momentum=0.9)[0]
    assert torch.equal(ours, plain)


@pytest.mark.parametrize("n", [2, 4])
def test_identical_data_keeps_models_identical_and_equal_to_single_worker_sgd(n):
    """Every rank sees the same batches: averaging identical models changes nothing beyond
    fp32 rounding of (w/n)*n (exact for power-of-two n)."""
    results = _run(n, dasgd(period=3, delay="2", warmup=2), 14, same=True)
    single = _train(None, None, 14, same=True)[0]
    for r in results:
        assert torch.equal(r, results[0])
        assert torch.equal(r, single)


def test_period_one_delay_zero_plain_sgd_equals_synchronous_gradient_averaging():
    n = 4
    ours = _run(n, dasgd(period=1, delay="0", warmup=0), 10)
    sync = _run(n, lambda model, opt, comm: _Sync(model, comm), 10)
    for a, b in zip(ours, sync):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # mean of (w - lr g_i) vs w - lr mean g_i


class _Sync:
    def __init__(self, model, comm):
        self.r = SyncReducer(model, "identity", comm)

    def after_backward(self):
        self.r.reduce()

    def after_step(self):
        pass


def test_after_a_merge_the_mean_model_is_the_mean_snapshot_plus_the_mean_progress():
    """period 4, delay 2: launches after local steps 4, 8; merges after 6, 10. Right after the
    merge at 6: mean_i w_i == mean_i snap_i + mean_i (w_i(before merge) - snap_i)."""
    n, seen = 3, {}

    def hook(step, model, method):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        seen[(step + 1, id(method))] = flat.clone()

    def fn(comm):
        snaps, before = {}, {}
        model = copy.deepcopy(BASE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        m = DaSGD(model, opt, comm, DaSGDConfig(period=4, delay="2", warmup=0))
        flat = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()  # noqa: E731
        for step in range(1, 7):
            x, y = _batch(comm.rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            m.after_backward()
            opt.step()
            if step == 4:
                snaps[comm.rank] = flat()  # the snapshot is taken after this step's update
            if step == 6:
                before[comm.rank] = flat()
            m.after_step()
        return snaps[comm.rank], before[comm.rank], flat()

    results = LocalWorld(n).run(fn)
    snap = torch.stack([r[0] for r in results]).mean(0)
    progress = torch.stack([r[1] - r[0] for r in results]).mean(0)
    after = torch.stack([r[2] for r in results]).mean(0)
    torch.testing.assert_close(after, snap + progress, rtol=0, atol=1e-6)
    assert not torch.equal(results[0][2], results[1][2])  # each rank keeps its own progress


def test_warmup_steps_are_synchronous():
    results = LocalWorld(3).run(lambda comm: _train(comm, dasgd(period=4, delay="2", warmup=5), 5)[0])
    assert all(torch.equal(r, results[0]) for r in results)  # 5 synchronous steps: identical models
    results = LocalWorld(3).run(lambda comm: _train(comm, dasgd(period=4, delay="2", warmup=5), 6)[0])
    assert not torch.equal(results[0], results[1])  # the first local step diverges


def test_batchnorm_buffers_are_averaged_at_merges():
    def fn(comm):
        flat, method = _train(comm, dasgd(period=2, delay="0", warmup=0), 4, bn=True)
        bn = method.state.model[1]
        return bn.running_mean.clone(), bn.running_var.clone()

    results = LocalWorld(3).run(fn)
    for mean, var in results[1:]:
        assert torch.equal(mean, results[0][0]) and torch.equal(var, results[0][1])


def test_average_momentum_averages_the_optimizer_state():
    def fn(comm, avg):
        model = copy.deepcopy(BASE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        m = DaSGD(model, opt, comm, DaSGDConfig(period=2, delay="0", warmup=0, average_momentum=avg))
        for step in range(2):
            x, y = _batch(comm.rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            m.after_step()
        return torch.cat([opt.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])

    on = LocalWorld(3).run(lambda comm: fn(comm, True))
    off = LocalWorld(3).run(lambda comm: fn(comm, False))
    assert all(torch.equal(r, on[0]) for r in on) and not torch.equal(off[0], off[1])


def test_bf16_codec_averages_deltas_close_to_the_exact_average():
    exact = _run(3, dasgd(period=2, delay="1", warmup=0), 12)
    bf16 = _run(3, dasgd(period=2, delay="1", warmup=0, codec="bf16"), 12)
    for a, b in zip(exact, bf16):
        err = ((a - b).norm() / a.norm()).item()
        assert 0 < err < 5e-3, err  # deltas since the anchor carry 8 bits; the anchor itself is exact


def test_auto_delay_is_agreed_by_every_rank():
    def fn(comm):
        _, m = _train(comm, dasgd(period=4, delay="auto", warmup=3), 5)
        return m.delay

    delays = LocalWorld(3).run(fn)
    assert len(set(delays)) == 1 and 0 <= delays[0] <= 4


@pytest.mark.parametrize("codec", ["bf16", "randomk:ratio=0.25"])  # randomk: error feedback on
@pytest.mark.parametrize("cut", [5, 6, 7, 9, 10])
def test_resume_from_a_checkpoint_continues_exactly(cut, codec):
    """Stop after ``cut`` steps (with an average in flight at 5, 6, 9 and 10; of deltas, through
    the codec, at 9 and 10), save, build a fresh method on copies of the models, load, and
    continue: the same result as never stopping."""
    _resumed_equals_straight(cut, codec, lambda state: state)


def _earlier_layout(state: dict, codec: str) -> dict:
    """``state`` as DaSGD saved it before its averages went through an Aggregator: its own
    error feedback, and an average of deltas in flight as its summed wire (the buffer then
    held no mean yet)."""
    from thinwire.codecs.specs import build_codec

    old = {k: v for k, v in state.items() if k not in ("pending_coded", "coded")}
    old["feedback"] = state["coded"]["feedback"] if state["coded"] is not None else {}
    old["payload_step"] = state["launches"] - 1
    old["payload_wire"] = None
    if state["pending_coded"]:
        c = build_codec(codec)
        c.step = old["payload_step"]
        old["payload_wire"] = c.encode(state["buf"], key="model").tensors[0].clone()  # the mean's own wire
        old["buf"] = torch.full_like(state["buf"], float("nan"))
    return old


@pytest.mark.parametrize("codec", ["bf16", "randomk:ratio=0.25"])
@pytest.mark.parametrize("cut", [6, 10])
def test_a_checkpoint_of_the_earlier_layout_continues_exactly(cut, codec):
    """A checkpoint written before averages went through an Aggregator (an exact average in
    flight at 6, one of deltas at 10) loads and goes on as if never stopped."""
    _resumed_equals_straight(cut, codec, lambda state: _earlier_layout(state, codec))


def _resumed_equals_straight(cut, codec, saved_as):
    make = dasgd(period=4, delay="3", warmup=1, codec=codec.replace(",", ";"))

    def fn(comm):
        model = copy.deepcopy(BASE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        m = make(model, opt, comm)
        for step in range(14):
            if step == cut:  # checkpoint and resume into fresh objects
                saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), saved_as(m.state_dict()))
                model = copy.deepcopy(BASE)
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                m = make(model, opt, comm)
                m.load_state_dict(saved[2])
            tiny.step(model, opt, m, *_batch(comm.rank, step))
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    resumed = LocalWorld(2).run(fn)
    straight = _run(2, make, 14, momentum=0.9)
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b[: a.numel()])


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(period=0), "period must be >= 1"),
        (dict(delay="5"), "delay must be <= period"),
        (dict(delay="-1"), "delay must be >= 0"),
        (dict(warmup=-1), "warmup must be >= 0"),
        (dict(codec="topk"), "codec must be a single-round SUM codec"),
        (dict(codec="powersgd"), "codec must be a single-round SUM codec"),
        (dict(delay="auto", warmup=1), "warmup must be >= 2"),
    ],
)
def test_bad_knobs(knobs, message):
    with pytest.raises(ValueError, match=message):
        DaSGDConfig(**knobs)

"""DiLoCo on the in-process communicator: the outer step against a hand-computed reference,
local SGD as its special case, the codec path for pseudo-gradients, exact resumption, and
the knobs' errors."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny
from thinwire.algorithms.diloco import DiLoCo, DiLoCoConfig
from thinwire.algorithms.local_sgd import LocalSGD, LocalSGDConfig
from thinwire.algorithms.methods import resolve_method
from thinwire.comm.local import LocalWorld

TOL = 1e-6  # fp32: theta - mean(theta - theta_i) against mean(theta_i), the same sums in another order


BASE, BASE_BN = tiny.net(5, 8, 3), tiny.net(5, 8, 3, bn=True)


_flat = tiny.flat


def _train(comm, make, steps, *, bn=False, cut=None):
    """This rank's flat state after ``steps`` (see :func:`tiny.train`)."""
    return tiny.train(comm, make, steps, BASE_BN if bn else BASE, cut=cut)[0]



def _reference(n: int, steps: int, period: int, lr: float, mu: float) -> torch.Tensor:
    """The paper's update by hand: n models stepping alone (inner SGD with momentum 0.5, its
    state kept), every period steps delta = mean(theta - theta_i), v = mu v + delta,
    theta -= lr (delta + mu v) (Nesterov), every model set to theta."""
    models = [copy.deepcopy(BASE) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in models]
    theta = _flat(models[0]).clone()
    v = torch.zeros_like(theta)
    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            tiny.backward(m, o, r, step)
            o.step()
        if (step + 1) % period == 0:
            delta = sum(theta - _flat(m) for m in models) / n
            v = mu * v + delta
            theta = theta - lr * (delta + mu * v)
            for m in models:
                torch.nn.utils.vector_to_parameters(theta.clone(), m.parameters())
    return theta


def test_two_ranks_two_outer_steps_follow_the_nesterov_update_by_hand():
    make = lambda m, o, c: DiLoCo(m, o, c, period=3, outer_lr=0.7, outer_momentum=0.9)  # noqa: E731
    got = LocalWorld(2).run(lambda comm: _train(comm, make, 6))  # ends on the second outer step
    assert torch.equal(got[0], got[1])  # every rank continues from the same theta
    assert torch.allclose(got[0], _reference(2, 6, period=3, lr=0.7, mu=0.9), atol=TOL, rtol=0)


@pytest.mark.parametrize("bn", [False, True])
def test_outer_sgd_at_lr_one_without_momentum_is_local_sgd(bn):
    mine = LocalWorld(2).run(
        lambda comm: _train(comm, lambda m, o, c: DiLoCo(m, o, c, period=3, outer_lr=1.0, outer_momentum=0.0), 10,
                            bn=bn))
    local = LocalWorld(2).run(lambda comm: _train(comm, lambda m, o, c: LocalSGD(m, o, c, LocalSGDConfig(period=3)),
                                                  10, bn=bn))
    for a, b in zip(mine, local):  # rank by rank: the last step is a local one
        assert torch.allclose(a, b, atol=TOL, rtol=0)


def test_an_outer_optimizer_of_the_users_own_is_the_same_as_the_knobs():
    knobs = LocalWorld(2).run(
        lambda comm: _train(comm, lambda m, o, c: DiLoCo(m, o, c, period=2, outer_lr=0.5, outer_momentum=0.0), 6))
    own = LocalWorld(2).run(lambda comm: _train(
        comm, lambda m, o, c: DiLoCo(m, o, c, period=2, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5)), 6))
    assert all(torch.equal(a, b) for a, b in zip(knobs, own))


def test_warm_up_steps_are_synchronous_and_the_rounds_start_from_their_model():
    make = lambda m, o, c: DiLoCo(m, o, c, period=4, warmup=3)  # noqa: E731
    after_warmup = LocalWorld(2).run(lambda comm: _train(comm, make, 3))
    assert torch.equal(after_warmup[0], after_warmup[1])
    done = LocalWorld(2).run(lambda comm: _train(comm, make, 7))  # 3 synchronous + one round of 4
    assert torch.equal(done[0], done[1])


@pytest.mark.parametrize("codec", ["identity", "topk:ratio=0.25", "rangefloat:bits=4;exp_bits=2"])
@pytest.mark.parametrize("cut", [2, 3, 5])
def test_resume_mid_round_and_right_after_an_outer_step_continues_exactly(cut, codec):
    make = lambda m, o, c: DiLoCo(m, o, c, period=3, codec=codec)  # noqa: E731
    resumed = LocalWorld(2).run(lambda comm: _train(comm, make, 8, bn=True, cut=cut))
    straight = LocalWorld(2).run(lambda comm: _train(comm, make, 8, bn=True))
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight))


def test_four_bit_pseudo_gradients_send_at_least_seven_times_fewer_bytes_per_outer_step():
    def sent(codec):
        def fn(comm):
            _train(comm, lambda m, o, c: DiLoCo(m, o, c, period=2, codec=codec), 2)  # one outer step
            return comm.meter.bytes_sent
        return LocalWorld(2).run(fn)[0]

    fp32, four = sent("identity"), sent("rangefloat:bits=4;exp_bits=2")
    assert fp32 / four >= 7, (fp32, four)


@pytest.mark.parametrize("cut", [2, 3])
def test_scattered_four_bit_pseudo_gradients_resume_exactly_and_leave_every_rank_the_same_model(cut):
    codec = "rangefloat:bits=4;exp_bits=2;ef=true"
    make = lambda m, o, c: DiLoCo(m, o, c, period=3, codec=codec, scatter=True)  # noqa: E731
    resumed = LocalWorld(3).run(lambda comm: _train(comm, make, 8, bn=True, cut=cut))
    straight = LocalWorld(3).run(lambda comm: _train(comm, make, 8, bn=True))
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight))
    synced = LocalWorld(3).run(lambda comm: _train(comm, make, 6, bn=True))  # ends with an outer step
    assert all(torch.equal(synced[0], s) for s in synced[1:])
    plain = LocalWorld(3).run(lambda comm: _train(comm, lambda m, o, c: DiLoCo(m, o, c, period=3), 6, bn=True))
    assert not torch.equal(plain[0], synced[0])  # the 4-bit mean is not the fp32 one


def test_four_bit_pseudo_gradients_by_reduce_scatter_send_at_least_seven_times_fewer_bytes_on_four_ranks():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))

    def sent(**knobs):
        def fn(comm):
            m = copy.deepcopy(model)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            method = DiLoCo(m, opt, comm, period=1, **knobs)
            m(torch.randn(2, 64, generator=torch.Generator().manual_seed(comm.rank))).sum().backward()
            method.after_backward()
            opt.step()
            method.after_step()  # one outer step
            return comm.meter.bytes_sent
        return LocalWorld(4).run(fn)[0]

    four = "rangefloat:bits=4;exp_bits=2;man_bits=1;min_numel=1024"
    fp32, gathered, scattered = sent(), sent(codec=four), sent(codec=four, scatter=True)
    assert fp32 / gathered == pytest.approx(4.0, rel=0.02)  # all_gather: 16/n on n = 4
    assert fp32 / scattered >= 7, (fp32, scattered)


@pytest.mark.parametrize("spec, message", [
    ("diloco:period=0", "period must be >= 1, got 0"),
    ("diloco:scatter=true", "scatter=true needs a gathered codec"),
    ("diloco:outer=lion", "outer must be one of sgd, adam, got 'lion'"),
    ("diloco:outer_lr=0", "outer_lr must be > 0, got 0.0"),
    ("diloco:outer_momentum=1", r"outer_momentum must be in \[0, 1\), got 1.0"),
    ("diloco:codec=nope", "unknown codec 'nope'"),
    ("diloco:codec=topk:ratio=2", "ratio"),
])
def test_bad_knobs_name_the_rule(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_method(spec)


def test_the_spec_fills_every_default():
    assert resolve_method("diloco") == ("diloco:period=50,warmup=0,outer=sgd,outer_lr=0.7,outer_momentum=0.9,"
                                        "nesterov=true,codec=identity:ef=false;min_numel=0,scatter=false,average_momentum=false,"
                                        "final_sync=true,sync=blocking")
    assert DiLoCoConfig().period == 50


def test_a_state_saved_before_fragments_resumes_exactly():
    """The layout of one pseudo-gradient aggregator (``pseudo``), before the fragments: the
    same state as the one fragment's, so a run resumed from it continues exactly."""
    make = lambda m, o, c: DiLoCo(m, o, c, period=2, codec="topk:ratio=0.25;ef=true")  # noqa: E731

    def earlier(comm):
        model = copy.deepcopy(BASE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        method = make(model, opt, comm)
        for step in range(9):
            if step == 5:  # mid-round: saved, converted to the earlier layout, loaded into a new DiLoCo
                state = method.state_dict()
                fragment = state.pop("fragments")[0]
                del state["peak_bytes"]
                method = make(model, opt, comm)
                method.load_state_dict({**state, "pseudo": fragment["agg"]})
            tiny.backward(model, opt, comm.rank, step)
            method.after_backward()
            opt.step()
            method.after_step()
        return _flat(model)

    straight = LocalWorld(2).run(lambda comm: _train(comm, make, 9))
    converted = LocalWorld(2).run(earlier)
    for a, b in zip(straight, converted):
        assert torch.equal(a, b)


@pytest.mark.spawns
def test_a_run_shorter_than_its_period_says_so_in_its_summary():
    from thinwire.run.config import TrainConfig
    from thinwire.run.trainer import train_rank

    cfg = TrainConfig(task="synthetic", method="diloco", workers=2, steps=3, eval_every=3, batch_size=8,
                      task_options={"dim": 8, "hidden": 8, "classes": 2, "samples": 64, "test_samples": 16}).resolve()
    summary = LocalWorld(2).run(lambda comm: train_rank(cfg, comm))[0]
    assert summary.warnings == ["diloco: 3 local steps and no outer step before finish() (period=50): the run "
                                   "trained a single round and finish() averages it"]
    assert summary.method_report["syncs_before_finish"] == 0 and summary.method_report["outer_steps"] == 1


def _bf16_run(comm, make, steps: int, *, finish: bool = False):
    """:func:`tiny.train` of BASE with bf16 weights: the model's flat state and θ, flat."""
    state, method = tiny.train(comm, make, steps, copy.deepcopy(BASE).to(torch.bfloat16), finish=finish)
    return state, torch.cat([t.detach().reshape(-1) for t in method.outer_params])


def test_a_bf16_model_keeps_theta_in_fp32_and_each_rank_continues_from_it_rounded_once():
    """Weights in bf16 (not autocast): θ and the pseudo-gradient are fp32, the outer step is
    the Nesterov update by hand in fp32, and every rank continues from θ rounded to bf16."""
    make = lambda m, o, c: DiLoCo(m, o, c, period=3, outer_lr=0.7, outer_momentum=0.9)  # noqa: E731
    base = copy.deepcopy(BASE).to(torch.bfloat16)

    models = [copy.deepcopy(base) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in models]
    theta, v = _flat(models[0]).float(), None
    for step in range(6):
        for r, (m, o) in enumerate(zip(models, opts)):
            tiny.backward(m, o, r, step)
            o.step()
        if (step + 1) % 3 == 0:
            delta = sum(theta - _flat(m).float() for m in models) / 2
            v = delta if v is None else 0.9 * v + delta
            theta = theta - 0.7 * (delta + 0.9 * v)
            for m in models:
                torch.nn.utils.vector_to_parameters(theta.to(torch.bfloat16), m.parameters())
    (flat0, theta0), (flat1, theta1) = LocalWorld(2).run(lambda comm: _bf16_run(comm, make, 6))
    assert theta0.dtype == torch.float32 and flat0.dtype == torch.bfloat16
    assert torch.equal(flat0, flat1) and torch.equal(flat0, theta0.to(torch.bfloat16))
    assert torch.allclose(theta0, theta, atol=TOL, rtol=0)


@pytest.mark.parametrize("spec", ["streaming-diloco:period=4,fragments=2,delay=1,alpha=0.5",
                                  "streaming-diloco:period=4,fragments=2,delay=2,merge=rebase",
                                  "diloco:period=3,sync=eager", "sparseloco:period=3,chunk=8,k=4"])
def test_the_diloco_family_trains_a_bf16_model_and_ends_on_theta_rounded(spec):
    """The mixing merge (fp32, rounded once), the rebase merge, eager's preview and SparseLoCo
    on bf16 weights: the ranks end on one model, θ (fp32) rounded to bf16."""
    from thinwire.algorithms.build import build_method

    make = lambda m, o, c: build_method(spec, m, o, c)  # noqa: E731
    (flat0, theta0), (flat1, theta1) = LocalWorld(2).run(lambda comm: _bf16_run(comm, make, 8, finish=True))
    assert flat0.dtype == torch.bfloat16 and theta0.dtype == torch.float32
    assert torch.equal(flat0, flat1) and torch.equal(theta0, theta1)
    assert torch.equal(flat0, theta0.to(torch.bfloat16))
    assert not torch.equal(flat0, _flat(BASE).to(torch.bfloat16))  # it trained

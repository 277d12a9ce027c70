"""The DiLoCo family's round average run behind the next round (``sync=eager|delayed``), on
the in-process communicator: the update against a by-hand reference, exact resume with an
average in flight, one model on every rank after finish(), the bytes, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

import tiny
from thinwire.algorithms.diloco import DiLoCo
from thinwire.algorithms.methods import resolve_method
from thinwire.algorithms.sparseloco import SparseLoCo
from thinwire.algorithms.streaming_diloco import StreamingDiLoCo
from thinwire.comm.local import LocalWorld

TOL = 1e-6  # fp32: the same sums as the reference, in another order
BASE, BASE_BN = tiny.net(5, 8, 3), tiny.net(5, 8, 3, bn=True)


def _reference(n: int, steps: int, period: int, eager: bool, lr: float = 0.7, mu: float = 0.9) -> list[torch.Tensor]:
    """By hand: n models (inner SGD, lr 0.1, momentum 0.5), each rank its own θ_i and Nesterov
    buffer v_i. At every round's end, with Δ_i = θ_i − x_i, Δ̄' the previous round's mean and
    Δ_i' this rank's previous Δ: g_i = Δ̄' + w (Δ_i − Δ_i') (eager, w = 1/n) or Δ̄' (delayed),
    no step while nothing has landed under delayed; x_i = θ_i. finish(): g_i = Δ̄ − w Δ_i,
    then (eager) every θ_i is replaced by their mean. Returns every rank's final flat model."""
    models = [copy.deepcopy(BASE) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in models]
    thetas = [tiny.flat(models[0]).clone() for _ in range(n)]
    vs: list[torch.Tensor | None] = [None] * n
    w = 1.0 / n if eager else 0.0
    mean, own = None, [None] * n

    def outer(i, g):
        vs[i] = g.clone() if vs[i] is None else mu * vs[i] + g
        thetas[i] = thetas[i] - lr * (g + mu * vs[i])

    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            tiny.backward(m, o, r, step)
            o.step()
        if (step + 1) % period == 0:
            fresh = [thetas[i] - tiny.flat(models[i]) for i in range(n)]
            for i in range(n):
                if mean is not None:
                    outer(i, mean + w * (fresh[i] - own[i]))
                elif eager:
                    outer(i, w * fresh[i])
                torch.nn.utils.vector_to_parameters(thetas[i].clone(), models[i].parameters())
            mean, own = sum(fresh) / n, fresh
    assert steps % period == 0  # finish() then has no partial round to sync
    for i in range(n):
        outer(i, mean - w * own[i])
    if eager:
        thetas = [sum(thetas) / n] * n
    return thetas


@pytest.mark.parametrize("sync", ["eager", "delayed"])
def test_three_rounds_follow_the_update_by_hand_and_end_with_one_model(sync):
    make = lambda m, o, c: DiLoCo(m, o, c, period=3, sync=sync)  # noqa: E731
    got = LocalWorld(2).run(lambda comm: tiny.train(comm, make, 9, BASE, finish=True)[0])
    ref = _reference(2, 9, period=3, eager=sync == "eager")
    assert torch.equal(got[0], got[1])  # one model on every rank after finish()
    assert torch.allclose(got[0], ref[0], atol=TOL, rtol=0)


def test_eager_ranks_differ_before_finish_and_delayed_ranks_do_not():
    def models(sync):
        make = lambda m, o, c: DiLoCo(m, o, c, period=3, sync=sync)  # noqa: E731
        return LocalWorld(2).run(lambda comm: tiny.train(comm, make, 6, BASE)[0])  # right after a round's end

    eager, delayed = models("eager"), models("delayed")
    assert not torch.equal(eager[0], eager[1])  # each previews its own pseudo-gradient
    assert torch.equal(delayed[0], delayed[1])  # every rank continues from the same θ


def test_delayed_first_round_is_applied_one_round_late():
    """After the first round nothing has landed: every rank goes back to the start; after the
    second, θ has stepped on the first round's mean only (the blocking run's first θ)."""
    start = tiny.flat(BASE)
    make = lambda m, o, c: DiLoCo(m, o, c, period=3, sync="delayed")  # noqa: E731
    first = LocalWorld(2).run(lambda comm: tiny.train(comm, make, 3, BASE)[0])
    assert torch.equal(first[0], start)
    blocking = lambda m, o, c: DiLoCo(m, o, c, period=3)  # noqa: E731
    one_round = LocalWorld(2).run(lambda comm: tiny.train(comm, blocking, 3, BASE)[0])
    second = LocalWorld(2).run(lambda comm: tiny.train(comm, make, 6, BASE)[0])
    assert torch.allclose(second[0], one_round[0], atol=TOL, rtol=0)


@pytest.mark.parametrize("make", [
    pytest.param(lambda m, o, c: DiLoCo(m, o, c, period=3, sync="eager"), id="diloco-eager"),
    pytest.param(lambda m, o, c: DiLoCo(m, o, c, period=3, sync="delayed", codec="rangefloat:bits=4;ef=true",
                                        scatter=True), id="diloco-delayed-4bit-scatter"),
    pytest.param(lambda m, o, c: SparseLoCo(m, o, c, period=3, chunk=4, k=3, sync="eager"), id="sparseloco-eager"),
])
@pytest.mark.parametrize("cut", [3, 4, 7])
def test_resume_with_an_average_in_flight_continues_exactly(make, cut):
    resumed = LocalWorld(3).run(lambda comm: tiny.train(comm, make, 10, BASE_BN, cut=cut, finish=True)[0])
    straight = LocalWorld(3).run(lambda comm: tiny.train(comm, make, 10, BASE_BN, finish=True)[0])
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight))
    assert all(torch.equal(resumed[0], r) for r in resumed[1:])  # one model on every rank after finish()


@pytest.mark.parametrize("knobs, extra", [({"sync": "delayed"}, 0), ({"sync": "eager"}, 1)])
def test_the_overlapped_run_sends_what_the_blocking_run_sends(knobs, extra):
    """Two rounds and finish(): the same two averages; eager adds one fp32 average of θ."""
    def sent(**kw):
        def fn(comm):
            tiny.train(comm, lambda m, o, c: DiLoCo(m, o, c, period=3, **kw), 6, BASE, finish=True)
            return comm.meter.bytes_sent
        return LocalWorld(2).run(fn)[0]

    fp32_model = 4 * sum(p.numel() for p in BASE.parameters())  # an all_reduce over 2 ranks sends it once
    assert sent(**knobs) == sent() + extra * fp32_model


def test_the_report_counts_the_hidden_average_and_the_extra_buffers():
    def fn(comm):
        _, method = tiny.train(comm, lambda m, o, c: DiLoCo(m, o, c, period=2, sync="eager"), 6, BASE, finish=True)
        return method.report(), method.state.numel(), method.summary_fields()["overlap"]

    report, numel, overlap = LocalWorld(2).run(fn)[0]
    # the cost model's terms: three averages landed, every element behind the computation that followed
    assert overlap["steps"] == 3 and overlap["early_share"] == 1.0 and overlap["reduces"] == 0
    assert overlap["window_seconds"] > 0
    assert report["sync"] == "eager"
    assert report["outer_steps"] == 4  # three rounds, each stepped at its end, and the last landed in finish()
    assert report["average_seconds"] > 0 and 0.0 <= report["hidden_fraction"] <= 1.0
    assert report["extra_memory_bytes"] == 4 * 4 * numel + 4 * numel  # θ, Δ, this round's Δ, the one sent; momentum


@pytest.mark.parametrize("spec, message", [
    ("diloco:sync=fast", "sync must be one of blocking, eager, delayed, got 'fast'"),
    ("diloco:sync=eager,final_sync=false", "sync=eager needs final_sync=true"),
    ("sparseloco:sync=later", "sync must be one of blocking, eager, delayed"),
    ("streaming-diloco:sync=eager", "streaming-diloco runs its fragments' averages behind the next steps through "
                                    "delay, not sync=eager"),
])
def test_a_sync_the_method_cannot_take_names_the_rule(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_method(spec)


def test_an_elastic_run_refuses_an_average_in_flight_across_rounds():
    config = DiLoCo.Config(sync="eager")
    assert "keeps a round's average in flight through the next round" in DiLoCo.check_elastic(config)
    assert DiLoCo.check_elastic(DiLoCo.Config()) is None
    assert StreamingDiLoCo.check_elastic(StreamingDiLoCo.Config(delay=0)) is None


def test_a_checkpoint_with_an_average_in_flight_resumes_only_under_its_own_sync():
    def fn(comm):
        _, method = tiny.train(comm, lambda m, o, c: DiLoCo(m, o, c, period=3, sync="eager"), 4, BASE)
        state = method.state_dict()
        other = DiLoCo(copy.deepcopy(BASE), torch.optim.SGD(copy.deepcopy(BASE).parameters(), lr=0.1), comm,
                       period=3, sync="delayed")
        with pytest.raises(ValueError, match="saved with sync=eager and a round's average in flight; this run has "
                                             "sync=delayed: resume with sync=eager"):
            other.load_state_dict(state)
        return True

    assert all(LocalWorld(2).run(fn))

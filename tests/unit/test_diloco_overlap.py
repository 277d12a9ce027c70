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


def _reference(n: int, steps: int, period: int, eager: bool, lr: float = 0.7, mu: float = 0.9) -> torch.Tensor:
    """By hand: n models (inner SGD, lr 0.1, momentum 0.5), one θ and one Nesterov buffer v. At
    every round's end, with x_i where rank i's round started and Δ_i = x_i − θ_i its progress:
    the previous round's mean (none after the first round) steps θ and v; rank i continues
    from the step θ would take with Δ_i − (x_i − θ)/2 as its gradient (its progress measured
    from halfway between its start and θ), v left as it was (eager), or from θ (delayed); the
    mean of the Δ_i is in flight. finish(): the last mean steps θ, every model
    is θ. Returns the final flat model."""
    models = [copy.deepcopy(BASE) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in models]
    theta = tiny.flat(models[0]).clone()
    starts = [theta.clone() for _ in range(n)]
    v: torch.Tensor | None = None
    mean = None

    def stepped(theta, v, g):
        v = g.clone() if v is None else mu * v + g
        return theta - lr * (g + mu * v), v

    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            tiny.backward(m, o, r, step)
            o.step()
        if (step + 1) % period == 0:
            fresh = [starts[i] - tiny.flat(models[i]) for i in range(n)]
            if mean is not None:
                theta, v = stepped(theta, v, mean)
            for i in range(n):  # eager's preview: the progress from halfway between the start and θ
                midway = fresh[i] - 0.5 * (starts[i] - theta)
                starts[i] = stepped(theta, v, midway)[0] if eager else theta.clone()
                torch.nn.utils.vector_to_parameters(starts[i].clone(), models[i].parameters())
            mean = sum(fresh) / n
    assert steps % period == 0  # finish() then has no partial round to sync
    return stepped(theta, v, mean)[0]


@pytest.mark.parametrize("sync", ["eager", "delayed"])
def test_three_rounds_follow_the_update_by_hand_and_end_with_one_model(sync):
    make = lambda m, o, c: DiLoCo(m, o, c, period=3, sync=sync)  # noqa: E731
    got = LocalWorld(2).run(lambda comm: tiny.train(comm, make, 9, BASE, finish=True)[0])
    ref = _reference(2, 9, period=3, eager=sync == "eager")
    assert torch.equal(got[0], got[1])  # one model on every rank after finish()
    assert torch.allclose(got[0], ref, atol=TOL, rtol=0)


def test_eager_ranks_continue_from_their_own_preview_of_one_theta_and_delayed_ranks_from_theta():
    def run(sync):
        make = lambda m, o, c: DiLoCo(m, o, c, period=3, sync=sync)  # noqa: E731

        def fn(comm):
            model, method = tiny.train(comm, make, 6, BASE)  # right after a round's end
            return model, torch.cat([t.detach().reshape(-1) for t in method.outer_params])
        return LocalWorld(2).run(fn)

    eager, delayed = run("eager"), run("delayed")
    assert not torch.equal(eager[0][0], eager[1][0])  # each continues from its own preview
    assert torch.equal(eager[0][1], eager[1][1])  # of the same θ
    assert torch.equal(delayed[0][0], delayed[1][0])  # every rank continues from θ itself


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


@pytest.mark.parametrize("sync", ["delayed", "eager"])
def test_the_overlapped_run_sends_what_the_blocking_run_sends(sync):
    """Two rounds and finish(): the same two averages, and no more."""
    def sent(**kw):
        def fn(comm):
            tiny.train(comm, lambda m, o, c: DiLoCo(m, o, c, period=3, **kw), 6, BASE, finish=True)
            return comm.meter.bytes_sent
        return LocalWorld(2).run(fn)[0]

    assert sent(sync=sync) == sent()


def test_the_report_counts_the_hidden_average_and_the_extra_buffers():
    def fn(comm):
        _, method = tiny.train(comm, lambda m, o, c: DiLoCo(m, o, c, period=2, sync="eager"), 6, BASE, finish=True)
        return method.report(), method.state.numel(), method.summary_fields()["overlap"]

    report, numel, overlap = LocalWorld(2).run(fn)[0]
    # the cost model's terms: three averages landed, every element behind the computation that followed
    assert overlap["steps"] == 3 and overlap["early_share"] == 1.0 and overlap["reduces"] == 0
    assert overlap["window_seconds"] > 0
    assert report["sync"] == "eager"
    assert report["outer_steps"] == 3  # three rounds, each mean landing a round late (the last in finish())
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


def _grouped(make):
    """``make`` over 4 in-process ranks as 2 worker groups of 2 replicas (thinwire averages the
    gradients inside a group every step, the method runs between the groups)."""
    from thinwire.comm.layout import NodeLayout
    from thinwire.comm.nodes import build_hierarchy

    def over_groups(m, o, c):
        if c.hierarchy is None:
            build_hierarchy(c, NodeLayout(4, 2))
        return make(m, o, c)
    return over_groups


@pytest.mark.parametrize("codec", ["identity", "rangefloat:bits=4;ef=true"])
def test_over_worker_groups_the_background_average_is_the_blocking_runs_mean_a_round_late(codec):
    """The twin's groups average as the world's do: after two delayed rounds θ has stepped on the
    first round's mean only, which is the blocking run's first θ; and each link carries the
    blocking run's bytes (the group's fp32 stages inside, the codec between the groups)."""
    def run(steps, finish=False, **kw):
        def fn(comm):
            model, _ = tiny.train(comm, _grouped(lambda m, o, c: DiLoCo(m, o, c, period=3, codec=codec, **kw)),
                                  steps, BASE, finish=finish)
            return model, comm.meter.link_bytes("intra"), comm.meter.link_bytes("inter")
        return LocalWorld(4).run(fn)

    blocking, delayed = run(3), run(6, sync="delayed")
    for b, d in zip(blocking, delayed, strict=True):
        assert torch.allclose(d[0], b[0], atol=TOL, rtol=0)
    assert torch.equal(delayed[0][0], delayed[3][0])  # every rank of every group continues from θ
    sent = run(9), run(9, finish=True, sync="delayed")  # three rounds; the overlapped one lands the last in finish()
    for b, d in zip(*sent, strict=True):
        assert d[1:] == b[1:] and b[2] > 0 and b[1] > 0


def test_over_worker_groups_eager_ranks_of_a_group_continue_from_one_preview_and_finish_as_one_model():
    def fn(comm):
        make = _grouped(lambda m, o, c: DiLoCo(m, o, c, period=3, sync="eager"))
        mid, _ = tiny.train(comm, make, 6, BASE)
        end, _ = tiny.train(comm, make, 9, BASE, finish=True)
        return mid, end

    got = LocalWorld(4).run(fn)
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[2][0], got[3][0])  # a group is one worker
    assert not torch.equal(got[0][0], got[2][0])  # each group previews its own pseudo-gradient
    assert all(torch.equal(got[0][1], g[1]) for g in got[1:])  # one model after finish()


def test_sparseloco_eager_ranks_continue_from_theta_stepped_with_their_own_sparse_message():
    """SparseLoCo's mean is of sparse messages (each rank's chunked top-k, quantized), which
    ``outer_lr`` scales: a rank previews with its own message, decoded, not with its dense
    pseudo-gradient. After one round (nothing landed yet, the error buffer empty) rank i is
    at ``θ − α · decode(encode(Δ_i))``, ``Δ_i`` its progress by hand."""
    make = lambda m, o, c: SparseLoCo(m, o, c, period=3, chunk=4, k=3, outer_lr=2.0, sync="eager")  # noqa: E731
    got = LocalWorld(2).run(lambda comm: (tiny.train(comm, make, 3, BASE)[0], comm.rank))
    start = tiny.flat(BASE)
    codec = LocalWorld(1).run(lambda comm: SparseLoCo(copy.deepcopy(BASE), None, comm, period=3, chunk=4, k=3).wire)[0]
    for model, rank in got:
        m = copy.deepcopy(BASE)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5)
        for step in range(3):
            tiny.backward(m, opt, rank, step)
            opt.step()
        delta = start - tiny.flat(m)
        sent = codec.decode(codec.encode(delta)).reshape(-1)
        assert 0 < int((sent != 0).sum()) < delta.numel()  # a sparse message, not the dense progress
        assert torch.allclose(model, start - 2.0 * sent, atol=TOL, rtol=0)

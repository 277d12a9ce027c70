"""Streaming DiLoCo on the in-process communicator: DiLoCo as its one-fragment case, the
staggered, delayed and mixed update against a hand-computed reference, the fragments'
split, the peak bytes of one step, exact resumption with a fragment in flight, and the
knobs' errors."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch

import tiny
from thinwire.algorithms.diloco import DiLoCo
from thinwire.algorithms.methods import check_model, resolve_method
from thinwire.algorithms.streaming_diloco import StreamingDiLoCo, balanced_split
from thinwire.comm.local import LocalWorld

TOL = 1e-6  # fp32: the same update in another order of operations


BASE, BASE_BN = tiny.net(5, 8, 3), tiny.net(5, 8, 3, bn=True)  # tensors of 40, 8, 24 and 3 parameters


_flat = tiny.flat


def _train(comm, make, steps, *, bn=False, cut=None, finish=False):
    """This rank's flat state and its method after ``steps`` (see :func:`tiny.train`)."""
    return tiny.train(comm, make, steps, BASE_BN if bn else BASE, cut=cut, finish=finish)



def _reference(n, steps, *, period, groups, delay, alpha, lr, mu, rebase=False):
    """The update by hand: n models stepping alone (inner SGD, momentum 0.5); per fragment
    (a range of parameter tensors) its own theta and outer momentum v. After local step t:
    first every fragment launched at t - delay merges (delta = mean of theta - theta_i at
    the launch, v = mu v + delta, theta -= lr (delta + mu v), every model's fragment =
    alpha own + (1 - alpha) theta, or with ``rebase`` theta + (own - own at the launch)),
    then fragment p launches when t % period == p period / P."""
    models = [copy.deepcopy(BASE) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in models]
    params = [list(m.parameters()) for m in models]
    frags = [{"lo": lo, "hi": hi, "offset": p * period // len(groups),
              "theta": [t.detach().clone() for t in params[0][lo:hi]], "v": None, "due": None, "delta": None}
             for p, (lo, hi) in enumerate(groups)]
    def merge(f):
        delta = f["delta"]
        f["v"] = delta if f["v"] is None else [mu * v + d for v, d in zip(f["v"], delta)]
        f["theta"] = [th - lr * (d + mu * v) for th, d, v in zip(f["theta"], delta, f["v"])]
        with torch.no_grad():
            for ps, at_launch in zip(params, f["launch"]):
                for p, th, p0 in zip(ps[f["lo"]:f["hi"]], f["theta"], at_launch):
                    p.copy_(th + (p - p0) if rebase and delay > 0 else alpha * p + (1 - alpha) * th)
        f["due"] = None

    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            tiny.backward(m, o, r, step)
            o.step()
        t = step + 1
        for f in frags:
            if f["due"] == t:
                merge(f)
        for f in frags:
            if t % period == f["offset"]:
                f["delta"] = [sum(th - ps[i] for ps in params).detach() / n
                              for i, th in zip(range(f["lo"], f["hi"]), f["theta"])]
                f["launch"] = [[p.detach().clone() for p in ps[f["lo"]:f["hi"]]] for ps in params]
                f["due"] = t + delay
                if delay == 0:
                    merge(f)
    return [_flat(m) for m in models]


@pytest.mark.parametrize("bn", [False, True])
def test_one_fragment_no_delay_and_alpha_zero_is_diloco_exactly(bn):
    streaming = lambda m, o, c: StreamingDiLoCo(m, o, c, period=3, fragments=1, delay=0, alpha=0.0)  # noqa: E731
    diloco = lambda m, o, c: DiLoCo(m, o, c, period=3)  # noqa: E731
    a = LocalWorld(2).run(lambda comm: _train(comm, streaming, 8, bn=bn)[0])
    b = LocalWorld(2).run(lambda comm: _train(comm, diloco, 8, bn=bn)[0])
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("delay, alpha", [(1, 0.5), (2, 0.0), (0, 0.25), (3, 1.0), (4, 0.5)])  # 4: a whole round
def test_two_fragments_staggered_delayed_and_mixed_follow_the_update_by_hand(delay, alpha):
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=delay, alpha=alpha,  # noqa: E731
                                           outer_lr=0.7, outer_momentum=0.9)
    got = LocalWorld(2).run(lambda comm: _train(comm, make, 13)[0])
    want = _reference(2, 13, period=4, groups=[(0, 1), (1, 4)], delay=delay, alpha=alpha, lr=0.7, mu=0.9)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=TOL, rtol=0)
    assert not torch.equal(got[0], got[1])  # some fragment is always mid-round


@pytest.mark.parametrize("delay", [1, 3, 4])  # 4: a whole round
def test_merge_rebase_sets_theta_plus_the_workers_own_steps_since_the_launch(delay):
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=delay, merge="rebase",  # noqa: E731
                                           outer_lr=0.7, outer_momentum=0.9)
    got = LocalWorld(2).run(lambda comm: _train(comm, make, 13)[0])
    want = _reference(2, 13, period=4, groups=[(0, 1), (1, 4)], delay=delay, alpha=0.5, lr=0.7, mu=0.9, rebase=True)
    mixed = _reference(2, 13, period=4, groups=[(0, 1), (1, 4)], delay=delay, alpha=0.5, lr=0.7, mu=0.9)
    for g, w, m in zip(got, want, mixed):
        assert torch.allclose(g, w, atol=TOL, rtol=0)
        assert not torch.allclose(g, m, atol=1e-3, rtol=0)  # not the mixing merge


def test_alpha_one_with_no_delay_keeps_the_workers_own_models_and_steps_only_theta():
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=2, fragments=2, delay=0, alpha=1.0)  # noqa: E731

    def alone(comm):
        state, method = _train(comm, make, 6)
        return state, [t.detach().clone() for t in method.outer_params], method.syncs

    mixed = LocalWorld(2).run(alone)
    plain = LocalWorld(2).run(lambda comm: _train(comm, lambda m, o, c: _Nothing(), 6)[0])
    for (state, _, syncs), own in zip(mixed, plain):
        assert torch.equal(state, own) and syncs == 6  # fragment 0 at 2, 4, 6; fragment 1 at 1, 3, 5
    assert all(torch.equal(a, b) for a, b in zip(mixed[0][1], mixed[1][1]))  # theta agrees
    assert not all(torch.equal(a, b) for a, b in zip(mixed[0][1], BASE.parameters()))  # and moved


class _Nothing:
    def after_backward(self):
        return True

    def after_step(self):
        pass

    def finish(self):
        pass


def test_the_split_covers_every_tensor_once_in_order_with_the_smallest_largest_fragment():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([1, 3, 8, 64, 65, 400]) for _ in range(rng.randint(1, 9))]
        for parts in range(1, len(sizes) + 1):
            groups = balanced_split(sizes, parts)
            assert len(groups) == parts and groups[0][0] == 0 and groups[-1][1] == len(sizes)
            assert all(lo < hi for lo, hi in groups) and all(a[1] == b[0] for a, b in zip(groups, groups[1:]))
            best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
                       for cuts in itertools.combinations(range(1, len(sizes)), parts - 1))
            assert max(sum(sizes[lo:hi]) for lo, hi in groups) == best


def test_every_rank_builds_the_same_fragments_and_offsets():
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=10, fragments=3)  # noqa: E731
    got = LocalWorld(3).run(lambda comm: [(f.lo, f.hi, f.offset) for f in make(copy.deepcopy(BASE), None,
                                                                                comm).fragments])
    assert got[0] == got[1] == got[2] == [(0, 1, 0), (1, 3, 3), (3, 4, 6)]  # 40 | 8 + 24 | 3


@pytest.mark.parametrize("codec", ["identity", "topk:ratio=0.25;ef=true", "rangefloat:bits=4;exp_bits=2"])
@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_resume_mid_period_and_with_a_fragment_in_flight_continues_exactly(cut, codec):
    # period 4, two fragments at offsets 0 and 2, delay 1: launches after steps 2 and 4, merges
    # after 3 and 5, so cuts 2 and 4 (after that many steps) fall with a fragment in flight
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=1, codec=codec)  # noqa: E731
    straight = LocalWorld(2).run(lambda comm: _train(comm, make, 10, bn=True)[0])
    resumed = LocalWorld(2).run(lambda comm: _train(comm, make, 10, bn=True, cut=cut)[0])
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("codec", ["identity", "rangefloat:bits=4;exp_bits=2"])
@pytest.mark.parametrize("cut", [2, 3, 4])
def test_merge_rebase_resumes_exactly_with_a_fragment_in_flight(cut, codec):
    # period 4, offsets 0 and 2, delay 2: fragment 1 launches after step 2 and merges after 4,
    # fragment 0 after 4 and 6; a cut after 2, 3 or 4 steps holds where a rank stood at a launch
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=2, merge="rebase",  # noqa: E731
                                           codec=codec)
    straight = LocalWorld(2).run(lambda comm: _train(comm, make, 10, bn=True)[0])
    resumed = LocalWorld(2).run(lambda comm: _train(comm, make, 10, bn=True, cut=cut)[0])
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_a_checkpoint_with_a_fragment_in_flight_resumes_only_under_its_own_merge():
    def fn(comm):
        make = lambda merge: lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=2,  # noqa: E731
                                                              merge=merge)
        _, method = _train(comm, make("rebase"), 3)  # fragment 1 launched after step 2, merges after 4
        state = method.state_dict()
        other = make("mix")(copy.deepcopy(BASE), torch.optim.SGD(copy.deepcopy(BASE).parameters(), lr=0.1), comm)
        with pytest.raises(ValueError, match="saved with merge=rebase and averages in flight; this run has "
                                             "merge=mix: resume with merge=rebase"):
            other.load_state_dict(state)
        return True

    assert all(LocalWorld(2).run(fn))


@pytest.mark.parametrize("scatter", [False, True])
def test_averages_run_whole_on_the_background_thread_as_they_would_inline(scatter):
    # with a delay each fragment's average (encode, collectives, decode; with scatter=true both
    # phases) runs on a background thread over a twin group: the same models, bytes and records
    # as the same averages run inline over the world's group
    def run(offload):
        def fn(comm):
            def make(m, o, c):
                method = StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=3, scatter=scatter,
                                         codec="rangefloat:bits=4;exp_bits=2")
                if not offload:
                    method.offload = None
                return method

            state, method = _train(comm, make, 10, finish=True)
            return state, comm.meter.bytes_sent, len(method._windows), method.offload is not None
        return LocalWorld(3).run(fn)

    behind, inline = run(True), run(False)
    for (a, sent_a, windows_a, used), (b, sent_b, windows_b, _) in zip(behind, inline):
        assert used and torch.equal(a, b)
        # launches after steps 2, 6, 10 (fragment 1) and 4, 8 (fragment 0): five averages behind steps
        assert sent_a == sent_b > 0 and windows_a == windows_b == 5


def test_a_state_saved_with_a_fragment_in_flight_holds_its_landed_mean():
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=2)  # noqa: E731
    states = LocalWorld(2).run(lambda comm: _train(comm, make, 3)[1].state_dict())  # fragment 1 launched at 2
    f0, f1 = states[0]["fragments"]
    assert f0["merge_at"] is None and f0["delta"] is None
    assert f1["merge_at"] == 4 and f1["landed"] and torch.equal(f1["delta"], states[1]["fragments"][1]["delta"])


def test_finish_merges_the_fragments_still_in_flight():
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=3)  # noqa: E731
    ended = LocalWorld(2).run(lambda comm: _train(comm, make, 4, finish=True)[1])
    assert all(f.merge_at is None and f.pending is None for m in ended for f in m.fragments)
    # fragment 1 (launched at 2) and fragment 0 (at 4) merged, then the final sync of each
    # (mixed with alpha at their merges, the ranks still differ)
    assert [m.syncs for m in ended] == [4, 4] and [m.syncs_before_finish for m in ended] == [0, 0]
    plain = LocalWorld(2).run(lambda comm: _train(comm, lambda m, o, c: StreamingDiLoCo(
        m, o, c, period=4, fragments=2, delay=3, final_sync=False), 4, finish=True)[1])
    assert [m.syncs for m in plain] == [2, 2]  # the merges of the averages in flight only


def test_one_step_sends_at_most_the_largest_fragment_where_diloco_sends_the_model():
    def peak(make):
        return LocalWorld(4).run(lambda comm: _train(comm, make, 8)[1].peak_bytes)[0]

    numel = sum(p.numel() for p in BASE.parameters())
    ring = 2 * 3 / 4 * 4  # bytes per fp32 element of a 4-rank ring all_reduce
    assert peak(lambda m, o, c: DiLoCo(m, o, c, period=4)) == ring * numel
    streaming = peak(lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=1))
    assert streaming == ring * 40  # the largest fragment: the first layer's 40 weights
    assert streaming <= 0.6 * ring * numel


@pytest.mark.parametrize("spec, message", [
    ("streaming-diloco:fragments=0", "fragments must be >= 1, got 0"),
    ("streaming-diloco:period=4,delay=5", r"delay must be <= period \(a whole round\): delay=5 > period=4"),
    ("streaming-diloco:delay=soon", "delay must be an integer or auto, got 'soon'"),
    ("streaming-diloco:delay=auto,link=fast", "link"),
    ("streaming-diloco:delay=-1", "delay must be >= 0, got -1"),
    ("streaming-diloco:alpha=1.5", r"alpha must be in \[0, 1\], got 1.5"),
    ("streaming-diloco:alpha=-0.1", r"alpha must be in \[0, 1\], got -0.1"),
    ("streaming-diloco:merge=keep", "merge must be one of mix, rebase, got 'keep'"),
    ("streaming-diloco:merge=rebase,delay=0", "merge=rebase keeps the worker's steps between a fragment's launch "
                                              "and its merge: it needs a delay"),
    ("streaming-diloco:outer_lr=0", "outer_lr must be > 0, got 0"),
    ("streaming-diloco:codec=nope", "nope"),
])
def test_bad_knobs_name_the_rule(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_method(spec)


def test_more_fragments_than_parameter_tensors_is_refused_before_training():
    with pytest.raises(ValueError, match="fragments must be at most the model's 4 trainable parameter tensors, got 5"):
        check_model("streaming-diloco:fragments=5", copy.deepcopy(BASE))
    check_model("streaming-diloco:fragments=4", copy.deepcopy(BASE))


def test_the_spec_fills_every_default():
    assert resolve_method("streaming-diloco") == (
        "streaming-diloco:period=50,warmup=0,outer=sgd,outer_lr=0.7,outer_momentum=0.9,nesterov=true,"
        "codec=identity:ef=false;min_numel=0,scatter=false,average_momentum=false,final_sync=true,sync=blocking,"
        "fragments=4,delay=1,alpha=0.5,merge=mix,link=")


def test_more_fragments_than_steps_in_a_period_is_refused():
    with pytest.raises(ValueError, match="fragments must be <= period .*fragments=4 > period=2"):
        resolve_method("streaming-diloco:period=2,fragments=4")


def test_diloco_merged_at_its_launch_reports_nothing_hidden():
    method = LocalWorld(2).run(lambda comm: _train(comm, lambda m, o, c: DiLoCo(m, o, c, period=2), 4)[1])[0]
    assert method.syncs == 2 and method.hidden_fraction() is None and method._windows == []
    from thinwire.comm.link import Link

    assert method.hidden_seconds(Link.parse("10mbit,1ms")) == 0.0


@pytest.mark.parametrize("make", [
    lambda m, o, c: DiLoCo(m, o, c, period=4),
    lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=1),
    lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=1, alpha=0.5),
    lambda m, o, c: StreamingDiLoCo(m, o, c, period=6, fragments=3, delay=2, codec="topk:ratio=0.25;ef=true"),
    lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=2, merge="rebase", alpha=0.0),
], ids=["diloco", "streaming", "streaming-alpha", "streaming-topk", "streaming-rebase"])
def test_finish_ends_with_one_model_bit_identical_on_every_rank(make):
    for steps in (7, 8, 9):  # mid-round, at a sync, with a fragment in flight
        ended = LocalWorld(3).run(lambda comm, steps=steps: _train(comm, make, steps, bn=True, finish=True))
        states = [s for s, _ in ended]
        assert all(torch.equal(states[0], s) for s in states[1:]), steps
        method = ended[0][1]
        assert all(torch.equal(p, t) for p, t in zip(method.state.params, method.outer_params))  # the model is θ
        assert method.syncs >= method.syncs_before_finish > 0


def test_final_sync_false_leaves_each_rank_its_own_model_and_a_sync_step_needs_no_extra_outer_step():
    make = lambda m, o, c: DiLoCo(m, o, c, period=4, final_sync=False)  # noqa: E731
    ended = LocalWorld(2).run(lambda comm: _train(comm, make, 6, finish=True))
    assert not torch.equal(ended[0][0], ended[1][0])  # 2 local steps since the sync at 4
    at_sync = LocalWorld(2).run(lambda comm: _train(comm, lambda m, o, c: DiLoCo(m, o, c, period=4), 8,
                                                    finish=True))
    plain = LocalWorld(2).run(lambda comm: _train(comm, lambda m, o, c: DiLoCo(m, o, c, period=4), 8))
    for (a, method), (b, _) in zip(at_sync, plain):
        assert torch.equal(a, b) and method.syncs == method.syncs_before_finish == 2  # nothing left to sync


def test_a_run_that_never_reached_a_sync_warns_once_and_still_ends_with_one_model():
    make = lambda m, o, c: DiLoCo(m, o, c, period=50)  # noqa: E731
    with pytest.warns(UserWarning, match=r"diloco: 3 local steps and no outer step before finish\(\) \(period=50\)"):
        ended = LocalWorld(2).run(lambda comm: _train(comm, make, 3, finish=True))
    assert torch.equal(ended[0][0], ended[1][0])
    assert [m.report()["syncs_before_finish"] for _, m in ended] == [0, 0] and ended[0][1].syncs == 1


def test_delay_auto_without_a_link_to_read_is_refused():
    def fn(comm):
        model = copy.deepcopy(BASE)
        with pytest.raises(ValueError, match="delay=auto needs a link to read: give link=RATE;LATENCY"):
            StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), comm, period=4, fragments=2,
                            delay="auto")
        return True

    assert all(LocalWorld(2).run(fn))


@pytest.mark.parametrize("link, delay", [("100gbit;1us", 1), ("1kbit;1ms", 4)])
def test_delay_auto_takes_the_smallest_delay_that_hides_a_fragment_up_to_a_whole_round(link, delay):
    """A fragment of this model is a few hundred bytes: on 100 Gbit/s one step hides it; on
    1 kbit/s no delay can (seconds against a step of milliseconds): a whole round, with a
    warning."""
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay="auto", link=link)  # noqa: E731

    def fn(comm):
        _, method = _train(comm, make, 9, finish=True)
        return method.report(), method.warned

    out = LocalWorld(2).run(fn)
    for report, warned in out:
        # the delay the estimate chose (averages measured slower later grow it: tested below)
        figures = report["delay_auto"]
        assert figures.get("first_delay", figures["delay"]) == delay and report["delay"] == figures["delay"] >= delay
        assert report["delay_auto"]["step_seconds"] > 0 and report["delay_auto"]["fragment_codec_seconds"] > 0
        assert bool(warned) == (delay == 4)
    assert out[0][0]["delay_auto"] == out[1][0]["delay_auto"]  # the ranks took the same figures


def test_delay_auto_grows_when_an_average_took_longer_than_its_steps(monkeypatch):
    # on 100 Gbit/s the estimate is one step; averages measured at a second each (far more than
    # the millisecond steps here) grow it to a whole round, the same on every rank
    import thinwire.algorithms.diloco as diloco

    monkeypatch.setattr(diloco, "_took", lambda pending: 1.0 if hasattr(pending, "finished_at") else None)
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay="auto", link="100gbit;1us")  # noqa: E731

    def fn(comm):
        state, method = _train(comm, make, 12, finish=True)
        return state, method.report()

    out = LocalWorld(2).run(fn)
    for _, report in out:
        figures = report["delay_auto"]
        assert report["delay"] == figures["delay"] == 4 and figures["first_delay"] == 1
        assert figures["average_seconds"] == 1.0
    assert torch.equal(out[0][0], out[1][0])  # finish() still ends on one model


def test_delay_auto_counts_the_codecs_seconds_too(monkeypatch):
    # on 100 Gbit/s the wire hides in one step; a codec that took seconds would not
    monkeypatch.setattr(StreamingDiLoCo, "_codec_seconds", lambda self, f: 5.0)
    make = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay="auto", link="100gbit;1us")  # noqa: E731
    for report in LocalWorld(2).run(lambda comm: _train(comm, make, 9, finish=True)[1].report()):
        assert report["delay"] == 4 and report["delay_auto"]["fragment_codec_seconds"] == 5.0


def test_a_resumed_delay_auto_run_keeps_the_delay_it_chose():
    slow = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay="auto", link="1kbit;1ms")  # noqa: E731
    fast = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay="auto", link="100gbit;1us")  # noqa: E731

    def fn(comm):
        _, method = _train(comm, slow, 5)
        state = method.state_dict()
        model = copy.deepcopy(BASE)
        other = fast(model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
        other.load_state_dict(state)
        return method.delay, other.delay

    assert LocalWorld(2).run(fn) == [(4, 4), (4, 4)]


def test_a_fixed_delay_other_than_the_one_saved_with_averages_in_flight_is_refused():
    def fn(comm):
        _, method = _train(comm, lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay=2), 3)
        state = method.state_dict()
        model = copy.deepcopy(BASE)
        other = StreamingDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), comm, period=4, fragments=2,
                                delay=3)
        with pytest.raises(ValueError, match="saved with delay=2 and averages in flight; this run has delay=3"):
            other.load_state_dict(state)
        return True

    assert all(LocalWorld(2).run(fn))


def test_delay_auto_resumed_before_its_first_launch_still_times_a_step():
    """Resumed after step 1, the first launch comes at the next step: the clock of the new
    object has seen no whole step, so it times the one since it was built (not zero, which
    would ask for a whole round)."""
    fast = lambda m, o, c: StreamingDiLoCo(m, o, c, period=4, fragments=2, delay="auto", link="100gbit;1us")  # noqa: E731
    out = LocalWorld(2).run(lambda comm: _train(comm, fast, 6, cut=1)[1].report()["delay_auto"])
    assert all(r.get("first_delay", r["delay"]) == 1 and r["step_seconds"] > 0 for r in out)

"""thinwire cost's model on hand-computed cases: step time, crossover bandwidth, verdicts,
the overlap with the backward pass, and the crossing solver against a dense scan."""

import dataclasses
import math
import random

import pytest

from thinwire.comm.link import Link
from thinwire.comm.overlap import overlap_hidden_seconds
from thinwire.lab.cost import StepCost, crossings_Bps, crossover_Bps, from_rows, from_summary, verdict
from tiny import fake_summary

# bf16: 10 ms compute, 1 ms codec, 1 MB and 6 messages per step; a compressor: 10 ms compute,
# 5 ms codec, 0.1 MB and 6 messages
REF = StepCost("bf16", 0.010, 0.001, 1_000_000, 6)
SMALL = StepCost("topk", 0.010, 0.005, 100_000, 6)


def test_step_time_is_compute_codec_latency_and_bytes():
    link = Link.parse("1gbit,50us")  # 125e6 bytes/s
    assert REF.seconds(link) == pytest.approx(0.010 + 0.001 + 6 * 50e-6 + 1_000_000 / 125e6, rel=1e-12)
    assert SMALL.seconds(link) == pytest.approx(0.015 + 6 * 50e-6 + 100_000 / 125e6, rel=1e-12)


def test_crossover_where_fewer_bytes_outweigh_more_codec_time():
    # equal when 4 ms of extra codec time = 0.9 MB / beta: beta = 225 MB/s = 1.8 Gbit/s
    beta = crossover_Bps(SMALL, REF, 50e-6)
    assert beta == pytest.approx(900_000 / 0.004, rel=1e-12)
    at = Link(latency_s=50e-6, bandwidth_Bps=beta)
    assert SMALL.seconds(at) == pytest.approx(REF.seconds(at), rel=1e-12)
    assert verdict(SMALL, REF, 50e-6) == "below 1.8 Gbit/s"
    # the other way round: bf16 beats the compressor above 1.8 Gbit/s
    assert verdict(REF, SMALL, 50e-6) == "above 1.8 Gbit/s"


def test_verdicts_without_a_crossing():
    cheaper = StepCost("x", 0.010, 0.0005, 500_000, 6)  # less codec time and fewer bytes
    dearer = StepCost("y", 0.010, 0.002, 2_000_000, 6)  # more of both
    assert crossover_Bps(cheaper, REF, 50e-6) is None and verdict(cheaper, REF, 50e-6) == "always"
    assert crossover_Bps(dearer, REF, 50e-6) is None and verdict(dearer, REF, 50e-6) == "never"
    assert verdict(REF, REF, 50e-6) == "(the reference)"
    # extra messages count at the latency: 100 more messages at 1 ms = 0.1 s per step
    chatty = StepCost("z", 0.010, 0.001, 100_000, 106)
    assert crossover_Bps(chatty, REF, 1e-3) == pytest.approx(900_000 / 0.1, rel=1e-12)


def test_communication_takes_at_least_its_wait_here():
    waiting = StepCost("bf16", 0.010, 0.001, 1_000_000, 6, wait_s=0.020)
    fast, slow = Link.parse("1gbit,50us"), Link.parse("100mbit,1ms")
    assert waiting.seconds(fast) == pytest.approx(0.011 + 0.020, rel=1e-12)  # the link's 8.3 ms hides under it
    assert waiting.seconds(slow) == pytest.approx(0.011 + 6e-3 + 1_000_000 / 12.5e6, rel=1e-12)


def test_two_crossings_where_a_wait_meets_more_bytes():
    # ref: 12 ms fixed, 1 MB, no wait; m: 5 ms fixed, 2 MB, 10 ms wait (kink at x = 5e-9 s/B).
    # m - ref = 3 ms - 1e6 x up to the kink, then -2 ms + 1e6 (x - 5e-9): zero at x = 3e-9 and 7e-9
    ref = StepCost("bf16", 0.012, 0.0, 1_000_000, 0)
    m = StepCost("m", 0.005, 0.0, 2_000_000, 0, wait_s=0.010)
    roots = crossings_Bps(m, ref, 0.0)
    assert roots == pytest.approx([1 / 7e-9, 1 / 3e-9], rel=1e-9)
    for beta in roots:
        at = Link(latency_s=0.0, bandwidth_Bps=beta)
        assert m.seconds(at) == pytest.approx(ref.seconds(at), rel=1e-9)
    assert verdict(m, ref, 0.0) == "between 1.14 Gbit/s and 2.67 Gbit/s"
    assert verdict(ref, m, 0.0) == "below 1.14 Gbit/s or above 2.67 Gbit/s"


def test_per_step_figures_from_a_summary():
    c = from_summary("m", fake_summary(steps=20, compute_seconds=2.0, codec_seconds=0.5, comm_seconds=0.4,
                                       bytes_sent_per_worker=4e6, messages_per_worker=120))
    assert (c.compute_s, c.codec_s, c.bytes, c.messages, c.wait_s) == (0.1, 0.025, 2e5, 6, 0.02)
    assert (c.window_s, c.early_share) == (0.0, 0.0)  # a run from before overlap: none


def test_overlap_figures_from_a_summary():
    base = {"steps": 20, "compute_seconds": 2.0, "codec_seconds": 0.5, "comm_seconds": 0.4,
            "bytes_sent_per_worker": 4e6, "messages_per_worker": 120}
    c = from_summary("m", fake_summary(**base, backward_seconds=1.2,
                                       overlap={"enabled": True, "steps": 19, "window_seconds": 0.38,
                                                "blocked_seconds": 0.1, "early_share": 0.57}))
    assert c.window_s == pytest.approx(0.019, rel=1e-12) and c.early_share == 0.57
    off = from_summary("m", fake_summary(**base, overlap={"enabled": False, "steps": 0, "window_seconds": 0.0,
                                                          "blocked_seconds": 0.0, "early_share": 0.0}))
    assert (off.window_s, off.early_share) == (0.0, 0.0)


# -- overlap with the backward pass ------------------------------------------------------------

def test_overlap_hides_the_early_share_of_codec_and_communication_up_to_the_window():
    # G = codec + max(wait, link) per step; the step = compute + G - min(window, early * G)
    c = StepCost("m", 0.010, 0.002, 1_000_000, 6, wait_s=0.005, window_s=0.003, early_share=0.5)
    fast = Link.parse("1gbit,50us")  # link 0.3 ms + 8 ms = 8.3 ms > wait: G = 10.3 ms, half of it 5.15 ms > 3 ms
    assert c.hidden_s(fast) == pytest.approx(0.003, rel=1e-12)
    assert c.seconds(fast) == pytest.approx(0.010 + 0.0103 - 0.003, rel=1e-12)
    slow = Link.parse("100mbit,1ms")  # 6 ms + 80 ms: G = 88 ms, the window is all it hides
    assert c.seconds(slow) == pytest.approx(0.010 + 0.088 - 0.003, rel=1e-12)
    lan = Link(latency_s=0.0, bandwidth_Bps=12.5e9)  # 0.08 ms < wait: G = 2 + 5 ms, half of it 3.5 ms > 3 ms
    assert c.seconds(lan) == pytest.approx(0.010 + 0.007 - 0.003, rel=1e-12)
    wide = StepCost("m", 0.010, 0.002, 1_000_000, 6, wait_s=0.005, window_s=0.010, early_share=0.5)
    assert wide.hidden_s(lan) == pytest.approx(0.0035, rel=1e-12)  # the window outlasts the early half
    assert wide.seconds(lan) == pytest.approx(0.010 + 0.007 - 0.0035, rel=1e-12)
    # no window or no early share: the model without overlap
    for none in (StepCost("m", 0.010, 0.002, 1_000_000, 6, wait_s=0.005, window_s=0.003),
                 StepCost("m", 0.010, 0.002, 1_000_000, 6, wait_s=0.005, early_share=0.5)):
        assert none.hidden_s(fast) == 0.0 and none.seconds(fast) == pytest.approx(0.010 + 0.0103, rel=1e-12)


def test_overlap_hidden_seconds_for_run_totals_and_per_step_alike():
    link = Link.parse("100mbit,1ms")  # 12.5e6 bytes/s
    # trainer call: run totals of 50 steps, no wait floor: link = 300 * 1 ms + 5e6 / 12.5e6 = 0.7 s
    total = overlap_hidden_seconds(link, bytes=5e6, messages=300, codec_s=0.1, window_s=0.25, early_share=0.4)
    assert total == pytest.approx(min(0.25, 0.4 * (0.1 + 0.7)), rel=1e-12)  # 0.25: the window
    per_step = overlap_hidden_seconds(link, bytes=1e5, messages=6, codec_s=0.002, window_s=0.005, early_share=0.4)
    assert 50 * per_step == pytest.approx(total, rel=1e-12)
    short = overlap_hidden_seconds(link, bytes=5e6, messages=300, codec_s=0.1, window_s=2.0, early_share=0.4)
    assert short == pytest.approx(0.32, rel=1e-12)  # the early share's 0.4 * 0.8 s, all of it
    assert overlap_hidden_seconds(link, bytes=5e6, messages=300, codec_s=0.1, window_s=0.0, early_share=0.4) == 0.0
    assert overlap_hidden_seconds(link, bytes=5e6, messages=300, codec_s=0.1, window_s=0.3, early_share=0.0) == 0.0
    # the probe's wait is a floor on the communication, here as in the step time
    floor = overlap_hidden_seconds(link, bytes=0.0, messages=0, codec_s=0.0, window_s=1.0, early_share=0.5, wait_s=0.2)
    assert floor == pytest.approx(0.1, rel=1e-12)


def test_the_references_overlap_moves_the_crossover():
    # bf16 hides min(2 ms, half of its 1 ms codec + 0.3 ms latency + 1e6 x): the whole 2 ms once
    # 1e6 x >= 2.7 ms. Beyond that kink topk - bf16 = 6 ms - 9e5 x: zero at x = 6.67e-9 s/B,
    # 150 MB/s = 1.2 Gbit/s (1.8 Gbit/s without the overlap); before it 4.65 ms - 4e5 x > 0
    ref = StepCost("bf16", 0.010, 0.001, 1_000_000, 6, window_s=0.002, early_share=0.5)
    assert crossings_Bps(SMALL, ref, 50e-6) == pytest.approx([1.5e8], rel=1e-12)
    assert verdict(SMALL, ref, 50e-6) == "below 1.2 Gbit/s" and verdict(ref, SMALL, 50e-6) == "above 1.2 Gbit/s"
    at = Link(latency_s=50e-6, bandwidth_Bps=1.5e8)
    assert SMALL.seconds(at) == pytest.approx(ref.seconds(at), rel=1e-12)


def test_the_windows_kink_gives_two_crossings():
    # ref: 10 ms + max(1e6 x - 2 ms, 0.5e6 x) (kink at x = 4e-9); m: 9.5 ms + 7e5 x, no overlap.
    # m - ref = -0.5 ms + 2e5 x before the kink (zero at 2.5e-9), 1.5 ms - 3e5 x after (zero at 5e-9)
    ref = StepCost("bf16", 0.010, 0.0, 1_000_000, 0, window_s=0.002, early_share=0.5)
    m = StepCost("m", 0.0095, 0.0, 700_000, 0)
    assert crossings_Bps(m, ref, 0.0) == pytest.approx([2e8, 4e8], rel=1e-12)
    assert verdict(m, ref, 0.0) == "below 1.6 Gbit/s or above 3.2 Gbit/s"
    assert verdict(ref, m, 0.0) == "between 1.6 Gbit/s and 3.2 Gbit/s"


def test_a_crossing_at_a_kink_is_found_once():
    # m: 10 ms + max(0, 2e6 x - 4 ms) (every element early, a 4 ms window): kink at x = 2e-9.
    # ref: 4 ms + 3e6 x. m - ref = 6 ms - 3e6 x, then 2 ms - 1e6 x: zero at the kink from both sides
    m = StepCost("m", 0.010, 0.0, 2_000_000, 0, window_s=0.004, early_share=1.0)
    ref = StepCost("bf16", 0.004, 0.0, 3_000_000, 0)
    assert crossings_Bps(m, ref, 0.0) == pytest.approx([5e8], rel=1e-12)
    assert verdict(m, ref, 0.0) == "below 4 Gbit/s"
    # ref: 8 ms + 1e6 x only touches m at the kink (m - ref >= 0 on both sides): m never wins
    touch = StepCost("bf16", 0.008, 0.0, 1_000_000, 0)
    assert crossings_Bps(m, touch, 0.0) == pytest.approx([5e8], rel=1e-12)
    assert verdict(m, touch, 0.0) == "never" and verdict(touch, m, 0.0) == "always"


def _random_cost(rng: random.Random, name: str) -> StepCost:
    c = StepCost(name, rng.uniform(0.008, 0.012), rng.uniform(0.0, 0.005), 10 ** rng.uniform(4, 7),
                 rng.choice([0, 2, 6, 20]), wait_s=rng.choice([0.0, rng.uniform(0.0, 0.02)]),
                 window_s=rng.choice([0.0, rng.uniform(0.0, 0.01)]), early_share=rng.uniform(0.0, 1.0))
    if rng.random() < 0.5:  # a queue of launched buckets instead of one window
        k = rng.randint(1, 4)
        shares = [rng.uniform(0.0, 1.0 / k) for _ in range(k)]
        leads = sorted((rng.uniform(0.0, 0.01) for _ in range(k)), reverse=True)  # the first launched leads most
        c = dataclasses.replace(c, leads=tuple(zip(leads, shares)))
    return c


def test_launched_buckets_queue_on_one_thread():
    # G = 2.5 s of work per step; a bucket of 56% launched 3.1 s before reduce(), one of 44%
    # launched 0.03 s before: the first is done in time, the second leaves 0.44 * 2.5 - 0.03 s
    c = StepCost("bf16", compute_s=2.0, codec_s=0.5, bytes=2e6, messages=0, leads=((3.1, 0.56), (0.03, 0.44)))
    link = Link.parse("8mbit,0us")  # 1e6 bytes/s: 2 s on the wire, G = 2.5 s
    assert c.hidden_s(link) == pytest.approx(2.5 - (0.44 * 2.5 - 0.03), rel=1e-12)
    assert c.seconds(link) == pytest.approx(2.0 + 0.44 * 2.5 - 0.03, rel=1e-12)
    # one window over the same share would hide it all: the queue is the sharper model
    flat = StepCost("bf16", compute_s=2.0, codec_s=0.5, bytes=2e6, messages=0, window_s=3.1, early_share=1.0)
    assert flat.seconds(link) == pytest.approx(2.0, rel=1e-12)
    # a slower link: the first bucket outlasts its lead too, and the queue carries it over
    slow = Link.parse("4mbit,0us")  # G = 4.5 s
    assert c.seconds(slow) == pytest.approx(2.0 + max(4.5 - 3.1, 0.44 * 4.5 - 0.03), rel=1e-12)


def test_the_step_time_is_the_largest_of_its_lines():
    rng = random.Random(1)
    for _ in range(200):
        c, lat = _random_cost(rng, "m"), rng.choice([0.0, 50e-6, 1e-3])
        for k in range(60):
            x = 10 ** (-13 + 8 * k / 59)
            assert max(a + s * x for a, s in c._lines(lat)) == pytest.approx(c._at(lat, x), rel=1e-12, abs=1e-15)


def test_crossings_match_a_dense_scan_over_bandwidth():
    rng = random.Random(7)
    grid = [10 ** (4 + 9 * k / 1999) for k in range(2000)]  # 10 kB/s to 10 TB/s, 222 points a decade
    found = {0: 0, 1: 0, 2: 0}
    for _ in range(300):
        m, ref, lat = _random_cost(rng, "m"), _random_cost(rng, "bf16"), rng.choice([0.0, 50e-6, 1e-3])

        def d(beta: float, m=m, ref=ref, lat=lat) -> float:
            return m._at(lat, 1.0 / beta) - ref._at(lat, 1.0 / beta)

        roots = crossings_Bps(m, ref, lat)
        assert roots == sorted(roots) and len(set(roots)) == len(roots)
        for beta in roots:  # every crossing is one: the two times agree there
            assert abs(d(beta)) <= 1e-9 * ref._at(lat, 1.0 / beta)
        values = [d(beta) for beta in grid]
        for (b1, v1), (b2, v2) in zip(zip(grid, values), zip(grid[1:], values[1:])):
            if v1 * v2 < 0:  # the scan sees a change of sign: the solver has a crossing there
                assert any(b1 * (1 - 1e-9) <= r <= b2 * (1 + 1e-9) for r in roots), (m, ref, lat, b1, b2)
        inside = [r for r in roots if grid[0] < r < grid[-1]]
        found[min(len(inside), 2)] += 1
        # the verdict agrees with the scan wherever the scan is clear of a crossing (by more
        # than the verdict's rounding to 3 digits)
        v = verdict(m, ref, lat)
        for beta, value in zip(grid[::12], values[::12]):
            if value != 0 and all(abs(math.log(beta / r)) > 1e-2 for r in roots):
                assert _wins(v, beta) == (value < 0), (v, beta, m, ref, lat)
    assert found[1] >= 20 and found[2] >= 3  # the scan did test crossings, two of them too


def _wins(text: str, beta: float) -> bool:
    """Whether the verdict ``text`` says the method is faster at ``beta`` bytes/s."""
    def rate(words: str) -> float:
        value, unit = words.split()
        return float(value) * (1e9 if unit == "Gbit/s" else 1e6) / 8

    if text in ("always", "never"):
        return text == "always"
    for span in text.split(" or "):
        kind, rest = span.split(" ", 1)
        if kind == "below" and beta < rate(rest):
            return True
        if kind == "above" and beta > rate(rest):
            return True
        if kind == "between":
            lo, hi = rest.split(" and ")
            if rate(lo) < beta < rate(hi):
                return True
    return False


def test_per_step_figures_between_two_records():
    first = {"step": 4, "compute_seconds": 1.0, "codec_seconds": 0.5, "comm_seconds": 2.0, "bytes_sent": 40.0,
             "messages": 8}
    last = {"step": 8, "compute_seconds": 1.4, "codec_seconds": 0.6, "comm_seconds": 2.2, "bytes_sent": 80.0,
            "messages": 16}
    old = from_rows("m", first, last)  # records from before overlap
    assert (old.compute_s, old.codec_s, old.bytes, old.messages, old.wait_s, old.window_s, old.early_share) == \
        pytest.approx((0.1, 0.025, 10.0, 2.0, 0.05, 0.0, 0.0), rel=1e-12)
    # every step but the first launched 60% of its elements in backward, 0.1 s before reduce():
    # cumulative shares 0.6 * 3/4 at step 4 and 0.6 * 7/8 at step 8; the span's own share is 0.6
    o1 = dict(first, backward_seconds=0.5, overlap_steps=3, overlap_window_seconds=0.3, overlap_blocked_seconds=0.05,
              overlap_early_share=0.45)
    o2 = dict(last, backward_seconds=0.7, overlap_steps=7, overlap_window_seconds=0.7, overlap_blocked_seconds=0.09,
              overlap_early_share=0.525)
    c = from_rows("m", o1, o2)
    assert (c.window_s, c.early_share) == pytest.approx((0.1, 0.6), rel=1e-12)
    # a skipped step averages nothing: shares are of the steps that reduced (3 of 4, then 6 of 8)
    s1 = dict(o1, skipped_steps=1, overlap_early_share=0.6 * 2 / 3)
    s2 = dict(o2, skipped_steps=2, overlap_early_share=0.6 * 5 / 6)
    assert from_rows("m", s1, s2).early_share == pytest.approx(0.6, rel=1e-12)
    with pytest.raises(ValueError, match="span no steps"):
        from_rows("m", o2, o2)


def _probe_launch(fail: str = "", overlap: bool = False):
    """Writes what a run writes: cumulative counters at the end of the warm-up and at the end,
    the warm-up's start-up cost in the first record only."""
    import json
    from pathlib import Path

    from thinwire.run.launch import RunFailed

    def launch(cfg, show_progress=False):
        if fail and cfg.method.startswith(fail):
            raise RunFailed("rank 0 failed after step 1: FloatingPointError: training loss is nan")
        half = cfg.steps // 2
        assert cfg.eval_every == half and cfg.steps == 8
        rows = [{"step": half, "compute_seconds": 1.0, "codec_seconds": 0.5, "comm_seconds": 2.0, "bytes_sent": 40.0,
                 "messages": 8},
                {"step": cfg.steps, "compute_seconds": 1.4, "codec_seconds": 0.6, "comm_seconds": 2.2,
                 "bytes_sent": 80.0, "messages": 16}]
        if overlap:  # the first step launches nothing in backward, every later one 80% of its elements
            rows[0].update(overlap_steps=half - 1, overlap_window_seconds=0.02 * (half - 1),
                           overlap_early_share=0.8 * (half - 1) / half)
            rows[1].update(overlap_steps=cfg.steps - 1, overlap_window_seconds=0.02 * (cfg.steps - 1),
                           overlap_early_share=0.8 * (cfg.steps - 1) / cfg.steps)
        Path(cfg.out, "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return fake_summary(steps=cfg.steps, compute_seconds=1.4, codec_seconds=0.6, bytes_sent_per_worker=80.0,
                            messages_per_worker=16)

    return launch


def test_probe_times_only_the_steps_after_its_warm_up():
    from thinwire.lab.cost import probe
    from thinwire.run.config import TrainConfig

    costs, failed = probe(TrainConfig(task="synthetic", steps=4), ["bf16"], 4, launch=_probe_launch(),
                          say=lambda line: None)
    c = costs["bf16"]
    assert not failed
    assert (c.compute_s, c.codec_s, c.bytes, c.messages, c.wait_s) == pytest.approx((0.1, 0.025, 10.0, 2.0, 0.05),
                                                                                     rel=1e-12)
    assert (c.window_s, c.early_share) == (0.0, 0.0)


def test_probe_reads_the_overlap_of_the_timed_steps():
    from thinwire.lab.cost import probe
    from thinwire.run.config import TrainConfig

    costs, failed = probe(TrainConfig(task="synthetic", steps=4), ["bf16"], 4, launch=_probe_launch(overlap=True),
                          say=lambda line: None)
    c = costs["bf16"]
    assert not failed and (c.window_s, c.early_share) == pytest.approx((0.02, 0.8), rel=1e-12)


def test_a_failed_probe_is_reported_and_the_others_run():
    from thinwire.lab.cost import probe
    from thinwire.run.config import TrainConfig

    costs, failed = probe(TrainConfig(task="synthetic", steps=4), ["bf16", "topk:ratio=0.1", "identity"], 4,
                          launch=_probe_launch(fail="topk"), say=lambda line: None)
    assert list(costs) == ["bf16", "identity"] and costs["bf16"].bytes == 10.0
    assert list(failed) == ["topk:ratio=0.1"] and "FloatingPointError" in failed["topk:ratio=0.1"]


@pytest.mark.parametrize("spec, steps, want", [
    ("bf16", 20, 20), ("localsgd:period=4", 20, 20), ("localsgd:period=8", 20, 24), ("diloco:period=50", 20, 50),
    ("streaming-diloco:period=50,fragments=4", 60, 100), ("dpsgd", 7, 7), ("hylo", 9, 9), ("diloco:period=1", 3, 3),
])
def test_a_periodic_method_is_probed_over_whole_periods(spec, steps, want):
    from thinwire.lab.cost import probe_steps

    assert probe_steps(spec, steps) == want


@pytest.mark.spawns
def test_a_probe_of_diloco_spreads_its_sync_over_the_period_and_reads_its_peak():
    """Real ranks: diloco with period 6 probed with 4 steps runs 6 + 6, one sync in the timed
    steps: its bytes per step are one pseudo-gradient all_reduce over 6 steps."""
    from thinwire.lab.cost import probe
    from thinwire.run.config import TrainConfig

    base = TrainConfig(task="synthetic", workers=2, task_options={"dim": 8, "hidden": 8, "classes": 2, "samples": 64,
                                                                   "test_samples": 16}, batch_size=8).resolve()
    costs, failed = probe(base, ["diloco:period=6", "streaming-diloco:period=6,fragments=2"], 4,
                          say=lambda line: None)
    assert not failed
    from thinwire.tasks import get

    numel = sum(p.numel() for p in get("synthetic")(dim=8, hidden=8, classes=2, samples=64,
                                                     test_samples=16).build_model().parameters())
    sync = 2 * (2 - 1) / 2 * 4 * numel  # bytes of one fp32 ring all_reduce of the model on 2 ranks
    d, s = costs["diloco:period=6"], costs["streaming-diloco:period=6,fragments=2"]
    assert d.probe_steps == s.probe_steps == 6
    assert d.bytes == pytest.approx(sync / 6) and d.peak_bytes == pytest.approx(sync)
    assert s.bytes == pytest.approx(sync / 6) and s.peak_bytes < 0.75 * sync


# -- repeats: rounds, medians, and the verdict's bandwidths over the repeats ----------------------
def test_repeats_probe_in_rounds_and_a_method_that_fails_once_is_not_probed_again():
    from thinwire.lab.cost import probe_repeats
    from thinwire.run.config import TrainConfig

    calls: list[str] = []
    fails = _probe_launch(fail="topk")

    def launch(cfg, show_progress=False):
        calls.append(cfg.method.split(":")[0])
        return fails(cfg, show_progress)

    lines: list[str] = []
    runs, failed = probe_repeats(TrainConfig(task="synthetic", steps=4), ["bf16", "topk:ratio=0.1", "identity"], 4, 2,
                                 launch=launch, say=lines.append)
    assert calls == ["bf16", "topk", "identity", "bf16", "identity"]  # every method once a round
    assert list(runs) == ["bf16", "identity"] and [len(cs) for cs in runs.values()] == [2, 2]
    assert list(failed) == ["topk:ratio=0.1"]
    assert lines[0] == "[1/3] probing bf16: 4 + 4 steps on 2 workers (repeat 1/2)"
    assert lines[-1] == "[2/2] probing identity: 4 + 4 steps on 2 workers (repeat 2/2)"


def test_the_median_cost_takes_each_figure_s_median():
    from thinwire.lab.cost import median_cost

    a = StepCost("m", 0.010, 0.001, 100.0, 6, wait_s=0.003, window_s=0.002, early_share=0.5,
                 leads=((0.01, 0.5),), peak_bytes=300.0, probe_steps=20)
    b = dataclasses.replace(a, compute_s=0.030, codec_s=0.002, wait_s=0.001, leads=((0.03, 0.7),), peak_bytes=100.0)
    c = dataclasses.replace(a, compute_s=0.020, codec_s=0.005, wait_s=0.002, leads=((0.02, 0.6),), peak_bytes=200.0)
    m = median_cost([a, b, c])
    assert (m.compute_s, m.codec_s, m.wait_s, m.bytes, m.messages) == (0.020, 0.002, 0.002, 100.0, 6)
    assert (m.leads, m.peak_bytes, m.probe_steps) == (((0.02, 0.6),), 200.0, 20)
    # two repeats: the mean of the two; another number of buckets: the leads of the median compute's repeat
    assert median_cost([a, b]).compute_s == pytest.approx(0.020, rel=1e-12)
    odd = dataclasses.replace(c, leads=((0.02, 0.3), (0.01, 0.3)))
    assert median_cost([a, b, odd]).leads == ((0.02, 0.3), (0.01, 0.3))
    assert median_cost([a, dataclasses.replace(b, peak_bytes=None)]).peak_bytes is None


# the reference and a compressor over three repeats: compute 10, 12 and 30 ms (both alike in each round), the
# compressor's codec 4, 5 and 5.5 ms against bf16's 1 ms; 0.9 MB fewer bytes cross at 0.9 MB / codec gap
REFS = [dataclasses.replace(REF, compute_s=c) for c in (0.010, 0.012, 0.030)]
SMALLS = [dataclasses.replace(SMALL, compute_s=c, codec_s=k) for c, k in ((0.010, 0.004), (0.012, 0.005),
                                                                          (0.030, 0.0055))]


def test_the_verdict_s_bandwidths_come_with_their_range_over_the_repeats():
    from thinwire.lab.cost import bound_ranges, bounds_text, median_cost
    from thinwire.lab.tables import spread

    # medians: codec 5 ms against 1 ms, the crossing at 0.9 MB / 4 ms = 225 MB/s = 1.8 Gbit/s; per repeat
    # 0.9 MB / 3 ms = 300 MB/s (2.4 Gbit/s), 225 MB/s and 0.9 MB / 4.5 ms = 200 MB/s (1.6 Gbit/s)
    assert verdict(median_cost(SMALLS), median_cost(REFS), 50e-6) == "below 1.8 Gbit/s"
    (lo, hi), = bound_ranges(SMALLS, REFS, 50e-6)
    assert (lo, hi) == (pytest.approx(200e6, rel=1e-12), pytest.approx(300e6, rel=1e-12))
    assert bounds_text(SMALLS, REFS, 50e-6) == "1.6 Gbit/s–2.4 Gbit/s"
    assert bounds_text(REFS, REFS, 50e-6) == "-"
    assert spread([1e3 * c.compute_s for c in SMALLS]) == "12.0 [10.0–30.0]" and spread([23.14]) == "23.1"
    assert spread([2.0, math.inf, math.inf]) == "∞ [2.0–∞]" and spread([]) == "-"
    # a repeat whose codec is as cheap as bf16's has no crossing (always faster): the shapes are listed
    cheap = [*SMALLS[:2], dataclasses.replace(SMALLS[2], codec_s=0.001)]
    assert bound_ranges(cheap, REFS, 50e-6) is None
    assert bounds_text(cheap, REFS, 50e-6) == "repeats: below 2.4 Gbit/s; below 1.8 Gbit/s; always"
    with pytest.raises(ValueError, match="3 repeats of the method against 2 of the reference"):
        bound_ranges(SMALLS, REFS[:2], 50e-6)


def test_cost_repeats_prints_medians_ranges_and_warns_of_a_busy_machine(monkeypatch, capsys):
    """The CLI over a stand-in probe: each figure as median [min–max] (the compute: the one
    figure the two methods share, over the blocks of every round), the verdict from the
    medians with its bandwidths' range, and one line on stderr for the load."""
    from thinwire import cli
    from thinwire.lab import cost, load

    rounds = iter(range(3))

    def probe(base, specs, steps, *, say=print, on_result=None, **_):
        r = next(rounds)
        say(f"[1/2] probing {specs[0].split(':')[0]}")  # specs resolved: bf16 first, as the reference
        out = {specs[0]: dataclasses.replace(REFS[r], method=specs[0]),
               specs[1]: dataclasses.replace(SMALLS[r], method=specs[1])}
        for spec, c in out.items():
            on_result(spec, c)
        return out, {}

    monkeypatch.setattr(cost, "probe", probe)
    monkeypatch.setattr(load, "load1", lambda: 9.0)
    monkeypatch.setattr(load, "cores", lambda: 2)
    assert cli.main(["cost", "--task", "synthetic", "--workers", "2", "--methods", "topk:ratio=0.01", "--repeats",
                     "3", "--link", "1gbit,50us"]) == 0
    out, err = capsys.readouterr()
    assert "[1/2] probing bf16 (repeat 3/3)" in out and "median [min-max] of 3 repeats" in out
    # the compute blocks 10, 12, 30 ms of each method in each round: median 12, quartiles 10.5 and 25.5
    assert "compute: 12.0 ms a step [10.5–25.5] over 6 blocks, shared by bf16, topk\n" in out
    row = next(line for line in out.splitlines() if line.startswith("│") and line.strip("│ ").startswith("topk"))
    cells = [c.strip() for c in row.strip("│").split("│")]
    # compute (the shared figure), codec, wait ms; ms @ 1gbit,50us = 12 ms + codec + 6 x 50 us + 0.1 MB / 125 MB/s
    assert cells[4:7] == ["12.0", "5.0 [4.0–5.5]", "0.0 [0.0–0.0]"]
    assert cells[8:] == ["18.1 [17.1–18.6]", "below 1.8 Gbit/s", "1.6 Gbit/s–2.4 Gbit/s"]
    assert err.strip() == ("thinwire: warning: load average 9.0 on 2 cores at the start of thinwire cost: other work "
                           "holds the cores, so the measured compute and codec times (and every time built on them) "
                           "vary from run to run")


def test_the_load_check_every_timing_command_shares():
    from thinwire.lab.load import high_load, load_warning

    assert high_load(2.0, 2) == 2.0 and high_load(1.99, 2) is None and high_load(0.5, 1) is None
    assert load_warning("thinwire compare", load=3.5, ncores=2) == (
        "warning: load average 3.5 on 2 cores at the start of thinwire compare: other work holds the cores, so the "
        "measured compute and codec times (and every time built on them) vary from run to run")
    assert load_warning("thinwire compare", load=1.0, ncores=2) is None


def test_a_probe_drops_the_diloco_familys_end_of_run_sync_unless_a_rounds_average_runs_behind_the_next():
    from thinwire.lab.cost import _steady

    assert "final_sync=false" in _steady("diloco:period=10")
    assert "final_sync=false" in _steady("sparseloco:period=10")
    assert "final_sync=true" in _steady("diloco:period=10,sync=eager")  # it refuses final_sync=false
    assert "final_sync=true" in _steady("sparseloco:period=10,sync=delayed")


def test_an_average_behind_a_whole_round_costs_the_step_only_what_outlasts_its_window():
    """sync=eager's figures (every element early, the window the round's compute): a step is
    compute + max(0, G − window), the larger of compute and communication when they are equal."""
    link = Link.parse("10mbit,1ms")
    c = StepCost("diloco", compute_s=0.5, codec_s=0.0, bytes=1e5, messages=0.0, window_s=0.5, early_share=1.0)
    g = 1e5 / link.bandwidth_Bps  # 0.08 s: hidden whole
    assert c.seconds(link) == pytest.approx(0.5, abs=1e-12)
    slow = dataclasses.replace(c, bytes=1e6)  # 0.8 s a step: 0.3 s of it outlasts the window
    assert slow.seconds(link) == pytest.approx(1e6 / link.bandwidth_Bps, abs=1e-12)
    assert g < 0.5


def test_the_span_ends_before_the_runs_end_of_run_traffic_where_the_record_gives_it():
    # the last record is written after finish(); the averages it lands or syncs there belong to
    # no step of the span, so its counters before finish() end the span
    from thinwire.lab.cost import from_rows

    first = {"step": 6, "compute_seconds": 1.0, "codec_seconds": 0.0, "comm_seconds": 0.0, "bytes_sent": 600.0,
             "messages": 6}
    last = dict(first, step=12, compute_seconds=2.2, bytes_sent=1500.0, messages=15)
    assert from_rows("m", first, last).bytes == pytest.approx(150.0)
    last.update(bytes_sent_before_finish=1200.0, messages_before_finish=12)
    cost = from_rows("m", first, last)
    assert cost.bytes == pytest.approx(100.0) and cost.messages == pytest.approx(1.0)

"""thinwire cost's model on hand-computed cases: step time, crossover bandwidth, verdicts."""

import pytest

from thinwire.comm.link import Link
from thinwire.run.cost import StepCost, crossings_Bps, crossover_Bps, from_summary, verdict

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
    c = from_summary("m", {"steps": 20, "compute_seconds": 2.0, "codec_seconds": 0.5,
                           "comm_seconds": 0.4, "bytes_sent_per_worker": 4e6, "messages_per_worker": 120})
    assert (c.compute_s, c.codec_s, c.bytes, c.messages, c.wait_s) == (0.1, 0.025, 2e5, 6, 0.02)


def _probe_launch(fail: str = ""):
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
        Path(cfg.out, "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {"steps": cfg.steps, "compute_seconds": 1.4, "codec_seconds": 0.6, "bytes_sent_per_worker": 80.0,
                "messages_per_worker": 16}

    return launch


def test_probe_times_only_the_steps_after_its_warm_up():
    from thinwire.run.config import TrainConfig
    from thinwire.run.cost import probe

    costs, failed = probe(TrainConfig(task="synthetic", steps=4), ["bf16"], 4, launch=_probe_launch(),
                          say=lambda line: None)
    c = costs["bf16"]
    assert not failed
    assert (c.compute_s, c.codec_s, c.bytes, c.messages, c.wait_s) == pytest.approx((0.1, 0.025, 10.0, 2.0, 0.05),
                                                                                     rel=1e-12)


def test_a_failed_probe_is_reported_and_the_others_run():
    from thinwire.run.config import TrainConfig
    from thinwire.run.cost import probe

    costs, failed = probe(TrainConfig(task="synthetic", steps=4), ["bf16", "topk:ratio=0.1", "identity"], 4,
                          launch=_probe_launch(fail="topk"), say=lambda line: None)
    assert list(costs) == ["bf16", "identity"] and costs["bf16"].bytes == 10.0
    assert list(failed) == ["topk:ratio=0.1"] and "FloatingPointError" in failed["topk:ratio=0.1"]

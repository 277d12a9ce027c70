"""thinwire cost's one compute figure, the verdict over its range, the user's own compute
(--compute-ms, --compute-from), the probe's budget in seconds, and the rows printed as each
probe ends and at an interrupt: hand-computed references, probes stood in for (no ranks)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from clicheck import refused
from thinwire.comm.link import Link
from thinwire.lab import cost
from thinwire.lab.compute import SharedCompute
from thinwire.lab.cost import (
    Pace,
    StepCost,
    at_compute,
    compute_from_run,
    probe_plan,
    ranged_verdict,
    shared_compute,
    verdict,
    with_compute,
)
from thinwire.run.config import TrainConfig
from tiny import fake_summary

MS = 1e-3


def _c(method: str, compute_ms: float, **kw) -> StepCost:
    return StepCost(method, compute_ms * MS, kw.pop("codec_s", 0.001), kw.pop("bytes", 1e6), kw.pop("messages", 6),
                    **kw)


# -- the shared figure --------------------------------------------------------------------------
def test_the_shared_figure_is_the_median_of_every_probe_s_block_and_its_quartiles():
    # blocks 46, 50 (bf16's two repeats), 48, 52 (identity's), 47 (topk's): median 48, quartiles
    # (inclusive) 47 and 50; DeMo computes its own step: its 200 ms is no block
    runs = {"bf16": [_c("bf16", 46), _c("bf16", 50)], "identity": [_c("identity", 48), _c("identity", 52)],
            "topk:ratio=0.01": [_c("topk:ratio=0.01", 47)], "demo": [_c("demo", 200)]}
    shared = shared_compute(runs)
    assert shared is not None
    assert (shared.per_step, shared.lo, shared.hi) == pytest.approx((0.048, 0.047, 0.050), rel=1e-12)
    assert shared.blocks == 5 and shared.methods == ("bf16", "identity", "topk:ratio=0.01")
    assert shared.text() == "48.0 ms a step [47.0–50.0] over 5 blocks"
    # fewer than 4 blocks: the smallest and the largest are the range
    few = shared_compute({"bf16": [_c("bf16", 10)], "identity": [_c("identity", 14)], "ab": [_c("ab", 3)]})
    assert few is not None and (few.per_step, few.lo, few.hi, few.blocks) == pytest.approx((0.012, 0.010, 0.014, 2))
    assert shared_compute({"demo": [_c("demo", 9)]}) is None  # no method shares it


def test_a_prediction_puts_the_shared_figure_in_place_of_the_method_s_own_compute():
    c = _c("topk", 50, codec_s=0.004, wait_s=0.002, window_s=0.010, early_share=0.5, leads=((0.010, 0.5),))
    shared = SharedCompute(0.040, 0.038, 0.043, 6)
    link = Link.parse("1gbit,50us")  # G = 4 ms + max(2 ms, 6 x 50 us + 1 MB / 125 MB/s = 8.3 ms) = 12.3 ms
    at = at_compute(c, True, shared)
    # the window (10 ms of a 50 ms step) scales to 8 ms of a 40 ms one: it hides min(8 ms, half of 12.3 ms)
    assert (at.compute_s, at.window_s, *at.leads[0]) == pytest.approx((0.040, 0.008, 0.008, 0.5), rel=1e-12)
    assert (at.codec_s, at.wait_s, at.bytes, at.messages) == (c.codec_s, c.wait_s, c.bytes, c.messages)
    assert at.seconds(link) == pytest.approx(0.040 + 0.0123 - 0.00615, rel=1e-12)
    # --compute-ms 10: 10 ms in its place, the window 2 ms, all of which the early half's 6.15 ms fills
    given = at_compute(c, True, shared, given_s=0.010)
    assert given.seconds(link) == pytest.approx(0.010 + 0.0123 - 0.002, rel=1e-12)
    # a method with its own compute keeps it, scaled by the given compute over the shared figure
    own = _c("demo", 80, codec_s=0.004)
    assert at_compute(own, False, shared) == own
    assert at_compute(own, False, shared, given_s=0.010).compute_s == pytest.approx(0.080 * 0.010 / 0.040)
    assert with_compute(_c("x", 0), 0.005).compute_s == 0.005  # no compute measured: nothing to scale


# -- the verdict over the compute range ----------------------------------------------------------
# bf16 shares the compute (measured 10 ms), 1 ms codec, 1 MB; a method with its own compute of
# 11.5 ms, no codec, 0.1 MB. At bf16's compute x, the method is faster where 0.9e6 / β > 10.5 ms - x:
# at 10 ms below 1.8e9 B/s (14.4 Gbit/s), at 9 ms below 6e8 B/s (4.8 Gbit/s), at 12 ms always
REF = StepCost("bf16", 0.010, 0.001, 1_000_000, 6)
OWN = StepCost("demo", 0.0115, 0.0, 100_000, 6)


def test_a_verdict_that_changes_within_the_compute_range_is_a_tie():
    shared = SharedCompute(0.010, 0.009, 0.012, 8)
    assert verdict(OWN, with_compute(REF, 0.010), 0.0) == "below 14.4 Gbit/s"
    assert ranged_verdict(OWN, REF, 0.0, shared, m_shares=False) == (
        "tie with bf16 within the measured compute range (at 9.0 ms: below 4.8 Gbit/s; at 12.0 ms: always)")


def test_a_verdict_that_holds_over_the_compute_range_gives_its_bound_and_the_bound_s_range():
    # at 9.5 ms below 9e8 B/s (7.2 Gbit/s), at 10.2 ms below 3e9 B/s (24 Gbit/s): the same words
    shared = SharedCompute(0.010, 0.0095, 0.0102, 8)
    assert ranged_verdict(OWN, REF, 0.0, shared, m_shares=False) == (
        "below 14.4 Gbit/s (7.2 Gbit/s–24 Gbit/s within the compute range)")
    # two methods that share the compute (no overlap window): it cancels, the bound is exact
    small = StepCost("topk", 0.013, 0.005, 100_000, 6)  # its own measured 13 ms is replaced too
    wide = SharedCompute(0.010, 0.005, 0.030, 8)
    assert ranged_verdict(small, REF, 50e-6, wide) == "below 1.8 Gbit/s"
    assert ranged_verdict(REF, REF, 50e-6, wide) == "(the reference)"
    assert ranged_verdict(OWN, REF, 0.0, None) == verdict(OWN, REF, 0.0)  # no shared figure: as measured


# -- the probe's budget -------------------------------------------------------------------------
@pytest.mark.parametrize("spec, steps, budget, want", [
    ("bf16", 20, None, (20, 20)), ("bf16", 20, 40, (20, 20)), ("bf16", 20, 30, (10, 20)), ("bf16", 20, 10, (1, 9)),
    ("bf16", 20, 2, (1, 1)), ("bf16", 20, 1, (1, 1)), ("localsgd:period=4", 20, 10, (2, 8)),
    ("localsgd:period=8", 20, 30, (6, 24)), ("diloco:period=50", 20, 10, (1, 50)), ("diloco:period=6", 4, 2, (1, 6)),
])
def test_a_budget_leaves_one_warm_up_step_and_times_what_fits_in_whole_periods(spec, steps, budget, want):
    assert probe_plan(spec, steps, budget) == want


def test_the_pace_turns_seconds_into_steps_and_takes_each_probe_s_measured_step():
    assert Pace(20.0, 9.1).budget_steps() == 2 and Pace(20.0, 0.5).budget_steps() == 40
    assert Pace(20.0, 30.0).budget_steps() == 2  # never under the 1 + 1 a figure needs
    assert Pace(None, 1.0).budget_steps() is None and Pace(math.inf, 1.0).budget_steps() is None
    assert Pace(20.0, None).budget_steps() is None
    pace = Pace(20.0, 1.0)
    pace.measured([{"step": 1, "wall_seconds": 3.0}, {"step": 4, "wall_seconds": 10.0}])
    assert pace.step_s == 2.5  # the probe's training seconds per step, its warm-up included
    pace.measured([{"step": 4}])  # a record without the clock changes nothing
    assert pace.step_s == 2.5


def test_the_first_pace_comes_from_one_step_timed_here(monkeypatch):
    import torch

    base = TrainConfig(task="synthetic", workers=2, task_options={"dim": 8, "hidden": 8, "classes": 2},
                       batch_size=8).resolve()
    threads = torch.get_num_threads()
    step = cost.estimate_step_seconds(base)
    assert 0 < step < 5 and torch.get_num_threads() == threads  # the process's own threads put back
    assert Pace.first(base, math.inf) == Pace(None, None) and Pace.first(base, None) == Pace(None, None)

    def fails(cfg):
        raise RuntimeError("a loss that fails")

    monkeypatch.setattr(cost, "estimate_step_seconds", fails)
    assert Pace.first(base, 20.0) == Pace(20.0, None)  # no estimate: the first probe runs whole, and fails itself


def _launch(seen: list, wall_per_step: float = 2.5, stop_at: int | None = None, signal: str = "SIGINT",
            interrupt_at: int | None = None):
    """A stand-in for launch: records at every evaluation step (cumulative counters: 10 ms of
    compute, 1 ms codec, 2 ms wait, 100 kB and 4 messages per step, the warm-up's first step
    10 times dearer) and ``wall_per_step`` training seconds a step."""
    def launch(cfg, show_progress=False):
        seen.append(cfg)
        if interrupt_at is not None and len(seen) == interrupt_at:
            raise KeyboardInterrupt
        if stop_at is not None and len(seen) == stop_at:
            return fake_summary(stopped_at=1, status="stopped", signal=signal)

        def record(step: int) -> dict:
            return {"step": step, "compute_seconds": 0.01 * (step + 9), "codec_seconds": 0.001 * step,
                    "comm_seconds": 0.002 * step, "bytes_sent": 1e5 * step, "messages": 4 * step,
                    "wall_seconds": wall_per_step * step}

        rows = [record(s) for s in range(cfg.eval_every, cfg.steps + 1, cfg.eval_every)]
        with open(f"{cfg.out}/metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return fake_summary(steps=cfg.steps)

    return launch


def test_the_first_probe_is_sized_from_the_estimate_and_the_next_from_the_step_it_measured():
    seen: list = []
    lines: list[str] = []
    costs, failed = cost.probe(TrainConfig(task="synthetic", workers=2), ["bf16", "identity"], 20,
                               pace=Pace(10.0, 1.0), launch=_launch(seen), say=lines.append)
    assert not failed
    # 10 s at 1 s a step: 1 + 9 steps (a record every step); then 2.5 s measured: 4 steps, 1 + 3
    assert [(cfg.steps, cfg.eval_every) for cfg in seen] == [(10, 1), (4, 1)]
    assert lines == ["[1/2] probing bf16: 1 + 9 steps on 2 workers (10 s of steps at about 1 s a step)",
                     "[2/2] probing identity: 1 + 3 steps on 2 workers (10 s of steps at about 2.5 s a step)"]
    c = costs["bf16"]  # between the records after step 1 and step 10: the first step's cost left out
    assert (c.compute_s, c.codec_s, c.wait_s, c.bytes, c.messages, c.probe_steps) == pytest.approx(
        (0.01, 0.001, 0.002, 1e5, 4, 9), rel=1e-12)
    # the probes' ranks skip the evaluations
    assert all(cfg.evaluate is False for cfg in seen)


def test_without_a_budget_the_probe_runs_its_steps_whole():
    seen: list = []
    cost.probe(TrainConfig(task="synthetic", workers=2), ["bf16"], 6, launch=_launch(seen), say=lambda line: None)
    assert [(cfg.steps, cfg.eval_every) for cfg in seen] == [(12, 6)]


@pytest.mark.spawns
def test_a_run_without_evaluation_writes_its_records_without_test_figures(tmp_path):
    from thinwire.run.launch import launch

    cfg = TrainConfig(task="synthetic", workers=2, steps=4, eval_every=2, evaluate=False, out=str(tmp_path / "r"),
                      task_options={"dim": 8, "hidden": 8, "classes": 2, "samples": 64, "test_samples": 16})
    summary = launch(cfg.resolve(), show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4] and all("test_loss" not in r for r in rows)
    assert all(r["compute_seconds"] > 0 for r in rows) and summary.final_loss is None


# -- the user's own compute ---------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--compute-ms", "0"], "--compute-ms must be a finite number of milliseconds > 0, got 0.0"),
    (["--compute-ms", "-1"], "--compute-ms must be a finite number of milliseconds > 0, got -1.0"),
    (["--compute-ms", "nan"], "--compute-ms must be a finite number of milliseconds > 0, got nan"),
    (["--compute-ms", "inf"], "--compute-ms must be a finite number of milliseconds > 0, got inf"),
    (["--compute-ms", "x"], "argument --compute-ms: invalid float value: 'x'"),
    (["--compute-ms", "5", "--compute-from", "."], "give one of --compute-ms and --compute-from"),
    (["--probe-seconds", "0"], "--probe-seconds must be a number of seconds > 0 (inf: no bound), got 0.0"),
    (["--probe-seconds", "nan"], "--probe-seconds must be a number of seconds > 0 (inf: no bound), got nan"),
])
def test_a_bad_compute_or_budget_is_one_line_and_exit_2_before_any_rank_starts(args, needle, capsys, monkeypatch):
    def launch(*a, **k):
        raise AssertionError("a rank started")

    monkeypatch.setattr("thinwire.run.launch.launch", launch)
    refused(capsys, ["cost", "--task", "synthetic", "--methods", "identity", *args], needle)


def _summary(**changes) -> dict:
    s = {"task": "synthetic", "method": "identity", "workers": 2, "steps": 400, "steps_run": 100,
         "compute_seconds": 6.0, "config": {"task": "synthetic", "task_options": {}, "batch_size": 64}}
    s.update(changes)
    return s


def test_compute_from_a_run_is_its_compute_per_step(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps(_summary()))
    # a resumed run's compute_seconds holds all of its 400 steps, though this part ran 100
    seconds, summary = compute_from_run(str(tmp_path))
    assert seconds == 6.0 / 400 and summary.method == "identity" and summary.steps_run == 100
    assert compute_from_run(str(tmp_path / "summary.json"))[0] == 6.0 / 400


@pytest.mark.parametrize("content, needle", [
    (None, "no summary.json there (thinwire train writes one at the end of a run)"),
    ("{not json", "not a readable summary: Expecting property name"),
    ("[1, 2]", "not a run summary (a JSON object)"),
    (json.dumps(_summary(compute_seconds=0.0)), "no compute_seconds > 0 and steps >= 1 in it (got 0.0 and 400)"),
    (json.dumps(_summary(steps=None)), "no compute_seconds > 0 and steps >= 1 in it (got 6.0 and None)"),
    (json.dumps({"compute_seconds": 6.0, "steps": 400}), "not a run summary: no task, method, workers"),
    (json.dumps(_summary(schema=99)), "summary schema 99 is newer than this thinwire reads (1): upgrade thinwire"),
    (json.dumps(_summary(task="mnist1d")), "that run's task is 'mnist1d', this probe's 'synthetic': its compute is "
                                           "another step's"),
    (json.dumps(_summary(config={"task": "synthetic", "task_options": {}, "batch_size": 8})),
     "that run's batch size is 8, this probe's 64"),
    (json.dumps(_summary(method="demo:chunk=8")), "its method demo computes a step of its own, not the task's plain"),
])
def test_a_bad_compute_from_is_one_line_and_exit_2(content, needle, tmp_path, capsys, monkeypatch):
    def launch(*a, **k):
        raise AssertionError("a rank started")

    monkeypatch.setattr("thinwire.run.launch.launch", launch)
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "summary.json").write_text(content)
    refused(capsys, ["cost", "--task", "synthetic", "--methods", "identity", "--compute-from", str(run)], needle,
            "--compute-from")


# -- the command: rows as each probe ends, the user's compute, an interrupt ----------------------
def _cells(out: str, name: str) -> list[str]:
    row = next(line for line in out.splitlines() if line.startswith("│") and line.strip("│ ").startswith(name + " "))
    return [c.strip() for c in row.strip("│").split("│")]


def _stand_in(monkeypatch, **kw) -> list:
    seen: list = []
    monkeypatch.setattr("thinwire.run.launch.launch", _launch(seen, **kw))
    monkeypatch.setattr(cost, "estimate_step_seconds", lambda cfg: 1e-3)  # 20 s of steps: every step fits
    return seen


ARGS = ["cost", "--task", "synthetic", "--workers", "2", "--probe-steps", "3", "--methods", "identity,demo",
        "--link", "1gbit,50us"]


def test_each_row_is_printed_as_its_probe_ends_then_the_table(monkeypatch, capsys):
    from thinwire.cli import main

    _stand_in(monkeypatch)
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    order = [next(i for i, line in enumerate(lines) if line.startswith(text)) for text in (
        "[1/3] probing bf16: 3 + 3 steps", "  bf16: MB / step 0.100", "[2/3] probing identity", "  identity: MB",
        "[3/3] probing demo", "  demo: MB", "compute: ", "│ bf16 ")]
    assert order == sorted(order)
    # every probe measured 10 ms of compute a step: three blocks, the two codecs' and bf16's; DeMo its own
    assert "compute: 10.0 ms a step [10.0–10.0] over 2 blocks, shared by bf16, identity; demo: their own\n" in out
    # ms @ 1gbit,50us = 10 ms + 1 ms codec + max(2 ms wait, 4 x 50 us + 0.1 MB / 125 MB/s = 1 ms)
    assert _cells(out, "identity")[4:9] == ["10.0", "1.0", "2.0", "0.0", "13.0"]
    assert lines[lines.index(next(line for line in lines if line.startswith("  identity:")))] == (
        "  identity: MB / step 0.100, peak MB -, messages 4, compute ms 10.0, codec ms 1.0, wait ms 2.0, window ms "
        "0.0, ms @ 1gbit,50us 13.0, beats bf16 never")


def test_compute_ms_replaces_the_measured_compute_in_every_prediction(monkeypatch, capsys):
    from thinwire.cli import main

    _stand_in(monkeypatch)
    assert main([*ARGS, "--compute-ms", "2.5"]) == 0
    out = capsys.readouterr().out
    assert ("compute: 2.5 ms a step (--compute-ms) in every prediction; measured here: 10.0 ms a step [10.0–10.0] "
            "over 2 blocks, shared by bf16, identity; demo: their own, scaled by 2.5 / 10.0\n") in out
    assert _cells(out, "bf16")[4:9] == ["2.5", "1.0", "2.0", "0.0", "5.5"]  # 2.5 + 1 + 2 ms
    assert _cells(out, "demo")[4] == "2.5"  # its own 10 ms, times 2.5 / 10


def test_compute_from_a_run_replaces_it_too(monkeypatch, capsys, tmp_path):
    from thinwire.cli import main

    _stand_in(monkeypatch)
    (tmp_path / "summary.json").write_text(json.dumps(_summary(compute_seconds=2.0, steps=400)))  # 5 ms a step
    assert main([*ARGS, "--compute-from", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"compute: 5.0 ms a step (--compute-from {tmp_path}) in every prediction" in out
    assert _cells(out, "identity")[8] == "8.0"  # 5 + 1 + 2 ms


@pytest.mark.parametrize("kw, code, signal", [
    ({"interrupt_at": 3}, 130, "SIGINT"),  # Ctrl-C a second time: the launch ends at once
    ({"stop_at": 3, "signal": "SIGTERM"}, 143, "SIGTERM"),  # the probe in flight stopped at its step
])
def test_an_interrupt_prints_the_methods_probed_so_far(monkeypatch, capsys, kw, code, signal):
    from thinwire.cli import main

    seen = _stand_in(monkeypatch, **kw)
    assert main(ARGS) == code
    captured = capsys.readouterr()
    assert len(seen) == 3  # demo's probe was the one stopped
    out = captured.out
    assert f"thinwire cost: stopped by {signal}; the methods probed so far:\n" in out
    assert "compute: 10.0 ms a step [10.0–10.0] over 2 blocks, shared by bf16, identity\n" in out
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert rows == ["bf16", "identity"] and "interrupted)" in out
    assert captured.err.strip().splitlines()[-1] == f"thinwire: stopped by {signal}"


def test_an_interrupt_before_the_reference_was_probed_says_so(monkeypatch, capsys):
    from thinwire.cli import main

    _stand_in(monkeypatch, interrupt_at=1)
    assert main(ARGS) == 130
    out = capsys.readouterr().out
    assert "thinwire cost: stopped by SIGINT before the reference (bf16) was probed\n" in out and "│" not in out


def test_a_failed_probe_is_told_when_it_fails_and_the_others_go_on(monkeypatch, capsys):
    from thinwire.cli import main

    seen: list = []
    ok = _launch(seen)

    def launch(cfg, show_progress=False):
        if cfg.method.startswith("identity"):
            seen.append(cfg)
            raise RuntimeError("rank 1 failed after step 2: boom")
        return ok(cfg, show_progress)

    monkeypatch.setattr("thinwire.run.launch.launch", launch)
    monkeypatch.setattr(cost, "estimate_step_seconds", lambda cfg: 1e-3)
    assert main(ARGS) == 0
    captured = capsys.readouterr()
    assert captured.err.count("the probe of identity failed: RuntimeError: rank 1 failed after step 2: boom") == 1
    rows = [line.split("│")[1].strip() for line in captured.out.splitlines() if line.startswith("│")]
    assert rows == ["bf16", "demo"]


def test_the_median_of_repeats_at_the_shared_figure():
    # with_compute on each repeat, then the median: the window scales with each repeat's own compute
    a = _c("m", 10, window_s=0.002, early_share=0.5)
    b = dataclasses.replace(a, compute_s=0.020, window_s=0.002)
    shared = SharedCompute(0.015, 0.010, 0.020, 2)
    m = cost.median_cost([at_compute(c, True, shared) for c in (a, b)])
    assert (m.compute_s, m.window_s) == pytest.approx((0.015, (0.003 + 0.0015) / 2), rel=1e-12)


# -- the compute (and codec times) of a GPU results file: benchmarks/bench_gpu.py's JSON ----------
GPU_OPTIONS = {"dim": 8, "hidden": 8, "classes": 2}
GPU_ARGS = ["cost", "--task", "synthetic", "--workers", "2", "--probe-steps", "3", "--methods", "identity,demo",
            "--link", "1gbit,50us", "--batch-size", "16", *[f"--option={k}={v}" for k, v in GPU_OPTIONS.items()]]


def _synthetic_parameters(**options) -> int:
    from thinwire.tasks import get as get_task

    return sum(p.numel() for p in get_task("synthetic")(**{**GPU_OPTIONS, **options}).build_model().parameters())


def _gpu_results(model_changes: dict | None = None, **changes) -> dict:
    """A hand-written bench_gpu result: the probe's synthetic model at 4 ms a step (its identity at
    0.5 ms and bf16 at 0.25 ms, one rank of 2 workers), and a model of no thinwire task."""
    mlp = {"label": "synthetic MLP", "task": "synthetic", "task_options": dict(GPU_OPTIONS), "batch_size": 16,
           "parameters": _synthetic_parameters(), "gradient_elements": 0, "compute": {"ms": 4.0, "steps": 25},
           "codecs": {"identity": {"spec": "identity", "kind": "gradient", "ms": 0.5},
                      "bf16": {"spec": "bf16", "kind": "gradient", "ms": 0.25},
                      "demo": {"spec": "demo (dct:chunk=64)", "kind": "slow-link", "ms": 9.0}}}
    mlp.update(model_changes or {})
    data = {"kind": "thinwire bench_gpu", "schema": 1, "tiny": False, "workers": 2,
            "machine": {"device": "cuda", "device_name": "NVIDIA H200"},
            "models": {"mlp": mlp, "resnet18": {"task": None, "batch_size": 256, "compute": {"ms": 20.0}}}}
    data.update(changes)
    return data


def _write(tmp_path, data, name: str = "gpu.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_gpu_results_file_gives_its_model_s_compute_and_codec_times(monkeypatch, capsys, tmp_path):
    from thinwire.cli import main

    _stand_in(monkeypatch)
    path = _write(tmp_path, _gpu_results())
    (tmp_path / "gpu.md").write_text("# the markdown beside it\n")
    for given in (path, tmp_path / "gpu.md"):  # the JSON, or the markdown file whose sibling it is
        assert main([*GPU_ARGS, "--compute-from", str(given)]) == 0
        out = capsys.readouterr().out
        assert (f"compute: 4.0 ms a step (--compute-from {given}: mlp on NVIDIA H200) in every prediction; measured "
                "here: 10.0 ms a step") in out
        assert "; codec ms of bf16, identity: the file's (2 workers), the others' this machine's\n" in out
        # the stand-in's probe: 2 ms wait, 4 messages and 0.1 MB a step, 1 ms codec; at 1gbit,50us the link
        # takes 4 x 50 us + 0.1 MB / 125 MB/s = 1 ms < the wait: identity 4 + 0.5 + 2, bf16 4 + 0.25 + 2
        assert _cells(out, "identity")[4:9] == ["4.0", "0.5", "2.0", "0.0", "6.5"]
        assert _cells(out, "bf16")[4:9] == ["4.0", "0.2", "2.0", "0.0", "6.2"]
        # DeMo computes its own step (scaled, 10 ms x 4 / 10) and keeps this machine's codec time
        assert _cells(out, "demo")[4:9] == ["4.0", "1.0", "2.0", "0.0", "7.0"]


def test_a_gpu_results_file_of_another_worker_count_gives_its_compute_alone(monkeypatch, capsys, tmp_path):
    from thinwire.cli import main

    _stand_in(monkeypatch)
    path = _write(tmp_path, _gpu_results(workers=8))
    assert main([*GPU_ARGS, "--compute-from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "; codec ms: this machine's (the file's are one rank's of 8 workers, this probe has 2)\n" in out
    assert _cells(out, "identity")[4:9] == ["4.0", "1.0", "2.0", "0.0", "7.0"]


def test_the_probe_s_options_are_matched_resolved_and_only_those_the_file_records(tmp_path):
    from thinwire.lab.gpu_results import model_for

    data = _gpu_results({"task_options": {"hidden": 8}})  # dim and classes: not recorded, free
    got = model_for(data, "gpu.json", task="synthetic", options={"dim": "8", "hidden": "8", "classes": 2},
                    batch_size=16, parameters=_synthetic_parameters())
    assert (got.name, got.compute_s, got.workers, got.device) == ("mlp", 0.004, 2, "NVIDIA H200")
    # the codec times by resolved spec, as thinwire cost resolves a method; DeMo's slow-link row is not one
    assert got.codec_s == {"identity:ef=false,min_numel=0": 0.0005, "bf16:ef=false,min_numel=0": 0.00025}
    # the text task's preset spelled out or left to the preset: the same resolved options
    text = {"task": "text", "task_options": {"model": "gpt-small", "layers": 8, "d_model": 512, "heads": 8,
                                             "context": 128}, "batch_size": 8, "parameters": 1,
            "compute": {"ms": 60.0}}
    data = _gpu_results(models={"transformer": text})
    assert model_for(data, "gpu.json", task="text", options={"model": "gpt-small"}, batch_size=8,
                     parameters=1).compute_s == pytest.approx(0.06)


@pytest.mark.parametrize("content, name, needle", [
    ("# no json beside it\n", "gpu.md", "gpu.md: no gpu.json beside it (bench_gpu.py writes the two together"),
    (json.dumps({"kind": "something else", "models": {}}), "gpu.json",
     "not a bench_gpu result (its kind is 'something else', not 'thinwire bench_gpu'); give a run's folder or "
     "summary.json, or the JSON benchmarks/bench_gpu.py writes"),
    (json.dumps({"models": {}}), "gpu.json",
     "neither a run summary (no compute_seconds) nor a bench_gpu result (no kind 'thinwire bench_gpu')"),
    (json.dumps(_gpu_results(schema=99)), "gpu.json",
     "bench_gpu schema 99 is newer than this thinwire reads (1): upgrade thinwire"),
    (json.dumps(_gpu_results(models=[])), "gpu.json", "a bench_gpu result without models"),
    (json.dumps(_gpu_results({"batch_size": 32})), "gpu.json",
     "it holds no model of this probe (task synthetic (dim=8, hidden=8, classes=2), batch size 16, "),
    (json.dumps(_gpu_results({"task_options": {**GPU_OPTIONS, "hidden": 16}})), "gpu.json",
     "; it holds: mlp (task synthetic (dim=8, hidden=16, classes=2), batch size 16, "),
    (json.dumps(_gpu_results({"parameters": 1})), "gpu.json", "resnet18 (no thinwire task)"),
    (json.dumps(_gpu_results({"compute": {}})), "gpu.json", "its mlp has no compute step measured (> 0 ms)"),
])
def test_a_bad_gpu_results_file_is_one_line_and_exit_2(content, name, needle, tmp_path, capsys, monkeypatch):
    def launch(*a, **k):
        raise AssertionError("a rank started")

    monkeypatch.setattr("thinwire.run.launch.launch", launch)
    path = _write(tmp_path, content, name)
    refused(capsys, [*GPU_ARGS, "--compute-from", str(path)], needle, "--compute-from")

"""thinwire compare's logic with a stand-in launcher: method lists, validation before any
run, a failing method that does not stop the race, the table, the CSV and the plots."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from thinwire.lab import compare
from thinwire.run import outdir
from thinwire.run.config import TrainConfig
from thinwire.run.launch import RunFailed
from thinwire.run.summary import Summary


def test_method_lists_split_on_commas_and_keep_knobs_together():
    assert compare.split_methods(["identity,topk:ratio=0.01,ef=false,bf16"]) == [
        "identity", "topk:ratio=0.01,ef=false", "bf16"]
    assert compare.split_methods(["dasgd:period=4,codec=randomk:ratio=0.1;seed=1", "torch-ddp"]) == [
        "dasgd:period=4,codec=randomk:ratio=0.1;seed=1", "torch-ddp"]
    assert compare.split_methods(["ab:exclude=first;fc1,group_size=2,identity"]) == [
        "ab:exclude=first;fc1,group_size=2", "identity"]


BASE = TrainConfig(task="synthetic", workers=2, steps=4, eval_every=2)


@pytest.mark.parametrize("methods, message", [
    (["identity,nosuch"], "unknown method 'nosuch'"),
    (["identity,bf16,identity"], "appears twice"),
    (["topk:ratio=0.01,topk:ratio=0.01"], "appears twice"),
    (["topk:ratio=2"], "method 'topk:ratio=2': ratio"),
    (["ab:exclude=first;fc9"], "cannot run on task synthetic"),
    (["dpsgd:topology=torus"], "a torus needs workers = rows x cols"),
])
def test_bad_method_lists_are_refused_before_any_run(methods, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        compare.prepare(BASE, methods, str(tmp_path / "out"))


def test_unwritable_out_and_bad_target_are_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        compare.prepare(BASE, ["identity"], str(blocker / "sub"))
    with pytest.raises(ValueError, match=r"target must be in \(0, 1\]"):
        compare.prepare(BASE, ["identity"], str(tmp_path / "out"), target=1.5)
    race = compare.prepare(BASE, ["identity"], str(tmp_path / "out"))
    (race.out / "results.csv").write_text("earlier\n")
    with pytest.raises(ValueError, match="already holds a comparison"):
        compare.prepare(BASE, ["identity"], str(tmp_path / "out"))
    with pytest.raises(ValueError, match="results.csv was not written by thinwire"):
        compare.prepare(BASE, ["identity"], str(tmp_path / "out"), overwrite=True)
    assert (race.out / "results.csv").read_text() == "earlier\n"  # nothing a user saved is lost


def _fake_launch(fail: str):
    """Writes what a run writes: metrics at steps 2 and 4, and the summary."""
    def launch(cfg, show_progress=True):
        if cfg.method.startswith(fail):
            raise RunFailed("rank 1 failed after step 3: FloatingPointError: training loss is nan")
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        bytes_per_step = 1000.0 if cfg.method.startswith("identity") else 250.0
        acc = {"identity": (0.5, 0.8), "bf16": (0.6, 0.79)}.get(cfg.method.split(":")[0], (0.4, 0.7))
        rows = []
        for step, a in zip((2, 4), acc):
            row = {"step": step, "test_accuracy": a, "bytes_sent": bytes_per_step * step}
            for link in cfg.links:
                row[f"modeled_seconds@{link}"] = step * (1.0 if "1gbit" in link else 3.0) * bytes_per_step / 1000
            rows.append(row)
        outdir.claim(out, "metrics.jsonl", "summary.json")  # a real run records its files first
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {"task": cfg.task, "method": cfg.method, "workers": cfg.workers, "steps": cfg.steps,
                   "final_accuracy": acc[-1], "final_loss": 0.5, "final_bpc": None,
                   "bytes_sent_per_worker": bytes_per_step * 4, "fp32_bytes_per_worker": 4000.0,
                   "compression_ratio": 4000.0 / (bytes_per_step * 4), "wall_seconds": 2.0, "compute_seconds": 1.0,
                   "codec_seconds": 0.25, "comm_seconds": 0.5,
                   "modeled_seconds_by_link": {link: rows[-1][f"modeled_seconds@{link}"] for link in cfg.links}}
        (out / "summary.json").write_text(json.dumps(summary))
        return Summary.from_json(summary)
    return launch


def test_a_failing_method_does_not_stop_the_race(tmp_path):
    race = compare.prepare(BASE, ["identity,topk:ratio=0.1,bf16"], str(tmp_path / "out"))
    lines: list[str] = []
    results = compare.run(race, launch=_fake_launch("topk"), show_progress=False, say=lines.append)
    assert [r["status"] for r in results] == ["ok", "failed", "ok"]
    assert "FloatingPointError" in results[1]["error"] and "[2/3] topk: FAILED" in lines[3]
    done = compare.finish(race, results, "thinwire compare ...")
    # target: 95% of the best final accuracy (0.8) = 0.76, first reached at step 4 by both
    assert done["target"] == pytest.approx(0.76)
    assert done["best"] == {"1gbit,50us": "bf16", "100mbit,1ms": "bf16"}  # fewer bytes, same step
    report = Path(done["report"]).read_text()
    assert "| topk | failed: RunFailed: rank 1 failed after step 3" in report and "**bf16**" in report
    assert sorted(os.path.basename(p) for p in done["plots"]) == [
        "accuracy_vs_bytes.png", "accuracy_vs_step.png", "accuracy_vs_time_100mbit_1ms.png",
        "accuracy_vs_time_1gbit_50us.png", "time_breakdown_100mbit_1ms.png", "time_breakdown_1gbit_50us.png"]
    for p in done["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(done["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["identity", "topk", "bf16"]
    assert rows[1]["status"] == "failed" and rows[1]["final_accuracy"] == ""
    assert float(rows[2]["bytes_sent_per_worker"]) == 1000.0 and rows[0]["seed"] == rows[2]["seed"] == "0"
    # interpolated between the evaluations at steps 2 and 4: identity climbs 0.5 -> 0.8, 13/15 of the way
    # to 0.76, bf16 0.6 -> 0.79, 16/19 of the way; at 100 Mbit/s identity's 6 -> 12 s, bf16's 1.5 -> 3 s
    assert float(rows[2]["step_to_target"]) == pytest.approx(2 + 2 * 16 / 19, rel=1e-12)
    assert float(rows[0]["modeled_seconds_to_target@100mbit,1ms"]) == pytest.approx(6 + 6 * 13 / 15, rel=1e-12)
    assert float(rows[2]["modeled_seconds_to_target@100mbit,1ms"]) == pytest.approx(1.5 + 1.5 * 16 / 19, rel=1e-12)


def test_runs_are_named_by_the_specs_as_typed(tmp_path):
    """Two variants of one method keep the strings the user gave; a method alone in the race is
    named alone; run folders hold the typed spec, never a resolved one ending in '-'."""
    race = compare.prepare(BASE, ["identity,topk:ratio=0.1,topk:ratio=0.2,ef=false,torch-ddp"], str(tmp_path / "out"))
    assert race.specs[3] == "torch-ddp:" and race.specs[1].startswith("topk:ef=true,")  # resolved
    seen: list[tuple[str, str]] = []
    fake = _fake_launch("none")

    def launch(cfg, show_progress=True):
        seen.append((cfg.label, Path(cfg.out).name))
        return fake(cfg, show_progress)

    lines: list[str] = []
    results = compare.run(race, launch=launch, show_progress=False, say=lines.append)
    assert [r["label"] for r in results] == ["identity", "topk:ratio=0.1", "topk:ratio=0.2,ef=false", "torch-ddp"]
    assert seen == [("identity", "01-identity"), ("topk:ratio=0.1", "02-topk-ratio=0.1"),
                    ("topk:ratio=0.2,ef=false", "03-topk-ratio=0.2_ef=false"), ("torch-ddp", "04-torch-ddp")]
    assert lines[2] == "[2/4] topk:ratio=0.1 (synthetic, 2 workers, 4 steps)"
    report = Path(compare.finish(race, results, "thinwire compare ...")["report"]).read_text()
    header = next(line for line in report.splitlines() if line.startswith("| method"))
    assert header.startswith("| method | final acc | final test loss | MB sent / worker |")
    assert "| topk:ratio=0.2,ef=false | 0.7000 | 0.5000 |" in report


# -- an earlier comparison's files are never overwritten without --overwrite --------------------
EARLIER = ["report.md", "results.csv", "accuracy_vs_step.png", "accuracy_vs_bytes.png",
           "accuracy_vs_time_1gbit_50us.png", "time_breakdown_1gbit_50us.png", "runs/01-identity/metrics.jsonl"]


def _listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("name", EARLIER)
def test_an_out_holding_any_file_of_an_earlier_comparison_is_refused(name, tmp_path):
    out = tmp_path / "out"
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).write_bytes(b"earlier \x00\xff")
    before = _listing(out)
    shown = "runs/01-identity" if name.startswith("runs/") else name
    with pytest.raises(ValueError, match=rf"--out {re.escape(str(out))} already holds a comparison \({shown}\); "
                                         "pass --overwrite or choose another --out"):
        compare.prepare(BASE, ["identity"], str(out))
    assert (out / name).read_bytes() == b"earlier \x00\xff" and _listing(out) == before  # nothing created
    # thinwire did not write it (no manifest records it): not even --overwrite replaces it
    with pytest.raises(ValueError, match=rf"{re.escape(name.rpartition('/')[2])} was not written by thinwire"):
        compare.prepare(BASE, ["identity"], str(out), overwrite=True)
    assert (out / name).read_bytes() == b"earlier \x00\xff"


def test_overwrite_replaces_an_earlier_comparisons_own_files(tmp_path):
    race = compare.prepare(BASE, ["identity"], str(tmp_path / "out"))
    compare.finish(race, compare.run(race, launch=_fake_launch("none"), show_progress=False, say=lambda s: None),
                   "thinwire compare ...")
    with pytest.raises(ValueError, match="already holds a comparison"):
        compare.prepare(BASE, ["identity"], str(race.out))
    again = compare.prepare(BASE, ["identity"], str(race.out), overwrite=True)
    compare.finish(again, compare.run(again, launch=_fake_launch("none"), show_progress=False, say=lambda s: None),
                   "thinwire compare again")
    assert "thinwire compare again" in (race.out / "report.md").read_text()


def test_an_out_holding_only_other_files_or_an_empty_runs_is_accepted(tmp_path):
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)  # what a prepare that never ran left behind
    (out / "notes.txt").write_text("mine\n")
    (out / "plot.png").write_text("mine\n")
    assert compare.prepare(BASE, ["identity"], str(out)).out == out
    assert (out / "notes.txt").read_text() == "mine\n"


def test_every_file_a_comparison_writes_is_one_prepare_refuses_to_overwrite(tmp_path):
    race = compare.prepare(BASE, ["identity,bf16"], str(tmp_path / "done"))
    compare.finish(race, compare.run(race, launch=_fake_launch("none"), show_progress=False, say=lambda s: None),
                   "thinwire compare ...")
    written = sorted(p.name for p in race.out.iterdir())
    assert "report.md" in written and "time_breakdown_1gbit_50us.png" in written and "runs" in written
    for name in written:
        if name == outdir.MANIFEST:  # the record of what thinwire wrote, not an output
            continue
        fresh = tmp_path / f"again-{name}"
        fresh.mkdir()
        copy = fresh / name
        if (race.out / name).is_dir():
            (copy / "01-identity").mkdir(parents=True)
        else:
            copy.write_bytes((race.out / name).read_bytes())
        with pytest.raises(ValueError, match="already holds a comparison"):
            compare.prepare(BASE, ["identity"], str(fresh))


# -- time to the target: interpolated between the evaluations that straddle it --------------------
L = "1gbit,50us"
CURVE = [{"step": 10, "test_accuracy": 0.5, "test_loss": 2.0, f"modeled_seconds@{L}": 2.0},
         {"step": 15, "test_accuracy": None, f"modeled_seconds@{L}": 3.0},  # no evaluation: not a point
         {"step": 20, "test_accuracy": 0.75, "test_loss": 1.5, f"modeled_seconds@{L}": 4.0},
         {"step": 30, "test_accuracy": 1.0, "test_loss": 1.0, f"modeled_seconds@{L}": 6.5}]


def test_time_to_target_interpolates_between_the_two_evaluations_that_straddle_it():
    # 0.875 is halfway from 0.75 (step 20, 4 s) to 1.0 (step 30, 6.5 s): step 25, 5.25 s (the first
    # evaluation at or above it would say step 30, 6.5 s)
    assert compare.crossing(CURVE, "test_accuracy", 0.875, L) == (25.0, 5.25)
    assert compare.to_target(CURVE, 0.875, L) == (25.0, 5.25)
    # a quarter of the way from 0.5 (step 10, 2 s) to 0.75 (step 20, 4 s); the row without an accuracy is skipped
    assert compare.crossing(CURVE, "test_accuracy", 0.5625, L) == (12.5, 2.5)
    assert compare.crossing(CURVE, "test_accuracy", 0.75, L) == (20.0, 4.0)  # reached exactly at an evaluation
    assert compare.crossing(CURVE, "test_accuracy", 0.25, L) == (10, 2.0)  # already there: the first evaluation
    assert compare.crossing(CURVE, "test_accuracy", 1.01, L) == (None, None)
    assert compare.to_target(CURVE, None, L) == (None, None)
    assert compare.crossing(CURVE, "test_accuracy", 0.875, "100mbit,1ms") == (25.0, None)  # no time at that link
    # a loss comes down: 1.25 is halfway from 1.5 to 1.0
    assert compare.crossing(CURVE, "test_loss", 1.25, L, higher=False) == (25.0, 5.25)


# -- a winner beyond the noise, or a tie ------------------------------------------------------------
def _standing(method: str, times: list[float], accs: list[float] | None = None) -> dict:
    return {"method": method, "status": "ok", "runs": [{}] * len(times), "failed": [],
            "final_accuracy": accs if accs is not None else [0.9] * len(times), "to_target": {L: times}}


INF = float("inf")


@pytest.mark.parametrize("table, by, best, tied", [
    # one seed: torch-ddp first at 10.0 s, bf16 at 10.5 s: 5% apart, a tie; identity at 20 s is beaten
    ([("identity", [20.0]), ("torch-ddp", [10.0]), ("bf16", [10.5])], "time", None, ("torch-ddp", "bf16")),
    ([("torch-ddp", [10.0]), ("bf16", [11.5])], "time", "torch-ddp", ()),  # 15% apart: a win
    ([("torch-ddp", [10.0]), ("bf16", [11.0])], "time", None, ("torch-ddp", "bf16")),  # exactly 10%: a tie
    ([("torch-ddp", [10.0]), ("bf16", [INF])], "time", "torch-ddp", ()),  # the other never reached it
    # several seeds: the leader's slowest seed must beat the other's fastest
    ([("a", [10.0, 11.0, 12.0]), ("b", [12.5, 13.0, 14.0])], "time", "a", ()),
    ([("a", [10.0, 11.0, 12.5]), ("b", [12.0, 13.0, 14.0])], "time", None, ("a", "b")),
    ([("a", [5.0, 6.0, INF]), ("b", [INF, INF, INF])], "time", "a", ()),  # b never reached it with any seed
    ([("a", [5.0, 6.0, INF]), ("b", [8.0, INF, INF])], "time", None, ("a", "b")),
])
def test_a_winner_beats_the_runner_up_beyond_the_noise_or_it_is_a_tie(table, by, best, tied):
    d = compare.decide([_standing(m, t) for m, t in table], (L,))[L]
    assert (d.by, d.best, d.tied) == (by, best, tied)
    assert d.ranged == (bool(tied) and len(table[0][1]) > 1)  # a tie over seeds compared ranges


def test_without_a_method_at_the_target_the_final_accuracy_decides_within_half_a_point():
    never = [INF]
    d = compare.decide([_standing("fp32", never, [0.925]), _standing("bf16", never, [0.921])], (L,))[L]
    assert (d.by, d.best, d.tied) == ("accuracy", None, ("fp32", "bf16"))  # 0.4 pts apart
    assert d.text() == ("tie between fp32 and bf16 (final accuracies within 0.5 pts of the best (no method reached "
                        "the target))")
    d = compare.decide([_standing("fp32", never, [0.921]), _standing("bf16", never, [0.927])], (L,))[L]
    assert (d.best, d.tied) == ("bf16", ())  # 0.6 pts
    d = compare.decide([_standing("a", never * 2, [0.90, 0.91]), _standing("b", never * 2, [0.85, 0.89])], (L,))[L]
    assert d.best == "a"  # its lowest (0.90) above b's highest (0.89)
    d = compare.decide([_standing("a", never * 2, [0.88, 0.91]), _standing("b", never * 2, [0.85, 0.89])], (L,))[L]
    assert d.tied == ("a", "b")
    assert compare.decide([{"method": "x", "status": "failed"}], (L,))[L] == compare.Decision("none")


def test_a_tie_is_named_in_words():
    d = compare.Decision("time", tied=("torch-ddp", "bf16", "identity"))
    assert d.text() == "tie between torch-ddp, bf16 and identity (times to the target within 10% of the fastest)"
    assert dataclasses.replace(d, ranged=True).text() == (
        "tie between torch-ddp, bf16 and identity (overlapping ranges over the seeds of the time to the target)")
    assert compare.Decision("time", best="bf16").text() == "bf16" and compare.Decision("none").text() == "none"


# -- several seeds ----------------------------------------------------------------------------------
def _seeded_launch(calls: list[tuple[str, int]]):
    """identity and bf16 as in _fake_launch, but the accuracy at step 4 depends on the seed:
    1.0, 0.875, 0.75 for seeds 0, 1, 2 (0.5 at step 2 for every seed)."""
    def launch(cfg, show_progress=True):
        calls.append((cfg.method.split(":")[0], cfg.seed))
        summary = _fake_launch("none")(cfg, show_progress)
        out = Path(cfg.out)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        final = {0: 1.0, 1: 0.875, 2: 0.75}[cfg.seed]
        rows[0]["test_accuracy"], rows[1]["test_accuracy"] = 0.5, final
        outdir.claim(out, "metrics.jsonl", "summary.json")  # a real run records its files first
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary.final_accuracy = final
        return summary
    return launch


def test_several_seeds_run_in_rounds_and_report_medians_and_ranges(tmp_path):
    race = compare.prepare(BASE, ["identity,bf16"], str(tmp_path / "out"), target=0.75, seeds=3)
    calls: list[tuple[str, int]] = []
    lines: list[str] = []
    results = compare.run(race, launch=_seeded_launch(calls), show_progress=False, say=lines.append)
    assert calls == [("identity", 0), ("bf16", 0), ("identity", 1), ("bf16", 1), ("identity", 2), ("bf16", 2)]
    assert lines[0] == "[1/6] identity (synthetic, 2 workers, 4 steps, seed 0)" and lines[-1].startswith("[6/6] bf16")
    assert sorted(p.name for p in (race.out / "runs").iterdir()) == [  # the specs as typed, then the seed
        f"0{i}-{name}-seed{seed}" for i, name in ((1, "identity"), (2, "bf16"))
        for seed in (0, 1, 2)]
    done = compare.finish(race, results, "thinwire compare ...")
    with open(done["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], r["seed"]) for r in rows] == [("identity", "0"), ("bf16", "0"), ("identity", "1"),
                                                        ("bf16", "1"), ("identity", "2"), ("bf16", "2")]
    # 0.75 is 1/2, 2/3 and all of the way from 0.5 to the accuracy at step 4: identity at 100 Mbit/s
    # (6 s -> 12 s) gets there at 9, 10 and 12 s, bf16 (1.5 -> 3 s) at 2.25, 2.5 and 3 s
    assert [float(r["modeled_seconds_to_target@100mbit,1ms"]) for r in rows] == pytest.approx(
        [9.0, 2.25, 10.0, 2.5, 12.0, 3.0], rel=1e-12)
    assert done["best"] == {"1gbit,50us": "bf16", "100mbit,1ms": "bf16"}  # bf16's slowest beats identity's fastest
    report = Path(done["report"]).read_text()
    assert ("- seeds 0, 1, 2 (each figure: median [min–max] over the seeds; ∞: a seed did not reach the target)"
            in report)
    assert ("| identity | 0.8750 [0.7500–1.0000] | 0.5000 [0.5000–0.5000] | 0.00 | 1.0x | 1.0 | 2.0 | 4.0 | 12.0 | "
            "3.3 [3.0–4.0] (step 3.3) "
            "| 10.0 [9.0–12.0] (step 3.3) |" in report)
    assert "| **bf16** |" in report and "**2.5 [2.2–3.0] (step 3.3)**" in report
    assert "slowest seed reaches the target before the fastest seed of every other method" in report
    assert len(done["plots"]) == 6 and "## Plots (seed 0's runs)" in report


def test_one_seed_that_does_not_beat_the_runner_up_by_10_percent_is_a_tie(tmp_path, monkeypatch, capsys):
    """The CLI over a stand-in launcher: the same bytes for bf16 and identity make a tie; a busy
    machine is one line on stderr and in the report."""
    from thinwire import cli
    from thinwire.lab import load
    from thinwire.run import launch as launch_module

    def same_bytes(cfg, show_progress=True):
        return _fake_launch("none")(dataclasses.replace(cfg, method=cfg.method.replace("bf16", "identity")))

    monkeypatch.setattr(launch_module, "launch", lambda cfg, show_progress=True: dataclasses.replace(
        same_bytes(cfg), method=cfg.method))
    monkeypatch.setattr(load, "load1", lambda: 4.0)
    monkeypatch.setattr(load, "cores", lambda: 2)
    out = tmp_path / "race"
    assert cli.main(["compare", "--task", "synthetic", "--workers", "2", "--steps", "4", "--eval-every", "2",
                     "--methods", "identity,bf16", "--out", str(out), "--quiet"]) == 0
    printed, err = capsys.readouterr()
    warning = ("warning: load average 4.0 on 2 cores at the start of thinwire compare: other work holds the cores, so "
               "the measured compute and codec times (and every time built on them) vary from run to run")
    assert err.strip() == f"thinwire: {warning}"
    assert ("best at 1gbit,50us: tie between identity and bf16 (times to the target within 10% of the fastest)"
            in printed)
    report = (out / "report.md").read_text()
    assert f"- {warning}" in report and "**" not in report.split("| method |")[1]  # nothing in bold
    assert "- best at 100mbit,1ms: tie between identity and bf16" in report
    assert "more than 10% shorter than every other method's" in report


def test_an_interpolated_step_shows_a_tenth_only_below_100():
    assert [compare._step(x) for x in (25.0, 3.33, 99.94, 227.96, 248.1, 300.0)] == \
        ["25", "3.3", "99.9", "228", "248", "300"]

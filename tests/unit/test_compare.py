"""thinwire compare's logic with a stand-in launcher: method lists, validation before any
run, a failing method that does not stop the race, the table, the CSV and the plots."""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import pytest

from thinwire.run import compare
from thinwire.run.config import TrainConfig
from thinwire.run.launch import RunFailed


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
    with pytest.raises(ValueError, match="is not writable"):
        compare.prepare(BASE, ["identity"], str(blocker / "sub"))
    with pytest.raises(ValueError, match=r"target must be in \(0, 1\]"):
        compare.prepare(BASE, ["identity"], str(tmp_path / "out"), target=1.5)
    race = compare.prepare(BASE, ["identity"], str(tmp_path / "out"))
    (race.out / "results.csv").write_text("earlier\n")
    with pytest.raises(ValueError, match="already holds a comparison"):
        compare.prepare(BASE, ["identity"], str(tmp_path / "out"))
    assert (race.out / "results.csv").read_text() == "earlier\n"  # nothing a user saved is lost
    assert compare.prepare(BASE, ["identity"], str(tmp_path / "out"), overwrite=True).specs[0].startswith("identity")


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
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {"task": cfg.task, "method": cfg.method, "workers": cfg.workers, "steps": cfg.steps,
                   "final_accuracy": acc[-1], "final_loss": 0.5, "final_bpc": None,
                   "bytes_sent_per_worker": bytes_per_step * 4, "fp32_bytes_per_worker": 4000.0,
                   "compression_ratio": 4000.0 / (bytes_per_step * 4), "wall_seconds": 2.0, "compute_seconds": 1.0,
                   "codec_seconds": 0.25, "comm_seconds": 0.5,
                   "modeled_seconds_by_link": {link: rows[-1][f"modeled_seconds@{link}"] for link in cfg.links}}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary
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
        "accuracy_vs_time_1gbit_50us.png", "time_breakdown.png"]
    for p in done["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(done["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["identity", "topk", "bf16"]
    assert rows[1]["status"] == "failed" and rows[1]["final_accuracy"] == ""
    assert float(rows[2]["bytes_sent_per_worker"]) == 1000.0 and rows[2]["step_to_target"] == "4"
    assert float(rows[0]["modeled_seconds_to_target@100mbit,1ms"]) == pytest.approx(12.0)
    assert float(rows[2]["modeled_seconds_to_target@100mbit,1ms"]) == pytest.approx(3.0)


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
           "accuracy_vs_time_1gbit_50us.png", "time_breakdown.png", "runs/01-identity/metrics.jsonl"]


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
    assert compare.prepare(BASE, ["identity"], str(out), overwrite=True).out == out


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
    assert "report.md" in written and "time_breakdown.png" in written and "runs" in written
    for name in written:
        fresh = tmp_path / f"again-{name}"
        fresh.mkdir()
        copy = fresh / name
        if (race.out / name).is_dir():
            (copy / "01-identity").mkdir(parents=True)
        else:
            copy.write_bytes((race.out / name).read_bytes())
        with pytest.raises(ValueError, match="already holds a comparison"):
            compare.prepare(BASE, ["identity"], str(fresh))

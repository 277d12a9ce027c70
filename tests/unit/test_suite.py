"""thinwire compare --suite: the measured ratios on hand-computed runs, a method shared by
several races runs once, a failed run leaves its claims unmeasured, and the files."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
from pathlib import Path

import pytest

from thinwire.lab import suite
from thinwire.lab.suite import Claim, Group
from thinwire.run.config import TrainConfig
from thinwire.run.launch import RunFailed
from thinwire.run.summary import Summary

LINKS = ("1gbit,50us", "100mbit,1ms")
BASE = TrainConfig(task="synthetic", workers=2, steps=12, eval_every=2, links=LINKS)  # dasgd averages at 12

# per method: modeled seconds at the two links, bytes per worker, final accuracy,
# modeled communication and the part hidden at the two links
FIGURES = {
    "topk": ((2.0, 4.0), 100.0, 0.80, (0.5, 1.0), (0.0, 0.0)),
    "identity": ((3.0, 12.0), 800.0, 0.82, (1.5, 9.0), (0.0, 0.0)),
    "bf16": ((2.5, 8.0), 400.0, 0.81, (1.0, 5.0), (0.0, 0.0)),
    "qsgd": ((2.2, 5.0), 150.0, 0.78, (0.7, 2.0), (0.0, 0.0)),
    "dasgd": ((1.5, 5.0), 200.0, 0.79, (0.8, 4.0), (0.6, 1.0)),
}

GROUPS = (
    Group("a", "Seed A", "A et al.", "topk:ratio=0.1", ("identity", "bf16", "qsgd"),
          (Claim("2x faster than no compression", "speedup", "identity", 2.0),
           Claim("1.5x faster than the best uniform codec", "speedup", "best-uniform", 1.5),
           Claim("4x fewer bytes than no compression", "bytes", "identity", 4.0),
           Claim("no accuracy loss", "accuracy", "identity", 0.0, " pts"))),
    Group("b", "Seed B", "B et al.", "dasgd:delay=2", ("identity",),
          (Claim("all communication hidden", "hidden", None, 1.0, ""),
           Claim("faster than sync", "speedup", "identity", None))),
)


def _launcher(calls: list[str], fail: str = ""):
    def launch(cfg, show_progress=True):
        name = cfg.method.split(":")[0]
        calls.append(name)
        if name == fail:
            raise RunFailed("rank 0 failed after step 1: FloatingPointError: training loss is nan")
        modeled, sent, acc, comm, hidden = FIGURES[name]
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = [{"step": s, "test_accuracy": acc * s / 4, "bytes_sent": sent * s / 4,
                 **{f"modeled_seconds@{link}": m * s / 4 for link, m in zip(cfg.links, modeled)}} for s in (2, 4)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {"task": cfg.task, "method": cfg.method, "workers": cfg.workers, "steps": cfg.steps,
                   "final_accuracy": acc, "final_loss": 0.5, "final_bpc": None, "bytes_sent_per_worker": sent,
                   "fp32_bytes_per_worker": 800.0, "compression_ratio": 800.0 / sent, "wall_seconds": 2.0,
                   "compute_seconds": 1.0, "codec_seconds": 0.1, "comm_seconds": 0.5,
                   "modeled_seconds_by_link": dict(zip(cfg.links, modeled)),
                   "modeled_comm_seconds_by_link": dict(zip(cfg.links, comm)),
                   "hidden_seconds_by_link": dict(zip(cfg.links, hidden))}
        (out / "summary.json").write_text(json.dumps(summary))
        return Summary.from_json(summary)

    return launch


def _run(tmp_path, fail=""):
    calls: list[str] = []
    races = suite.prepare(BASE, str(tmp_path / "suite"), groups=GROUPS)
    results = suite.run(races, GROUPS, launch=_launcher(calls, fail), show_progress=False, say=lambda s: None)
    done = suite.finish(str(tmp_path / "suite"), races, results, "thinwire compare --suite test", GROUPS)
    return calls, done


def _row(rows, group, claim_start, link=""):
    return next(r for r in rows if r["group"] == group and r["claim"].startswith(claim_start) and r["link"] == link)


def test_measured_ratios_equal_the_hand_computed_ones(tmp_path):
    calls, done = _run(tmp_path)
    rows = done["rows"]
    r = _row(rows, "a", "2x faster", LINKS[0])
    assert r["measured"] == pytest.approx(3.0 / 2.0) and r["reading"] == "partly"
    r = _row(rows, "a", "2x faster", LINKS[1])
    assert r["measured"] == pytest.approx(12.0 / 4.0) and r["reading"] == "holds"
    # the fastest uniform codec (identity excluded): qsgd at both links (2.2 s, 5.0 s)
    assert _row(rows, "a", "1.5x", LINKS[0])["measured"] == pytest.approx(2.2 / 2.0)
    assert _row(rows, "a", "1.5x", LINKS[1])["measured"] == pytest.approx(5.0 / 4.0)
    assert "qsgd" in _row(rows, "a", "1.5x", LINKS[1])["detail"]
    assert _row(rows, "a", "4x fewer")["measured"] == pytest.approx(8.0) and _row(rows, "a", "4x fewer")["link"] == ""
    acc = _row(rows, "a", "no accuracy")
    assert acc["measured"] == pytest.approx(100 * (0.80 - 0.82)) and acc["reading"] == "partly"  # 2 pts > 0.5
    assert _row(rows, "b", "all communication", LINKS[0])["measured"] == pytest.approx(0.6 / 0.8)
    assert _row(rows, "b", "all communication", LINKS[1])["measured"] == pytest.approx(1.0 / 4.0)
    assert _row(rows, "b", "faster than sync", LINKS[1])["reading"] == "holds"  # no figure: any speedup


def test_a_method_shared_by_races_runs_once_and_each_race_has_its_files(tmp_path):
    calls, done = _run(tmp_path)
    assert sorted(calls) == ["bf16", "dasgd", "identity", "qsgd", "topk"]  # identity once, not twice
    out = tmp_path / "suite"
    for key in ("a", "b"):
        assert (out / key / "report.md").exists() and (out / key / "results.csv").exists()
    with open(out / "b" / "results.csv") as f:
        ident = next(r for r in csv.DictReader(f) if r["method"] == "identity")
    assert float(ident["bytes_sent_per_worker"]) == 800.0  # the copied run's figures
    assert len(list((out / "b" / "runs").glob("02-identity*/metrics.jsonl"))) == 1
    with open(out / "claims.csv") as f:
        claims = list(csv.DictReader(f))
    assert len(claims) == len(done["rows"]) == 2 + 2 + 1 + 1 + 2 + 2
    report = (out / "report.md").read_text()
    assert "## Seed A — A et al." in report
    assert "| 2x faster than no compression | 100mbit,1ms | 2.00x | 3.00x | holds" in report


def test_a_failed_run_leaves_its_claims_unmeasured_and_the_suite_goes_on(tmp_path):
    calls, done = _run(tmp_path, fail="identity")
    rows = done["rows"]
    r = _row(rows, "a", "2x faster", LINKS[0])
    assert r["measured"] is None and r["reading"] == "not measured" and "identity's run failed" in r["detail"]
    assert _row(rows, "a", "1.5x", LINKS[0])["measured"] == pytest.approx(1.1)  # other peers still measured
    assert _row(rows, "b", "all communication", LINKS[0])["measured"] == pytest.approx(0.75)


def test_an_out_holding_a_suite_is_refused(tmp_path):
    _run(tmp_path)
    with pytest.raises(ValueError, match="already holds a suite"):
        suite.prepare(BASE, str(tmp_path / "suite"), groups=GROUPS)


def test_the_seed_suite_validates_on_its_task():
    """Every race of the shipped suite resolves on mnist1d with the suite's workers."""
    import tempfile

    base = TrainConfig(task="mnist1d", workers=suite.SUITE_WORKERS, steps=101)  # AB-training's warm-up is 100
    with tempfile.TemporaryDirectory() as tmp:
        races = suite.prepare(base, tmp)
    assert [r.specs[0].split(":")[0] for r in races] == ["fft", "hylo", "dasgd", "powergossip", "ab"]
    for race, group in zip(races, suite.SEEDS):
        labels = {s.split(":")[0] for s in race.specs}
        for claim in group.claims:
            assert claim.peer in (None, "best-uniform") or claim.peer in labels


def test_a_suite_whose_steps_end_inside_a_warm_up_is_refused_before_anything_is_made(tmp_path):
    """AB-training's 100 warm-up steps in a 100-step race: it would be data parallel under
    another name, its bytes ratio reading 1.00x as if measured."""
    base = TrainConfig(task="mnist1d", workers=suite.SUITE_WORKERS, steps=100)
    with pytest.raises(ValueError) as e:
        suite.prepare(base, str(tmp_path / "s"))
    assert str(e.value) == ("--steps 100 cannot measure the ab race: ab never leaves its warm-up of 100 synchronous "
                            "steps (warmup=100) in 100 steps; its claims need that phase (pass a larger --steps)")
    assert not (tmp_path / "s").exists()
    with pytest.raises(ValueError, match=r"the dasgd race: dasgd first averages after step 12 \(warmup 8 \+ period "
                                         r"4\), later than the run's 11 steps"):
        suite.prepare(dataclasses.replace(base, steps=11), str(tmp_path / "s"))


@pytest.mark.parametrize("spec, steps, want", [
    ("ab", 100, "ab never leaves its warm-up of 100 synchronous steps (warmup=100) in 100 steps"),
    ("ab", 101, None), ("ab:warmup=0", 1, None),
    ("localsgd:period=4,warmup=8", 11, "localsgd first averages after step 12 (warmup 8 + period 4), later than "
                                       "the run's 11 steps"),
    ("localsgd:period=4,warmup=8", 12, None), ("localsgd:period=1,warmup=3", 3,
                                               "localsgd never leaves its warm-up of 3 synchronous steps (warmup=3) "
                                               "in 3 steps"),
    ("diloco:period=50", 49, "diloco first averages after step 50 (warmup 0 + period 50), later than the run's 49 "
                             "steps"),
    ("diloco:period=50", 50, None), ("topk", 1, None), ("identity", 1, None), ("dpsgd", 1, None),
])
def test_the_phase_a_method_is_about_must_fit_the_steps(spec, steps, want):
    assert suite.unreached_phase(spec, steps) == want


@pytest.mark.parametrize("name", ["report.md", "claims.csv", "b/report.md", "b/results.csv",
                                  "b/time_breakdown_1gbit_50us.png", "b/runs/01-dasgd/summary.json"])
def test_an_out_holding_any_file_of_an_earlier_suite_is_refused_before_anything_is_made(name, tmp_path):
    out = tmp_path / "suite"
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).write_bytes(b"earlier")
    shown = name if not name.startswith("b/runs/") else "b/runs/01-dasgd"
    with pytest.raises(ValueError, match=rf"already holds a suite \({shown}\); pass --overwrite"):
        suite.prepare(BASE, str(out), groups=GROUPS)
    assert (out / name).read_bytes() == b"earlier"
    assert not (out / "a").exists()  # race a was not prepared before race b's files were seen
    if name.startswith("b/runs/"):  # no run of this suite writes into that folder: --overwrite leaves it be
        assert [r.out for r in suite.prepare(BASE, str(out), overwrite=True, groups=GROUPS)] == [out / "a", out / "b"]
    else:  # thinwire did not write it (no manifest records it): not even --overwrite replaces it
        with pytest.raises(ValueError, match=rf"{re.escape(name.rpartition('/')[2])} was not written by thinwire"):
            suite.prepare(BASE, str(out), overwrite=True, groups=GROUPS)
        assert not (out / "a").exists()  # every race is checked before any folder is made
    assert (out / name).read_bytes() == b"earlier"


def test_an_out_holding_only_other_files_is_accepted_by_the_suite(tmp_path):
    out = tmp_path / "suite"
    (out / "a").mkdir(parents=True)
    (out / "notes.txt").write_text("mine\n")
    (out / "a" / "notes.txt").write_text("mine\n")
    assert len(suite.prepare(BASE, str(out), groups=GROUPS)) == 2
    assert (out / "notes.txt").read_text() == "mine\n" and (out / "a" / "notes.txt").read_text() == "mine\n"


# -- targets of ours (the lowbandwidth suite's kinds) --------------------------------------------
# per spec: final test loss, bytes per worker, most bytes in one step, and per evaluation
# (step 2, step 4): test loss and modeled seconds at the two links
LOSSES = {
    "identity": (1.00, 1000.0, 100.0, ((1.10, 1.00), ((4.0, 20.0), (8.0, 40.0)))),
    "localsgd:period=2": (1.05, 40.0, 20.0, ((1.08, 1.05), ((2.0, 3.0), (4.0, 3.2)))),
    "dasgd:period=2": (1.01, 40.0, 20.0, ((1.02, 1.01), ((2.5, 3.5), (5.0, 7.0)))),
    "diloco:period=2": (1.015, 20.0, 20.0, ((1.019, 1.015), ((1.0, 2.0), (2.0, 4.0)))),
    "streaming-diloco:period=2,fragments=2": (1.03, 20.0, 5.0, ((1.04, 1.03), ((1.0, 2.0), (2.0, 4.0)))),
}
TARGET_GROUPS = (
    Group("d", "DiLoCo", "D et al.", "diloco:period=2", ("identity", "localsgd:period=2", "dasgd:period=2"),
          (Claim("loss within 2%", "loss", "identity", 0.02, "rel", target=True),
           Claim("beats local SGD", "loss", "localsgd:period=2", 0.0, "rel", target=True),
           Claim("45x fewer bytes", "bytes", "identity", 45.0, target=True),
           Claim("5x to target", "to-target", "identity", 5.0, target=True),
           Claim("1.3x to target", "to-target", "best:localsgd:period=2|dasgd:period=2", 1.3, target=True)),
          target_loss=("identity", 0.02)),
    Group("s", "Streaming", "S et al.", "streaming-diloco:period=2,fragments=2", ("diloco:period=2", "identity"),
          (Claim("loss within 1%", "loss", "diloco:period=2", 0.01, "rel", target=True),
           Claim("peak 0.3x", "peak", "diloco:period=2", 0.3, target=True),
           Claim("5x to target", "to-target", "identity", 5.0, target=True),
           Claim("loss, no figure", "loss", "identity", None, "rel")),
          target_loss=("identity", 0.02)),
)


def _loss_launcher(calls: list[str]):
    def launch(cfg, show_progress=True):
        spec = next(k for k in LOSSES if k.split(":")[0] == cfg.method.split(":")[0])  # one spec per method
        calls.append(spec)
        final, sent, peak, (losses, modeled) = LOSSES[spec]
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        rows = [{"step": s, "test_loss": loss, "test_accuracy": None, "bytes_sent": sent * s / 4,
                 **{f"modeled_seconds@{link}": m for link, m in zip(cfg.links, ms)}}
                for s, loss, ms in zip((2, 4), losses, modeled)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {"task": cfg.task, "method": cfg.method, "workers": cfg.workers, "steps": cfg.steps,
                   "final_accuracy": None, "final_loss": final, "final_bpc": None, "bytes_sent_per_worker": sent,
                   "fp32_bytes_per_worker": 1000.0, "compression_ratio": 1000.0 / sent, "wall_seconds": 2.0,
                   "compute_seconds": 1.0, "codec_seconds": 0.1, "comm_seconds": 0.5,
                   "modeled_seconds_by_link": dict(zip(cfg.links, modeled[-1])),
                   "modeled_comm_seconds_by_link": dict(zip(cfg.links, (1.0, 1.0))),
                   "hidden_seconds_by_link": dict(zip(cfg.links, (0.0, 0.0))),
                   "method_report": {"peak_bytes_per_sync": peak}}
        (out / "summary.json").write_text(json.dumps(summary))
        return Summary.from_json(summary)

    return launch


def test_targets_read_pass_or_miss_against_hand_computed_runs(tmp_path):
    calls: list[str] = []
    races = suite.prepare(BASE, str(tmp_path / "suite"), groups=TARGET_GROUPS)
    results = suite.run(races, TARGET_GROUPS, launch=_loss_launcher(calls), show_progress=False, say=lambda s: None)
    done = suite.finish(str(tmp_path / "suite"), races, results, "thinwire compare --suite test", TARGET_GROUPS)
    rows = done["rows"]
    r = _row(rows, "d", "loss within 2%")
    assert r["measured"] == pytest.approx(0.015) and r["reading"] == "PASS"
    assert _row(rows, "d", "beats local SGD")["measured"] == pytest.approx(1.015 / 1.05 - 1)
    assert _row(rows, "d", "beats local SGD")["reading"] == "PASS"
    r = _row(rows, "d", "45x fewer")
    assert r["measured"] == pytest.approx(50.0) and r["reading"] == "PASS"
    # target loss 1.02: identity comes down 1.10 -> 1.00 from step 2 to 4, 0.8 of the way there, so at
    # 4 + 0.8 x 4 = 7.2 s and 20 + 0.8 x 20 = 36 s; diloco is there at its first evaluation (1 s, 2 s)
    r = _row(rows, "d", "5x to target", LINKS[0])
    assert r["measured"] == pytest.approx(7.2, rel=1e-12) and r["reading"] == "PASS"
    assert _row(rows, "d", "5x to target", LINKS[1])["measured"] == pytest.approx(18.0, rel=1e-12)
    # the best of local SGD (never reaches 1.02: its whole run, 4.0 s and 3.2 s, bounds its time) and
    # DaSGD (step 2: 2.5 s, 3.5 s)
    r = _row(rows, "d", "1.3x to target", LINKS[0])
    assert r["measured"] == pytest.approx(2.5) and r["reading"] == "PASS" and "dasgd" in r["detail"]
    r = _row(rows, "d", "1.3x to target", LINKS[1])
    assert r["measured"] == pytest.approx(3.2 / 2.0) and r["reading"] == "PASS" and "lower bound" in r["detail"]
    r = _row(rows, "s", "loss within 1%")
    assert r["measured"] == pytest.approx(1.03 / 1.015 - 1) and r["reading"] == "MISS"
    r = _row(rows, "s", "peak 0.3x")
    assert r["measured"] == pytest.approx(0.25) and r["reading"] == "PASS"
    r = _row(rows, "s", "5x to target", LINKS[0])  # streaming never reaches 1.02
    assert r["measured"] == 0.0 and r["reading"] == "MISS" and "did not reach" in r["detail"]
    assert _row(rows, "s", "loss, no figure")["reading"] == "measured"
    report = (tmp_path / "suite" / "report.md").read_text()
    assert "| loss within 2% | any | +2.0% | +1.5% | PASS |" in report


@pytest.mark.parametrize("task", ["charlm", "mnist1d"])
def test_the_lowbandwidth_suite_validates_on_its_tasks_and_every_peer_it_names_runs(task, tmp_path):
    base = TrainConfig(task=task, workers=suite.SUITE_WORKERS, steps=100)
    races = suite.prepare(base, str(tmp_path), groups=suite.LOWBANDWIDTH)
    assert [r.specs[0].split(":")[0] for r in races] == ["diloco", "diloco", "streaming-diloco", "sparseloco",
                                                         "diloco", "demo", "identity"]
    by_key = {g.key: g for g in suite.LOWBANDWIDTH}
    for group, race in zip(suite.LOWBANDWIDTH, races):
        assert race.base.optimizer == (group.optimizer or "adamw")  # MuLoCo: Muon; the rest AdamW
        # the tuned reference at its own lr; every other race at the command's (here the task's)
        assert race.base.lr == (suite.TUNED_ADAMW_LR if group.key == "tuned" else races[0].base.lr)
        for claim in group.claims:
            if claim.peer is None:
                continue
            peers = by_key[claim.race].specs if claim.race else group.peers
            keys = claim.peer[len("best:"):].split("|") if claim.peer.startswith("best:") else [claim.peer]
            assert all(k in peers for k in keys), (group.key, claim.text)
            assert claim.among is None or all(k in group.specs for k in claim.among.split("|")), claim.text
        if group.target_loss is not None:  # in the race, or in the other race a claim reads (MuLoCo's)
            assert group.target_loss[0] in group.peers or any(
                c.race and group.target_loss[0] in by_key[c.race].specs for c in group.claims)


def test_the_lowbandwidth_suite_fills_its_settings_where_the_command_leaves_them_out(tmp_path):
    races = suite.prepare(TrainConfig(task="text", workers=suite.SUITE_WORKERS), str(tmp_path / "a"),
                          groups=suite.LOWBANDWIDTH)
    b = races[0].base
    assert (b.steps, b.batch_size, b.eval_every, b.optimizer) == (3000, 4, 150, "adamw")
    assert (b.lr_schedule, b.warmup_steps, b.min_lr) == ("cosine", 150, 0.1)
    assert b.task_options == {"context": 64, "eval_windows": 512}
    assert b.steps // suite.H >= 100  # at least 100 outer steps
    assert b.steps * b.batch_size * b.workers * 64 < 11_000_000  # less than one epoch of the stdlib's text
    mine = TrainConfig(task="text", workers=suite.SUITE_WORKERS, steps=600, batch_size=2, lr_schedule="wsd",
                       warmup_steps=10, task_options={"context": 32})
    b = suite.prepare(mine, str(tmp_path / "b"), groups=suite.LOWBANDWIDTH)[0].base
    assert (b.steps, b.batch_size, b.lr_schedule, b.warmup_steps, b.min_lr) == (600, 2, "wsd", 10, 0.0)
    assert b.task_options == {"context": 32, "eval_windows": 512}
    # another suite's races keep the command's settings as they are
    b = suite.prepare(mine, str(tmp_path / "c"), groups=TARGET_GROUPS)[0].base
    assert (b.lr_schedule, b.task_options) == ("wsd", {"context": 32})
    # the outer lrs the sweep chose: in every spec that takes DiLoCo's or SparseLoCo's
    groups = suite.lowbandwidth(1.0, 1.3)
    assert "outer_lr=1," in groups[0].seed + "," and groups[3].seed == "sparseloco:period=30,outer_lr=1.3"
    assert [g.key for g in groups] == [g.key for g in suite.LOWBANDWIDTH]


# a race of its own optimizer (MuLoCo's), a claim against a run of another race, the best of several
OPT_GROUPS = (
    Group("x", "DiLoCo", "D et al.", "diloco:period=2", ("identity", "localsgd:period=2", "dasgd:period=2"),
          (Claim("best 2x to target", "best-to-target", "identity", 2.0, target=True),
           Claim("best of two 3x to target", "best-to-target", "identity", 3.0, target=True,
                 among="localsgd:period=2|dasgd:period=2")),
          target_loss=("identity", 0.02)),
    Group("m", "MuLoCo", "M et al.", "diloco:period=2", (),
          (Claim("no higher than DiLoCo's", "loss", "diloco:period=2", 0.0, "rel", target=True, race="x"),
           Claim("to x's target", "to-target", "identity", race="x")),
          target_loss=("identity", 0.02), optimizer="adam"),
    Group("t", "tuned", "ours", "identity", (), (), lr=0.2),
)


def test_a_race_of_its_own_optimizer_reruns_a_shared_spec_and_reads_another_races_run(tmp_path):
    calls: list[str] = []
    inner = _loss_launcher(calls)
    seen: list[tuple[str, str | None, float | None]] = []

    def launch(cfg, show_progress=True):
        seen.append((cfg.method.split(":")[0], cfg.optimizer, cfg.lr))
        summary = inner(cfg, show_progress)
        if cfg.optimizer == "adam":
            summary.final_loss = 1.0
        return summary

    races = suite.prepare(BASE, str(tmp_path / "suite"), groups=OPT_GROUPS)
    assert [r.base.optimizer for r in races] == ["sgd", "adam", "sgd"]  # synthetic's own, then the group's
    assert races[2].base.lr == 0.2 and races[0].base.lr != 0.2  # a race of its own lr
    results = suite.run(races, OPT_GROUPS, launch=launch, show_progress=False, say=lambda s: None)
    rows = suite.finish(str(tmp_path / "suite"), races, results, "thinwire compare --suite test", OPT_GROUPS)["rows"]
    lr = races[0].base.lr
    assert seen.count(("diloco", "sgd", lr)) == 1 and seen.count(("diloco", "adam", lr)) == 1  # not a copy
    assert seen.count(("identity", "sgd", lr)) == 1 and seen.count(("identity", "sgd", 0.2)) == 1
    r = _row(rows, "m", "no higher")
    assert r["measured"] == pytest.approx(1.0 / 1.015 - 1) and r["reading"] == "PASS"
    # the target loss from the other race's identity (1.02 x its final), reached by the seed at 1 s / 2 s
    assert _row(rows, "m", "to x's", LINKS[0])["measured"] == pytest.approx(7.2)
    assert _row(rows, "m", "to x's", LINKS[1])["measured"] == pytest.approx(18.0)
    # target 1.02: identity there at 7.2 s / 36 s; the best of the rest is diloco (1 s / 2 s), of local SGD
    # (never) and DaSGD (2.5 s / 3.5 s) DaSGD
    r = _row(rows, "x", "best 2x", LINKS[0])
    assert r["measured"] == pytest.approx(7.2) and r["reading"] == "PASS" and "diloco" in r["detail"]
    assert _row(rows, "x", "best 2x", LINKS[1])["measured"] == pytest.approx(18.0)
    r = _row(rows, "x", "best of two", LINKS[0])
    assert r["measured"] == pytest.approx(7.2 / 2.5) and r["reading"] == "MISS" and "dasgd" in r["detail"]


# -- the transform suite's pieces: a peer that cannot run, a claim for one link, the step kind ------
STEP_GROUPS = (
    Group("t", "Transform", "T et al.", "diloco:period=2", ("identity", "localsgd:period=2", "dasgd:period=2"),
          (Claim("step at most 1.0x", "step", "localsgd:period=2", 1.0, target=True),
           Claim("to target at 100 Mbit/s", "to-target", "identity", 5.0, target=True, link="100mbit"),
           Claim("to target at 10 Mbit/s", "to-target", "identity", 5.0, target=True, link="10mbit"),
           Claim("loss against DaSGD", "loss", "dasgd:period=2", None, "rel")),
          target_loss=("identity", 0.02)),
)


def test_a_peer_left_out_a_claim_for_one_link_and_step_seconds(tmp_path):
    calls: list[str] = []

    def launch(cfg, show_progress=True):
        summary = _loss_launcher(calls)(cfg, show_progress)
        if cfg.method.startswith("diloco"):  # 0.3 s of codec and communication in 4 steps, against 0.6 s
            summary.codec_seconds, summary.comm_seconds = 0.1, 0.2
        return summary

    races = suite.prepare(BASE, str(tmp_path / "suite"), groups=STEP_GROUPS)
    races[0].specs.remove(next(s for s in races[0].specs if s.startswith("dasgd")))  # as if it cannot run here
    races[0].skipped = {"dasgd:period=2": "dasgd: no such layer here"}
    results = suite.run(races, STEP_GROUPS, launch=launch, show_progress=False, say=lambda s: None)
    rows = suite.finish(str(tmp_path / "suite"), races, results, "thinwire compare --suite test", STEP_GROUPS)["rows"]
    assert "dasgd:period=2" not in calls
    r = _row(rows, "t", "step at most")
    assert r["measured"] == pytest.approx(0.3 / 0.6) and r["reading"] == "PASS" and "ms" in r["detail"]
    assert [x["link"] for x in rows if x["claim"].startswith("to target at 100")] == [LINKS[1]]  # that link alone
    r = _row(rows, "t", "to target at 10 Mbit/s", "10mbit")
    assert r["measured"] is None and r["reading"] == "not measured" and "no 10mbit link" in r["detail"]
    r = _row(rows, "t", "loss against DaSGD")
    assert r["measured"] is None and "cannot run on this task: dasgd: no such layer here" in r["detail"]


def test_the_transform_suite_leaves_out_detonation_on_convolutions_and_validates(tmp_path):
    for task, skipped in (("charlm", set()), ("mnist1d", {"peer-demo"})):
        base = TrainConfig(task=task, workers=suite.SUITE_WORKERS, steps=100, optimizer="adamw")
        races = suite.prepare(base, str(tmp_path / task), groups=suite.TRANSFORM)
        assert [r.specs[0].split(":")[0] for r in races] == ["demo", "demo", "demo", "dct"]
        assert {s for r in races for s in r.skipped} == skipped
        if skipped:
            assert "1-D and 2-D parameters only" in races[0].skipped["peer-demo"]
        for group, race in zip(suite.TRANSFORM, races):
            for claim in group.claims:
                assert claim.peer is None or claim.peer in group.peers or any(
                    p.split(":")[0] == claim.peer for p in group.peers), (group.key, claim.text)
            assert len(race.specs) + len(race.skipped) == len(group.specs)


def test_a_claim_reads_the_races_shared_compute_not_one_runs_noisy_figure(tmp_path):
    """top-k and identity send alike here (1 s a run at every link) and run the same step; identity's run
    measured 0.6 s of compute a step, top-k's 0.3 s (a busy machine during one run). On their own figures
    top-k would be 1.55x faster; on the race's shared figure (0.45 s) the speedup is exactly 1."""
    groups = (Group("a", "Seed A", "A et al.", "topk:ratio=0.1", ("identity",),
                    (Claim("faster than no compression", "speedup", "identity", None),)),)
    per_step = {"topk": 0.3, "identity": 0.6}

    def launch(cfg, show_progress=True):
        name, out = cfg.method.split(":")[0], Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        c = per_step[name]
        rows = [{"step": s, "test_accuracy": 0.2 * s, "bytes_sent": 100.0 * s, "compute_seconds": c * s,
                 **{f"modeled_seconds@{link}": c * s + 0.25 * s for link in cfg.links}} for s in (2, 4)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = {"task": cfg.task, "method": cfg.method, "workers": cfg.workers, "steps": 4, "steps_run": 4,
                   "final_accuracy": 0.8, "final_loss": 0.5, "final_bpc": None, "bytes_sent_per_worker": 400.0,
                   "fp32_bytes_per_worker": 400.0, "compression_ratio": 1.0, "wall_seconds": 2.0,
                   "compute_seconds": 4 * c, "codec_seconds": 0.0, "comm_seconds": 0.5,
                   "modeled_seconds_by_link": {link: 4 * c + 1.0 for link in cfg.links}}
        (out / "summary.json").write_text(json.dumps(summary))
        return Summary.from_json(summary)

    races = suite.prepare(BASE, str(tmp_path / "suite"), groups=groups)
    results = suite.run(races, groups, launch=launch, show_progress=False, say=lambda s: None)
    rows = suite.finish(str(tmp_path / "suite"), races, results, "thinwire compare --suite test", groups)["rows"]
    speedups = [r for r in rows if r["claim"].startswith("faster than no compression")]
    assert speedups and all(float(r["measured"]) == pytest.approx(1.0, rel=1e-12) for r in speedups), speedups

"""A run's learning-rate schedule and Muon through the trainer (real gloo ranks): the rate in
the metrics at named steps against the formula, an exact resume mid-schedule, and MuLoCo
(DiLoCo with Muon inside) training and resuming exactly."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from resumes import rank_states
from thinwire.optim import schedule
from thinwire.run import checkpoint
from thinwire.run.config import TrainConfig
from thinwire.run.launch import launch

SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _models_equal(out_a, out_b, step):
    for rank, a, b in rank_states(out_a, out_b, step, 2):
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (rank, k)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind, optimizer, method", [("cosine", "adamw", "identity"),
                                                     ("wsd", "muon", "diloco:period=3,warmup=0")])
def test_the_rate_follows_the_schedule_and_a_resume_mid_schedule_is_exact(kind, optimizer, method, tmp_path):
    cfg = TrainConfig(task="synthetic", method=method, workers=2, steps=12, eval_every=3, batch_size=16,
                      task_options=SMALL, optimizer=optimizer, lr=0.01, lr_schedule=kind, warmup_steps=2,
                      min_lr=0.1, out=str(tmp_path / "a"), checkpoint_every=6).resolve()
    launch(cfg, show_progress=False)
    rows = _rows(tmp_path / "a")
    # each row holds the rate of its own step (step s of the row is index s - 1)
    assert [r["lr"] for r in rows] == pytest.approx(
        [0.01 * schedule.factor(r["step"] - 1, 12, kind, 2, 0.1) for r in rows], rel=1e-12)
    assert rows[-1]["lr"] < 0.01 * 0.5  # it decayed
    resumed = dataclasses.replace(cfg, out=str(tmp_path / "b"), resume=str(checkpoint.step_dir(cfg.out, 6)))
    launch(resumed, show_progress=False)
    _models_equal(tmp_path / "a", tmp_path / "b", 12)
    assert _rows(tmp_path / "b")[-1]["lr"] == rows[-1]["lr"]


def test_a_resume_with_another_schedule_is_refused_naming_it(tmp_path):
    cfg = TrainConfig(task="synthetic", workers=2, steps=6, eval_every=3, batch_size=16, task_options=SMALL,
                      lr_schedule="cosine", out=str(tmp_path / "a"), checkpoint_every=3).resolve()
    launch(cfg, show_progress=False)
    other = TrainConfig(task="synthetic", workers=2, steps=6, eval_every=3, batch_size=16, task_options=SMALL,
                        lr_schedule="wsd", out=str(tmp_path / "b"), resume=str(checkpoint.step_dir(cfg.out, 3)))
    with pytest.raises(ValueError, match=r"lr schedule cosine \(this run: wsd\)"):
        other.resolve()

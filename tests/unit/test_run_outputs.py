"""What a run writes beyond its figures: the training loss between evaluations in
metrics.jsonl (``train_loss_mean``, kept across a resume), and summary.json's timestamps,
versions and machine facts (nothing that names the host)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import socket
from pathlib import Path

import pytest
import torch

from thinwire.comm.local import LocalWorld
from thinwire.run import checkpoint
from thinwire.run.config import TrainConfig
from thinwire.run.trainer import train_rank

SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}


def _cfg(tmp: Path, **kw) -> TrainConfig:
    base = dict(task="synthetic", method="identity", workers=1, steps=7, eval_every=3, out=str(tmp / "a"),
                task_options=SMALL, batch_size=16)
    return TrainConfig(**{**base, **kw}).resolve()


def _rows(out: str) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.spawns
def test_every_row_holds_the_mean_training_loss_since_the_previous_one(tmp_path):
    cfg = _cfg(tmp_path)
    losses: dict[int, float] = {}

    def report(kind, **fields):
        if kind == "step":
            losses[fields["step"]] = fields["loss"]

    LocalWorld(1).run(lambda comm: train_rank(cfg, comm, report=report))
    rows = _rows(cfg.out)
    assert [r["step"] for r in rows] == [3, 6, 7]
    windows = ([1, 2, 3], [4, 5, 6], [7])
    assert [r["train_loss_mean"] for r in rows] == [sum(losses[s] for s in w) / len(w) for w in windows]
    assert [r["train_loss"] for r in rows] == [losses[3], losses[6], losses[7]]  # the step's own, as before


@pytest.mark.spawns
def test_two_ranks_average_their_windows(tmp_path):
    cfg = _cfg(tmp_path, workers=2, steps=4, eval_every=2)
    summary = LocalWorld(2).run(lambda comm: train_rank(cfg, comm))[0]
    rows = _rows(cfg.out)
    assert [r["step"] for r in rows] == [2, 4]
    assert all(isinstance(r["train_loss_mean"], float) and r["train_loss_mean"] > 0 for r in rows)
    assert summary.final_train_loss == rows[-1]["train_loss"]


@pytest.mark.spawns
def test_a_resume_mid_window_logs_the_mean_the_straight_run_logs(tmp_path):
    cfg = _cfg(tmp_path, workers=2, steps=8, eval_every=4, checkpoint_every=2)
    LocalWorld(2).run(lambda comm: train_rank(cfg, comm))
    resumed = dataclasses.replace(cfg, out=str(tmp_path / "b"), resume=str(checkpoint.step_dir(cfg.out, 6)))
    LocalWorld(2).run(lambda comm: train_rank(resumed, comm))
    straight, again = _rows(cfg.out), _rows(resumed.out)
    assert [r["step"] for r in again] == [4, 8]
    assert again[-1]["train_loss_mean"] == straight[-1]["train_loss_mean"]  # steps 5 and 6 came from the checkpoint


@pytest.mark.spawns
def test_the_summary_says_when_and_on_what_it_ran(tmp_path):
    cfg = _cfg(tmp_path, steps=2, eval_every=2)
    before = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    LocalWorld(1).run(lambda comm: train_rank(cfg, comm))
    after = datetime.datetime.now(datetime.timezone.utc)
    summary = json.loads((Path(cfg.out) / "summary.json").read_text())
    stamps = [summary["started_at"], summary["ended_at"]]
    for stamp in stamps:
        assert len(stamp) == 20 and stamp.endswith("Z"), stamp  # 2026-01-31T12:00:00Z
    start, end = (datetime.datetime.strptime(s, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
                  for s in stamps)
    assert before <= start <= end <= after
    assert summary["torch_version"] == torch.__version__
    assert summary["python_version"] == platform.python_version()
    assert summary["machine"] == {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                  "architecture": platform.machine(), "device": "cpu"}
    assert socket.gethostname() not in json.dumps(summary["machine"])

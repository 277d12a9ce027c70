"""TensorBoard event files beside metrics.jsonl, read back with tensorboard's own reader."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from thinwire.run.config import TrainConfig
from thinwire.run.metrics import MetricsWriter, read_jsonl
from thinwire.run.tensorboard import EVENTS, scalars, tag

SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}


def _read(out: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(out))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tags_group_the_records_keys():
    keys = ("train_loss", "train_loss_mean", "test_accuracy", "modeled_seconds@1gbit,50us", "bytes_sent", "theta")
    assert [tag(k) for k in keys] == ["train/loss", "train/loss_mean", "test/accuracy", "modeled_seconds/1gbit,50us",
                                      "thinwire/bytes_sent", "thinwire/theta"]
    record = {"step": 7, "train_loss": 0.5, "test_accuracy": 0.75, "phase": "warmup", "skipped_steps": 0,
              "overlap_lead_seconds_and_shares": [[0.1, 0.5]], "non_finite": {"x": "nan"}, "hidden": True}
    assert scalars(record) == {"train/loss": 0.5, "test/accuracy": 0.75, "thinwire/skipped_steps": 0.0,
                               "thinwire/hidden": 1.0}


def test_every_record_is_written_at_its_step_and_an_earlier_runs_events_go(tmp_path):
    first = MetricsWriter(str(tmp_path), tensorboard=True)
    first.write({"step": 1, "train_loss": 9.0})
    first.close()
    history = [{"step": 2, "train_loss": 1.5, "test_accuracy": 0.25, "bytes_sent": 1000}]
    w = MetricsWriter(str(tmp_path), history, tensorboard=True)  # a resumed run: its history first
    w.write({"step": 4, "train_loss": 1.0, "test_accuracy": 0.5, "bytes_sent": 3000, "modeled_seconds@1gbit": 2.5})
    w.close()
    assert len(list(tmp_path.glob(EVENTS))) == 1  # the first run's file went with it
    assert _read(tmp_path) == {"train/loss": [(2, 1.5), (4, 1.0)], "test/accuracy": [(2, 0.25), (4, 0.5)],
                               "thinwire/bytes_sent": [(2, 1000.0), (4, 3000.0)], "modeled_seconds/1gbit": [(4, 2.5)]}


def test_without_tensorboard_no_event_file(tmp_path):
    w = MetricsWriter(str(tmp_path))
    w.write({"step": 1, "train_loss": 1.0})
    w.close()
    assert not list(tmp_path.glob(EVENTS))


@pytest.mark.spawns
@pytest.mark.timeout(180)
def test_a_training_run_writes_what_metrics_jsonl_holds(tmp_path):
    from thinwire.run.launch import launch

    cfg = TrainConfig(task="synthetic", method="dasgd:period=2", workers=2, steps=8, eval_every=4, out=str(tmp_path),
                      task_options=SMALL, batch_size=16, links=("1gbit,50us",)).resolve()
    assert cfg.tensorboard is True  # installed: on by default
    launch(cfg, show_progress=False)
    events = _read(tmp_path)
    for row in read_jsonl(os.path.join(tmp_path, "metrics.jsonl")):
        for name, value in scalars(row).items():
            assert (row["step"], pytest.approx(value, rel=1e-6)) in events[name], name  # float32 in event files
    assert {"train/loss", "test/accuracy", "thinwire/bytes_sent", "modeled_seconds/1gbit,50us",
            "thinwire/delay"} <= set(events)
    off = dataclasses.replace(cfg, out=str(tmp_path / "off"), tensorboard=False)
    launch(off, show_progress=False)
    assert not list((tmp_path / "off").glob(EVENTS))


def test_asking_for_tensorboard_without_the_package_names_the_install(monkeypatch):
    monkeypatch.setattr("thinwire.run.tensorboard.available", lambda: False)
    with pytest.raises(ValueError, match=r"--tensorboard needs the tensorboard package: pip install "
                                         r"'thinwire\[tensorboard\]'"):
        TrainConfig(task="synthetic", tensorboard=True, task_options=SMALL).resolve()
    assert TrainConfig(task="synthetic", task_options=SMALL).resolve().tensorboard is False

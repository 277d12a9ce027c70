"""--on-nonfinite and stop requests: every rank agrees on the step, a NaN gradient is caught
before anything is encoded, and a stopped run resumes exactly."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch

from thinwire.comm.local import LocalWorld
from thinwire.run import checkpoint
from thinwire.run.config import TrainConfig
from thinwire.run.trainer import train_rank
from thinwire.tasks.synthetic import Synthetic

SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}


def _cfg(tmp: Path, **kw) -> TrainConfig:
    base = dict(task="synthetic", method="topk:ratio=0.1", workers=2, steps=6, eval_every=3, out=str(tmp / "run"),
                task_options=SMALL, batch_size=16)
    base.update(kw)
    return TrainConfig(**base).resolve()


class Poison:
    """A bad value in rank 1's batch at the given steps."""

    def __init__(self) -> None:
        self.steps: set[int] = set()
        self.value = float("nan")


@pytest.fixture
def poison(monkeypatch) -> Poison:
    bad = Poison()
    original = Synthetic.train_batches

    def batches(self, rank, world_size, batch_size, start=0):
        for step, (x, y) in enumerate(original(self, rank, world_size, batch_size, start), start + 1):
            if rank == 1 and step in bad.steps:
                x = x.clone()
                x[0, 0] = bad.value
            yield x, y

    monkeypatch.setattr(Synthetic, "train_batches", batches)
    return bad


def test_raise_names_the_parameter_rank_and_step(poison, tmp_path):
    poison.steps.add(3)
    with pytest.raises(FloatingPointError, match=r"non-finite gradient in fc1.weight on rank 1 at step 3"):
        LocalWorld(2).run(lambda comm: train_rank(_cfg(tmp_path), comm))


def test_a_finite_gradient_too_large_for_its_norm_counts_as_non_finite(poison, tmp_path):
    poison.steps.add(2)
    poison.value = 3e38  # finite, but the gradients' norms overflow fp32
    with pytest.raises(FloatingPointError, match=r"non-finite gradient in fc1.weight on rank 1 at step 2"):
        LocalWorld(2).run(lambda comm: train_rank(_cfg(tmp_path), comm))


@pytest.mark.spawns
def test_a_stop_agreed_on_the_last_step_lets_the_run_finish(tmp_path, monkeypatch):
    monkeypatch.setattr("thinwire.run.trainer.STOP_POLL_SECONDS", 0.0)
    cfg = _cfg(tmp_path, steps=1, eval_every=1)
    summary = LocalWorld(2).run(lambda comm: train_rank(cfg, comm, stop_requested=lambda: True))[0]
    assert summary.stopped_at is None and (Path(cfg.out) / "summary.json").exists()


@pytest.mark.spawns
def test_skip_drops_the_step_on_every_rank_and_keeps_residuals_finite(poison, tmp_path):
    poison.steps.update({2, 5})
    cfg = _cfg(tmp_path, on_nonfinite="skip", checkpoint_every=6)
    summary = LocalWorld(2).run(lambda comm: train_rank(cfg, comm))[0]
    assert summary.skipped_steps == 2 and summary.final_loss == summary.final_loss  # not NaN
    states = [checkpoint.load_rank(checkpoint.step_dir(cfg.out, 6), r) for r in range(2)]
    for name, a in states[0]["model"].items():
        assert torch.isfinite(a).all() and torch.equal(a, states[1]["model"][name]), name  # one model, finite
    residuals = [t for t in _tensors(states[0]["method"]) + _tensors(states[1]["method"]) if t.is_floating_point()]
    assert residuals and all(torch.isfinite(t).all() for t in residuals)  # error feedback never saw the NaN


@pytest.mark.spawns
def test_a_skipped_step_leaves_the_optimizer_untouched(poison, tmp_path):
    poison.steps.add(4)
    cfg = _cfg(tmp_path, method="identity", optimizer="adam", on_nonfinite="skip", checkpoint_every=6)
    LocalWorld(2).run(lambda comm: train_rank(cfg, comm))
    for rank in range(2):
        state = checkpoint.load_rank(checkpoint.step_dir(cfg.out, 6), rank)
        assert state["seconds"]["skipped"] == 1
        # 6 steps, 1 skipped (3 layers)
        assert [float(v["step"]) for v in state["optimizer"]["state"].values()] == [5.0] * 6


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


@pytest.mark.spawns
@pytest.mark.parametrize("method", ["topk:ratio=0.1", "ab:warmup=1,cycle=6,full_steps=1",
                                    "dasgd:warmup=1,period=3,delay=2"])
def test_a_stop_request_checkpoints_and_the_resume_is_exact(method, tmp_path, monkeypatch):
    monkeypatch.setattr("thinwire.run.trainer.STOP_POLL_SECONDS", 0.0)  # agree on a stop every step
    calls = {"n": 0}
    lock = threading.Lock()

    def stop_requested() -> bool:  # asked once per step on each rank; true from the 5th ask on
        with lock:
            calls["n"] += 1
            return calls["n"] >= 5

    cfg = _cfg(tmp_path, method=method, steps=8, eval_every=4)  # ab and dasgd stop mid-schedule
    summary = LocalWorld(2).run(lambda comm: train_rank(cfg, comm, stop_requested=stop_requested))[0]
    at = summary.stopped_at
    assert at in (2, 3) and not (Path(cfg.out) / "summary.json").exists()  # stopped, not finished
    assert checkpoint.locate(cfg.out) == checkpoint.step_dir(cfg.out, at)
    resumed = LocalWorld(2).run(lambda comm: train_rank(dataclasses.replace(cfg, resume=cfg.out), comm))[0]
    straight_cfg = dataclasses.replace(cfg, out=str(tmp_path / "straight"))
    straight = LocalWorld(2).run(lambda comm: train_rank(straight_cfg, comm))[0]
    assert resumed.resumed_from == at and resumed.stopped_at is None
    for key in ("final_loss", "final_accuracy", "bytes_sent_per_worker", "messages_per_worker"):
        assert getattr(resumed, key) == getattr(straight, key), key
    rows = lambda out: [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["step"] for r in rows(cfg.out)] == [r["step"] for r in rows(straight_cfg.out)] == [4, 8]

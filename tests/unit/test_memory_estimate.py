"""A batch that cannot fit the machine's memory is refused before any rank starts
(thinwire.run.memory_estimate), by train, compare and cost, under torchrun too; the figures
it uses are the model's own, and the normal configurations are not touched."""

from __future__ import annotations

import re

import pytest
import torch

from thinwire.cli import main
from thinwire.run import config, memory_estimate
from thinwire.run.config import TrainConfig

SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_an_impossible_batch_is_refused_in_one_line_before_any_rank_starts(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--batch-size", "100000000", "--out", str(out), "--quiet"]) == 2
    err = _one_line(capsys)
    assert re.fullmatch(r"thinwire: error: --batch-size 100000000 needs about [\d.]+ TB per rank "
                        r"\(2 ranks: [\d.]+ TB\) for mnist1d's model, more than the [\d.]+ GB of memory this "
                        r"machine has available; at most about \d+ per rank would fit", err), err
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("command", [
    ["compare", "--methods", "identity,topk", "--steps", "2", "--quiet", "--out"],
    ["cost", "--workers", "2", "--methods", "identity", "--option"],
])
def test_compare_and_cost_refuse_it_the_same_way(capsys, tmp_path, command):
    last = str(tmp_path / "cmp") if command[0] == "compare" else "size=default"
    assert main([*command, last, "--batch-size", "100000000"]) == 2
    assert "--batch-size 100000000 needs about" in _one_line(capsys)
    assert not (tmp_path / "cmp" / "report.md").exists()


def test_the_footprint_is_the_models_own():
    # synthetic's MLP (depth 2): autograd keeps each ReLU's output (hidden floats) and the
    # loss's log-softmax (classes floats) per sample; the largest module output is a hidden layer
    fp = memory_estimate.footprint("synthetic", 0, None, SMALL)
    assert fp is not None
    h, c, d = SMALL["hidden"], SMALL["classes"], SMALL["dim"]
    assert fp.kept_bytes == 4 * (2 * h + c)
    assert fp.output_bytes == 4 * h
    assert fp.sample_bytes == 4 * d + 8  # float inputs, an int64 label
    params = (d * h + h) + (h * h + h) + (h * c + c)
    assert fp.parameter_bytes == 4 * params
    assert fp.data_bytes == (SMALL["samples"] + SMALL["test_samples"]) * (4 * d + 8)


def test_the_batch_it_says_fits_is_accepted_and_one_more_is_refused(monkeypatch):
    monkeypatch.setattr(config, "_available_memory", lambda: 3e9)  # the machine says 3 GB are free
    with pytest.raises(ValueError, match="more than the 3.0 GB") as refused:
        TrainConfig(batch_size=100_000_000).resolve()
    fits = int(str(refused.value).split("at most about ")[1].split(" ")[0])
    assert 1000 < fits < 100_000
    assert TrainConfig(batch_size=fits).resolve().batch_size == fits
    with pytest.raises(ValueError, match=f"--batch-size {fits + 1} needs about"):
        TrainConfig(batch_size=fits + 1).resolve()


def test_the_default_batches_of_the_bundled_tasks_are_far_from_the_limit():
    for task in ("mnist1d", "synthetic", "charlm"):
        cfg = TrainConfig(task=task).resolve()  # not refused on this machine
        fp = memory_estimate.footprint(task)
        assert fp is not None
        need = memory_estimate.estimate(cfg, fp)
        assert need.per_rank < 1e9, (task, need)
        assert need.largest_batch(8e9) > 50 * cfg.batch_size, (task, need)  # even on a machine of 8 GB


def test_a_task_that_cannot_be_built_is_left_to_the_checks_that_name_it():
    assert memory_estimate.footprint("cifar10", 0, None, {}) is None  # no --data-dir: the task check says so


def test_under_torchrun_each_rank_counts_the_ranks_on_its_machine(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"needs about .* per rank \(2 ranks: "):
        TrainConfig(batch_size=100_000_000, workers=7).resolve()  # --workers is not torchrun's world
    assert TrainConfig(batch_size=64).resolve().batch_size == 64


def test_ranks_that_do_not_fit_even_without_a_batch_are_left_to_the_workers_bound(monkeypatch):
    # --max-workers replaces the machine's bound on ranks; the batch check does not bring it back
    monkeypatch.setattr(config, "_available_memory", lambda: 3e9)
    assert TrainConfig(workers=8, max_workers=8).resolve().workers == 8  # 8 x 0.5 GB: more than 3 GB
    with pytest.raises(ValueError, match=r"--batch-size 100000 needs about .* \(2 ranks: "):
        TrainConfig(workers=2, batch_size=100_000).resolve()

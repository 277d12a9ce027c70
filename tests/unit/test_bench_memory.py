"""thinwire bench memory: state and peak in model copies, verdicts against the documented
figures, a failing run reported; and the trainer's method_state_bytes on real methods."""

from __future__ import annotations

import pytest

from thinwire.comm.local import LocalWorld
from thinwire.lab import bench_memory
from thinwire.run.config import TrainConfig
from thinwire.run.trainer import train_rank
from tiny import fake_summary


def test_copies_and_verdicts_from_the_runs_figures():
    _, params = bench_memory.measure([], launch=lambda cfg, show_progress: {"peak_rss_bytes": 0,
                                                                            "method_state_bytes": 0},
                                     say=lambda s: None)
    copy = 4 * params
    figures = {"identity": (100 * copy, 0), "topk": (101 * copy, copy), "dasgd": (103 * copy, 2.5 * copy)}

    def launch(cfg, show_progress=False):
        name = cfg.method.split(":")[0]
        if name == "qsgd":
            raise RuntimeError("rank 1 failed after step 2: boom")
        peak, state = figures[name]
        return fake_summary(peak_rss_bytes=peak, method_state_bytes=state)

    rows, _ = bench_memory.measure(["topk", "dasgd", "qsgd"], launch=launch, say=lambda s: None)
    by = {r["method"]: r for r in rows}
    assert [r["method"] for r in rows] == ["identity", "topk", "dasgd", "qsgd"]  # identity first
    assert by["topk"]["state_copies"] == pytest.approx(1.0) and by["topk"]["passed"]
    assert by["topk"]["peak_copies"] == pytest.approx(1.0)
    assert by["dasgd"]["state_copies"] == pytest.approx(2.5) and by["dasgd"]["passed"] is False  # documented 2
    assert by["qsgd"]["passed"] is None and "boom" in by["qsgd"]["error"]
    text = bench_memory.table_md(rows, params)
    assert "| dasgd | 2.500 | <= 2 | MISS |" in text and "| topk | 1.000 | <= 1 | PASS |" in text


WEIGHTS, BIASES = 24 * 32 + 32 * 32 + 32 * 4, 32 + 32 + 4  # fc1, fc2, out


@pytest.mark.parametrize("spec, numel", [
    ("identity", 0),
    ("topk:ratio=0.1,min_numel=1", WEIGHTS),  # a residual per compressed (matrix) tensor; biases travel as fp32
    ("dasgd:warmup=2", 2 * (WEIGHTS + BIASES)),  # snapshot + buffer of the whole model
])
@pytest.mark.spawns
def test_method_state_bytes_counts_what_the_method_keeps(spec, numel):
    cfg = TrainConfig(task="synthetic", method=spec, workers=2, steps=6, eval_every=6, batch_size=16,
                      task_options={"dim": 24, "hidden": 32, "classes": 4, "samples": 256,
                                    "test_samples": 64}).resolve()
    summary = LocalWorld(2).run(lambda comm: train_rank(cfg, comm))[0]
    assert summary.method_state_bytes == 4 * numel
    assert summary.peak_rss_bytes > 0

"""What the exact-resume tests compare: a straight run and the same run resumed from its
checkpoint at step ``k`` into a folder of its own, state for state."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch


def straight_and_resumed(cfg: Any, k: int, tmp_path: Path) -> tuple[Any, Any]:
    """``cfg`` (resolved, its ``out`` set, checkpointing at ``k``) run whole, then again from
    its step-``k`` checkpoint into ``tmp_path / "b"``; the two summaries."""
    from thinwire.run import checkpoint
    from thinwire.run.launch import launch

    straight = launch(cfg, show_progress=False)
    resumed = launch(dataclasses.replace(cfg, out=str(tmp_path / "b"), resume=str(checkpoint.step_dir(cfg.out, k))),
                     show_progress=False)
    assert straight is not None and resumed is not None
    return straight, resumed


def rank_states(out_a: Any, out_b: Any, step: int, workers: int) -> list[tuple[int, dict, dict]]:
    """Each rank's checkpointed state at ``step`` in the run folders ``out_a`` and ``out_b``:
    ``(rank, a, b)`` for every rank."""
    from thinwire.run import checkpoint

    return [(rank, checkpoint.load_rank(checkpoint.step_dir(out_a, step), rank),
             checkpoint.load_rank(checkpoint.step_dir(out_b, step), rank)) for rank in range(workers)]


def assert_same(a: Any, b: Any, path: str = "", *, clocks: bool = True) -> None:
    """``a`` and ``b`` equal all the way down (tensors bit for bit); ``clocks=False`` passes
    over keys naming seconds (clock readings differ between runs)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            if clocks or "seconds" not in str(k):
                assert_same(a[k], b[k], f"{path}/{k}", clocks=clocks)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", clocks=clocks)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"

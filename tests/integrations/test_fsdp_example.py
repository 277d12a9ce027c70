"""examples/fsdp_diloco.py under torchrun: 4 CPU processes as 2 groups of 2, each group one
replica sharded with FSDP2, DiLoCo between the groups; a run resumed from its checkpoint
(torch.distributed.checkpoint per group, thinwire's state per rank) is the straight run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spawn import free_port

EXAMPLE = Path(__file__).parents[2] / "examples" / "fsdp_diloco.py"
ARGS = ["--group-size", "2", "--method", "diloco:period=5", "--width", "32"]


def _torchrun(tmp: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(EXAMPLE), *ARGS, *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def _reports(tmp: Path, name: str) -> list[dict]:
    return [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.spawns
@pytest.mark.timeout(480)
def test_fsdp_groups_run_diloco_between_them_and_resume_exactly(tmp_path):
    out = _torchrun(tmp_path, "--steps", "20", "--report", "straight", "--save", "ck", "--save-at", "10")
    assert "diloco:period=5 between 2 groups of 2: final loss" in out
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "group0", "group1", *(f"thinwire.rank{r}.pt" for r in range(4))]
    _torchrun(tmp_path, "--steps", "20", "--resume", "ck", "--report", "resumed")
    straight, resumed = _reports(tmp_path, "straight"), _reports(tmp_path, "resumed")
    for a, b in zip(straight, resumed, strict=True):
        assert b["losses"] == a["losses"][10:]  # bit for bit: every loss after the resume
        assert b["digest"] == a["digest"]
    assert len({r["digest"] for r in straight}) == 1  # finish(): one model on every rank of every group
    assert straight[0]["losses"][-1] < straight[0]["losses"][0]
    for r in straight:  # 4 syncs, each rank sending its fp32 shard once (an all_reduce over 2 groups)
        assert r["bytes_between_groups"] == 4 * 4 * r["shard_numel"]

"""Hierarchical averaging on real gloo process groups: reduce_scatter over reordered
sub-groups, two-level averages equal to flat ones with identity and the same bits on every
rank with a codec, an exact resume through the trainer, and a torchrun launch of two
"nodes" (two launcher processes) on one machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_resume_gloo import SMALL

from resumes import assert_same, rank_states, straight_and_resumed
from spawn import free_port, run_ranks
from thinwire.codecs.specs import build_codec
from thinwire.comm.layout import NodeLayout
from thinwire.comm.meter import sent_bytes
from thinwire.comm.nodes import build_hierarchy
from thinwire.comm.torch_dist import TorchComm
from thinwire.hierarchical import build_aggregator
from thinwire.run.config import TrainConfig

SHAPES = {"w1": (33, 17), "b1": (33,), "w2": (9, 33), "b2": (9,)}


def _grads(rank: int, integer: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + rank)
    if integer:  # multiples of 4: every division and sum is exact, in any order
        return {k: 4.0 * torch.randint(-500, 500, s, generator=g).float() for k, s in SHAPES.items()}
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _ranks(rank: int, world: int) -> dict:
    comm = TorchComm()
    # reduce_scatter over a sub-group whose rank order is not torch's (sorted): chunk i to our rank i
    sub = comm.subgroup([3, 1])
    if sub is not None:
        x = torch.arange(6, dtype=torch.float32) + 10 * rank
        out = torch.empty(3)
        sub.reduce_scatter(x, out)
        ref = (torch.arange(6, dtype=torch.float32) * 2 + 40).view(2, 3)[sub.rank]
        assert torch.equal(out, ref), (rank, out, ref)

    flat = _grads(rank, integer=True)
    build_aggregator([(k, torch.zeros(s)) for k, s in SHAPES.items()], lambda _n, _t: build_codec("identity"),
               comm).reduce_(flat)
    comm.meter.reset()
    build_hierarchy(comm, NodeLayout(world, 2))
    hier = _grads(rank, integer=True)
    build_aggregator([(k, torch.zeros(s)) for k, s in SHAPES.items()], lambda _n, _t: build_codec("identity"),
               comm).reduce_(hier)
    for k in SHAPES:
        assert torch.equal(hier[k], flat[k]), k
        assert torch.equal(hier[k], sum(_grads(r, integer=True)[k] for r in range(world)) / world), k
    numel = sum(torch.Size(s).numel() for s in SHAPES.values())
    assert comm.meter.link_bytes("inter") == pytest.approx(sent_bytes("all_reduce", 4 * numel / 2, 2), rel=0.02)
    fp32_intra = comm.meter.link_bytes("intra")

    coded = _grads(rank, integer=False)
    topk = build_codec("topk:ratio=0.1,min_numel=100")
    agg = build_aggregator([(k, torch.zeros(s)) for k, s in SHAPES.items()], lambda _n, _t: topk, comm)
    agg.reduce_(coded)

    # bf16 inside the node: gloo's bf16 reduce_scatter and all_gather, half the bytes there; small
    # multiples of 4 keep every halving and sum exact in bf16's 8 bits, so the mean is still exact
    build_hierarchy(comm, NodeLayout(world, 2), intra_dtype="bf16")
    comm.meter.reset()

    def small(r: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(70 + r)
        return {k: 4.0 * torch.randint(-8, 9, s, generator=g).float() for k, s in SHAPES.items()}

    half = small(rank)
    build_aggregator([(k, torch.zeros(s)) for k, s in SHAPES.items()], lambda _n, _t: build_codec("identity"),
               comm).reduce_(half)
    for k in SHAPES:
        assert half[k].dtype == torch.float32
        assert torch.equal(half[k], sum(small(r)[k] for r in range(world)) / world), k
    assert comm.meter.link_bytes("intra") == fp32_intra / 2
    return coded


@pytest.mark.timeout(120)
def test_two_levels_on_gloo_equal_flat_with_identity_and_agree_bit_for_bit_with_a_codec():
    results = run_ranks(_ranks, 4, timeout=100)
    for r in range(1, 4):
        for k in SHAPES:
            assert torch.equal(results[r][k], results[0][k]), (r, k)


@pytest.mark.timeout(240)
def test_a_hierarchical_run_resumes_exactly(tmp_path):
    k = 4
    cfg = TrainConfig(task="synthetic", method="topk:ratio=0.05,min_numel=64", workers=4, ranks_per_node=2,
                      steps=2 * k, eval_every=k, out=str(tmp_path / "a"), checkpoint_every=k, task_options=SMALL,
                      batch_size=16, threads=1).resolve()
    straight, resumed = straight_and_resumed(cfg, k, tmp_path)
    for rank, a, b in rank_states(cfg.out, tmp_path / "b", 2 * k, 4):
        for part in ("model", "optimizer", "meter"):
            assert_same(a[part], b[part], f"rank {rank} {part}")
        timed = ("overlap",)  # seconds measured on the clock: never equal twice
        assert_same({k: v for k, v in a["method"].items() if k not in timed},
              {k: v for k, v in b["method"].items() if k not in timed}, f"rank {rank} method")
        assert a["method"]["nodes"] == [2, 2] and a["method"]["feedback"]  # per-shard residuals, restored
    assert resumed.final_loss == straight.final_loss and resumed.resumed_from == k
    assert straight.bytes_by_link_per_worker["inter"] > 0 and straight.ranks_per_node == 2
    assert straight.intra_dtype == "fp32"


@pytest.mark.timeout(240)
def test_torchrun_with_two_nodes_on_one_machine(tmp_path):
    out, port = tmp_path / "run", free_port()
    opts = [a for key, v in SMALL.items() for a in ("--option", f"{key}={v}")]
    env = {key: v for key, v in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "thinwire", "train", "--task", "synthetic", "--method", "topk:ratio=0.05,min_numel=64",
               "--ranks-per-node", "auto", "--intra-dtype", "bf16", "--link", "100mbit,1ms", "--steps", "6",
               "--eval-every", "3",
               "--batch-size", "16", "--threads", "1", "--quiet", "--out", str(out), *opts]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        outputs = [p.communicate(timeout=200) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    summary = json.loads(Path(out, "summary.json").read_text())
    assert summary["workers"] == 4 and summary["ranks_per_node"] == 2 and summary["intra_dtype"] == "bf16"
    by_link = summary["bytes_by_link_per_worker"]
    assert by_link["intra"] > 0 and 0 < by_link["inter"] < by_link["intra"]

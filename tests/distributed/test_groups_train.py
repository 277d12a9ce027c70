"""``thinwire train --group-size 2 --shard`` on 4 local ranks: each group's replica sharded over
its two ranks with FSDP2, the method between the groups. A run resumed from its checkpoint
(the groups' models and optimizers through torch.distributed.checkpoint, every other state in
the rank files) is the straight run bit for bit; sharded groups follow replicated ones."""

from __future__ import annotations

import dataclasses
import json

import pytest

from resumes import assert_same, rank_states, straight_and_resumed
from thinwire.run.config import TrainConfig

SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}
K = 4


def _cfg(tmp_path, spec: str, shard: bool = True) -> TrainConfig:
    return TrainConfig(task="synthetic", method=spec, workers=4, ranks_per_node=2, shard=shard, steps=2 * K,
                       eval_every=K, out=str(tmp_path / "a"), checkpoint_every=K, task_options=SMALL, batch_size=16,
                       optimizer="adamw").resolve()


@pytest.mark.spawns
@pytest.mark.timeout(240)
# streaming DiLoCo runs DiLoCo's engine, with a fragment in flight across the checkpoint; SparseLoCo's
# blocks are cut by the shard; a gradient codec's residuals are per shard (test_groups_gloo.py resumes
# top-k and PowerSGD in a user's loop)
# sync=eager: a round's 4-bit average (scatter: over the twin's groups between the groups) is in flight at the
# checkpoint
# merge=rebase: where each rank's shard stood at fragment 0's launch (step 4) is held across the checkpoint
@pytest.mark.parametrize("spec", ["streaming-diloco:period=4,fragments=2,delay=1", "sparseloco:period=3,chunk=8,k=4",
                                  "diloco:period=3,sync=eager,codec=rangefloat:bits=4;ef=true,scatter=true",
                                  "streaming-diloco:period=4,fragments=2,delay=2,merge=rebase"])
def test_sharded_groups_resume_exactly(spec, tmp_path):
    cfg = _cfg(tmp_path, spec)
    straight, resumed = straight_and_resumed(cfg, K, tmp_path)
    for rank, a, b in rank_states(cfg.out, tmp_path / "b", 2 * K, 4):
        assert "model" not in a and "optimizer" not in a  # they are in the group's folder
        assert_same(a["method"], b["method"], f"rank {rank} method")
        # the group's model and optimizer shards, through torch.distributed.checkpoint: the same bytes
        # (its .metadata names a fresh id per save)
        data = [{k: v for k, v in s["group_files"].items() if k.endswith(".distcp")} for s in (a, b)]
        assert data[0] == data[1] and len(data[0]) == 2, rank
    assert resumed.final_loss == straight.final_loss and resumed.resumed_from == K
    assert straight.shard and straight.ranks_per_node == 2


@pytest.mark.spawns
@pytest.mark.timeout(240)
def test_sharded_groups_follow_replicated_groups_from_the_command_line(tmp_path):
    sharded = _cfg(tmp_path, "diloco:period=3")
    replicated = dataclasses.replace(sharded, shard=False, out=str(tmp_path / "r"), checkpoint_every=0)
    from thinwire.run.launch import launch

    a, b = launch(sharded, show_progress=False), launch(replicated, show_progress=False)
    assert a is not None and b is not None
    rows = [[json.loads(line) for line in open(f"{c.out}/metrics.jsonl")] for c in (sharded, replicated)]
    for x, y in zip(*rows, strict=True):
        assert x["train_loss"] == pytest.approx(y["train_loss"], abs=1e-6)
        assert x["test_loss"] == pytest.approx(y["test_loss"], abs=1e-6)
    # between the groups each sharded rank sends half of what a replicated rank sends in total
    assert a.bytes_by_link_per_worker["inter"] == pytest.approx(b.bytes_by_link_per_worker["inter"], rel=0.02)
    assert a.bytes_by_link_per_worker["intra"] > 0  # FSDP2's own collectives, metered
    # rank 0 holds half of every parameter (the synthetic MLP's rows split evenly over 2 ranks), and
    # so half of the gradients, AdamW's moments and DiLoCo's θ and outer momentum
    assert a.memory is not None and b.memory is not None
    for part in ("parameters", "gradients", "method"):
        assert 2 * a.memory[part] == b.memory[part], part
    assert a.memory["fsdp_unsharded"] > 0 and b.memory["fsdp_unsharded"] == 0
    assert a.memory["activations"] > 0

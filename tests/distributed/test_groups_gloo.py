"""Worker groups on 4 gloo ranks as 2 groups of 2 (a 2-D DeviceMesh): the method runs between
the groups, in a user's loop (``thinwire.attach(..., mesh=mesh)``).

- identity between replicated groups is the flat 4-worker identity run (fp32, 1e-6);
- identity, diloco and streaming-diloco between FSDP2-sharded groups follow replicated groups
  loss for loss over 50 steps (these methods act element by element: sharding changes only
  the order of reduction; the tolerance is 1e-6, and on this model the two are equal);
- top-k with error feedback, PowerSGD and sparseloco select within a shard: every rank still
  ends with the same model, every rank's bytes between the groups are the codec's count for
  its own shard's shapes, and a resume from the method's, the model's and the optimizer's
  state is bit for bit the straight run;
- DiLoCo with each round's average behind the next (``sync=eager``, over twins of the groups)
  runs between sharded groups and between groups DDP averages inside as between replicated
  ones, and sends the blocking run's bytes;
- a group sends between groups what one unsharded worker sends, each rank its shard's part;
  FSDP's own collectives inside a group are metered apart (link ``intra``);
- methods that read whole tensors, and meshes that do not match how the model was wrapped,
  are refused by name.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from spawn import run_ranks

STEPS = 50
TOL = 1e-6  # fp32: the same sums in another order (exact on this model in practice)
SHAPES = [(30, 12), (30,), (5, 30), (5,)]  # 30 and 5 rows: even and uneven shards over 2 ranks
EAGER = "diloco:period=5,sync=eager"  # each round's average behind the next, over twins of the groups


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # rank r: flat worker r, or group r // 2's rank r % 2
    return torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)


def _build(layout: str, mesh, spec: str, wrap: str = "") -> tuple:
    import thinwire

    model = _model()
    if layout == "sharded":
        from torch.distributed.fsdp import fully_shard

        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh["group"])
        fully_shard(model, mesh=mesh["group"])
    elif wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh.get_group(1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    run = thinwire.attach(model, opt, spec, mesh=None if layout == "flat" else mesh)
    return model, opt, run


def _steps(model, opt, run, rank: int, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(run.model(x), y)
        loss.backward()
        run.after_backward(loss)
        opt.step()
        run.after_step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model) -> list[torch.Tensor]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def _train(rank: int, layout: str, mesh, spec: str, wrap: str = "") -> dict:
    model, opt, run = _build(layout, mesh, spec, wrap)
    losses = _steps(model, opt, run, rank, 0, STEPS)
    run.finish()
    return {"losses": losses, "full": _full(model), "inter": run.comm.meter.link_bytes("inter"),
            "intra": run.comm.meter.link_bytes("intra"), "bytes": run.bytes_sent}


def _resume(rank: int, mesh, spec: str, k: int, n: int) -> dict:
    """n steps straight, and k steps, every state copied, everything built again, the
    states loaded and n - k steps more: both runs' losses past k and final models."""
    model, opt, run = _build("sharded", mesh, spec)
    straight = _steps(model, opt, run, rank, 0, n)
    run.finish()
    a = _full(model)
    model, opt, run = _build("sharded", mesh, spec)
    _steps(model, opt, run, rank, 0, k)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), run.state_dict()))
    model, opt, run = _build("sharded", mesh, spec)
    model.load_state_dict(saved[0], strict=True)
    opt.load_state_dict(saved[1])
    run.load_state_dict(saved[2])
    resumed = _steps(model, opt, run, rank, k, n)
    run.finish()
    return {"straight": straight[k:], "resumed": resumed, "a": a, "b": _full(model)}


def _refusals(rank: int, mesh) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import thinwire

    out = {}
    for spec in ("dpsgd", "powergossip", "ab"):
        try:
            _build("sharded", mesh, spec)
        except ValueError as e:
            out[spec] = str(e)
    world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("all",))
    model = _model()
    fully_shard(model, mesh=world)  # sharded over all 4 ranks, not over a group's 2
    try:
        thinwire.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), "diloco", mesh=mesh)
    except ValueError as e:
        out["world-sharded"] = str(e)
    model = _model()
    fully_shard(model, mesh=mesh)  # HSDP over both dimensions: averages between the groups itself
    try:
        thinwire.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), "diloco", mesh=mesh)
    except ValueError as e:
        out["hsdp"] = str(e)
    try:
        thinwire.attach(_model(), None, "identity", mesh=world)
    except ValueError as e:
        out["1-d"] = str(e)
    return out


def _ranks(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cross", "group"))
    out: dict = {}
    out["identity", "flat"] = _train(rank, "flat", mesh, "identity")
    out["identity", "ddp"] = _train(rank, "replicated", mesh, "identity", wrap="ddp")
    for spec in ("identity", "bf16", "diloco:period=5", "streaming-diloco:period=6,fragments=2"):
        for layout in ("replicated", "sharded"):
            out[spec, layout] = _train(rank, layout, mesh, spec)
    for layout in ("replicated", "sharded"):
        out[EAGER, layout] = _train(rank, layout, mesh, EAGER)
    out[EAGER, "ddp"] = _train(rank, "replicated", mesh, EAGER, wrap="ddp")
    for spec in ("topk:ratio=0.1,ef=true", "powersgd:rank=2", "sparseloco:period=5,chunk=8,k=4"):
        out[spec, "sharded"] = _train(rank, "sharded", mesh, spec)
        out[spec, "resume"] = _resume(rank, mesh, spec, k=7, n=14)
    out["refused"] = _refusals(rank, mesh)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_ranks, 4, timeout=300)


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _params_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.spawns
@pytest.mark.timeout(320)
def test_identity_between_replicated_groups_is_the_flat_run(results):
    for r in results:
        assert _close(r["identity", "replicated"]["losses"], r["identity", "flat"]["losses"]) <= TOL
        assert _params_close(r["identity", "replicated"]["full"], r["identity", "flat"]["full"]) <= TOL
        # DDP over the group's dimension, thinwire's identity between the groups: the same mean
        assert _close(r["identity", "ddp"]["losses"], r["identity", "flat"]["losses"]) <= TOL


@pytest.mark.spawns
@pytest.mark.timeout(320)
@pytest.mark.parametrize("spec", ["identity", "bf16", "diloco:period=5", "streaming-diloco:period=6,fragments=2"])
def test_sharded_groups_follow_replicated_groups_loss_for_loss(results, spec):
    for r in results:
        assert len(r[spec, "sharded"]["losses"]) == STEPS
        assert _close(r[spec, "sharded"]["losses"], r[spec, "replicated"]["losses"]) <= TOL, spec
        assert _params_close(r[spec, "sharded"]["full"], r[spec, "replicated"]["full"]) <= TOL, spec
    # the groups are one model at the end: every rank's whole model is rank 0's
    for r in results[1:]:
        assert _params_close(r[spec, "sharded"]["full"], results[0][spec, "sharded"]["full"]) == 0.0


@pytest.mark.spawns
@pytest.mark.timeout(320)
def test_a_rounds_average_behind_the_next_runs_between_groups_of_every_layout(results):
    """sync=eager over twins of the groups: sharded groups, and groups that DDP averages inside
    (thinwire between them over the mesh's dimension 0 alone, its twin made by every process),
    follow thinwire's replicated groups loss for loss; one model at the end; the bytes between
    the groups are the blocking run's."""
    for r in results:
        for layout in ("sharded", "ddp"):
            assert _close(r[EAGER, layout]["losses"], r[EAGER, "replicated"]["losses"]) <= TOL, layout
            assert _params_close(r[EAGER, layout]["full"], r[EAGER, "replicated"]["full"]) <= TOL, layout
        assert r[EAGER, "sharded"]["inter"] == r["diloco:period=5", "sharded"]["inter"] > 0
        assert r[EAGER, "replicated"]["inter"] == r["diloco:period=5", "replicated"]["inter"] > 0
    for r in results[1:]:
        assert _params_close(r[EAGER, "sharded"]["full"], results[0][EAGER, "sharded"]["full"]) == 0.0
    # eager is not blocking: each group continued from its own preview for a round at a time
    assert _close(results[0][EAGER, "replicated"]["losses"], results[0]["diloco:period=5", "replicated"]["losses"]) > 0


def _rows(rank: int, rows: int) -> int:
    """FSDP2's dim-0 shard of ``rows`` on local rank ``rank`` of 2: ceil(rows / 2) rows first."""
    first = math.ceil(rows / 2)
    return first if rank == 0 else rows - first


def _shard_shapes(local_rank: int) -> list[tuple[int, ...]]:
    return [(_rows(local_rank, s[0]), *s[1:]) for s in SHAPES]


@pytest.mark.spawns
@pytest.mark.timeout(320)
@pytest.mark.parametrize(("spec", "per_element"), [("identity", 4), ("bf16", 2)])
def test_a_group_sends_what_one_unsharded_worker_sends(results, spec, per_element):
    numel = sum(math.prod(s) for s in SHAPES)
    for group in (0, 1):
        ranks = [results[2 * group], results[2 * group + 1]]
        # an all_reduce over 2 groups sends 2(n - 1)/n = 1 payload per rank: the whole model per group
        assert sum(r[spec, "sharded"]["inter"] for r in ranks) == STEPS * per_element * numel
        for local_rank, r in enumerate(ranks):
            mine = sum(math.prod(s) for s in _shard_shapes(local_rank))
            assert r[spec, "sharded"]["inter"] == STEPS * per_element * mine
    # DiLoCo in fp32: a sync sends the model once per group, each rank its shard
    syncs = STEPS // 5
    assert sum(results[r]["diloco:period=5", "sharded"]["inter"] for r in (0, 1)) == syncs * 4 * numel


@pytest.mark.spawns
@pytest.mark.timeout(320)
@pytest.mark.parametrize("spec", ["topk:ratio=0.1,ef=true", "powersgd:rank=2"])
def test_a_codec_between_sharded_groups_sends_its_count_for_the_shards_shapes(results, spec):
    from thinwire.codecs.specs import build_codec

    codec = build_codec(spec)
    for rank, r in enumerate(results):
        per_step = 0
        for shape in _shard_shapes(rank % 2):
            size = torch.Size(shape)
            # over 2 groups an all_gather sends (n - 1) = 1 payload, an all_reduce 2(n - 1)/n = 1
            per_step += codec.nbytes(size, torch.float32) if codec.compresses(size) else 4 * size.numel()
        assert r[spec, "sharded"]["inter"] == STEPS * per_step, (spec, rank)
        assert r[spec, "sharded"]["bytes"] == r[spec, "sharded"]["inter"] + r[spec, "sharded"]["intra"]


@pytest.mark.spawns
@pytest.mark.timeout(320)
def test_fsdps_own_traffic_inside_the_group_is_metered_apart(results):
    # each Linear is a unit: its shard (rows padded to a multiple of 2, half each) is all-gathered
    # in forward and again in backward ((G - 1) shards sent each), its gradient reduce-scattered
    # ((G - 1)/G of the padded whole): 3 shards of fp32 per unit and step at G = 2
    shard = sum(math.ceil(w[0] / 2) * (w[1] + 1) for w in (SHAPES[0], SHAPES[2]))  # weight rows and bias
    for r in results:
        assert r["identity", "sharded"]["intra"] == STEPS * 3 * 4 * shard
        assert r["identity", "flat"]["intra"] == 0


@pytest.mark.spawns
@pytest.mark.timeout(320)
@pytest.mark.parametrize("spec", ["topk:ratio=0.1,ef=true", "powersgd:rank=2", "sparseloco:period=5,chunk=8,k=4"])
def test_a_shard_selects_on_its_own_and_the_ranks_still_agree_and_resume_exactly(results, spec):
    for r in results:
        assert all(math.isfinite(v) for v in r[spec, "sharded"]["losses"])
        assert _params_close(r[spec, "sharded"]["full"], results[0][spec, "sharded"]["full"]) == 0.0
        resumed = r[spec, "resume"]
        assert resumed["resumed"] == resumed["straight"], spec
        for a, b in zip(resumed["a"], resumed["b"], strict=True):
            assert torch.equal(a, b), spec


@pytest.mark.spawns
@pytest.mark.timeout(320)
def test_what_cannot_run_between_groups_is_refused_by_name(results):
    refused = results[0]["refused"]
    assert refused["dpsgd"] == ("dpsgd cannot run between groups of sharded ranks: it exchanges whole models with "
                                "its graph neighbours by rank")
    assert refused["powergossip"].startswith("powergossip cannot run between groups of sharded ranks")
    assert refused["ab"].startswith("ab cannot run between groups of sharded ranks")
    assert "sharded over ranks [0, 1, 2, 3]" in refused["world-sharded"]
    assert "HSDP" in refused["hsdp"]
    assert refused["1-d"] == "a mesh of worker groups has 2 dimensions (across groups, inside a group), this one has 1"

"""Worker groups: a worker is a group of ranks that trains one replica in step over a fast
link, and thinwire's method runs between the groups, over the slow one.

The layout is a 2-D ``torch.distributed.device_mesh.DeviceMesh``: dimension 0 across the
groups, dimension 1 inside one (torchtitan's HSDP order), ``G`` consecutive ranks per group
(torchrun's nodes). Inside a group the ranks are either

* **replicas**: the user's model is plain (thinwire averages its gradients inside the group
  in fp32 every step, as DDP does, then each rank carries ``1/G`` of every average across:
  :mod:`thinwire.hierarchical`), or wrapped in PyTorch's ``DistributedDataParallel`` over the
  group's dimension (DDP averages inside; thinwire runs the method over dimension 0 alone,
  each rank sending the whole model); or
* **shards**: the model is wrapped with FSDP2's ``fully_shard`` over the group's dimension,
  its parameters DTensors of which each rank holds a shard. FSDP averages the gradients
  inside the group (its reduce-scatter); thinwire averages each rank's shard (its DTensors'
  local tensors, :func:`local_part`) with the same shard in the other groups, over dimension 0.

:func:`worker_groups` reads which of these a model is and gives the communicator a method
runs over. Nothing here shards anything: the shards are FSDP2's.
"""

from __future__ import annotations

from typing import Any

import torch

from thinwire.comm.base import Communicator
from thinwire.comm.layout import NodeLayout
from thinwire.comm.meter import ByteMeter
from thinwire.comm.nodes import build_hierarchy, check_mesh


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's local tensor (a view that writes
    through to the shard), any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (this rank holds a part of it)."""
    return callable(getattr(t, "to_local", None))


def shard_mesh(model: torch.nn.Module) -> Any:
    """The 1-D ``DeviceMesh`` the model's parameters are sharded over (``fully_shard``), or
    None when none is a DTensor. Raises ``ValueError`` when they are sharded over several
    meshes, or over a mesh of more than one dimension (HSDP, which averages between the
    groups itself)."""
    meshes = {(tuple(mesh.mesh.flatten().tolist()), mesh.ndim): mesh
              for p in model.parameters() if (mesh := getattr(p, "device_mesh", None)) is not None}
    if not meshes:
        return None
    if len(meshes) > 1:
        raise ValueError("the model's parameters are sharded over several device meshes; shard them all over the "
                         "mesh's dimension inside a group")
    mesh = next(iter(meshes.values()))
    if mesh.ndim != 1:
        raise ValueError(f"the model is sharded over a {mesh.ndim}-D mesh (HSDP averages between the groups "
                         "itself): shard it with fully_shard over the mesh's dimension inside a group (mesh[its name])")
    return mesh


def worker_groups(model: torch.nn.Module, mesh: Any, world: Communicator | None = None, *,
                  intra_dtype: str = "fp32") -> Communicator:
    """The communicator a method runs over for ``model`` laid out on the 2-D ``mesh``
    (dimension 0 across groups, dimension 1 inside one): the world with its groups
    (:func:`~thinwire.comm.nodes.build_hierarchy` over the mesh's process groups: sharded when
    the model's parameters are ``fully_shard`` DTensors, replicated for a plain model), or, for
    a model wrapped in ``DistributedDataParallel`` over dimension 1, the communicator over
    dimension 0 alone. Every rank calls it, in the same order. Raises ``ValueError`` naming
    the rule when the model is wrapped over another group than the mesh's dimension 1."""
    from thinwire.comm.torch_dist import TorchComm

    world = world if world is not None else TorchComm()
    if getattr(mesh, "ndim", None) == 2 and mesh.mesh.numel() != world.world_size:
        raise ValueError(f"the mesh holds {mesh.mesh.numel()} ranks, the world {world.world_size}")
    layout = NodeLayout(world.world_size, mesh.size(1) if getattr(mesh, "ndim", None) == 2 else world.world_size)
    check_mesh(mesh, layout)
    rank = world.rank
    mine = layout.node_ranks(layout.node(rank))
    held = shard_mesh(model)
    if held is not None:
        ranks = sorted(held.mesh.flatten().tolist())
        if ranks != sorted(mine):
            raise ValueError(f"the model is sharded over ranks {ranks}, the mesh's dimension inside a group holds "
                             f"{sorted(mine)} on rank {rank}: shard it over dimension 1, "
                             "fully_shard(model, mesh=mesh[its name])")
        build_hierarchy(world, layout, intra_dtype=intra_dtype, mesh=mesh, sharded=True)
        meter_fsdp(model, world.meter)  # FSDP's own traffic, counted inside the groups
        return world
    group = getattr(model, "process_group", None)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        import torch.distributed as dist

        ranks = sorted(dist.get_process_group_ranks(group)) if group is not None else list(range(world.world_size))
        if ranks != sorted(mine):
            raise ValueError(f"the model's DistributedDataParallel averages over ranks {ranks}, the mesh's dimension "
                             f"inside a group holds {sorted(mine)} on rank {rank}: wrap it with "
                             "DistributedDataParallel(model, process_group=mesh.get_group(1))")
        local_rank = layout.local_rank(rank)
        return TorchComm(mesh.get_group(0), _order=layout.peers(local_rank))
    build_hierarchy(world, layout, intra_dtype=intra_dtype, mesh=mesh)
    return world


def shard_replica(model: torch.nn.Module, mesh: Any) -> list[torch.nn.Module]:
    """Shard ``model`` over the 1-D ``mesh`` (a group's ranks) with FSDP2's ``fully_shard``, as
    its documentation advises, block by block: every child holding parameters of a
    ``ModuleList`` or ``Sequential`` (a transformer's layers, a ResNet stage's blocks; the
    outermost such, not what is inside a block) is a unit of its own, else every direct child
    holding parameters; then the root (what is left: embeddings, heads). Returns the units,
    the root last. Parameters become DTensors sharded on dimension 0."""
    from torch.distributed.fsdp import fully_shard

    def has_params(m: torch.nn.Module) -> bool:
        return any(True for _ in m.parameters())

    units: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and has_params(child):
                units.append(child)  # a block: its insides go with it
            else:
                visit(child)

    visit(model)
    units = units or [c for c in model.children() if has_params(c)]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return [*units, model]


def meter_fsdp(model: torch.nn.Module, meter: ByteMeter) -> int:
    """Count FSDP2's own collectives inside the group with ``meter`` (link ``intra``): each
    unit's all-gather of the parameters (its shard in, forward and, resharded, backward) and
    reduce-scatter of the gradients, as FSDP issues them (its padded buffers), through FSDP's
    custom-collective hooks; a unit whose collectives the user replaced keeps them, unmetered.
    Returns how many units it saw."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class Gather(DefaultAllGather):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            meter.record("all_gather", input_tensor.numel() * input_tensor.element_size(), group.size(), "intra")
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class Scatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            meter.record("reduce_scatter", input_tensor.numel() * input_tensor.element_size(), group.size(), "intra")
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        groups = unit._get_fsdp_state()._fsdp_param_groups
        # FSDP's defaults only: a collective of the user's own stays theirs (and unmetered)
        if all(type(g._all_gather_comm) is DefaultAllGather for g in groups):
            unit.set_custom_all_gather(Gather())
        if all(type(g._reduce_scatter_comm) is DefaultReduceScatter for g in groups):
            unit.set_custom_reduce_scatter(Scatter())
    return len(units)

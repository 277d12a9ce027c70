"""Nodes: which ranks share a machine, and the communicators inside and between them.

Real clusters have two links: ranks on one node talk over NVLink, PCIe or shared memory,
nodes talk over a network ten to a thousand times slower. A :class:`NodeLayout` says which
ranks share a node, in torchrun's numbering: ``ranks_per_node`` consecutive ranks per node,
node ``k`` holding ranks ``k*L .. k*L+L-1`` (``GROUP_RANK = k``, ``LOCAL_RANK = rank - k*L``).

A :class:`Hierarchy` holds two communicators built once, identically on every rank, from the
world: ``intra`` over this rank's node (its rank is the local rank) and ``inter`` over the
ranks with this local rank, one per node (its rank is the node). An
:class:`~thinwire.aggregate.Aggregator` over a world that carries a hierarchy averages in two
levels (:mod:`thinwire.hierarchical`): uncompressed inside the node, through the codec
between nodes.

The ``L`` ranks of a node average their shards between nodes at the same time, on the node's
one network link: each gets ``1/L`` of its bandwidth. The meter says so (``inter_share``, for
the cost model), and under an :class:`~thinwire.comm.link.EmulatedLink` world ``inter`` runs
on the world's link at ``1/L`` of its bandwidth (each rank emulates its own part of the
card), while ``intra`` gets a link of its own, :data:`INTRA_LINK` unless given. The node's own
stages run in fp32 unless the hierarchy says ``bf16`` (``--intra-dtype``; :data:`INTRA_DTYPES`).
"""

from __future__ import annotations

from typing import Any

import torch

from thinwire.comm.base import Communicator, Hierarchy
from thinwire.comm.layout import INTRA_DTYPES, NodeLayout

# The link inside a node when none is given: 100 Gbit/s and 10 µs per message, the order of
# PCIe 4.0 x16 or shared memory between processes (NVLink is several times faster still).
INTRA_LINK = "100gbit,10us"


def build_hierarchy(world: Communicator, layout: NodeLayout, intra_link: str | None = None, *,
                    intra_dtype: str = "fp32", mesh: Any = None, sharded: bool = False) -> Hierarchy:
    """Create every node's and every local rank's group (all ranks call this, in the same
    order), set ``world.nodes`` and ``world.hierarchy`` and return the hierarchy. Each rank
    first checks that all ranks agree on the layout (one small all_gather, not metered).
    ``intra_link``: the link inside a node for an emulated world (default :data:`INTRA_LINK`);
    ``intra_dtype``: ``fp32`` or ``bf16``, the dtype of the collectives inside a node (bf16
    halves their bytes, rounding each gradient to bf16 before the node's sum, and the mean
    again for the node's all_gather). ``mesh``: a 2-D ``DeviceMesh`` (across groups, inside a
    group) whose process groups are used instead of new ones (a world over
    ``torch.distributed``); ``sharded``: the groups' ranks hold FSDP2 shards
    (:class:`~thinwire.comm.base.Hierarchy`)."""
    from thinwire.comm.link import EmulatedLink, Link

    if intra_dtype not in INTRA_DTYPES:
        raise ValueError(f"intra-dtype must be one of {', '.join(INTRA_DTYPES)}, got {intra_dtype!r}")

    if layout.world_size != world.world_size:
        raise ValueError(f"the node layout has {layout.world_size} ranks, the world {world.world_size}")
    _agree(world, layout)
    base = world.inner if isinstance(world, EmulatedLink) else world
    intra: Communicator | None
    inter: Communicator | None
    if mesh is not None:
        intra, inter = mesh_groups(base, layout, mesh)
    else:
        intra = inter = None
        for node in range(layout.count):  # every group is created by every rank, in this order
            intra = base.subgroup(layout.node_ranks(node)) or intra
        for local in range(layout.ranks_per_node):
            inter = base.subgroup(layout.peers(local)) or inter
    assert intra is not None and inter is not None  # every rank is on one node and has one local rank
    share = layout.ranks_per_node
    if isinstance(world, EmulatedLink):  # this rank's part of the node's card
        part = Link(latency_s=world.link.latency_s, bandwidth_Bps=world.link.bandwidth_Bps / share)
        inter = EmulatedLink(inter, part, sleep=world.sleep, _clock=world._clock)
        intra = EmulatedLink(intra, Link.parse(intra_link or INTRA_LINK), sleep=world.sleep)
    intra.scope, inter.scope = "intra", "inter"
    hierarchy = Hierarchy(layout, intra, inter, INTRA_DTYPES[intra_dtype], sharded=sharded, mesh=mesh)
    world.nodes = layout
    world.hierarchy = hierarchy if share > 1 else None
    world.meter.inter_share = share
    return hierarchy


def twin(comm: Communicator) -> Communicator:
    """A second communicator over ``comm``'s ranks (:meth:`~Communicator.same_ranks`), with
    worker groups of its own when ``comm`` has them: the same layout, links, dtype and
    sharding, on new process groups (a mesh's included), so that work on another thread (a
    background average) never meets ``comm``'s collectives in any of its groups. Every rank
    of the job calls it, in the same order. Its meter is a new one (its bytes counted apart,
    for the caller to absorb)."""
    from thinwire.comm.link import EmulatedLink
    from thinwire.comm.meter import ByteMeter

    out = comm.same_ranks()
    out.use_meter(ByteMeter(inter_share=comm.meter.inter_share))
    h = comm.hierarchy
    if h is not None:
        intra = str(h.intra.link) if isinstance(h.intra, EmulatedLink) else None
        build_hierarchy(out, h.layout, intra, intra_dtype=h.dtype_name, sharded=h.sharded)
        out.use_meter(out.meter)  # the new groups count with the twin's meter
    return out


def mesh_groups(world: Communicator, layout: NodeLayout, mesh: Any) -> tuple[Communicator, Communicator]:
    """This rank's group (``intra``) and its peers in the other groups (``inter``) as
    communicators over a 2-D ``DeviceMesh``'s own process groups: dimension 0 across the
    groups, dimension 1 inside one (torchtitan's HSDP order: replicate, then shard). The
    mesh must lay out the groups as ``layout`` does, ``G`` consecutive ranks each (torchrun's
    nodes); its bytes are counted by ``world``'s meter."""
    from thinwire.comm.torch_dist import TorchComm

    if not isinstance(world, TorchComm) or world.world_size != layout.world_size:
        raise ValueError("a DeviceMesh's groups need a communicator over every torch.distributed process")
    check_mesh(mesh, layout)
    rank = world.rank
    node, local = layout.node(rank), layout.local_rank(rank)
    intra = TorchComm(mesh.get_group(1), world.meter, _order=layout.node_ranks(node))
    inter = TorchComm(mesh.get_group(0), world.meter, _order=layout.peers(local))
    return intra, inter


def check_mesh(mesh: Any, layout: NodeLayout) -> None:
    """Raise ``ValueError`` unless ``mesh`` is 2-D and lays out ``layout``'s groups: dimension 0
    across them, dimension 1 inside one, ``G`` consecutive ranks each (torchrun's nodes)."""
    if getattr(mesh, "ndim", None) != 2:
        raise ValueError(f"a mesh of worker groups has 2 dimensions (across groups, inside a group), this one has "
                         f"{getattr(mesh, 'ndim', 'none')}")
    expected = [layout.node_ranks(k) for k in range(layout.count)]
    got = mesh.mesh.tolist()
    if got != expected:
        raise ValueError(f"the mesh's groups must be {layout.ranks_per_node} consecutive ranks each (dimension 0 "
                         f"across the groups, dimension 1 inside one: {expected}), got {got}")


def check_intra_dtype(saved: str | None, ours: str) -> None:
    """Refuse a checkpoint whose node stages ran in another dtype (``None``: saved before
    ``--intra-dtype`` existed, so fp32)."""
    saved = saved or "fp32"
    if saved != ours:
        raise ValueError(f"checkpoint was saved with --intra-dtype {saved}, this run has {ours}: resume with the "
                         "same --intra-dtype")


def _agree(world: Communicator, layout: NodeLayout) -> None:
    """Refuse a layout the ranks do not share (each rank derives it from its own environment)."""
    device = _control_device()
    mine = torch.tensor([layout.world_size, layout.ranks_per_node], dtype=torch.int64, device=device)
    every = torch.empty(world.world_size, 2, dtype=torch.int64, device=device)
    with world.meter.paused():
        world.all_gather(mine, every)
    seen = {tuple(row) for row in every.tolist()}
    if len(seen) != 1:
        raise ValueError(f"ranks disagree on the node layout (world size, ranks per node): {sorted(seen)}")


def _control_device() -> torch.device:
    """Where the layout check's tensors live: the rank's GPU under NCCL (which reduces only
    GPU tensors), else the CPU (gloo, and in-process worlds)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""Where each rank sits: ranks grouped into nodes (``--group-size``), and the dtypes the
collectives inside a node may run in. Plain data, no communicator: the meter, the launcher and
the hierarchy all read it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

# the dtypes the collectives inside a node may run in (--intra-dtype)
INTRA_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class NodeLayout:
    """``world_size`` ranks, ``ranks_per_node`` consecutive ranks on each node."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"--group-size {self.ranks_per_node} must divide the world of "
                             f"{self.world_size} ranks")

    @property
    def count(self) -> int:
        """How many nodes."""
        return self.world_size // self.ranks_per_node

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_ranks(self, node: int) -> list[int]:
        """The ranks on ``node``, by local rank."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def peers(self, local_rank: int) -> list[int]:
        """The ranks with ``local_rank``, one per node, by node."""
        return [k * self.ranks_per_node + local_rank for k in range(self.count)]

    def __str__(self) -> str:
        return f"{self.count} node(s) x {self.ranks_per_node} rank(s)"


def torchrun_layout(env: Mapping[str, str] | None = None) -> tuple[int, int, int] | None:
    """``(LOCAL_WORLD_SIZE, GROUP_RANK, LOCAL_RANK)`` as torchrun sets them, or None outside it."""
    env = os.environ if env is None else env
    if "LOCAL_WORLD_SIZE" not in env or "GROUP_RANK" not in env:
        return None
    try:
        return int(env["LOCAL_WORLD_SIZE"]), int(env["GROUP_RANK"]), int(env.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ValueError(f"torchrun's LOCAL_WORLD_SIZE, GROUP_RANK and LOCAL_RANK must be integers, got "
                         f"{env['LOCAL_WORLD_SIZE']!r}, {env['GROUP_RANK']!r}, {env.get('LOCAL_RANK')!r}") from None


def layout_for(world_size: int, ranks_per_node: int | str | None, rank: int | None = None,
               env: Mapping[str, str] | None = None) -> NodeLayout | None:
    """The layout a run asked for: ``ranks_per_node`` ranks per node (an integer, or ``"auto"``:
    torchrun's ``LOCAL_WORLD_SIZE``), or None (no nodes: every rank its own). Under torchrun
    (``rank`` given) the layout must be torchrun's: the same ranks per node, and this rank at
    ``GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``."""
    if ranks_per_node is None:
        return None
    launched = torchrun_layout(env) if rank is not None else None
    if ranks_per_node == "auto":
        if launched is None:
            raise ValueError("--group-size auto takes the layout from torchrun (LOCAL_WORLD_SIZE); "
                             "give a number of ranks per node instead")
        ranks_per_node = launched[0]
    layout = NodeLayout(world_size, int(ranks_per_node))
    if launched is not None and rank is not None:
        local_world, group_rank, local_rank = launched
        if local_world != layout.ranks_per_node:
            raise ValueError(f"--group-size {layout.ranks_per_node} disagrees with torchrun's layout: "
                             f"LOCAL_WORLD_SIZE={local_world}")
        if rank != group_rank * local_world + local_rank:
            raise ValueError(f"torchrun placed rank {rank} at node {group_rank}, local rank {local_rank}: not "
                             f"{local_world} consecutive ranks per node, which --group-size needs")
    return layout

"""Checkpoints written by rank 0 alone (Lightning, accelerate) of state that differs by rank.

thinwire's residuals and codec state are each rank's own; a framework that saves from the
main process only would keep rank 0's and hand it to every rank on load. :class:`EveryRank`
gathers every rank's state into the one file and gives each rank its own back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (in dicts, lists and tuples) moved to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def gather_states(state: Any, group: Any = None) -> list[Any] | None:
    """Every rank's ``state`` (tensors on the CPU), in rank order, on the group's first rank
    (None on the others, which write nothing); collective."""
    first = dist.get_global_rank(group, 0) if group is not None else 0
    mine = dist.get_rank() == first
    ranks: list[Any] | None = [None] * dist.get_world_size(group) if mine else None
    dist.gather_object(to_cpu(state), ranks, dst=first, group=group)
    return ranks


class EveryRank:
    """``obj``'s state from every rank in one ``state_dict`` (collective: every rank calls it;
    the states land on the group's first rank, the one that writes), and this rank's own back
    from ``load_state_dict``; a state saved by another number of ranks is refused by name."""

    def __init__(self, obj: Any, group: Any = None) -> None:
        self.obj = obj
        self.group = group

    def state_dict(self) -> dict[str, Any]:
        states = gather_states(self.obj.state_dict(), self.group)
        return {"world_size": dist.get_world_size(self.group), "ranks": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        world = dist.get_world_size(self.group)
        if state["world_size"] != world:
            raise ValueError(f"the checkpoint's thinwire state is for {state['world_size']} ranks, this run has "
                             f"{world}")
        self.obj.load_state_dict(state["ranks"][dist.get_rank(self.group)])

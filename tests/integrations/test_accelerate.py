"""thinwire.accelerate: an Accelerator loop, two CPU processes (MULTI_CPU, gloo) under
torchrun, against a plain DDP loop with the same hook; save_state/load_state exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _torchrun import torchrun

import thinwire.accelerate


@pytest.mark.timeout(240)
def test_accelerator_loop_equals_plain_ddp_and_resumes_exactly(tmp_path):
    for rank in torchrun("accelerate_fit.py", tmp_path):
        assert rank["distributed_type"] == "DistributedType.MULTI_CPU" and rank["num_processes"] == 2
        assert rank["hook_type"] == "HookState"
        assert rank["max_diff"] == 0.0 and rank["bytes"] == rank["ref_bytes"] > 0
        assert rank["resume_max_diff"] == 0.0 and rank["resumed_step"] == 6


def test_one_process_has_nothing_to_register(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert thinwire.accelerate.register(SimpleNamespace(num_processes=1), torch.nn.Linear(2, 2)) is None


def test_processes_accelerate_runs_alone_under_torchrun_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's two processes, an Accelerator without cpu=True on the CPU
    with pytest.raises(ValueError, match=r"accelerate runs this process alone, but WORLD_SIZE=2: on the CPU create "
                                         r"Accelerator\(cpu=True\)"):
        thinwire.accelerate.register(SimpleNamespace(num_processes=1), torch.nn.Linear(2, 2))


def test_a_model_accelerate_did_not_wrap_in_ddp_is_refused():
    accelerator = SimpleNamespace(num_processes=2, distributed_type="FSDP")
    with pytest.raises(ValueError, match="needs the DDP-wrapped model.*got Linear.*FSDP"):
        thinwire.accelerate.register(accelerator, torch.nn.Linear(2, 2))


class _Own:
    """A state that differs by rank."""

    def __init__(self, value: float) -> None:
        self.value = torch.tensor([value])

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"].clone()


def _every_rank(rank, world_size):
    import torch.distributed as dist

    from thinwire.integrations.ranks import EveryRank

    mine = EveryRank(_Own(10.0 + rank)).state_dict()  # collective: rank 0, the writer, holds every rank's
    held = mine["ranks"]
    file = [mine]
    dist.broadcast_object_list(file, src=0)  # what rank 0 wrote, as every rank reads it back
    saved = file[0]
    back = _Own(0.0)
    EveryRank(back).load_state_dict(saved)
    try:
        EveryRank(_Own(0.0)).load_state_dict({**saved, "world_size": 3})
        refused = ""
    except ValueError as e:
        refused = str(e)
    return (saved["world_size"], [s["value"].item() for s in saved["ranks"]], back.value.item(), refused,
            held is None)


@pytest.mark.timeout(120)
def test_every_ranks_state_goes_into_one_file_and_each_gets_its_own_back():
    from spawn import run_ranks

    for rank, (world, values, back, refused, held_none) in enumerate(run_ranks(_every_rank, 2, timeout=100)):
        assert world == 2 and values == [10.0, 11.0] and back == 10.0 + rank
        assert held_none == (rank != 0)  # only the writer receives the states
        assert refused == "the checkpoint's thinwire state is for 3 ranks, this run has 2"

"""Run under torchrun (or ``accelerate launch``) with two CPU processes: an ``Accelerator``
loop with thinwire's hook on the prepared model, against a plain DDP loop with the same hook
(the reference), and save_state/load_state carrying the hook's state.

Writes ``rank<R>.json`` into the directory given as the first argument."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import thinwire
import thinwire.accelerate

BATCH, LR, STEPS = 8, 0.1, 6
METHOD = "powersgd:rank=2"


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long())


def net() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def shard() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches, fixed (the same for the accelerate loop and the reference)."""
    loader = DataLoader(dataset(), batch_size=BATCH, sampler=DistributedSampler(dataset(), shuffle=False))
    return list(loader)[:STEPS]


def accelerate_loop(steps: range, state_dir: str | None = None, load: str | None = None):
    accelerator = Accelerator(cpu=True)  # one per loop: save_state/load_state count the models it prepared
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = accelerator.prepare(model, opt)
    hook = thinwire.accelerate.register(accelerator, model, METHOD)  # the one line
    if load:
        accelerator.load_state(load)
    batches = shard()
    for i in steps:
        x, y = batches[i]
        opt.zero_grad()
        accelerator.backward(F.cross_entropy(model(x), y))
        opt.step()
    if state_dir:
        accelerator.save_state(state_dir)
    return accelerator, accelerator.unwrap_model(model), hook


def reference():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ddp = DistributedDataParallel(model)
    state = thinwire.ddp.register(ddp, METHOD)
    for x, y in shard():
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return model, state


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main(out: str) -> None:
    accelerator, model, hook = accelerate_loop(range(STEPS))
    ref, ref_state = reference()
    half = os.path.join(out, "state")
    accelerate_loop(range(STEPS // 2), state_dir=half)
    _, resumed, resumed_hook = accelerate_loop(range(STEPS // 2, STEPS), load=half)
    result = {
        "distributed_type": str(accelerator.distributed_type),
        "num_processes": accelerator.num_processes,
        "hook_type": type(hook).__name__,
        "max_diff": (flat(model) - flat(ref)).abs().max().item(),
        "bytes": hook.scalars()["thinwire/bytes_sent"],
        "ref_bytes": ref_state.comm.meter.bytes_sent,
        "resume_max_diff": (flat(resumed) - flat(model)).abs().max().item(),
        "resumed_step": resumed_hook.step,
    }
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])

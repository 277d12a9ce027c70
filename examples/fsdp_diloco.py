"""DiLoCo between worker groups whose ranks shard one replica with FSDP2.

    torchrun --nproc-per-node 4 examples/fsdp_diloco.py --group-size 2            # CPU: gloo
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/fsdp_diloco.py --group-size 8   # a group per node, NCCL

The ranks form a 2-D DeviceMesh: dimension 0 across the groups (the slow link), dimension 1
inside a group (the fast one). Each group trains one replica sharded over its ranks with
``fully_shard``, in step every step (FSDP's reduce-scatter of the gradients); between the
groups, ``thinwire.attach(..., mesh=mesh)`` runs the method on what each rank holds: its shard
of the pseudo-gradient goes to the ranks holding the same shard in the other groups.

With ``--save DIR`` each group writes its model and optimizer through
``torch.distributed.checkpoint`` over its own ranks (``DIR/group<k>``: the groups' inner
optimizer states differ, so one checkpoint over the whole world would keep one group's), and
each rank its thinwire state (its shards of θ and the outer momentum); ``--resume DIR``
continues from them with the same layout.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import thinwire


def model_for(width: int) -> torch.nn.Module:
    torch.manual_seed(0)  # every group starts from the same replica
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                               torch.nn.GELU(), torch.nn.Linear(width, 4))


def batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: a fixed teacher's labels on fresh inputs."""
    teacher = torch.Generator().manual_seed(1)
    w = torch.randn(32, 4, generator=teacher)
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(64, 32, generator=g)
    return x.to(device), (x @ w).argmax(1).to(device)


def save(folder: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run: thinwire.Attached,
         mesh) -> None:
    """Each group's model and optimizer through torch.distributed.checkpoint over its own
    ranks; each rank's thinwire state (its shards of θ and the outer momentum) in a file."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(step)}
    rank = dist.get_rank()
    group_dir = os.path.join(folder, f"group{rank // mesh.size(1)}")
    dcp.save(state, checkpoint_id=group_dir, process_group=mesh.get_group("group"))
    torch.save(run.state_dict(), os.path.join(folder, f"thinwire.rank{rank}.pt"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group-size", type=int, default=2, help="ranks per group (they shard one replica)")
    p.add_argument("--method", default="diloco:period=10", help="the method between the groups")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--save", help="a torch.distributed.checkpoint folder to write (after --save-at steps)")
    p.add_argument("--save-at", type=int, help="the step after which to --save (default: the last)")
    p.add_argument("--resume", help="a folder --save wrote: continue from it")
    p.add_argument("--report", help="write this rank's figures as JSON to REPORT.rank<r>.json")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.group_size:
        raise SystemExit(f"--group-size {args.group_size} must divide the world of {world} ranks")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world // args.group_size, args.group_size),
                            mesh_dim_names=("cross", "group"))

    model = model_for(args.width).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["group"])
    fully_shard(model, mesh=mesh["group"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run = thinwire.attach(model, optimizer, args.method, mesh=mesh)  # <- the method between the groups

    start = 0
    if args.resume:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "step": torch.zeros((), dtype=torch.int64)}
        group_dir = os.path.join(args.resume, f"group{rank // args.group_size}")
        dcp.load(state, checkpoint_id=group_dir, process_group=mesh.get_group("group"))  # each rank its shards
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        run.load_state_dict(torch.load(os.path.join(args.resume, f"thinwire.rank{rank}.pt"), weights_only=True))
        start = int(state["step"])

    losses = []
    for step in range(start, args.steps):
        x, y = batch(rank, step, device)
        loss = F.cross_entropy(run.model(x), y)
        loss.backward()
        run.after_backward(loss)
        optimizer.step()
        run.after_step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if rank == 0 and (step + 1) % 20 == 0:
            meter = run.comm.meter  # this rank's bytes: FSDP's inside the group, the method's between groups
            print(f"step {step + 1}: loss {loss.item():.4f}; MB sent inside the group "
                  f"{meter.link_bytes('intra') / 1e6:.3f}, between groups {meter.link_bytes('inter') / 1e6:.3f}")
        if args.save and step + 1 == (args.save_at or args.steps):
            save(args.save, step + 1, model, optimizer, run, mesh)
    run.finish()  # the groups end on one model: a last outer step

    whole = [p.detach().full_tensor() for p in model.parameters()]  # every rank gathers the whole model
    if rank == 0:
        print(f"{args.method} between {world // args.group_size} groups of {args.group_size}: final loss "
              f"{losses[-1]:.4f}" if losses else "nothing left to train")
    if args.report:
        digest = float(sum(t.double().sum() * (i + 1) for i, t in enumerate(whole)))
        with open(f"{args.report}.rank{rank}.json", "w") as f:
            json.dump({"losses": losses, "digest": digest, "bytes_between_groups": run.comm.meter.link_bytes("inter"),
                       "shard_numel": sum(p.to_local().numel() for p in model.parameters())}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

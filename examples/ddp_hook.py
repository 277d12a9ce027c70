"""An existing DDP script with thinwire's comm hook: the only change is one line.

    torchrun --nproc-per-node 2 examples/ddp_hook.py --method bf16
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="bf16")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)

    thinwire.ddp.register(model, args.method)  # <- the one line

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1234 + rank)
    w_true = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=g)
        y = (x @ w_true).argmax(1)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""thinwire in a plain training loop.

Run on one machine with 2 CPU processes:
    torchrun --nproc-per-node 2 examples/plain_loop.py --method topk:ratio=0.01
"""

import argparse

import torch
import torch.distributed as dist

import thinwire


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="powersgd:rank=2")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if torch.cuda.is_available() else torch.device("cpu")

    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    reducer = thinwire.SyncReducer(model, args.method)  # the default process group

    g = torch.Generator().manual_seed(1234 + rank)  # each rank its own data
    w_true = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=g)
        y = (x @ w_true).argmax(1)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        reducer.reduce(loss)  # .grad is now the mean over ranks, through the codec
        optimizer.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f}, bytes sent so far {reducer.comm.meter.bytes_sent:,.0f}")
    if rank == 0:
        print(f"done on {world} ranks with {args.method}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""An existing DDP script with thinwire's comm hook: the only change is one line.

    torchrun --nproc-per-node 2 examples/ddp_hook.py --method bf16
    torchrun --nproc-per-node 2 examples/ddp_hook.py --method topk:ratio=0.01 --amp
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire


def train(method: str, steps: int = 200, *, amp: bool = False, log_every: int = 50) -> dict:
    """Train a small classifier under DDP with thinwire's hook on the default process group;
    returns this rank's final loss, the bytes it sent and the hook's checkpoint state."""
    rank = dist.get_rank()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    scaler = torch.amp.GradScaler(device.type, enabled=amp)  # mixed precision: give the hook the scaler

    hook = thinwire.ddp.register(model, method, scaler=scaler)  # <- the one line; keep what it returns

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1234 + rank)
    w_true = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    autocast_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    loss = torch.zeros(())
    for step in range(steps):
        x = torch.randn(64, 32, generator=g)
        y = (x @ w_true).argmax(1)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=amp):
            loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        scaler.scale(loss).backward()  # the hook averages each bucket as it is ready
        scaler.step(optimizer)
        scaler.update()
        if rank == 0 and log_every and step % log_every == 0:
            print(f"step {step}: loss {loss.item():.4f}, bytes sent so far {hook.comm.meter.bytes_sent:,.0f}")
    # the hook's state (residuals, codec state, step; keyed by parameter name) belongs in a
    # checkpoint beside the model's and the optimizer's; hook.load_state_dict restores it
    checkpoint = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "hook": hook.state_dict()}
    return {"loss": loss.item(), "bytes_sent": hook.comm.meter.bytes_sent, "checkpoint": checkpoint}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="bf16", help="a codec spec or policy preset (`thinwire methods`)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--amp", action="store_true", help="mixed precision with a GradScaler")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    result = train(args.method, args.steps, amp=args.amp)
    if dist.get_rank() == 0:
        print(f"done: loss {result['loss']:.4f}, {result['bytes_sent']:,.0f} bytes sent by rank 0")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

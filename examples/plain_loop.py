"""thinwire in a plain training loop: any method `thinwire methods` lists, attached in one line.

Run on one machine with 2 CPU processes:
    torchrun --nproc-per-node 2 examples/plain_loop.py --method topk:ratio=0.01
    torchrun --nproc-per-node 2 examples/plain_loop.py --method dasgd:period=4 --amp
"""

import argparse
import math

import torch
import torch.distributed as dist

import thinwire


def train(method: str, steps: int = 200, *, amp: bool = False, log_every: int = 50) -> dict:
    """Train a small classifier with ``method`` on the default process group; returns this
    rank's final loss and the bytes it sent."""
    rank = dist.get_rank()
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(  # three layers: AB-training factors all but the first and the last
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4),
    ).to(device)
    # a method that is an optimizer itself (DeMo: demo, peer-demo) replaces SGD; its sign steps want a small lr
    optimizer = thinwire.method_optimizer(method, model.parameters(), lr=2e-3) or torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9)
    run = thinwire.attach(model, optimizer, method)  # <- the one line: codec, policy or algorithm
    # your own learning-rate schedule, as without thinwire (here: warm-up, then cosine down to a tenth)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    # mixed precision: fp16 autocast with a loss scaler on GPUs, bf16 autocast on the CPU
    scaler = torch.amp.GradScaler(device.type, enabled=amp)
    autocast_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    g = torch.Generator().manual_seed(1234 + rank)  # each rank its own data
    w_true = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    loss = torch.zeros(())
    for step in range(steps):
        x = torch.randn(64, 32, generator=g)
        y = (x @ w_true).argmax(1)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=amp):
            loss = torch.nn.functional.cross_entropy(run.model(x), y)  # run.model: DDP's wrapper for torch-*
        scaler.scale(loss).backward()
        run.after_backward(loss, scaler=scaler)  # gradients averaged (codecs: in unscaled units)
        scaler.step(optimizer)  # skipped on every rank alike after an overflow
        scaler.update()
        run.after_step()  # models averaged or mixed, for methods with a schedule
        schedule.step()
        if rank == 0 and log_every and step % log_every == 0:
            print(f"step {step}: loss {loss.item():.4f}, bytes sent so far {run.bytes_sent:,.0f}")
    run.finish()  # AB-training's last sync (a plain model again); nothing for most methods
    # a checkpoint holds the method's state beside the model's and the optimizer's
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "method": run.state_dict()}
    group = optimizer.param_groups[0]
    return {"loss": loss.item(), "bytes_sent": run.bytes_sent, "checkpoint_keys": sorted(checkpoint),
            "lr_factor": group["lr"] / group["initial_lr"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", default="powersgd:rank=2", help="any spec `thinwire methods` lists")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--amp", action="store_true", help="mixed precision with a GradScaler")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    result = train(args.method, args.steps, amp=args.amp)
    if dist.get_rank() == 0:
        print(f"done on {dist.get_world_size()} ranks with {args.method}: loss {result['loss']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Real model, real link: ResNet-18 step time under DDP and thinwire's hook, two ranks over a shaped veth.

Two ranks, each in its own network namespace, joined by a veth pair shaped with ``tc tbf``
(``_shaped_link.py``; needs Linux, root and iproute2, and says so and skips otherwise). Each
rank: 1 torch thread, ResNet-18 at CIFAR-10 shape (11.2M parameters, 3x32x32 inputs, batch
32 of random data: the step's cost does not depend on the values), SGD, a plain DDP script as
a user writes it. Arms, each its own model copy, run in alternating blocks (A B C ... A B C),
one warm-up round first, then the median of the timed blocks:

- ``compute``: DDP under ``no_sync()`` (no communication at all: the floor);
- ``ddp``: DDP's default fp32 all_reduce; ``torch-fp16``: PyTorch's ``fp16_compress_hook``;
  ``torch-psgd-r1``: PyTorch's ``powerSGD_hook`` at rank 1 (start_powerSGD_iter=2);
- ``tw-SPEC``: ``thinwire.ddp.register(ddp, SPEC)`` (the hook overlaps the backward pass);
  ``tw-identity-inhook``: the same with ``overlap=False`` (every bucket averaged inside the
  hook, the behaviour before overlap), to show what overlap buys.

Targets (issue: real models, real links; ResNet-18): thinwire identity hook / DDP <= 1.02 at
1 Gbit/s; thinwire bf16 hook / torch fp16 hook <= 1.00 at both rates; thinwire powersgd r1
hook / torch powerSGD r1 <= 0.95 at both rates. Each is printed with PASS or MISS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import Figure, Report, alternate_blocks, load_note, median, paired_ratio, parser, table

HERE = Path(__file__).resolve().parent
RATES_MBIT = (1000, 100)
BATCH = 32
ARMS = ("compute", "ddp", "torch-fp16", "torch-psgd-r1", "tw-identity", "tw-identity-inhook", "tw-bf16",
        "tw-powersgd:rank=1", "tw-topk:ratio=0.01")
TARGETS = (  # (figure, arm, peer, target, rates)
    ("identity_hook_vs_ddp", "tw-identity", "ddp", 1.02, (1000,)),
    ("bf16_hook_vs_torch_fp16", "tw-bf16", "torch-fp16", 1.00, RATES_MBIT),
    ("powersgd_r1_hook_vs_torch", "tw-powersgd:rank=1", "torch-psgd-r1", 0.95, RATES_MBIT),
)


# -- the model ------------------------------------------------------------------------------------
def resnet18(classes: int = 10):
    """ResNet-18 for 32x32 inputs (3x3 stem, no max-pool; 11.17M parameters)."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                          if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            y = self.bn1(self.conv1(x)).relu()
            return (self.bn2(self.conv2(y)) + self.short(x)).relu()

    layers, cin = [], 64
    for cout, stride in ((64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)):
        layers.append(Block(cin, cout, stride))
        cin = cout
    return nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(), *layers,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


# -- one rank (inside its namespace) ---------------------------------------------------------------------
def rank_main(steps: int, warmup: int, blocks: int, arms: list[str], out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
               for _ in range(2)]
    loss_fn = torch.nn.CrossEntropyLoss()
    steppers, hooks = {}, {}
    for arm in arms:
        torch.manual_seed(0)
        model = DDP(resnet18())
        if arm == "torch-fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif arm == "torch-psgd-r1":
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            model.register_comm_hook(state, psgd.powerSGD_hook)
        elif arm.startswith("tw-"):
            spec = arm[3:].removesuffix("-inhook")
            hooks[arm] = thinwire.ddp.register(model, spec, overlap=not arm.endswith("-inhook"))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step(i: int, model=model, opt=opt, quiet=arm == "compute") -> None:
            x, y = batches[i % len(batches)]
            opt.zero_grad()
            if quiet:
                with model.no_sync():
                    loss_fn(model(x), y).backward()
            else:
                loss_fn(model(x), y).backward()
            opt.step()

        steppers[arm] = step
    seconds = alternate_blocks(steppers, steps, warmup, blocks)
    sent = {arm: h.comm.meter.bytes_sent for arm, h in hooks.items()}
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "bytes": sent, "steps_per_block": steps,
                                         "params": sum(p.numel() for p in resnet18().parameters())}))
    dist.barrier()
    dist.destroy_process_group()


# -- the launcher (root namespace) ---------------------------------------------------------------------
def run_rate(rate: int, steps: int, warmup: int, blocks: int, arms: list[str]) -> dict:
    from _shaped_link import ShapedPair

    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"thinwire-real-{os.getpid()}-{rate}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-worker", "--steps", str(steps), "--warmup",
           str(warmup), "--blocks", str(blocks), "--arms", ",".join(arms), "--result", str(out)]
    env = dict(os.environ, MASTER_PORT="29517", OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    with ShapedPair(rate) as pair:
        procs = [pair.popen(r, cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        logs = [p.communicate(timeout=3000)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank failed at {rate} Mbit/s:\n" + "\n".join(l[-3000:] for l in logs))
    result = json.loads(out.read_text())
    out.unlink()
    return result


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--rank-worker", action="store_true", help=argparse_hidden())
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--rates", default=",".join(map(str, RATES_MBIT)), help="link rates in Mbit/s, comma-separated")
    p.add_argument("--result")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    if args.rank_worker:
        rank_main(args.steps, args.warmup, args.blocks, arms, args.result)
        return 0
    from _shaped_link import unavailable

    why = unavailable()
    if why is not None:
        print(f"bench_real_models: skipped: {why}")
        return 0
    report = Report("Real model (ResNet-18) over a shaped link: thinwire's hook against DDP and PyTorch's hooks",
                    "python benchmarks/bench_real_models.py")
    for rate in (int(x) for x in args.rates.split(",")):
        t0 = time.perf_counter()
        r = run_rate(rate, args.steps, args.warmup, args.blocks, arms)
        sec = r["seconds"]
        floor = median(sec["compute"])
        rows = []
        for arm in arms:
            peer = {"tw-identity": "ddp", "tw-identity-inhook": "ddp", "tw-bf16": "torch-fp16",
                    "tw-powersgd:rank=1": "torch-psgd-r1"}.get(arm)
            rows.append([arm, f"{1e3 * median(sec[arm]):.0f}", f"{1e3 * min(sec[arm]):.0f}-{1e3 * max(sec[arm]):.0f}",
                         f"{paired_ratio(sec[arm], sec['compute']):.3f}",
                         f"{paired_ratio(sec[arm], sec[peer]):.3f} ({peer})" if peer else "-",
                         f"{r['bytes'][arm] / (len(sec[arm]) + args.warmup) / args.steps / 1e6:.2f}"
                         if arm in r["bytes"] else "-"])
        report.add(f"### {rate} Mbit/s each way ({len(sec['compute'])} timed blocks of {args.steps} steps, "
                         f"{time.perf_counter() - t0:.0f} s; {load_note()}); compute-only floor {1e3 * floor:.0f} ms\n\n"
                   + table(["arm", "ms/step (median)", "range", "/ compute", "/ peer", "MB sent/step (rank 0)"], rows))
        for name, arm, peer, target, rates in TARGETS:
            if rate in rates and arm in sec and peer in sec:
                ratio = paired_ratio(sec[arm], sec[peer])
                report.figures.append(Figure(f"{name}_{rate}mbit", ratio, "<=", target, "x",
                                             f"{arm} {1e3 * median(sec[arm]):.0f} ms/step, "
                                             f"{peer} {1e3 * median(sec[peer]):.0f} ms/step"))
    return report.finish(args.json)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())

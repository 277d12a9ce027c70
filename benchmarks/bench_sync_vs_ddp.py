"""thinwire ``identity`` synchronous step vs PyTorch DDP's default step, same spawned run.

2 ranks spawned with gloo, 1 torch thread each, the mnist1d CNN (0.21M parameters), batch 64
per rank, Adam. Every arm has its own copy of the model (same initial weights) and optimizer
and runs a block of steps in turn: A B A B ..., warm-up rounds first, then the median of the
timed blocks. A step is zero_grad, forward, backward, gradient averaging, optimizer step.

Arms: DDP default (bucketed fp32 all_reduce overlapped with backward) and thinwire
``SyncReducer(model, "identity")`` after backward (the figure), plus baselines: thinwire
``bf16``, DDP with ``fp16_compress_hook`` and the same step without any communication.

Target: thinwire identity step time / DDP default step time <= 1.10.
"""

from __future__ import annotations

import sys
import time
from itertools import islice

from _common import (
    Figure,
    Report,
    alternate_blocks,
    load_note,
    median,
    paired_ratio,
    parser,
    run_ranks,
    table,
    training_step,
)

TARGET = 1.10
BATCH = 64
FIGURE_ARMS = ("thinwire identity", "DDP default")


def _rank(rank: int, world: int, steps: int, warmup: int, blocks: int) -> dict:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire
    from thinwire.tasks import get

    task = get("mnist1d")(seed=0)
    batches = list(islice(task.train_batches(rank, world, BATCH), 16))
    lr = task.defaults.lr

    def arm(model, after_backward=None):
        return training_step(model, torch.optim.Adam(model.parameters(), lr=lr), batches, task.loss, after_backward)

    arms, reducers = {}, {}
    m = task.build_model()
    reducers["thinwire identity"] = r = thinwire.SyncReducer(m, "identity")
    arms["thinwire identity"] = arm(m, r.reduce)
    m = DDP(task.build_model())
    arms["DDP default"] = arm(m)
    m = task.build_model()
    reducers["thinwire bf16"] = r = thinwire.SyncReducer(m, "bf16")
    arms["thinwire bf16"] = arm(m, r.reduce)
    m = DDP(task.build_model())
    m.register_comm_hook(None, default_hooks.fp16_compress_hook)
    arms["DDP fp16_compress_hook"] = arm(m)
    m = task.build_model()
    arms["no communication"] = arm(m)

    def reset() -> None:
        for r in reducers.values():
            r.timing.codec_seconds = r.timing.comm_seconds = 0.0
            r.comm.meter.reset()

    times = alternate_blocks(arms, steps, warmup, blocks, after_warmup=reset)
    timed_steps = steps * blocks
    split = {
        name: (r.timing.codec_seconds / timed_steps, r.timing.comm_seconds / timed_steps,
               r.comm.meter.bytes_sent / timed_steps, len(r.aggregator.buckets))
        for name, r in reducers.items()
    }
    params = sum(p.numel() for p in task.build_model().parameters())
    return {"times": times, "split": split, "params": params, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    steps, warmup, blocks = (10, 1, 5) if args.quick else (20, 2, 11)
    report = Report("sync vs DDP", "python benchmarks/bench_sync_vs_ddp.py" + (" --quick" if args.quick else ""))
    t0 = time.perf_counter()
    load = load_note()
    res = run_ranks(_rank, 2, steps, warmup, blocks, threads=1, timeout=900)[0]
    times, split = res["times"], res["split"]
    ddp = times["DDP default"]
    rows = []
    for name, ts in times.items():
        codec, comm, nbytes, buckets = split.get(name, (None, None, None, None))
        rows.append((
            name, f"{median(ts) * 1e3:.2f}", f"{min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}", f"{paired_ratio(ts, ddp):.3f}",
            "-" if codec is None else f"{codec * 1e3:.3f} / {comm * 1e3:.3f}",
            "-" if nbytes is None else f"{nbytes / 1e3:.1f} KB in {buckets} bucket(s)",
        ))
    report.add(
        f"2 ranks x batch {BATCH}, mnist1d CNN ({res['params']:,} params), gloo, {res['threads']} thread/rank, "
        f"{steps} steps per block, {warmup} warm-up round(s), median of {blocks} alternating blocks; "
        f"{load} at start\n\n"
        + table(["arm", "median ms/step", "range", "/ DDP default (paired median)", "thinwire codec / comm ms/step",
                 "thinwire bytes sent/step"], rows)
    )
    ratio = paired_ratio(times["thinwire identity"], ddp)
    report.figures.append(Figure(
        "sync_identity_vs_ddp_step_time", ratio, "<=", TARGET, "x",
        f"thinwire identity {median(times['thinwire identity']) * 1e3:.2f} ms/step, "
        f"DDP default {median(ddp) * 1e3:.2f} ms/step, no-comm {median(times['no communication']) * 1e3:.2f} ms/step",
    ))
    report.seconds = time.perf_counter() - t0
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

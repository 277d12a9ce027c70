"""thinwire ``powersgd`` (rank 1 and 4) vs PyTorch's ``powerSGD_hook``, same spawned run.

2 ranks spawned with gloo, 1 torch thread each, the mnist1d CNN, batch 64 per rank, Adam.
Every arm has its own model copy and optimizer; arms run blocks of steps in turn (A B C ...),
warm-up rounds first (past torch's ``start_powerSGD_iter``: torch allows no less than 2 with
error feedback or warm start, and runs vanilla all_reduce before it), then the median of the
timed blocks.

Arms per rank r: torch ``powerSGD_hook`` on DDP (PowerSGDState(process_group=None,
matrix_approximation_rank=r, start_powerSGD_iter=2, min_compression_rate=2,
use_error_feedback=True, warm_start=True)); thinwire as a DDP hook
(``thinwire.ddp.register(model, "powersgd:rank=r")``, the apples-to-apples comparison, to
which the targets apply); thinwire as ``SyncReducer`` after backward (reported beside it).
Baselines: DDP default (fp32 all_reduce) and thinwire ``bf16`` as a DDP hook (torch's
``bf16_compress_hook`` refuses to run on CPU/gloo).

Bytes per rank and step: thinwire's from its ByteMeter; torch's by wrapping
``torch.distributed.all_reduce`` in the rank processes while a torch arm runs, with the same
ring formula 2(n-1)/n * B. Targets per rank: step time ratio (thinwire DDP hook / torch hook)
<= 1.0 and bytes equal within 1%.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
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

RANKS = (1, 4)
BATCH = 64
TIME_TARGET, BYTES_TOL = 1.0, 0.01


def _rank(rank: int, world: int, steps: int, warmup: int, blocks: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire
    from thinwire.comm.meter import ByteMeter, sent_bytes
    from thinwire.comm.torch_dist import TorchComm
    from thinwire.tasks import get

    # count torch's all_reduce bytes: the hook module calls dist.all_reduce at call time
    counted = {"arm": None, "on": False}
    torch_bytes: dict[str, float] = defaultdict(float)
    torch_calls: dict[str, int] = defaultdict(int)
    original = dist.all_reduce

    def counting_all_reduce(tensor, *a, **k):
        if counted["arm"] is not None and counted["on"]:
            torch_bytes[counted["arm"]] += sent_bytes("all_reduce", tensor.numel() * tensor.element_size(), world)
            torch_calls[counted["arm"]] += 1
        return original(tensor, *a, **k)

    dist.all_reduce = counting_all_reduce

    task = get("mnist1d")(seed=0)
    batches = list(islice(task.train_batches(rank, world, BATCH), 16))
    lr = task.defaults.lr

    def arm(model, after_backward=None):
        return training_step(model, torch.optim.Adam(model.parameters(), lr=lr), batches, task.loss, after_backward)

    def labelled(name, step):
        def run(i):
            counted["arm"] = name
            try:
                step(i)
            finally:
                counted["arm"] = None
        return run

    # time inside each DDP comm hook, from its call until its future completes (not waited on,
    # so DDP runs exactly as it would; a diagnostic beside the step times)
    hook_seconds: dict[str, float] = defaultdict(float)

    def timed_hook(name, fn):
        def hook(state, bucket):
            t0 = time.perf_counter()
            fut = fn(state, bucket)
            if counted["on"]:
                def done(_):
                    hook_seconds[name] += time.perf_counter() - t0
                fut.add_done_callback(done)
            return fut
        return hook

    arms, meters, timings, decisions = {}, {}, {}, {}
    for r in RANKS:
        spec = f"powersgd:rank={r}"
        m = DDP(task.build_model())
        state = psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2, min_compression_rate=2,
            use_error_feedback=True, warm_start=True,
        )
        m.register_comm_hook(state, timed_hook(f"torch powerSGD_hook r{r}", psgd.powerSGD_hook))
        arms[f"torch powerSGD_hook r{r}"] = labelled(f"torch powerSGD_hook r{r}", arm(m))

        m = DDP(task.build_model())
        meters[f"thinwire DDP hook r{r}"] = meter = ByteMeter()
        register = m.register_comm_hook  # thinwire.ddp.register's hook goes through the timer
        m.register_comm_hook = lambda st, fn, _r=register, _n=f"thinwire DDP hook r{r}": _r(st, timed_hook(_n, fn))
        hook_state = thinwire.ddp.register(m, spec, comm=TorchComm(None, meter))
        timings[f"thinwire DDP hook r{r}"] = hook_state
        arms[f"thinwire DDP hook r{r}"] = arm(m)

        m = task.build_model()
        meters[f"thinwire SyncReducer r{r}"] = meter = ByteMeter()
        reducer = thinwire.SyncReducer(m, spec, comm=TorchComm(None, meter))
        timings[f"thinwire SyncReducer r{r}"] = reducer
        arms[f"thinwire SyncReducer r{r}"] = arm(m, reducer.reduce)

        # which tensors each side compresses (torch: _should_compress on the (shape[0], -1) view)
        codec = thinwire.build_codec(spec)
        rows = []
        for name, p in m.named_parameters():
            rows_, cols = p.shape[0], p.numel() // p.shape[0]
            t_comp = p.dim() > 1 and psgd._should_compress(rows_, cols, min(rows_, cols, r), 2)[0]
            rows.append((name, tuple(p.shape), bool(codec.compresses(p.shape)), bool(t_comp)))
        decisions[r] = rows
    m = DDP(task.build_model())
    arms["DDP default (fp32)"] = arm(m)
    m = DDP(task.build_model())  # the bf16 baseline (torch's bf16_compress_hook refuses CPU/gloo)
    meters["thinwire bf16 DDP hook"] = meter = ByteMeter()
    timings["thinwire bf16 DDP hook"] = thinwire.ddp.register(m, "bf16", comm=TorchComm(None, meter))
    arms["thinwire bf16 DDP hook"] = arm(m)

    def start_counting() -> None:
        counted["on"] = True
        for meter in meters.values():
            meter.reset()
        for t in timings.values():
            if hasattr(t, "aggregators"):
                for agg in t.aggregators.values():
                    agg.timing.codec_seconds = agg.timing.comm_seconds = 0.0
            else:
                t.timing.codec_seconds = t.timing.comm_seconds = 0.0

    times = alternate_blocks(arms, steps, warmup, blocks, after_warmup=start_counting)
    dist.all_reduce = original
    timed = steps * blocks
    out_bytes = {k: v / timed for k, v in torch_bytes.items()}
    out_calls = {k: v / timed for k, v in torch_calls.items()}
    for name, meter in meters.items():
        out_bytes[name] = meter.bytes_sent / timed
        out_calls[name] = meter.ops.get("all_reduce").calls / timed if "all_reduce" in meter.ops else 0
    split = {name: (t.timing.codec_seconds / timed, t.timing.comm_seconds / timed) for name, t in timings.items()}
    params = sum(p.numel() for p in task.build_model().parameters())
    out_bytes["DDP default (fp32)"] = sent_bytes("all_reduce", 4 * params, world)  # computed: C++ all_reduce
    hooks = {k: v / timed for k, v in hook_seconds.items()}

    def plan(aggs) -> str:  # thinwire's buckets: one collective per bucket and round
        return " | ".join(f"{b.codec.name}({', '.join(s.name for s in b.slots)})" for a in aggs for b in a.buckets)

    plans = {  # the hook's aggregators still in use (DDP rebuilds its buckets after the first step)
        name: plan([a for a in t.aggregators.values() if a.step >= t.step] if hasattr(t, "aggregators")
                   else [t.aggregator])
        for name, t in timings.items()
    }
    return {"times": times, "bytes": out_bytes, "calls": out_calls, "split": split, "decisions": decisions,
            "hooks": hooks, "plans": plans,
            "params": params, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    steps, warmup, blocks = (10, 1, 5) if args.quick else (20, 2, 11)
    report = Report("PowerSGD vs torch powerSGD_hook",
                    "python benchmarks/bench_powersgd.py" + (" --quick" if args.quick else ""))
    t0 = time.perf_counter()
    load = load_note()
    res = run_ranks(_rank, 2, steps, warmup, blocks, threads=1, timeout=900)[0]
    times, nbytes, calls, split = res["times"], res["bytes"], res["calls"], res["split"]
    rows = []
    for name, ts in times.items():
        r = next((r for r in RANKS if name.endswith(f"r{r}")), None)
        ref = times[f"torch powerSGD_hook r{r}"] if r else times["DDP default (fp32)"]
        codec_comm = split.get(name)
        rows.append((
            name, f"{median(ts) * 1e3:.2f}", f"{min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}",
            f"{paired_ratio(ts, ref):.3f}", f"{paired_ratio(ts, times['DDP default (fp32)']):.3f}",
            "-" if codec_comm is None else f"{codec_comm[0] * 1e3:.2f} / {codec_comm[1] * 1e3:.2f}",
            f"{res['hooks'][name] * 1e3:.2f}" if name in res["hooks"] else "-", f"{nbytes[name] / 1e3:.2f}",
            "-" if name not in calls else f"{calls[name]:.0f}",
        ))
    report.add(
        f"2 ranks x batch {BATCH}, mnist1d CNN ({res['params']:,} params), gloo, {res['threads']} thread/rank, "
        f"{steps} steps per block, {warmup} warm-up round(s), median of {blocks} alternating blocks; "
        f"{load} at start\n\n"
        + table(["arm", "median ms/step", "range", "/ torch hook same rank (paired)", "/ DDP default (paired)",
                 "thinwire codec / comm ms/step", "in comm hook ms/step", "KB sent/step (2(n-1)/n B)",
                 "all_reduces/step"], rows)
        + "\n\nDDP default bytes are computed (4 B x params, ring formula): its all_reduce runs in C++, not "
          "through torch.distributed.all_reduce. In comm hook: seconds from the hook's call until its future "
          "completes, per step (a diagnostic: the part of the step each library's hook owns)."
    )
    for r in RANKS:
        diff = [(n, s, tw, tc) for n, s, tw, tc in res["decisions"][r] if tw != tc]
        lines = [f"rank {r}: thinwire and torch compress the same tensors"] if not diff else [
            f"rank {r}: tensors compressed by one side only: " + ", ".join(
                f"{n} {s} (thinwire {'yes' if tw else 'no'}, torch {'yes' if tc else 'no'})" for n, s, tw, tc in diff)
        ]
        comp = [f"{n} {s}" for n, s, tw, _ in res["decisions"][r] if tw]
        lines.append(f"  compressed: {', '.join(comp)}; every other tensor travels as fp32")
        report.add("\n".join(lines))

    report.add("thinwire's buckets (one all_reduce per bucket and round; PowerSGD has 2 rounds):\n" + "\n".join(
        f"- {name}: {len(plan.split(' | '))} bucket(s): {plan}" for name, plan in res["plans"].items()))
    for r in RANKS:
        tw, th = times[f"thinwire DDP hook r{r}"], times[f"torch powerSGD_hook r{r}"]
        sync = times[f"thinwire SyncReducer r{r}"]
        report.figures.append(Figure(
            f"powersgd_r{r}_ddp_hook_vs_torch_step_time", paired_ratio(tw, th), "<=", TIME_TARGET, "x",
            f"thinwire DDP hook {median(tw) * 1e3:.2f} ms/step, torch powerSGD_hook {median(th) * 1e3:.2f} ms/step; "
            f"thinwire SyncReducer {median(sync) * 1e3:.2f} ms/step = {paired_ratio(sync, th):.3f}x torch",
        ))
        bw, bt = nbytes[f"thinwire DDP hook r{r}"], nbytes[f"torch powerSGD_hook r{r}"]
        bs = nbytes[f"thinwire SyncReducer r{r}"]
        report.figures.append(Figure(
            f"powersgd_r{r}_bytes_diff_vs_torch", 100 * abs(bw - bt) / bt, "<=", 100 * BYTES_TOL, "%",
            f"thinwire DDP hook {bw:.0f} B/step, SyncReducer {bs:.0f} B/step, torch {bt:.0f} B/step per rank",
        ))
    report.seconds = time.perf_counter() - t0
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

"""Worker groups on a real link: 4 ranks as 2 FSDP2-sharded groups of 2, one network namespace per group, a shaped veth between.

Each group is a network namespace holding two ranks (``_shaped_link.py``: they talk over the
namespace's loopback, where FSDP2's all-gathers and reduce-scatters run); the two groups are
joined by one veth pair shaped with ``tc tbf`` at each rate (100 Mbit/s and 10 Mbit/s each way;
needs Linux, root and iproute2, and says so and skips otherwise). Every rank: 1 torch thread,
the text task's largest preset (``gpt-small``: 8 layers of width 512, 8 heads, over 256 byte
values, 25.5M parameters) at context 64, random batches of 8 windows per rank, AdamW; the
model sharded over its group with ``fully_shard`` block by block
(``thinwire.comm.groups.shard_replica``), the method between the groups through
``thinwire.attach(model, optimizer, SPEC, mesh=mesh)``. Arms, each its own model copy, run in
alternating blocks (A B C A B C) after one untimed round:

- ``compute``: the sharded group training alone (FSDP2 inside the group, nothing between the
  groups): the floor;
- ``identity``, ``bf16``: gradients averaged between the groups every step (blocks of one
  step: at 10 Mbit/s an fp32 step moves 51 MB per rank);
- ``diloco-4bit``: ``diloco:period=30,codec=rangefloat:bits=4,scatter=true``;
- ``sparseloco``: ``sparseloco:period=30`` (blocks of 30 steps: one whole round, its sync
  included, per block, with the compute floor timed the same way).

Per arm: median seconds per step, its ratio to ``compute`` (median of per-block ratios), and
this rank's MB per step between the groups (the meter's ``inter`` link) and inside the group
(``intra``: FSDP2's collectives, metered through its hooks).

Quality (``--quality``; no link, no root needed): the lowbandwidth suite's text settings (the
tiny transformer, 3,000 steps, 4 ranks of 4 windows each, AdamW at lr 0.001, 5% warm-up and
cosine to 0.1x, context 64, 512 test windows), run by ``thinwire train``: synchronous AdamW
(fp32 all_reduce every step), DiLoCo (H = 30, outer lr 0.7, the suite's) over 4 drifting
ranks, and DiLoCo between 2 groups of 2 ranks in step, replicated and sharded: the same
tokens per step in every run.

Targets: SparseLoCo <= 1.10x the compute-only step at
10 Mbit/s; DiLoCo between 2 groups of 2 within 1% of synchronous AdamW's final test loss, and
below DiLoCo's over 4 drifting ranks.
"""  # noqa: E501  (line 1 is the --help description: kept whole)

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Figure, Report, alternate_blocks, load_note, median, paired_ratio, parser, table

HERE = Path(__file__).resolve().parent
RATES_MBIT = (100, 10)
PER_GROUP = 2
H = 30
CONTEXT, BATCH = 64, 8
SYNC_ARMS = {"identity": "identity", "bf16": "bf16"}
SLOW_ARMS = {"diloco-4bit": f"diloco:period={H},codec=rangefloat:bits=4,scatter=true",
             "sparseloco": f"sparseloco:period={H}"}
TARGET = ("sparseloco", 10, 1.10)  # arm, rate, the most its step may be against compute's


def _model(preset: str):
    import torch

    from thinwire.tasks.charlm import PRESETS, TinyTransformer

    torch.manual_seed(0)
    p = PRESETS[preset]
    return TinyTransformer(256, CONTEXT, p["layers"], p["d_model"], p["heads"], 0.0)


def rank_main(preset: str, warmup: int, blocks: int, arms: list[str], out: str) -> None:
    """One rank inside its group's namespace: every arm's model, then the alternating blocks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import thinwire
    from thinwire.comm.groups import meter_fsdp, shard_replica
    from thinwire.comm.meter import ByteMeter

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // PER_GROUP, PER_GROUP), mesh_dim_names=("cross", "group"))
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (BATCH, CONTEXT + 1), generator=g) for _ in range(4)]
    runs, steps = {}, {}
    floor_meter = ByteMeter()
    for arm in ["compute", *arms]:
        model = _model(preset)
        shard_replica(model, mesh["group"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        spec = {**SYNC_ARMS, **SLOW_ARMS}.get(arm)
        run = thinwire.attach(model, optimizer, spec, mesh=mesh) if spec is not None else None
        if run is None:  # the floor's own FSDP traffic, metered as the arms' is
            meter_fsdp(model, floor_meter)
        runs[arm] = (model, optimizer, run)

        def step(i: int, model=model, optimizer=optimizer, run=run) -> None:
            tokens = batches[i % len(batches)]
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            if run is not None:
                run.after_backward(loss)
            optimizer.step()
            if run is not None:
                run.after_step()
            optimizer.zero_grad()

        steps[arm] = step
    seconds: dict[str, dict[str, list[float]]] = {}
    counted: dict[str, int] = {arm: 0 for arm in runs}
    for kind, per_block in (("sync", 1), ("slow", H)):
        chosen = [a for a in arms if a in (SYNC_ARMS if kind == "sync" else SLOW_ARMS)]
        if not chosen:
            continue
        wrapped = {}
        for arm in ["compute", *chosen]:
            def timed(i: int, arm: str = arm) -> None:
                steps[arm](i)
                counted[arm] += 1
            wrapped[arm] = timed
        marks: dict[str, tuple[int, float, float]] = {}

        def meter_of(arm: str) -> ByteMeter:
            run = runs[arm][2]
            return run.comm.meter if run is not None else floor_meter

        def mark(marks: dict = marks, wrapped: dict = wrapped) -> None:  # after the untimed round
            for a in wrapped:
                m = meter_of(a)
                marks[a] = (counted[a], m.link_bytes("inter"), m.link_bytes("intra"))

        seconds[kind] = alternate_blocks(wrapped, per_block, warmup, blocks, after_warmup=mark)
        for arm in wrapped:
            m = meter_of(arm)
            n, inter, intra = marks[arm]
            seconds[kind][f"{arm}:inter_mb"] = [(m.link_bytes("inter") - inter) / (counted[arm] - n) / 1e6]
            seconds[kind][f"{arm}:intra_mb"] = [(m.link_bytes("intra") - intra) / (counted[arm] - n) / 1e6]
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.barrier()
    dist.destroy_process_group()


def run_rate(preset: str, rate: int, warmup: int, blocks: int, arms: list[str]) -> dict:
    from _shaped_link import run_nodes

    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-worker", "--preset", preset, "--warmup",
           str(warmup), "--blocks", str(blocks), "--arms", ",".join(arms)]
    return run_nodes(rate, PER_GROUP, cmd, port=29519, timeout=7200, tag="groups")


def measure(report: Report, args) -> None:
    arms = args.arms.split(",") if args.arms else [*SYNC_ARMS, *SLOW_ARMS]
    for rate in [int(r) for r in args.rates.split(",")]:
        t0 = time.perf_counter()
        r = run_rate(args.preset, rate, args.warmup, args.blocks, arms)
        rows = []
        for kind, per_block in (("sync", 1), ("slow", H)):
            blocks = r.get(kind)
            if not blocks:
                continue
            floor = blocks["compute"]
            rows.append([f"compute ({per_block}-step blocks)", f"{median(floor) * 1e3:.0f}",
                         f"{min(floor) * 1e3:.0f}-{max(floor) * 1e3:.0f}", "1.000", "0.000",
                         f"{blocks['compute:intra_mb'][0]:.2f}"])
            for arm in [a for a in arms if a in (SYNC_ARMS if kind == "sync" else SLOW_ARMS)]:
                ratio = paired_ratio(blocks[arm], floor)
                rows.append([arm, f"{median(blocks[arm]) * 1e3:.0f}",
                             f"{min(blocks[arm]) * 1e3:.0f}-{max(blocks[arm]) * 1e3:.0f}", f"{ratio:.3f}",
                             f"{blocks[f'{arm}:inter_mb'][0]:.3f}", f"{blocks[f'{arm}:intra_mb'][0]:.2f}"])
                if (arm, rate) == TARGET[:2]:
                    report.figures.append(Figure(f"{arm}_vs_compute_{rate}mbit_sharded_groups", ratio, "<=",
                                                 TARGET[2], "x", f"{arm} {median(blocks[arm]) * 1e3:.0f} ms/step "
                                                 f"over whole rounds of {H} steps, compute "
                                                 f"{median(floor) * 1e3:.0f} ms/step"))
        report.add(f"### {args.preset}, 2 groups of {PER_GROUP} sharded ranks, {rate} Mbit/s each way between the "
                   f"groups ({args.blocks} timed blocks, {time.perf_counter() - t0:.0f} s; {load_note()})\n\n"
                   + table(["arm", "ms/step (median)", "range", "/ compute", "MB/step/rank between groups",
                            "MB/step/rank inside (FSDP2)"], rows))


QUALITY_ARGS = ["--task", "text", "--steps", "3000", "--batch-size", "4", "--eval-every", "150", "--lr", "0.001",
                "--optimizer", "adamw", "--lr-schedule", "cosine", "--warmup-steps", "150", "--min-lr", "0.1",
                "--option", "context=64", "--option", "eval_windows=512", "--workers", "4", "--quiet"]
QUALITY_RUNS = {  # name: (method, extra options)
    "synchronous AdamW": ("identity", []),
    "DiLoCo, 4 drifting ranks": ("diloco:period=30,outer_lr=0.7", []),
    "DiLoCo, 2 groups of 2 replicas": ("diloco:period=30,outer_lr=0.7", ["--group-size", "2"]),
    "DiLoCo, 2 groups of 2 shards": ("diloco:period=30,outer_lr=0.7", ["--group-size", "2", "--shard"]),
}
QUALITY_SLACK = 0.01  # within 1% of synchronous AdamW's final test loss


def quality(report: Report, keep: str | None) -> None:
    """The quality runs (see the module), one after another, through the command line."""
    base = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="thinwire-groups-"))
    rows, loss = [], {}
    for i, (name, (method, extra)) in enumerate(QUALITY_RUNS.items()):
        out = base / f"run{i}"
        cmd = [sys.executable, "-m", "thinwire", "train", *QUALITY_ARGS, "--method", method, *extra, "--out", str(out),
               "--overwrite"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        summary = json.loads((out / "summary.json").read_text())
        loss[name] = summary["final_loss"]
        by_link = summary.get("bytes_by_link_per_worker") or {}
        rows.append([name, f"`{method}` {' '.join(extra)}".strip(), f"{loss[name]:.4f}",
                     f"{summary['bytes_sent_per_worker'] / 1e6:.1f}", f"{by_link.get('inter', 0) / 1e6:.1f}",
                     f"{time.perf_counter() - t0:.0f}"])
    sync = loss["synchronous AdamW"]
    drift = loss["DiLoCo, 4 drifting ranks"]
    for name in ("DiLoCo, 2 groups of 2 replicas", "DiLoCo, 2 groups of 2 shards"):
        key = "sharded" if "shards" in name else "replicated"
        gap = loss[name] / sync - 1
        report.figures.append(Figure(f"text_diloco_2_groups_{key}_vs_sync_adamw", 100 * gap, "<=",
                                     100 * QUALITY_SLACK, "%", f"{loss[name]:.4f} vs synchronous AdamW {sync:.4f}"))
        report.figures.append(Figure(f"text_diloco_2_groups_{key}_vs_4_drifting", 100 * (loss[name] / drift - 1), "<=",
                                     0.0, "%", f"{loss[name]:.4f} vs DiLoCo over 4 drifting ranks {drift:.4f}"))
    report.add("### Quality: the lowbandwidth suite's text settings\n\n`thinwire train " + " ".join(QUALITY_ARGS)
               + " --method METHOD [--group-size 2 [--shard]]`\n\n"
               + table(["run", "method", "final test loss", "MB sent / rank", "of which between groups", "s"], rows))


def _shown(argv: list[str]) -> list[str]:
    """The command's own options, without where it writes its JSON and keeps its runs (paths of one machine)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--keep"):
            skip = True
        elif not a.startswith(("--json=", "--keep=")):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = parser(__doc__)
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", choices=["tiny", "gpt-small"], default="gpt-small",
                   help="the text task's model preset (default: its largest)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--blocks", type=int, default=2, help="timed rounds")
    p.add_argument("--arms", help="comma-separated (default: every arm)")
    p.add_argument("--rates", default=",".join(map(str, RATES_MBIT)), help="link rates in Mbit/s, comma-separated")
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--quality", action="store_true", help="also the quality runs (about 12 minutes on 2 cores)")
    p.add_argument("--no-link", action="store_true", help="leave out the shaped-link step times")
    p.add_argument("--keep", help="keep the quality runs' folders here")
    args = p.parse_args(argv)
    if args.rank_worker:
        rank_main(args.preset, args.warmup, args.blocks, args.arms.split(","), args.result)
        return 0
    from _shaped_link import unavailable

    report = Report("Worker groups: 2 sharded groups of 2 ranks over a shaped link",
                    " ".join(["python benchmarks/bench_groups.py",
                              *_shown(argv if argv is not None else sys.argv[1:])]))
    if args.quality:
        quality(report, args.keep)
    why = unavailable()
    if args.no_link:
        pass
    elif why is not None:
        report.add(f"Sharded groups over a shaped link: skipped: {why}")
    else:
        measure(report, args)
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

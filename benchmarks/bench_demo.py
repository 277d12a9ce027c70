"""DeMo and the transform family at equal steps: loss, bytes, codec time and time to a target
loss, against AdamW with fp32 all_reduce and detonation's DeMo.

1. ``thinwire compare --suite transform`` on charlm (4 workers, ``--optimizer adamw`` for the
   methods that use the run's optimizer, the task's 600 steps, seed 0, evaluations every 25
   steps), modeled at 1 Gbit/s, 100 Mbit/s and 10 Mbit/s. Every target of the suite (see
   ``thinwire.lab.suite.TRANSFORM``) is a figure here:

   * demo (chunk 64, top 32, bf16): final loss within 3% of AdamW with fp32 all_reduce;
     >= 30x fewer bytes per worker; time to the target loss (fp32's final loss + 2%) at
     10 Mbit/s >= 3x shorter than fp32's;
   * demo at about detonation's bytes (top 304 of each 64 x 64 block, bf16 + int16: 0.96x
     the bytes of detonation's top 32 at fp32 + int32 of its smaller blocks): final loss no
     higher than ``peer-demo``'s; its codec and communication seconds per step <= 1.0x the
     peer's.

   Beside them, measured without a target: demo with 1-bit values, the ``dct`` codec with
   error feedback under AdamW, the seed FFT method, top-k with error feedback and PowerSGD.
   ``--tasks charlm,mnist1d`` races mnist1d too (800 steps; detonation cannot run on its CNN:
   said in the claims). ``--from DIR[,DIR]`` reads suites already run instead.
2. Seeds (``--seeds``, not with ``--quick``): the demo-peer race on charlm at seeds 0, 1 and
   2, on 2 workers (detonation's two all_gathers per tensor make its 4-worker run take ~10
   minutes here). Figure: demo's final loss over peer-demo's, minus 1, mean of the three
   seeds less one standard error of that mean: <= 0 (not worse beyond the noise).

Time here: the charlm suite ~32 minutes, the seeds ~17, the mnist1d suite ~10.

``--quick``: 200 steps and charlm only (no loss can settle: the figures only show the
harness works). A full run writes benchmarks/results/demo.md.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Figure, Report, load_note, table
from bench_diloco import command_of, suite_parser, suites

EXTRA = ("--workers", "4", "--optimizer", "adamw")
PEER_GROUP = "demo-peer"
SEEDS, SEED_WORKERS = (0, 1, 2), 2
RESULTS = Path(__file__).resolve().parent / "results" / "demo.md"


def peer_losses(out: Path) -> tuple[float, float]:
    """(demo's, peer-demo's) final test loss in a demo-peer race's runs."""
    runs = sorted((out / PEER_GROUP / "runs").iterdir())
    losses = [json.loads((r / "summary.json").read_text())["final_loss"] for r in runs]
    return losses[0], losses[1]


def seeds_section(report: Report, tmp: Path) -> None:
    from thinwire.lab import suite

    group = next(g for g in suite.TRANSFORM if g.key == PEER_GROUP)
    pairs = []
    for seed in SEEDS:
        out = tmp / f"seed{seed}"
        cmd = [sys.executable, "-m", "thinwire", "compare", "--methods", ",".join(group.specs), "--task", "charlm",
               "--seed", str(seed), "--eval-every", "100", "--out", str(out / PEER_GROUP), "--overwrite", "--quiet",
               "--workers", str(SEED_WORKERS), "--optimizer", "adamw"]
        subprocess.run(cmd, check=False)
        pairs.append((seed, *peer_losses(out)))
    diffs = [a / b - 1 for _, a, b in pairs]
    mean = statistics.mean(diffs)
    err = statistics.stdev(diffs) / len(diffs) ** 0.5
    report.add(f"### charlm, {SEED_WORKERS} workers: demo at about detonation's bytes against detonation's DeMo, "
               "three seeds\n\n"
               + table(["seed", f"{group.seed} final test loss", "peer-demo final test loss", "demo / peer - 1"],
                       [[s, f"{a:.4f}", f"{b:.4f}", f"{100 * (a / b - 1):+.2f}%"] for s, a, b in pairs])
               + f"\n\nmean {100 * mean:+.2f}%, standard error {100 * err:.2f}%")
    report.figures.append(Figure("charlm demo over peer-demo final loss, mean of 3 seeds less one standard error",
                                 100 * (mean - err), "<=", 0.0, "%",
                                 ", ".join(f"seed {s}: {100 * (a / b - 1):+.2f}%" for s, a, b in pairs)))


def main(argv: list[str] | None = None) -> int:
    p = suite_parser(__doc__, "transform")
    p.add_argument("--seeds", action="store_true", help="also race demo against detonation's at three seeds")
    args = p.parse_args(argv)
    command = command_of("bench_demo.py", argv)
    report = Report("DeMo and the transform family: loss, bytes and time to a target loss", command)
    report.add(load_note())
    suites(report, args, "transform", EXTRA)
    if args.seeds and not args.quick:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="bench-demo-") as tmp:
            seeds_section(report, Path(tmp))
        print(f"seeds: {time.perf_counter() - t0:.0f} s", flush=True)
    code = report.finish(args.json)
    if not args.quick and not args.source:
        RESULTS.write_text("\n\n".join([f"# {report.title}", f"`{command}`", *report.sections,
                                        "## Figures", "\n".join(f"- {f.line()}" for f in report.figures)]) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())

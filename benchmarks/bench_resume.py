"""Checkpoints: what a resume recomputes, whether it ends bit-identical, what a write costs.

For each method: a straight run of STEPS steps writing a checkpoint every EVERY steps, then a
run resumed from its checkpoint at STEPS - EVERY (the newest two are kept) up to STEPS. The
resumed run must run exactly the steps after its checkpoint (target: at most one step
recomputed) and end with the straight run's parameters bit for bit; the mean checkpoint
write time and file size are reported (mnist1d CNN, 2 workers).
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import Figure, Report, load_note, parser, table
from thinwire.run import checkpoint
from thinwire.run.config import TrainConfig
from thinwire.run.launch import launch

METHODS = ("identity", "topk:ratio=0.01", "powersgd:rank=2", "dasgd", "powergossip", "ab:group_size=1")
STEPS, EVERY = 200, 50
TARGET_RECOMPUTED = 1


def _equal(a, b) -> bool:
    """Bit-for-bit equality of two state dicts (tensors, and the plain values beside them)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    steps, every = (40, 10) if args.quick else (STEPS, EVERY)
    report = Report("checkpoints: resume recomputation, exactness, write time (mnist1d, 2 workers)",
                    "python benchmarks/bench_resume.py" + (" --quick" if args.quick else ""))
    report.add(f"each method: {steps} straight steps with --checkpoint-every {every}, then --resume from step "
               f"{steps - every} up to {steps}; {load_note()}")
    t0 = time.perf_counter()
    rows, worst = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(METHODS, 1):
            base = TrainConfig(task="mnist1d", method=spec, workers=2, steps=steps, eval_every=steps,
                               checkpoint_every=every, out=str(Path(tmp) / f"{i}-a")).resolve()
            straight = launch(base, show_progress=False)
            half = checkpoint.step_dir(base.out, steps - every)
            resumed = launch(dataclasses.replace(base, out=str(Path(tmp) / f"{i}-b"), resume=str(half)),
                             show_progress=False)
            recomputed = resumed.steps_run - every
            worst = max(worst, recomputed)
            same = all(_equal(checkpoint.load_rank(checkpoint.step_dir(base.out, steps), r)["model"],
                              checkpoint.load_rank(checkpoint.step_dir(Path(tmp) / f"{i}-b", steps), r)["model"])
                       for r in range(2))
            size = (checkpoint.step_dir(base.out, steps) / "rank-0.pt").stat().st_size
            per = straight.checkpoint_seconds / max(1, straight.checkpoints_written)
            rows.append([spec.split(":")[0], straight.checkpoints_written, f"{1e3 * per:.1f}", f"{size / 1e6:.2f}",
                         resumed.steps_run, recomputed, "yes" if same else "NO"])
            print(f"[{i}/{len(METHODS)}] {spec}: {1e3 * per:.1f} ms per checkpoint, recomputed {recomputed}, "
                  f"bit-identical {same}", flush=True)
            report.figures.append(Figure(f"resumed run ends bit-identical [{spec.split(':')[0]}]", float(same), ">=",
                                         1.0, "", "1 = every parameter equal on both ranks"))
    report.add(table(["method", "checkpoints", "ms per checkpoint (write)", "MB per rank file",
                      "steps run after resume", "steps recomputed", "bit-identical"], rows))
    report.figures.append(Figure("steps recomputed by a resume (worst method)", worst, "<=", TARGET_RECOMPUTED, ""))
    report.seconds = time.perf_counter() - t0
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

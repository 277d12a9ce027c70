"""FFT compression in training: accuracy, bytes and modeled time to a target accuracy, mnist1d, 4 workers.

Seven runs of ``thinwire train`` (one subprocess each), identical but for ``--method``:
task mnist1d, 4 local workers, seed 0, the task's default steps (200 with ``--quick``),
``--eval-every 25``, links ``1gbit,50us`` and ``100mbit,1ms``. Methods: identity (the fp32
baseline), fft at a constant theta of 0.9 with 8-bit range floats, fft at its defaults
(theta falling from 0.9 to 0.5, cosine), bf16, topk at 1%, qsgd and terngrad at their defaults.

Targets, for each of the two fft runs:
- final accuracy drop vs identity (identity - fft, in accuracy points) <= 1.0;
- compression vs an fp32 all_reduce (summary.json's ``compression_ratio``) >= 15.

Time to accuracy (no target, a comparison): for each method the first evaluation (every 25
steps) with test accuracy >= TARGET_ACCURACY, and the modeled seconds at each link logged with
it (measured compute + codec seconds + the link's time for the bytes actually sent). The full
run also writes that table to benchmarks/results/fft_time_to_accuracy.md.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from _common import Figure, Report, load_note, parser
from _training import environment, progress_line, run_training, time_table, write_table_file

HERE = Path(__file__).resolve().parent
TABLE_FILE = HERE / "results" / "fft_time_to_accuracy.md"

TASK, WORKERS, SEED, EVAL_EVERY, QUICK_STEPS = "mnist1d", 4, 0, 25, 200
LINKS = ("1gbit,50us", "100mbit,1ms")
FFT_CONSTANT, FFT_DEFAULT = "fft:theta=0.9,bits=8,schedule=constant", "fft"
METHODS = ("identity", FFT_CONSTANT, FFT_DEFAULT, "bf16", "topk:ratio=0.01", "qsgd", "terngrad")
TARGET_ACCURACY = 0.90  # identity passes it at step 150 of 800 and ends near 0.946 (seed 0)
DROP_TARGET = 1.0  # accuracy points, identity - fft
COMPRESSION_TARGET = 15.0  # x vs fp32 all_reduce


# -- runs ------------------------------------------------------------------------------------------
def train_args(steps: int | None) -> list[str]:
    """The ``thinwire train`` arguments of every run but ``--method`` (``steps`` None: the
    task's default)."""
    args = ["--task", TASK, "--workers", str(WORKERS), "--seed", str(SEED), "--eval-every", str(EVAL_EVERY)]
    for link in LINKS:
        args += ["--link", link]
    return args + (["--steps", str(steps)] if steps is not None else [])


# -- figures and tables ----------------------------------------------------------------------------
def fft_figures(runs: dict[str, dict]) -> list[Figure]:
    """Accuracy drop vs identity and compression, for each fft run (NaN, a MISS, when a run failed)."""
    base = runs["identity"].get("final_accuracy")
    figures = []
    for spec in (FFT_CONSTANT, FFT_DEFAULT):
        run = runs[spec]
        acc, ratio = run.get("final_accuracy"), run.get("compression_ratio")
        # accuracy points; rounded so that float noise cannot turn an exact 1.0 into a MISS
        drop = round(100.0 * (base - acc), 6) if base is not None and acc is not None else float("nan")
        detail = (f"identity {base:.4f}, {spec} {acc:.4f}" if base is not None and acc is not None
                  else run.get("error", "identity run failed"))
        figures.append(Figure(f"final accuracy drop vs identity [{spec}]", drop, "<=", DROP_TARGET, " pts", detail))
        figures.append(Figure(
            f"compression vs fp32 [{spec}]", ratio if ratio is not None else float("nan"), ">=", COMPRESSION_TARGET,
            "x", f"{run['bytes_sent_per_worker'] / 1e6:.2f} MB vs {run['fp32_bytes_per_worker'] / 1e6:.2f} MB fp32"
            if ratio is not None else run.get("error", "")))
    return figures


def theta_note(run: dict) -> str:
    """First and last theta logged by an fft run (the schedule's range over this run)."""
    thetas = [r["theta"] for r in run.get("rows", []) if "theta" in r]
    return f"{thetas[0]:.3f} -> {thetas[-1]:.3f}" if thetas else "-"


def notes(steps: str, identity: dict) -> str:
    ends = f"identity ends at {identity['final_accuracy']:.4f}" if "final_accuracy" in identity else "identity failed"
    return (f"Task {TASK}, {WORKERS} workers, seed {SEED}, {steps}, evaluation every {EVAL_EVERY} steps; target "
            f"test accuracy {TARGET_ACCURACY:.2f} ({ends}). Step to target: the first evaluation "
            "at or above it. Modeled seconds = measured compute + codec seconds (CPU, shared machine: these move "
            "from run to run) + the link's time for the bytes each worker actually sent (deterministic for the "
            "seed). MB sent / worker and compression count every step of the run. Gather codecs (fft, topk, qsgd, "
            f"terngrad) send (n-1)B per worker where an fp32 all_reduce sends 2(n-1)/n x 4N, so at {WORKERS} workers "
            "their compression here is about half of a codec's own ratio (as in `thinwire bench codecs`).")


# -- entry -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    steps = QUICK_STEPS if args.quick else None
    command = "python benchmarks/bench_fft_training.py" + (" --quick" if args.quick else "")
    report = Report("FFT compression in training (mnist1d, 4 workers)", command)
    env = environment()
    step_note = f"{QUICK_STEPS} steps" if args.quick else "the task's default steps"
    report.add(f"{len(METHODS)} runs of thinwire train, {step_note}; {load_note()}")

    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, spec in enumerate(METHODS, 1):
            runs[spec] = run_training(spec, train_args(steps), Path(tmp) / f"run{i}")
            print(progress_line(i, len(METHODS), spec, runs[spec]), flush=True)

    thetas = "; ".join(f"{spec}: {theta_note(runs[spec])}" for spec in (FFT_CONSTANT, FFT_DEFAULT))
    steps_run = next((r["steps"] for r in runs.values() if "steps" in r), None)
    body = time_table(runs, TARGET_ACCURACY, LINKS) + "\n\n"
    body += notes(f"{steps_run} steps" if steps_run else step_note, runs["identity"])
    body += f" Theta, first -> last evaluation: {thetas}."
    report.add(body)
    report.figures.extend(fft_figures(runs))
    if not args.quick:
        each = "thinwire train --method METHOD " + " ".join(train_args(None))
        write_table_file(TABLE_FILE, "FFT compression: modeled time to accuracy, mnist1d, 4 workers", command, each,
                         env, body)
        print(f"wrote {TABLE_FILE.relative_to(HERE.parent)}", flush=True)
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

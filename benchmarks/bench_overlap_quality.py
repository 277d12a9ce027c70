"""Quality with the wire overlapped: each slow-link method with its round's average behind the next round, against its own blocking form, at the lowbandwidth suite's settings.

Every run is ``thinwire train`` on the ``text`` task at ``thinwire compare --suite
lowbandwidth``'s settings (4 workers, 3,000 steps = 100 rounds of H = 30, batch 4, context 64,
AdamW at lr 0.001, 150 warm-up steps then cosine to 0.1 x lr, 512 evaluation windows; a
corpus read 0.26 times, so no batch repeats), one seed. Pairs, each method beside the same
method without overlap:

- ``diloco`` with ``sync=eager`` (and ``sync=delayed``, the paper's naive variant; and eager at
  the outer step ``--tune`` chose on the validation windows, lr 0.4 with momentum 0.9) against
  ``sync=blocking``;
- ``sparseloco`` (outer lr 4, the suite's) with ``sync=eager`` (each rank previewing with its
  own sparse message), and at the outer lr ``--tune sparseloco`` chose on the validation
  windows (3), against blocking;
- ``streaming-diloco`` (4 fragments) with ``delay=auto`` on a 10 Mbit/s link against
  ``delay=0`` (no overlap) and the suite's ``delay=1``, in fp32 and through the 4-bit codec
  the speed target runs (``streaming4-*``), with the paper's mixing merge and with
  ``merge=rebase`` (``*-rebase``);
- MuLoCo (``diloco`` with ``--optimizer muon``) against synchronous Muon (``identity`` with
  ``--optimizer muon``): the same inner optimizer, so the gap is communication's alone.

``--rounds N`` trains each run over N rounds instead of 100 (the same warm-up, the cosine
over the whole run): whether a gap closes with the budget.

Targets (ours): overlapped DiLoCo and SparseLoCo within 1% of their blocking final loss,
Streaming DiLoCo with ``delay=auto`` within 2% of it without overlap, MuLoCo within 2% of
synchronous Muon. ``--from DIR`` reads the runs from an earlier call's folder instead of
training (each run in ``DIR/NAME``); ``--only NAME,...`` trains some of them; ``--tune
[diloco|diloco-momentum|sparseloco]`` trains that method's outer-step grid on the validation
windows instead (``diloco-momentum``: eager's outer momentum at the tuned long-run step).
"""  # noqa: E501  (line 1 is the --help description: kept whole)

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from _common import Figure, Report, given_command, parser, table

HERE = Path(__file__).resolve().parent
ROUNDS = 100  # the suite's budget: 100 rounds of H = 30
MAX_ROUNDS = 380  # at 0.26 corpus reads per 100 rounds, more would read some batches twice


def settings(rounds: int = ROUNDS) -> str:
    """The suite's settings over ``rounds`` rounds of H = 30 (the same warm-up, the cosine over
    the whole run, an evaluation every twentieth of it)."""
    steps = 30 * rounds
    return (f"--task text --workers 4 --steps {steps} --batch-size 4 --eval-every {steps // 20} --lr 0.001 "
            "--lr-schedule cosine --warmup-steps 150 --min-lr 0.1 --option context=64 --option eval_windows=512")


SETTINGS = settings()
FOUR_BIT = "codec=rangefloat:bits=4;exp_bits=3;ef=true"
RUNS = {  # name: (optimizer, method)
    "diloco": ("adamw", "diloco:period=30,outer_lr=0.7"),
    "diloco-eager": ("adamw", "diloco:period=30,outer_lr=0.7,sync=eager"),
    "diloco-delayed": ("adamw", "diloco:period=30,outer_lr=0.7,sync=delayed"),
    # the outer step --tune chose on the validation windows (outer lr 0.4, momentum 0.9)
    "diloco-eager-tuned": ("adamw", "diloco:period=30,outer_lr=0.4,outer_momentum=0.9,sync=eager"),
    "sparseloco": ("adamw", "sparseloco:period=30,outer_lr=4"),
    "sparseloco-eager": ("adamw", "sparseloco:period=30,outer_lr=4,sync=eager"),
    # the outer lr --tune sparseloco chose on the validation windows
    "sparseloco-eager-tuned": ("adamw", "sparseloco:period=30,outer_lr=3,sync=eager"),
    "streaming-0": ("adamw", "streaming-diloco:period=30,fragments=4,delay=0,outer_lr=0.7"),
    "streaming-1": ("adamw", "streaming-diloco:period=30,fragments=4,delay=1,outer_lr=0.7"),
    "streaming-auto": ("adamw", "streaming-diloco:period=30,fragments=4,delay=auto,link=10mbit;1ms,outer_lr=0.7"),
    # a merge that keeps all of a worker's steps since the launch, with theta's new value under them
    "streaming-auto-rebase": ("adamw", "streaming-diloco:period=30,fragments=4,delay=auto,link=10mbit;1ms,"
                                       "merge=rebase,outer_lr=0.7"),
    # the form the speed target runs: fragments through the 4-bit codec, which hides them in fewer steps
    "streaming4-0": ("adamw", f"streaming-diloco:period=30,fragments=4,{FOUR_BIT},delay=0,outer_lr=0.7"),
    "streaming4-auto": ("adamw", f"streaming-diloco:period=30,fragments=4,{FOUR_BIT},delay=auto,link=10mbit;1ms,"
                                 "outer_lr=0.7"),
    "streaming4-auto-rebase": ("adamw", f"streaming-diloco:period=30,fragments=4,{FOUR_BIT},delay=auto,"
                                        "link=10mbit;1ms,merge=rebase,outer_lr=0.7"),
    "muloco": ("muon", "diloco:period=30,outer_lr=0.7"),
    "muon-sync": ("muon", "identity"),
}
# --tune: the outer step for a round-old mean, chosen on the validation windows (eval_split=valid,
# the held-out windows after the test's), never on the test's; blocking at the paper's setting beside it
TUNE_DILOCO = {
    "blocking-lr0.7-m0.9": ("adamw", "diloco:period=30,outer_lr=0.7,outer_momentum=0.9"),
    **{f"eager-lr{lr}-m0.9": ("adamw", f"diloco:period=30,outer_lr={lr},outer_momentum=0.9,sync=eager")
       for lr in ("0.7", "0.5", "0.4", "0.3")},
}
# --tune diloco-momentum: the outer momentum for eager at the long-run step lr / (1 − μ) of the
# tuned eager (0.4, 0.9: 4). The preview's offset from θ scales with the gain on one round's
# gradient, k = lr (1 + μ): a higher μ at a lower lr keeps the long-run step and halves k
TUNE_DILOCO_MOMENTUM = {
    f"eager-lr{lr}-m{m}": ("adamw", f"diloco:period=30,outer_lr={lr},outer_momentum={m},sync=eager")
    for lr, m in (("0.4", "0.9"), ("0.2", "0.95"), ("0.8", "0.8"))
}
TUNE_SPARSELOCO = {  # SparseLoCo's outer SGD has no momentum: its lr alone
    "sparseloco-blocking-lr4": ("adamw", "sparseloco:period=30,outer_lr=4"),
    **{f"sparseloco-eager-lr{lr}": ("adamw", f"sparseloco:period=30,outer_lr={lr},sync=eager")
       for lr in ("4", "3", "2", "1", "0.5")},
}
TUNE = {"diloco": TUNE_DILOCO, "diloco-momentum": TUNE_DILOCO_MOMENTUM, "sparseloco": TUNE_SPARSELOCO}
TARGETS = (  # (figure, run, its baseline, bound on the relative final-loss gap)
    ("diloco_eager_final_loss_vs_blocking", "diloco-eager", "diloco", 0.01),
    ("diloco_eager_tuned_final_loss_vs_blocking", "diloco-eager-tuned", "diloco", 0.01),
    ("sparseloco_eager_final_loss_vs_blocking", "sparseloco-eager", "sparseloco", 0.01),
    ("sparseloco_eager_tuned_final_loss_vs_blocking", "sparseloco-eager-tuned", "sparseloco", 0.01),
    ("streaming_delay_auto_final_loss_vs_no_overlap", "streaming-auto", "streaming-0", 0.02),
    ("streaming_4bit_delay_auto_final_loss_vs_no_overlap", "streaming4-auto", "streaming4-0", 0.02),
    ("streaming_delay_auto_rebase_final_loss_vs_no_overlap", "streaming-auto-rebase", "streaming-0", 0.02),
    ("streaming_4bit_delay_auto_rebase_final_loss_vs_no_overlap", "streaming4-auto-rebase", "streaming4-0", 0.02),
    ("muloco_final_loss_vs_synchronous_muon", "muloco", "muon-sync", 0.02),
)


def command(name: str, out: Path, runs: dict[str, tuple[str, str]] = RUNS, extra: tuple[str, ...] = (),
            rounds: int = ROUNDS) -> list[str]:
    optimizer, method = runs[name]
    return [sys.executable, "-m", "thinwire", "train", *shlex.split(settings(rounds)), *extra, "--optimizer", optimizer,
            "--method", method, "--out", str(out / name), "--quiet"]


def tune(grid: dict[str, tuple[str, str]], folder: Path, source: bool, report: Report, json_path: str | None) -> int:
    """Train (or, with ``source``, read) one of the :data:`TUNE` grids on the validation
    windows and report its final losses, best first."""
    for name in grid:
        if source or (folder / name / "summary.json").exists():
            continue
        t0 = time.perf_counter()
        print(f"[{name}] thinwire train ... --method {grid[name][1]} (validation windows)", flush=True)
        done = subprocess.run(command(name, folder, grid, ("--option", "eval_split=valid")), cwd=HERE.parent)
        if done.returncode != 0:
            report.add(f"{name}: thinwire train failed ({done.returncode})")
            return report.finish(json_path) or 1
        print(f"[{name}] {time.perf_counter() - t0:.0f} s", flush=True)
    found = {n: json.loads((folder / n / "summary.json").read_text()) for n in grid
             if (folder / n / "summary.json").exists()}
    best_first = sorted(found.items(), key=lambda i: i[1]["final_loss"])
    rows = [[n, grid[n][1], f"{s['final_loss']:.4f}"] for n, s in best_first]
    report.add(f"Settings: `thinwire train {SETTINGS} --option eval_split=valid` with each run's `--method` "
               "(validation windows: the held-out windows after the test's).\n\n"
               + table(["run", "method", "final validation loss"], rows))
    return report.finish(json_path)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--from", dest="source", help="read the runs from this folder (one subfolder per run)")
    p.add_argument("--out", default="runs/overlap-quality", help="where the runs go (default: %(default)s)")
    p.add_argument("--only", help=f"comma-separated runs to train (default: all of {', '.join(RUNS)})")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"rounds of H = 30 each run trains (default: the suite's %(default)s; at most {MAX_ROUNDS}, "
                        "beyond which batches repeat)")
    p.add_argument("--tune", nargs="?", const="diloco", choices=list(TUNE),
                   help="train a method's outer-step grid for sync=eager on the validation windows instead "
                        "(default: diloco; folder: runs/overlap-quality-tune; runs already there are kept)")
    args = p.parse_args(argv)
    if not 1 <= args.rounds <= MAX_ROUNDS:
        p.error(f"--rounds must be between 1 and {MAX_ROUNDS} (more would read some batches twice), got {args.rounds}")
    if args.tune and args.rounds != ROUNDS:
        p.error("--tune chooses the outer step at the suite's budget: leave --rounds out")
    folder = Path(args.source or (args.out if not args.tune or "--out" in (argv or sys.argv)
                                  else "runs/overlap-quality-tune"))
    given = given_command(argv)
    report = Report("Quality with the wire overlapped (text, lowbandwidth settings)"
                    + (f": {args.tune}'s outer step for sync=eager, on the validation windows" if args.tune else ""),
                    f"python benchmarks/bench_overlap_quality.py {given}".strip())
    if args.tune:
        return tune(TUNE[args.tune], folder, args.source is not None, report, args.json)
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        p.error(f"--only: unknown run {unknown[0]!r}; the runs are {', '.join(RUNS)}")
    if args.source is None:
        for name in names:
            t0 = time.perf_counter()
            print(f"[{name}] thinwire train ... --method {RUNS[name][1]} --optimizer {RUNS[name][0]}", flush=True)
            done = subprocess.run(command(name, folder, rounds=args.rounds), cwd=HERE.parent)
            if done.returncode != 0:
                report.add(f"{name}: thinwire train failed ({done.returncode})")
                return report.finish(args.json) or 1
            print(f"[{name}] {time.perf_counter() - t0:.0f} s", flush=True)
    summaries = {n: json.loads((folder / n / "summary.json").read_text()) for n in RUNS
                 if (folder / n / "summary.json").exists()}
    rows = []
    for name, s in summaries.items():
        r = s["method_report"]
        extra = []
        if r.get("delay_auto"):
            a = r["delay_auto"]
            extra.append(f"delay {a['delay']} (step {1e3 * a['step_seconds']:.0f} ms, fragment "
                         f"{a['fragment_link_seconds']:.2f} s on the link"
                         + (f", {a['fragment_codec_seconds']:.2f} s of codec" if "fragment_codec_seconds" in a else "")
                         + ")")
        if r.get("hidden_fraction") is not None:
            extra.append(f"hidden {r['hidden_fraction']:.2f}")
        rows.append([name, RUNS[name][0], s["method"], f"{s['final_loss']:.4f}",
                     f"{s['bytes_sent_per_worker'] / 1e6:.2f}", f"{s['wall_seconds']:.0f}", "; ".join(extra) or "-"])
    report.add(f"Settings: `thinwire train {settings(args.rounds)}` with each run's `--optimizer` and `--method`.\n\n"
               + table(["run", "optimizer", "method", "final test loss", "MB sent / worker", "wall s", "notes"], rows))
    for figure, run, base, bound in TARGETS:
        if run in summaries and base in summaries:
            a, b = summaries[run]["final_loss"], summaries[base]["final_loss"]
            report.figures.append(Figure(figure, 100 * (a / b - 1), "<=", 100 * bound, "%",
                                         f"{run} {a:.4f} vs {base} {b:.4f}"))
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

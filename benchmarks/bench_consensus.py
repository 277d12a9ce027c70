"""Consensus: bits per worker to reach 1e-2 and 1e-4 of the initial consensus error,
powergossip rank 1, 2 and 4 against uncompressed gossip (dpsgd).

The PowerGossip paper's standard problem (``thinwire bench consensus``): 8 in-process workers
on a ring, each one 100 x 100 N(0, 1) matrix, no gradients; every method runs until its
error falls under 1e-4 of the start or 3,000 steps (300 with ``--quick``).

Target, per powergossip rank: reaches 1e-2 with fewer bits per worker than uncompressed
gossip (figure: powergossip bits / dpsgd bits, <= 1).
"""

from __future__ import annotations

import sys

from _common import Figure, Report, load_note, parser, table

RANKS = (1, 2, 4)


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    from thinwire.lab.bench_consensus import LEVELS, curve, first_below

    steps = 300 if args.quick else 3000
    report = Report("Consensus: powergossip vs uncompressed gossip",
                    "python benchmarks/bench_consensus.py" + (" --quick" if args.quick else ""))
    report.add(f"8 workers, ring, one 100x100 N(0,1) matrix each, up to {steps} steps; {load_note()}")
    specs = ["dpsgd"] + [f"powergossip:rank={r}" for r in RANKS]
    curves = {}
    for i, spec in enumerate(specs, 1):
        curves[spec] = curve(spec, 8, 100, "ring", steps)
        print(f"[{i}/{len(specs)}] {spec}: {curves[spec][-1][0]} steps, relative error {curves[spec][-1][2]:.3g}",
              flush=True)
    rows = []
    for spec, rows_ in curves.items():
        hits = [first_below(rows_, lv) for lv in LEVELS]
        rows.append([spec, *(f"{h[1] / 1e6:.2f} Mbit (step {h[0]})" if h else "not reached" for h in hits),
                     rows_[-1][0], f"{rows_[-1][2]:.3g}"])
    report.add(table(["method", *(f"bits / worker to {lv:g}" for lv in LEVELS), "steps", "final rel. error"], rows))
    base = first_below(curves["dpsgd"], LEVELS[0])
    for r in RANKS:
        hit = first_below(curves[f"powergossip:rank={r}"], LEVELS[0])
        ratio = hit[1] / base[1] if hit and base else float("nan")
        detail = (f"powergossip {hit[1] / 1e6:.2f} Mbit vs dpsgd {base[1] / 1e6:.2f} Mbit" if hit and base
                  else f"not reached in {steps} steps")
        report.figures.append(Figure(f"powergossip rank {r} bits to 1e-2 vs uncompressed gossip", ratio, "<=", 1.0,
                                     "x", detail))
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

"""``thinwire compare --suite seeds``: how long the whole suite takes, and whether its report
sets a measured figure beside every seed method's headline claims.

Runs the real command (``python -m thinwire compare --suite seeds --out TMP``: mnist1d, 4
workers, 800 steps, every race of the five seed methods) as a user would, timed from the
start of the process to its end. Targets (issue 8): the suite completes in under 30 minutes
on this machine, and for each of the five seed methods ``claims.csv`` holds a measured
ratio for every one of its paper's claims. The claims table itself is copied below.
``--quick`` runs 200 steps (the time target still applies; the ratios mean less).
"""

from __future__ import annotations

import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Figure, Report, load_note, parser, table
from thinwire.lab.suite import SEEDS, format_value

TARGET_SECONDS = 30 * 60


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    cmd = [sys.executable, "-m", "thinwire", "compare", "--suite", "seeds", "--quiet"]
    cmd += ["--steps", "200"] if args.quick else []
    shown = "thinwire compare --suite seeds" + (" --steps 200" if args.quick else "")
    report = Report("thinwire compare --suite seeds: wall time and the claims it measures",
                    "python benchmarks/bench_suite.py" + (" --quick" if args.quick else ""))
    report.add(f"`{shown} --out DIR`; {load_note()}")
    with tempfile.TemporaryDirectory(prefix="bench-suite-") as tmp:
        out = Path(tmp) / "seeds"
        t0 = time.perf_counter()
        done = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if done.returncode != 0:
            print(done.stdout[-4000:] + done.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"the suite failed (exit code {done.returncode})")
        print(done.stdout[-6000:], flush=True)
        with open(out / "claims.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    complete = 0
    for group in SEEDS:
        mine = [r for r in rows if r["group"] == group.key]
        measured = [r for r in mine if r["measured"] != ""]
        complete += bool(mine) and len(measured) == len(mine)
        print(f"{group.key}: {len(measured)} of {len(mine)} claims measured", flush=True)
    report.add(table(["seed method", "claim", "link", "paper", "measured", "reading"],
                     [[r["group"], r["claim"], r["link"] or "any", _value(r["paper"], r["unit"]),
                       _value(r["measured"], r["unit"]), r["reading"]] for r in rows]))
    report.figures.append(Figure("suite wall time", seconds, "<=", TARGET_SECONDS, " s",
                                 f"{seconds / 60:.1f} min for {len(SEEDS)} races"))
    report.figures.append(Figure("seed methods with every claim measured", complete, ">=", len(SEEDS), "",
                                 f"of {len(SEEDS)}"))
    report.seconds = seconds
    return report.finish(args.json)


def _value(text: str, unit: str) -> str:
    """A claims.csv number as the suite's own report shows it."""
    return format_value(float(text) if text else None, unit)


if __name__ == "__main__":
    sys.exit(main())

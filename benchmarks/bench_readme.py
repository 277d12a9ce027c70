"""The figures README.md states, measured again at one commit into one file.

``make bench-readme`` runs this (37-43 minutes on 2 cores) and writes
``benchmarks/results/readme.md``: a header (command, commit, machine, wall time) and one table,
``| figure | measured | from |``. README.md's "Measured" table is that table, row for row
(tests/unit/test_readme.py keeps the two in step). Four sources:

1. **the default race** (``make run``'s ``thinwire compare``: fp32 all_reduce, bf16, PowerSGD,
   top-k and DaSGD on MNIST-1D, 2 workers, 600 steps, 3 seeds): each method's bytes against fp32
   and its final accuracy (the median over the seeds and their range), and the method first to
   the target accuracy at each link beyond the spread over the seeds, or a tie;
2. **slow links** (``thinwire compare --suite lowbandwidth --task text``: 4 workers, 3,000 steps
   of text read less than once, H = 30, warm-up and cosine): DiLoCo against synchronous AdamW and
   local SGD, its 4-bit pseudo-gradients, SparseLoCo and MuLoCo;
3. **the cost model on links** (``benchmarks/bench_cost.py``): how many methods ``thinwire
   cost`` predicts within 20% of the measured step, on emulated links and, as root, on real
   links shaped with ``tc`` (not root: those rows say so);
4. **elastic** (``benchmarks/bench_elastic.py``'s kill-restart job, short): seconds from a kill
   to the quorum without the worker, from a restart to its first step, and whether every
   worker that finished holds the same model.

Not part of the package.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

OUT = "benchmarks/results/readme.md"
RACE_ARGS = ("compare --methods identity,bf16,powersgd,topk,dasgd --steps 600 --seeds 3 --link 10gbit,10us "
             "--link 1gbit,50us --link 100mbit,1ms")  # the Makefile's RUN_ARGS, less the output folder
RACE_NAMES = {"identity": "fp32 all_reduce", "bf16": "bf16", "powersgd": "PowerSGD", "topk": "top-k",
              "dasgd": "DaSGD"}
SUITE_ARGS = "compare --suite lowbandwidth --task text"
# the slow-link claims the README states: (group, claim's start) -> the row's name
SUITE_ROWS = {
    ("diloco", "bytes per worker against synchronous AdamW"): "DiLoCo, H = 30: bytes per worker against "
                                                              "synchronous AdamW",
    ("diloco", "final loss within 2% of synchronous AdamW"): "DiLoCo: final loss against synchronous AdamW",
    ("diloco", "the outer optimizer matters"): "DiLoCo: final loss against local SGD at the same H",
    ("diloco-4bit", "at least 7x fewer bytes"): "DiLoCo with 4-bit pseudo-gradients: bytes against fp32 ones",
    ("diloco-4bit", "final loss within 1% of fp32"): "DiLoCo with 4-bit pseudo-gradients: final loss against "
                                                     "fp32 ones",
    ("sparseloco", "at least 50x fewer bytes"): "SparseLoCo: bytes against DiLoCo",
    ("sparseloco", "final loss at most 1.01x"): "SparseLoCo: final loss against DiLoCo",
    ("muloco", "final loss within 2% of synchronous Muon"): "MuLoCo (Muon inside DiLoCo): final loss against "
                                                             "synchronous Muon",
}
Row = tuple[str, str, str]  # figure, measured, from


def _thinwire(args: str, out: Path, log: Callable[[str], None]) -> str:
    """Run ``thinwire ARGS --out OUT --quiet`` (this checkout's package); its output."""
    cmd = [sys.executable, "-m", "thinwire", *shlex.split(args), "--out", str(out), "--quiet"]
    log("$ thinwire " + args)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"thinwire {args} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


def race_rows(tmp: Path, log: Callable[[str], None]) -> list[Row]:
    stdout = _thinwire(RACE_ARGS, tmp / "race", log)
    runs: dict[str, list[dict[str, str]]] = {}
    with open(tmp / "race" / "results.csv", newline="") as f:
        for r in csv.DictReader(f):  # a row per run: every method's seeds
            runs.setdefault(r["method"], []).append(r)
    fp32 = _median(runs["identity"], "bytes_sent_per_worker")
    rows: list[Row] = []
    for label, seeds in runs.items():
        accuracy = _median_range(seeds, "final_accuracy")
        if label == "identity":
            rows.append(("default race: fp32 all_reduce's final test accuracy", accuracy, "make run"))
            continue
        ratio = fp32 / _median(seeds, "bytes_sent_per_worker")
        rows.append((f"default race: {RACE_NAMES.get(label, label)}, bytes and final test accuracy against fp32",
                     f"{ratio:.1f}x fewer bytes, accuracy {accuracy}", "make run"))
    for link, text in re.findall(r"^best at (\S+): (.+)$", stdout, flags=re.M):
        rows.append((f"default race: first to the target accuracy @ {link}", text.strip(), "make run"))
    return rows


def _median(runs: list[dict[str, str]], key: str) -> float:
    return statistics.median(float(r[key]) for r in runs)


def _median_range(runs: list[dict[str, str]], key: str) -> str:
    """``0.953 [0.950–0.959]``: the median over the seeds and their range (one seed: the value)."""
    values = [float(r[key]) for r in runs]
    median = f"{statistics.median(values):.3f}"
    return median if len(values) == 1 else f"{median} [{min(values):.3f}–{max(values):.3f}]"


def suite_rows(tmp: Path, log: Callable[[str], None]) -> list[Row]:
    from thinwire.lab.suite import format_value

    _thinwire(SUITE_ARGS, tmp / "lowbw", log)
    with open(tmp / "lowbw" / "claims.csv", newline="") as f:
        claims = list(csv.DictReader(f))
    rows: list[Row] = []
    for (group, start), name in SUITE_ROWS.items():
        found = [c for c in claims if c["group"] == group and c["claim"].startswith(start)]
        if not found:
            rows.append((f"slow links: {name}", "not measured (no such claim in the suite)", "compare --suite"))
            continue
        c = found[0]
        value = format_value(float(c["measured"]), c["unit"]) if c["measured"] else "-"
        if c["unit"] == "x":
            value += " fewer"
        rows.append((f"slow links: {name}", value, "compare --suite lowbandwidth"))
    return rows


def cost_rows(tmp: Path, log: Callable[[str], None]) -> list[Row]:
    import json

    import bench_cost

    log("$ python benchmarks/bench_cost.py")
    path = tmp / "cost.json"
    bench_cost.main(["--json", str(path)])
    data = json.loads(path.read_text())
    rows: list[Row] = []
    for f in data["figures"]:
        link = f["name"][f["name"].index("[") + 1 : -1]
        of = re.search(r"of (\d+); worst error ([\d.]+%)", f["detail"])
        measured = f"{int(f['value'])} of {of.group(1)} (worst error {of.group(2)})" if of else f"{f['value']:g}"
        rows.append((f"thinwire cost: methods predicted within 20% of the measured step @ {link}", measured,
                     "bench_cost.py"))
    if not any("shaped" in r[0] for r in rows):
        why = next((s.removeprefix("real shaped link: skipped: ") for s in data["sections"]
                    if s.startswith("real shaped link: skipped")), "no shaped-link figure")
        rows.append(("thinwire cost: predicted within 20% @ a real shaped link", f"not measured: {why}",
                     "bench_cost.py (root)"))
    return rows


def elastic_rows(tmp: Path, log: Callable[[str], None]) -> list[Row]:
    import bench_elastic

    log("$ python benchmarks/bench_elastic.py: mnist1d powersgd kill-restart, --quick")
    r = bench_elastic.run_job("mnist1d", "powersgd", "kill-restart", tmp, 4.0, quick=True)
    where = "bench_elastic.py (4 workers, --min-workers 2)"
    return [
        ("elastic: a killed worker out of the quorum after (max)", f"{max(r['absent']):.1f} s" if r["absent"] else "-",
         where),
        ("elastic: a restarted worker training again after (max)", f"{max(r['rejoin']):.1f} s" if r["rejoin"] else "-",
         where),
        ("elastic: every worker that finished holds the same model", "yes" if r["identical"] else "NO", where),
    ]


SECTIONS: dict[str, Callable[[Path, Callable[[str], None]], list[Row]]] = {
    "race": race_rows, "suite": suite_rows, "cost": cost_rows, "elastic": elastic_rows}


def header(command: str, seconds: float) -> list[str]:
    from _training import environment

    env = environment()
    return ["# The README's figures", "",
            f"- command: `{command}`", f"- git commit: {env['git commit']}", f"- torch: {env['torch']}",
            f"- machine: {env['CPU']}, {'root' if os.geteuid() == 0 else 'not root'}",
            f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}", f"- wall time: {seconds:.0f} s", "",
            "README.md's \"Measured\" table is the table below (tests/unit/test_readme.py keeps them in step). "
            "The runs themselves are not kept; each source's own command gives its full report: `make run` for "
            "the race, `thinwire compare --suite lowbandwidth --task text`, benchmarks/bench_cost.py, "
            "benchmarks/bench_elastic.py.", ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--only", help=f"comma-separated sections of {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--out", default=OUT, help=f"the results file (default: {OUT})")
    args = p.parse_args(argv)
    chosen = args.only.split(",") if args.only else list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if os.geteuid() != 0:
        print("bench-readme: not root, so the real shaped links are not measured (their rows say so); run as root "
              "for them", flush=True)
    t0 = time.perf_counter()
    rows: list[Row] = []
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            started = time.perf_counter()
            where = Path(tmp) / name
            where.mkdir()
            try:
                got = SECTIONS[name](where, lambda line: print(line, flush=True))
            except Exception as e:  # noqa: BLE001  (the other sections still run; the file says what failed)
                failed.append(name)
                got = [(f"{name}: not measured", f"failed: {type(e).__name__}: {e}"[:300], name)]
            rows += got
            print(f"[{name}] {time.perf_counter() - started:.0f} s", *(f"  {r}" for r in got), sep="\n", flush=True)
    given = argv if argv is not None else sys.argv[1:]
    command = "python benchmarks/bench_readme.py" + "".join(f" {a}" for a in given)
    lines = header(command, time.perf_counter() - t0)
    lines += ["| figure | measured | from |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    Path(ROOT / args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    if failed:
        print(f"bench-readme: {', '.join(failed)} failed (their rows say why)", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

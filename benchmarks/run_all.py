"""Run every thinwire benchmark (what ``make bench`` runs) and write benchmarks/results/RESULTS.md.

Each benchmark runs in its own process (``python benchmarks/bench_X.py --json ...``) and prints
its tables and one ``figure NAME: VALUE target OP THRESHOLD PASS|MISS`` line per figure. Then
``thinwire bench codecs`` (1 torch thread, the per-rank setting of a 2-worker run on 2 cores)
adds the codec table: time, error and bytes of every codec, no target. Finally every figure
is printed again with its target and verdict, and RESULTS.md records them with the command,
git commit, torch version, CPU model, thread count, load average and date.

Exit code: 2 when a benchmark failed to run; with ``--strict``, 1 when any figure is a MISS;
otherwise 0 (a MISS is a measured result, reported as such, not a failure to measure).
``--quick`` runs shorter versions (still >= 5 timed repeats) and writes RESULTS-quick.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHES = ("bench_sync_vs_ddp", "bench_powersgd", "bench_topk", "bench_fft", "bench_fft_training",
           "bench_error_at_bytes", "bench_hylo_codecs", "bench_hylo_training", "bench_dasgd", "bench_consensus",
           "bench_powergossip",
           "bench_ab", "bench_cost", "bench_resume", "bench_suite", "bench_real_models", "bench_powersgd_codec",
           "bench_codec_overhead", "bench_diloco", "bench_dct", "bench_demo", "bench_hierarchical",
           "bench_lowbandwidth", "bench_elastic", "bench_groups", "bench_overlap_quality", "bench_sync_cpu")
TIMEOUT_S = 1800
# bench_ab: 12 training runs, three of them a VGG on 4 workers (~40 min here); bench_suite: its
# target is 30 minutes, and a slower run must come back as a MISS, not as a timeout
LONG_TIMEOUT_S = {"bench_ab": 3600, "bench_suite": 3600, "bench_diloco": 3600, "bench_demo": 3600,
                  "bench_hierarchical": 3600, "bench_lowbandwidth": 5400, "bench_elastic": 5400, "bench_groups": 5400,
                  "bench_overlap_quality": 5400}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def environment(command: str) -> dict:
    import torch

    return {
        "command": command,
        "git commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "CPU": f"{cpu_model()} x {os.cpu_count()} logical cores",
        "threads": f"torch default {torch.get_num_threads()}; distributed benchmarks: 2 ranks x 1 thread; "
                   "bench_topk: torch default; codec table: 1",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "load average at start": loadavg(),
    }


def run_bench(name: str, quick: bool, tmp: Path, extra: list[str] | None = None) -> dict:
    """Run one benchmark script (with ``extra`` arguments); its output streams through.
    Returns its JSON report."""
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(HERE / f"{name}.py"), "--json", str(out)] + (["--quick"] if quick else [])
    cmd += extra or []
    print(f"\n===== {name} =====", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, timeout=LONG_TIMEOUT_S.get(name, TIMEOUT_S))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    seconds = time.perf_counter() - t0
    if out.exists():
        report = json.loads(out.read_text())
        report["wall_seconds"] = seconds
        return report
    return {"title": name, "command": " ".join(cmd), "error": f"exit code {code}", "figures": [], "sections": [],
            "wall_seconds": seconds}


def run_codecs(quick: bool, tmp: Path) -> dict:
    out = tmp / "codecs"
    cmd = [sys.executable, "-m", "thinwire.lab.bench_codecs", "--threads", "1", "--out", str(out)]
    cmd += ["--quick"] if quick else []
    print("\n===== thinwire bench codecs =====", flush=True)
    t0 = time.perf_counter()
    try:
        code = subprocess.run(cmd, cwd=ROOT, timeout=TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    md = out / "codecs.md"
    return {
        "command": "thinwire bench codecs" + (" --quick" if quick else "") + " (python -m thinwire.lab.bench_codecs "
                   "--threads 1" + (" --quick" if quick else "") + ")",
        "table": md.read_text() if md.exists() else f"(failed: exit code {code})",
        "ok": md.exists(), "wall_seconds": time.perf_counter() - t0,
    }


def write_results(path: Path, env: dict, reports: list[dict], codecs: dict | None, total_s: float) -> None:
    lines = ["# thinwire benchmark results", ""]
    lines += [f"- {k}: `{v}`" if k in ("command", "git commit") else f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- load average at end: {loadavg()}", f"- wall time: {total_s:.0f} s", ""]
    lines += ["Rules: ratios measured side by side in one run, alternating, median of >= 5 "
              "repeats after warm-up; absolute times beside every ratio. The machine is shared: the load "
              "average above is what else ran.", ""]
    lines += ["## Figures", "", "| figure | value | target | verdict | absolute figures |", "|---|---|---|---|---|"]
    for r in reports:
        for f in r["figures"]:
            lines.append(f"| {f['name']} | {f['value']:.3f}{f['unit']} | {f['op']} {f['threshold']:g}{f['unit']} | "
                         f"{'PASS' if f['passed'] else 'MISS'} | {f['detail']} |")
        if r.get("error"):
            lines.append(f"| {r['title']} | - | - | ERROR | {r['error']} |")
    lines.append("")
    for r in reports:
        lines += [f"## {r['title']}", "", f"`{r['command']}` ({r['wall_seconds']:.0f} s)", ""]
        for s in r["sections"]:
            lines += [s, ""]
    if codecs is not None:
        lines += ["## Codecs (no target)", "", f"`{codecs['command']}` ({codecs['wall_seconds']:.0f} s)", "",
                  codecs["table"], ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter runs; writes RESULTS-quick.md")
    p.add_argument("--only", nargs="+", choices=BENCHES, help="run only these benchmarks")
    p.add_argument("--skip-codecs", action="store_true", help="leave out the codec table")
    p.add_argument("--out", help="results file (default: benchmarks/results/RESULTS.md, or RESULTS-quick.md)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any figure misses its target")
    p.add_argument("--args", action="append", default=[], metavar="BENCH=ARGS",
                   help="extra arguments for one benchmark, e.g. bench_diloco='--from runs/lowbw' (repeatable)")
    args = p.parse_args(argv)
    extra: dict[str, list[str]] = {}
    for item in args.args:
        name, eq, rest = item.partition("=")
        if not eq or name not in BENCHES:
            p.error(f"--args needs BENCH=ARGS with BENCH one of the benchmarks, got {item!r}")
        extra[name] = shlex.split(rest)
    command = "python benchmarks/run_all.py" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(
        sys.argv[1:] if argv is None else argv))
    out = Path(args.out) if args.out else HERE / "results" / ("RESULTS-quick.md" if args.quick else "RESULTS.md")
    env = environment(command)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        reports = [run_bench(name, args.quick, Path(tmp), extra.get(name)) for name in (args.only or BENCHES)]
        codecs = None if args.skip_codecs else run_codecs(args.quick, Path(tmp))
    total = time.perf_counter() - t0
    write_results(out, env, reports, codecs, total)

    print("\n===== all figures =====")
    figures = [f for r in reports for f in r["figures"]]
    for f in figures:
        print(f["line"])
    errors = [r for r in reports if r.get("error")] + ([] if codecs is None or codecs["ok"] else [codecs])
    for r in errors:
        print(f"ERROR {r.get('title', 'bench codecs')}: {r.get('error', 'failed')}")
    misses = sum(not f["passed"] for f in figures)
    print(f"{len(figures) - misses} PASS, {misses} MISS, {len(errors)} error(s); {total:.0f} s; wrote {out}")
    return 2 if errors else (1 if misses and args.strict else 0)


if __name__ == "__main__":
    sys.exit(main())

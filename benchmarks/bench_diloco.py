"""The DiLoCo family over a real shaped link: a streamed fragment's transfer hidden behind the
next step. The races of the DiLoCo family (loss, bytes, peak bytes, time to a target loss,
the lowbandwidth suite's targets) are ``benchmarks/bench_lowbandwidth.py``'s, on the text
task; ``suites`` and the helpers here also serve ``bench_demo.py``'s transform suite.

A real shaped link (Linux, root, iproute2: ``_shaped_link.py``): 2 ranks, 1 thread each, in
their own network namespaces joined by a veth pair shaped to 100 Mbit/s each way; charlm,
``streaming-diloco:period=20,fragments=4,delay=1`` and ``diloco:period=20`` for 120 steps
(``--quick``: 60), no emulation. Target: streaming-diloco's measured ``hidden_fraction``
(1 - seconds its merges blocked / launch-to-completion seconds of its fragments' averages)
>= 0.9; diloco's (it blocks by design) and both step times beside it. Skipped, with the
reason, where namespaces cannot be made.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import Figure, Report, load_note, parser, table
from thinwire.lab.suite import LOWBANDWIDTH, SUITES, Group, format_value, measure
from thinwire.run.summary import Summary

LINKS = ("1gbit,50us", "100mbit,1ms", "10mbit,1ms")
SHAPED_MBIT = 100.0
SHAPED_SPECS = ("streaming-diloco:period=20,fragments=4,delay=1", "diloco:period=20")
HIDDEN_TARGET = 0.9
OPS = {"loss": "<=", "peak": "<=", "step": "<=", "bytes": ">=", "hidden": ">=", "to-target": ">="}


def run_suite(task: str, out: Path, steps: int | None, suite: str = "lowbandwidth",
              extra: tuple[str, ...] = ()) -> float:
    cmd = [sys.executable, "-m", "thinwire", "compare", "--suite", suite, "--task", task, "--eval-every", "25",
           "--out", str(out), "--overwrite", "--quiet", *[a for link in LINKS for a in ("--link", link)], *extra]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=False)
    return time.perf_counter() - t0


def suite_sections(report: Report, task: str, out: Path, seconds: float | None, suite: str = "lowbandwidth",
                   extra: tuple[str, ...] = ()) -> list[dict]:
    """The suite's method table and claims as a section, its targets as figures; the claims."""
    groups = SUITES[suite]
    rows = claims(out, groups, task)
    report.add(f"### {task}: the {suite} suite\n\n"
               + (f"`thinwire compare --suite {suite} --task {task} --eval-every 25 "
                  + " ".join([*(f"--link {link}" for link in LINKS), *extra]) + f" --out DIR` ({seconds:.0f} s)\n\n"
                  if seconds is not None else f"read from the runs of an earlier `{_suite_command(out, suite)}`\n\n")
               + method_table(out) + "\n\n"
               + table(["group", "claim", "link", "target", "measured", "reading", "from"],
                       [[c["group"], c["claim"], c["link"] or "any",
                         "-" if c["paper"] is None else format_value(c["paper"], c["unit"]),
                         format_value(c["measured"], c["unit"]), c["reading"], c["detail"]] for c in rows]))
    for c in rows:
        if c["reading"] not in ("PASS", "MISS", "not measured") or c["paper"] is None:
            continue
        if "cannot run on this task" in c["detail"]:  # a peer left out of the race, with why: no figure
            continue
        value = c["measured"] if c["measured"] is not None else math.nan
        at = f" @ {c['link']}" if c["link"] else ""
        scale, unit = (100.0, "%") if c["unit"] == "rel" else (1.0, "x" if c["unit"] == "x" else "")
        report.figures.append(Figure(f"{task} {c['group']}: {c['claim']}{at}", scale * value, OPS[c["kind"]],
                                     scale * c["paper"], unit, c["detail"]))
    return rows


def _suite_command(out: Path, suite: str = "lowbandwidth") -> str:
    """The command that ran the suite in ``out``, as its report gives it, with --out as DIR."""
    for line in (out / "report.md").read_text().splitlines():
        if line.startswith("- command: `"):
            words = line[len("- command: `"):].rstrip("`").split()
            return " ".join("DIR" if i and words[i - 1] == "--out" else w for i, w in enumerate(words))
    return f"thinwire compare --suite {suite}"


def claims(out: Path, groups: tuple[Group, ...] = LOWBANDWIDTH, task: str = "charlm") -> list[dict]:
    """The suite's rows, measured afresh from the runs in ``out`` (each group's runs in the
    order of its specs, as ``thinwire compare`` numbers them, less the peers that cannot
    run on ``task``)."""
    from thinwire.lab.suite import cannot_run
    from thinwire.run.config import TrainConfig

    rows = []
    for group in groups:
        skipped = cannot_run(TrainConfig(task=task), group.peers)
        results = []
        for run in sorted((out / group.key / "runs").iterdir()):
            summary_path = run / "summary.json"
            ok = summary_path.exists()
            summary = Summary.read(str(summary_path)) if ok else None
            metrics = run / "metrics.jsonl"
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            results.append({"label": _short(summary.method) if summary is not None else run.name, "spec": run.name,
                            "status": "ok" if summary is not None and summary.status == "ok" else "failed",
                            "summary": summary, "rows": [json.loads(x) for x in lines if x.strip()]})
        rows += measure(group, results, LINKS, skipped)
    return rows


def method_table(out: Path) -> str:
    """One row per run of the suite: final loss, bytes, peak bytes in one step, modeled time per link."""
    seen: dict[str, dict] = {}
    for path in sorted(out.glob("*/runs/*/summary.json")):
        s = json.loads(path.read_text())
        seen.setdefault(s["method"], s)
    rows = []
    for spec, s in seen.items():
        peak = (s.get("method_report") or {}).get("peak_bytes_per_sync")
        rows.append([_short(spec), f"{s['final_loss']:.4f}", f"{s.get('final_bpc') or float('nan'):.4f}",
                     f"{s['bytes_sent_per_worker'] / 1e6:.2f}", "-" if peak is None else f"{peak / 1e6:.3f}",
                     *[f"{s['modeled_seconds_by_link'][link]:.1f}" for link in LINKS]])
    return table(["method", "final test loss", "bpc", "MB sent / worker", "peak MB in one step",
                  *[f"modeled s @ {link}" for link in LINKS]], rows)


def _short(spec: str) -> str:
    """The spec with only the knobs that tell a suite's runs apart (period, a compressing
    codec with its bits or ratio, fragments, delay, alpha; DeMo's topk and values)."""
    name, _, knobs = spec.partition(":")
    keep = []
    for knob in knobs.split(","):
        key, _, value = knob.partition("=")
        if key in ("period", "fragments", "delay", "alpha") or (name == "demo" and key in ("topk", "values")):
            keep.append(knob)
        elif key == "codec" and not value.startswith("identity"):
            codec, _, inner = value.partition(":")
            told = [k for k in inner.split(";") if k.split("=")[0] in ("bits", "exp_bits", "ratio", "ef")]
            keep.append(f"codec={codec}" + (":" + ";".join(told) if told else ""))
    return name + (":" + ",".join(keep) if keep else "")


# -- 2. the shaped link -----------------------------------------------------------------------------
def shaped_section(report: Report, steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _shaped_link import ShapedPair, unavailable

    why = unavailable()
    if why is not None:
        report.add(f"real shaped link: skipped: {why}")
        return
    results = {}
    with ShapedPair(SHAPED_MBIT) as pair:
        for i, spec in enumerate(SHAPED_SPECS):
            results[spec] = _shaped_run(pair, spec, steps, 29700 + i)
    rows = []
    for spec, s in results.items():
        r = s["method_report"]
        hidden = r["hidden_fraction"]
        blocked = "all (merged at launch)" if hidden is None else f"{1e3 * r['blocked_seconds']:.0f}"
        rows.append([spec, f"{1e3 * s['wall_seconds'] / s['steps']:.1f}", "-" if hidden is None else f"{hidden:.3f}",
                     blocked, f"{1e3 * r['average_seconds']:.0f}",
                     f"{r['peak_bytes_per_sync'] / 1e6:.3f}", f"{s['final_loss']:.4f}"])
    report.add(f"### a real link shaped to {SHAPED_MBIT:.0f} Mbit/s: 2 ranks, charlm, {steps} steps\n\n"
               + table(["method", "ms / step", "hidden fraction", "blocked ms", "averages in flight ms",
                        "peak MB in one step", "final test loss"], rows))
    streaming = results[SHAPED_SPECS[0]]["method_report"]
    report.figures.append(Figure(f"streaming-diloco hidden fraction over a real {SHAPED_MBIT:.0f} Mbit/s link",
                                 streaming["hidden_fraction"], ">=", HIDDEN_TARGET, "",
                                 f"blocked {1e3 * streaming['blocked_seconds']:.0f} ms of "
                                 f"{1e3 * streaming['average_seconds']:.0f} ms in flight; diloco waits for every "
                                 f"sync by design: {1e3 * results[SHAPED_SPECS[1]]['comm_seconds']:.0f} ms of "
                                 f"communication)"))


def _shaped_run(pair, spec: str, steps: int, port: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-diloco-") as tmp:
        cmd = [sys.executable, "-m", "thinwire", "train", "--task", "charlm", "--method", spec, "--steps", str(steps),
               "--eval-every", str(steps), "--threads", "1", "--out", tmp, "--overwrite", "--quiet"]
        env = dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
        procs = [pair.popen(r, cmd, dict(env, LOCAL_RANK=str(r)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True) for r in range(2)]
        errs = [p.communicate(timeout=1200)[1] for p in procs]
        if any(p.returncode for p in procs):
            tail = next((e.strip().splitlines()[-1] for e in errs if e.strip()), "")
            raise RuntimeError(f"a rank failed (exit codes {[p.returncode for p in procs]}): {tail}")
        return json.loads((Path(tmp) / "summary.json").read_text())


def suite_parser(doc: str, suite: str):
    """The arguments a suite benchmark takes: ``--tasks``, ``--from``, ``--keep`` (and the common ones)."""
    p = parser(doc)
    p.add_argument("--tasks", default="charlm", help="tasks to race, comma-separated (default: charlm)")
    p.add_argument("--from", dest="source", metavar="DIR[,DIR]",
                   help=f"read each task's suite from its DIR (finished --suite {suite} runs, in the order of "
                   "--tasks) instead of running it")
    p.add_argument("--keep", metavar="DIR", help="run the suites into DIR/<task> and keep them")
    return p


def command_of(script: str, argv: list[str] | None) -> str:
    """The command that ran ``script``, less ``--json`` (where run_all collects the report)."""
    given = list(argv if argv is not None else sys.argv[1:])
    if "--json" in given:
        i = given.index("--json")
        del given[i : i + 2]
    return " ".join([f"python benchmarks/{script}", *given])


def suites(report: Report, args, suite: str = "lowbandwidth", extra: tuple[str, ...] = ()) -> None:
    """Each of ``--tasks``' suite sections: read from ``--from``, or run (into ``--keep``)."""
    steps = 200 if args.quick else None
    sources = args.source.split(",") if args.source else []
    with tempfile.TemporaryDirectory(prefix="bench-suite-") as tmp:
        for i, task in enumerate(args.tasks.split(",")):
            if i < len(sources):
                suite_sections(report, task, Path(sources[i]), None, suite)
                continue
            out = Path(args.keep or tmp) / task
            seconds = run_suite(task, out, steps, suite, extra)
            suite_sections(report, task, out, seconds, suite, extra)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    args = p.parse_args(argv)
    report = Report("The DiLoCo family over a real link: a streamed fragment hidden behind the next step",
                    command_of("bench_diloco.py", argv))
    report.add(f"{load_note()}\n\nThe races of the DiLoCo family: `benchmarks/bench_lowbandwidth.py` "
               "(benchmarks/results/lowbandwidth.md)")
    shaped_section(report, 60 if args.quick else 120)
    return report.finish(args.json)

if __name__ == "__main__":
    sys.exit(main())

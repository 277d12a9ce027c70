"""Shared by the end-to-end training benchmarks: one ``thinwire train`` subprocess per method,
the first evaluation at a target accuracy, and the table file with its environment.

Not part of the package.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _common import table

HERE = Path(__file__).resolve().parent


def run_training(method: str, args: Sequence[str], out: Path) -> dict:
    """``thinwire train --method METHOD ARGS`` in a subprocess writing to ``out``: its
    summary.json plus ``rows`` (metrics.jsonl, one dict per evaluation) and ``seconds`` (wall
    time), or ``error`` (and empty ``rows``) when it failed."""
    cmd = [sys.executable, "-m", "thinwire", "train", "--method", method, *args, "--out", str(out), "--quiet",
           "--overwrite"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    summary_path, metrics_path = out / "summary.json", out / "metrics.jsonl"
    if proc.returncode != 0 or not summary_path.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        return {"method": method, "error": f"exit code {proc.returncode}: {tail[0]}", "seconds": seconds, "rows": []}
    summary = json.loads(summary_path.read_text())
    summary["rows"] = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    summary["seconds"] = seconds
    return summary


def progress_line(i: int, total: int, label: str, run: dict) -> str:
    if "error" in run:
        return f"[{i}/{total}] {label}: FAILED ({run['error']}) after {run['seconds']:.0f} s"
    return (f"[{i}/{total}] {label}: {run['steps']} steps, final accuracy {run['final_accuracy']:.4f}, "
            f"compression {run['compression_ratio']:.1f}x, {run['seconds']:.0f} s")


def first_at_target(rows: list[dict], target: float) -> dict | None:
    """The first evaluation row whose test accuracy reaches ``target``, or None."""
    return next((r for r in rows if (r.get("test_accuracy") or 0.0) >= target), None)


def time_table(runs: dict[str, dict], target: float, links: Sequence[str],
               label: Callable[[str], str] = lambda spec: spec) -> str:
    """Per run: final accuracy, compression, MB sent, the first evaluation at ``target`` and
    the modeled seconds to it and for the whole run at each link."""
    headers = ["method", "final acc", "compression", "MB sent / worker", f"step to {target:.2f}"]
    headers += [f"modeled s to {target:.2f} @ {link}" for link in links]
    headers += [f"modeled s, whole run @ {link}" for link in links]
    rows = []
    for spec, run in runs.items():
        if "error" in run:
            rows.append([label(spec), "failed: " + run["error"]] + ["-"] * (len(headers) - 2))
            continue
        hit = first_at_target(run["rows"], target)
        reach = [str(hit["step"])] if hit else ["not reached"]
        reach += [f"{hit[f'modeled_seconds@{link}']:.1f}" if hit else "not reached" for link in links]
        whole = [f"{run['modeled_seconds_by_link'][link]:.1f}" for link in links]
        rows.append([label(spec), f"{run['final_accuracy']:.4f}", f"{run['compression_ratio']:.1f}x",
                     f"{run['bytes_sent_per_worker'] / 1e6:.2f}", *reach, *whole])
    return table(headers, rows)


def dirty() -> bool:
    """Whether tracked files differ from the recorded commit (read-only ``git status``)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE.parent,
                             capture_output=True, text=True, timeout=10)
        return bool(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return False


def environment() -> dict:
    """What the table's figures depend on, recorded at the start of the runs."""
    import torch

    from run_all import cpu_model, git_commit, loadavg

    return {
        "git commit": f"`{git_commit()}`" + (" (working tree has uncommitted changes)" if dirty() else ""),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "CPU": cpu_model(),
        "threads": "torch threads per worker: thinwire's default, max(1, cores / workers)",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "load average at start": loadavg(),
    }


def write_table_file(path: Path, title: str, command: str, each_run: str, env: dict, body: str) -> None:
    """A markdown file: title, the command, the per-run command line, environment, then ``body``."""
    from run_all import loadavg

    lines = [f"# {title}", "", f"- command: `{command}`", f"- each run: `{each_run}`"]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- load average at end: {loadavg()}", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines + [body, ""]))

"""Behaviour unchanged across two commits: the same runs at both, bit for bit.

For each method (default: identity, dasgd, diloco, hylo, powergossip, demo) one ``thinwire
train`` on MNIST-1D (2 workers, 200 steps, seed 0) at commit BEFORE and at commit AFTER (each a
``git worktree`` of this checkout, run with this environment's Python); then per method the
final test loss, the bytes each worker sent, and whether every evaluation record (step, test
loss, train loss, bytes) is the same at both. A refactoring that claims to change no behaviour
must show ``identical`` on every row.

    python benchmarks/bench_unchanged.py --before ae7bfe1 --after HEAD

Not part of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("identity", "dasgd", "diloco", "hylo", "powergossip", "demo")
KEYS = ("step", "test_loss", "train_loss", "bytes_sent")


def _runs(tree: Path, out: Path, methods: list[str], steps: int) -> dict[str, tuple[dict, list]]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    found = {}
    for method in methods:
        where = out / method
        cmd = [sys.executable, "-m", "thinwire", "train", "--method", method, "--steps", str(steps), "--out",
               str(where), "--quiet", "--no-tensorboard"]
        subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True, text=True)
        summary = json.loads((where / "summary.json").read_text())
        lines = (where / "metrics.jsonl").read_text().splitlines()
        rows = [tuple(json.loads(line).get(k) for k in KEYS) for line in lines if line]
        found[method] = (summary, rows)
        print(f"  {tree.name}: {method} {summary['final_loss']!r}", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--before", required=True, help="the commit before the change")
    p.add_argument("--after", default="HEAD", help="the commit after it (default: HEAD)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default: {','.join(METHODS)})")
    p.add_argument("--steps", type=int, default=200, help="steps per run (default: 200)")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in ("before", "after"):
            rev = getattr(args, side)
            tree = Path(tmp) / side
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True,
                           capture_output=True)
            try:
                results[side] = _runs(tree, Path(tmp) / f"{side}-runs", methods, args.steps)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    same_all = True
    before, after = args.before, args.after
    print(f"\n| method | final loss at {before} | at {after} | bytes/worker at {before} | at {after} "
          "| every evaluation |")
    print("|---|---|---|---|---|---|")
    for m in methods:
        (a, ra), (b, rb) = results["before"][m], results["after"][m]
        same = (a["final_loss"], a["bytes_sent_per_worker"], ra) == (b["final_loss"], b["bytes_sent_per_worker"], rb)
        same_all &= same
        print(f"| {m} | {a['final_loss']!r} | {b['final_loss']!r} | {a['bytes_sent_per_worker']:.0f} | "
              f"{b['bytes_sent_per_worker']:.0f} | {'identical' if same else 'DIFFERENT'} |")
    print("\nALL IDENTICAL" if same_all else "\nDIFFERENCES", flush=True)
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())

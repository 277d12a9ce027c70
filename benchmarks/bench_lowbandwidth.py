"""Slow-link training against the literature: the lowbandwidth suite on the text task.

1. The learning-rate sweep, judged on the VALIDATION split of the text task
   (``--option eval_split=valid``: the held-out windows after the test set's, never a test
   window): synchronous AdamW's lr over ``--inner-lrs`` (default 1e-3, the text task's, 2e-3
   and 4e-3): its best runs as the ``tuned`` race; DiLoCo's inner x outer lr together
   (``--inner-lrs`` x ``--diloco-lrs``, default 0.4, 0.7, 1.0: the paper's 0.7 and one step
   either side): its inner lr is every other race's (the DiLoCo paper's protocol: the
   baseline shares the inner optimizer's lr); SparseLoCo's outer lr over ``--sparseloco-lrs``
   at that inner lr (default 1, 2, 4: the authors' code's 1, and up to R = 4 workers, since the
   paper's mean over all R workers moves an entry one worker sent R times less than the
   code's). The value with the lowest final validation loss is chosen (ties: the paper's).
   Runs already kept under ``--keep DIR`` are read back, not rerun.
2. ``thinwire compare --suite lowbandwidth --task text`` with the chosen values
   (:func:`thinwire.lab.suite.lowbandwidth`): 4 workers, tiny transformer over bytes, 4
   windows of 64 bytes per worker and step, 3,000 steps (H = 30: 100 outer steps; 0.26
   epochs of the training text), AdamW at DiLoCo's chosen inner lr with 150 warm-up steps and
   cosine to 0.1 x,
   evaluations every 150 steps on the test set (512 windows), modeled at 1 Gbit/s, 100 Mbit/s
   and 10 Mbit/s. Every target of the suite is a figure here (PASS/MISS):

   * DiLoCo fp32: final test loss within 2% of synchronous AdamW; below local SGD's;
   * 4-bit pseudo-gradients: within 1% of fp32 DiLoCo; >= 7x fewer bytes;
   * Streaming DiLoCo: within 1% of DiLoCo; peak per step <= 0.3x; >= 90% hidden;
   * SparseLoCo: final loss <= 1.01x DiLoCo fp32's; >= 50x fewer bytes than DiLoCo fp32;
   * MuLoCo (DiLoCo, Muon inside): within 2% of synchronous Muon; <= DiLoCo's with AdamW inside;
   * DeMo: within 5% of synchronous AdamW;
   * time to the target loss (synchronous AdamW's final + 3%) at 10 Mbit/s: the best
     slow-link method >= 10x shorter than synchronous AdamW.

``--budget-minutes M``: a run that would start after M minutes is not run (reported as
such; the sweep first, then the races). ``--skip-sweep``: the suite's built-in lrs.
``--keep DIR``: the sweep in DIR/sweep, the suite in DIR/suite. ``--sweep-only`` (with
``--keep DIR``) stops after the sweep and keeps its choice in DIR/sweep/chosen.json;
``--sweep-from DIR`` runs the suite with that choice and reports the sweep beside it.
``--quick``: 300 steps (H = 30: 10 outer steps), no sweep: only shows the harness works.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import Figure, Report, load_note, parser, table
from thinwire.lab import compare, suite
from thinwire.run.config import TrainConfig, for_method
from thinwire.run.summary import Summary

LINKS = ("1gbit,50us", "100mbit,1ms", "10mbit,1ms")
OPS = {"loss": "<=", "peak": "<=", "step": "<=", "bytes": ">=", "hidden": ">=", "to-target": ">=",
       "best-to-target": ">="}


class OutOfTime(Exception):
    pass


def _launcher(deadline: float, minutes: dict[str, float]):
    from thinwire.run.launch import launch

    def run(cfg: TrainConfig, show_progress: bool = True) -> Any:
        if time.perf_counter() > deadline:
            raise OutOfTime("not run: the benchmark's --budget-minutes was spent")
        t0 = time.perf_counter()
        summary = launch(cfg, show_progress=show_progress)
        minutes[f"{cfg.method}|{cfg.optimizer}|{cfg.resolve().lr}"] = (time.perf_counter() - t0) / 60
        return summary

    return run


def base_config(steps: int | None) -> TrainConfig:
    return suite.lowbandwidth_settings(TrainConfig(task="text", workers=suite.SUITE_WORKERS, links=LINKS,
                                                   steps=steps))


def settings_lines(b: TrainConfig) -> str:
    o = b.task_options
    lr = for_method(b, "identity").resolve().lr  # the task's when the command gives none
    return (f"Settings (the suite's, `thinwire.lab.suite.LOWBANDWIDTH_SETTINGS`): task text (Python's stdlib "
            f"source, bytes), model tiny (2 layers, d_model 128, 431k parameters), context {o.get('context')}, "
            f"{b.batch_size} windows per worker and step, {b.workers} workers, {b.steps} steps, H = {suite.H} "
            f"({b.steps // suite.H} outer steps), {b.optimizer} lr {lr:g} with {b.warmup_steps} warm-up steps and "
            f"{b.lr_schedule} decay to {b.min_lr} x lr (warm-up share and floor ours: the papers' runs differ), "
            f"evaluation every {b.eval_every} steps on {o.get('eval_windows')} held-out windows, seed {b.seed}")


# -- 1. the sweep ------------------------------------------------------------------------------------
def _valid(base: TrainConfig) -> TrainConfig:
    return dataclasses.replace(base, task_options={**base.task_options, "eval_split": "valid"})


def _race(valid: TrainConfig, specs: list[str], out: Path, launch: Any, name: str) -> list[dict]:
    race = compare.prepare(valid, specs, str(out), overwrite=True)
    results = compare.run(race, launch=launch, show_progress=False, say=lambda s: print(s, flush=True))
    compare.finish(race, results, f"python benchmarks/bench_lowbandwidth.py ({name})")
    return results


def _row(label: str, r: dict) -> tuple[list[str], float | None]:
    ok = r["status"] == "ok"
    value = r["summary"].final_loss if ok else None
    epoch = r["rows"][-1].get("epoch") if ok and r["rows"] else None
    return ([label, "-" if value is None else f"{value:.4f}", "-" if epoch is None else f"{epoch:.3f}",
             f"{r['seconds'] / 60:.1f}" if ok else r["error"]], value)


def _pick(done: list[tuple[float | None, Any]], default: Any) -> Any:
    """The value with the lowest validation loss (a tie: the default, else the first)."""
    ran = [(v, x) for v, x in done if v is not None]
    if not ran:
        return default
    best = min(v for v, _ in ran)
    tied = [x for v, x in ran if v == best]
    return default if default in tied else tied[0]


def _key(cfg: TrainConfig, spec: str) -> tuple:
    """What makes two sweep runs the same run: the task, workers, method (resolved), lr, steps,
    batch, schedule, task options, optimizer and seed."""
    from thinwire.algorithms.methods import resolve_method

    return (cfg.task, cfg.workers, resolve_method(spec), cfg.lr, cfg.steps, cfg.batch_size, cfg.lr_schedule,
            cfg.warmup_steps, cfg.min_lr, json.dumps(cfg.task_options, sort_keys=True), cfg.optimizer, cfg.seed)


def _kept(out: Path) -> dict[tuple, dict]:
    """The finished runs already under ``out`` (an earlier, interrupted or shorter sweep kept
    with --keep), by :func:`_key`: a sweep run again reads them instead of training again."""
    found: dict[tuple, dict] = {}
    for path in sorted(out.glob("**/summary.json")) if out.is_dir() else []:
        try:
            summary = Summary.read(str(path))
        except (TypeError, ValueError):  # not a summary this version reads
            continue
        cfg = summary.config or {}
        if summary.status != "ok" or "lr" not in cfg:
            continue
        try:
            key = _key(TrainConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items()
                                      if k in {f.name for f in dataclasses.fields(TrainConfig)}}), summary.method)
        except (TypeError, ValueError):
            continue
        metrics = path.parent / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
        found[key] = {"status": "ok", "summary": summary, "rows": rows[-1:], "seconds": summary.wall_seconds,
                      "spec": summary.method, "kept": path.parent}
    return found


def sweep(out: Path, base: TrainConfig, inner_lrs: list[float], diloco_lrs: list[float], sparse_lrs: list[float],
          launch: Any) -> dict[str, Any]:
    """The learning rates, on the validation split: synchronous AdamW's lr (its own best: the
    ``tuned`` reference); DiLoCo's inner and outer lr together (every inner lr x every outer
    lr); SparseLoCo's outer lr at DiLoCo's inner lr. The race runs at DiLoCo's inner lr, the
    DiLoCo paper's protocol (the baseline shares the inner optimizer's lr), with synchronous
    AdamW at its own best lr beside it. Runs already kept under ``out`` are read, not rerun.
    Returns the chosen values and the section's text."""
    t0 = time.perf_counter()
    valid = _valid(base)
    kept = _kept(out)
    default_lr = for_method(base, "identity").resolve().lr

    def one(lr: float, spec: str) -> tuple[list[str], float | None]:
        cfg = dataclasses.replace(valid, lr=lr)
        r = kept.get(_key(for_method(cfg, spec).resolve(), spec))
        if r is None:
            [r] = _race(cfg, [spec], out / f"{spec.split(':')[0]}-{_short(spec).partition(':')[2] or 'defaults'}"
                        f"-lr{lr:g}".replace(",", "-").replace("=", ""), launch, f"sweep: {spec} at lr {lr:g}")
        return _row(f"{_short(spec)}, inner lr {lr:g}", r)

    adamw = [one(x, "identity") for x in inner_lrs]
    tuned = _pick([(v, x) for (_, v), x in zip(adamw, inner_lrs, strict=True)], default_lr)
    grid = [(x, y, *one(x, suite.diloco_spec(y))) for x in inner_lrs for y in diloco_lrs]
    lr, d = _pick([(v, (x, y)) for x, y, _, v in grid], (default_lr, suite.DILOCO_OUTER_LR))
    sparse = [one(lr, suite.sparseloco_spec(y)) for y in sparse_lrs]
    s = _pick([(v, y) for (_, v), y in zip(sparse, sparse_lrs, strict=True)], suite.SPARSELOCO_OUTER_LR)
    rows = [row for row, _ in adamw] + [row for *_, row, _ in grid] + [row for row, _ in sparse]
    missing = [row[0] for row in rows if row[1] == "-"]
    eval_windows = base.task_options.get("eval_windows", 0)
    text = ("### 1. The learning-rate sweep, judged on the validation split (never the test windows)\n\n"
            f"`--option eval_split=valid`: held-out windows {eval_windows} to {2 * eval_windows - 1} (the test set "
            f"is windows 0 to {eval_windows - 1}); the suite's settings otherwise "
            f"({(time.perf_counter() - t0) / 60:.1f} min this time; a run kept from an earlier sweep is read, not "
            "rerun: its minutes are its own)\n\n"
            "Synchronous AdamW's lr (the `tuned` reference), DiLoCo's inner x outer lr, then SparseLoCo's outer lr "
            "at DiLoCo's inner lr. The races run at DiLoCo's inner lr, the DiLoCo paper's protocol (the baseline "
            "shares the inner optimizer's lr); synchronous AdamW at its own best lr runs beside them:\n\n"
            + table(["run", "final validation loss", "epoch at the end", "minutes"], rows)
            + f"\n\nChosen: synchronous AdamW's own lr **{tuned:g}**; DiLoCo inner lr **{lr:g}** (every race's), "
              f"outer lr **{d:g}**; SparseLoCo outer lr **{s:g}**"
            + (f" (no result from {', '.join(missing)}: see the minutes column; a value without a result cannot "
               "be chosen)" if missing else ""))
    return {"lr": lr, "tuned_lr": tuned, "diloco_lr": d, "sparseloco_lr": s, "text": text}


# -- 2. the suite ------------------------------------------------------------------------------------
def races(report: Report, out: Path, base: TrainConfig, d: float, s: float, launch: Any,
          minutes: dict[str, float], tuned: float | None = None) -> None:
    groups = suite.lowbandwidth(d, s, tuned)
    base_lr = for_method(base, "identity").resolve().lr
    prepared = suite.prepare(base, str(out), True, groups)
    t0 = time.perf_counter()
    results = suite.run(prepared, groups, launch=launch, show_progress=False, say=lambda x: print(x, flush=True))
    command = (f"thinwire compare --suite lowbandwidth --task text --link {' --link '.join(LINKS)} --out DIR"
               + (f" --steps {base.steps}" if base.steps != suite.LOWBANDWIDTH_SETTINGS["steps"] else "")
               + (f" --lr {base.lr:g}" if base.lr is not None else "")
               + (f"  (from the sweep: thinwire.lab.suite.lowbandwidth({d:g}, {s:g}, {tuned:g}))" if tuned else
                  f"  (thinwire.lab.suite.lowbandwidth({d:g}, {s:g}))"))
    done = suite.finish(str(out), prepared, results, command, groups)
    total = (time.perf_counter() - t0) / 60
    rows = []
    seen = set()
    for g, res in zip(groups, results, strict=True):
        for r in res:
            key = (r["spec"], g.optimizer, g.lr)
            if key in seen:
                continue
            seen.add(key)
            sm = r["summary"] if r["status"] == "ok" else None
            opt = g.optimizer or base.optimizer
            name = ("demo" if r["spec"].startswith("demo") else opt)
            glr = g.lr if g.lr is not None else base_lr
            kind = r["spec"].split(":")[0] if r["spec"].startswith("demo") else opt
            mins = minutes.get(f"{r['spec']}|{kind}|{glr}")
            if sm is None:
                rows.append([_short(r["spec"]), name, f"{glr:g}", "-", "-", "-", "-", *["-"] * len(LINKS), "-",
                             r["error"][:80]])
                continue
            peak = sm.method_report.get("peak_bytes_per_sync")
            epoch = r["rows"][-1].get("epoch") if r["rows"] else None
            rows.append([_short(r["spec"]), name, f"{glr:g}", f"{sm.final_loss:.4f}",
                         f"{sm.final_bpc or 0:.4f}",
                         f"{sm.bytes_sent_per_worker / 1e6:.2f}", "-" if peak is None else f"{peak / 1e6:.3f}",
                         *[f"{sm.modeled_seconds_by_link[x]:.0f}" for x in LINKS],
                         "-" if epoch is None else f"{epoch:.3f}", "-" if mins is None else f"{mins:.1f}"])
    claims = done["rows"]
    lr = for_method(base, "identity").resolve().lr
    report.add(f"### 2. The suite's races (inner lr {lr:g}; outer lrs: DiLoCo {d:g}, SparseLoCo {s:g})\n\n`{command}` "
               f"({total:.1f} min; each race's report in DIR/<race>/report.md)\n\n"
               + table(["method", "inner optimizer", "lr", "final test loss", "bpc", "MB sent / worker",
                        "peak MB in one step", *[f"modeled s @ {x}" for x in LINKS], "epoch at the end", "minutes"],
                       rows)
               + "\n\n"
               + table(["race", "claim", "link", "target", "measured", "reading", "from"],
                       [[c["group"], c["claim"], c["link"] or "any",
                         "-" if c["paper"] is None else suite.format_value(c["paper"], c["unit"]),
                         suite.format_value(c["measured"], c["unit"]), c["reading"], c["detail"]] for c in claims]))
    for c in claims:
        if c["reading"] not in ("PASS", "MISS", "not measured") or c["paper"] is None:
            continue
        value = c["measured"] if c["measured"] is not None else float("nan")
        at = f" @ {c['link']}" if c["link"] else ""
        scale, unit = (100.0, "%") if c["unit"] == "rel" else (1.0, "x" if c["unit"] == "x" else "")
        report.figures.append(Figure(f"text {c['group']}: {c['claim']}{at}", scale * value, OPS[c["kind"]],
                                     scale * c["paper"], unit, c["detail"]))


def _short(spec: str) -> str:
    name, _, knobs = spec.partition(":")
    keep = [k for k in knobs.split(",") if k.split("=")[0] in ("period", "outer_lr", "fragments", "delay")
            or k.startswith("codec=") and not k.startswith("codec=identity")]
    return name + (":" + ",".join(keep) if keep else "")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--inner-lrs", default="0.001,0.002,0.004",
                   help="inner lrs to sweep, for synchronous AdamW and for DiLoCo (with each outer lr) "
                        "(default: 0.001,0.002,0.004)")
    p.add_argument("--diloco-lrs", default="0.4,0.7,1.0", help="DiLoCo outer lrs to sweep (default: 0.4,0.7,1.0)")
    p.add_argument("--sparseloco-lrs", default="1.0,2.0,4.0",
                   help="SparseLoCo outer lrs to sweep (default: 1.0,2.0,4.0)")
    p.add_argument("--skip-sweep", action="store_true", help="the suite's built-in lrs, no sweep")
    p.add_argument("--sweep-only", action="store_true",
                   help="run the sweep only and keep its choice in DIR/sweep/chosen.json (needs --keep DIR)")
    p.add_argument("--sweep-from", metavar="DIR",
                   help="take the sweep from an earlier --sweep-only run kept in DIR (DIR/sweep/chosen.json)")
    p.add_argument("--budget-minutes", type=float, default=75.0,
                   help="no run starts after this many minutes (default: 75)")
    p.add_argument("--keep", metavar="DIR", help="write the sweep and the suite into DIR/sweep and DIR/suite")
    args = p.parse_args(argv)
    if args.sweep_only and not args.keep:
        p.error("--sweep-only needs --keep DIR (the chosen values are kept there for --sweep-from)")
    given = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--json" in given:
        i = given.index("--json")
        del given[i : i + 2]
    report = Report("Slow-link training against the literature: the lowbandwidth suite on the text task",
                    " ".join(["python benchmarks/bench_lowbandwidth.py", *given]))
    deadline = time.perf_counter() + 60 * args.budget_minutes
    minutes: dict[str, float] = {}
    launch = _launcher(deadline, minutes)
    base = base_config(300 if args.quick else None)
    report.add(f"{load_note()}\n\n{settings_lines(base)}")
    with tempfile.TemporaryDirectory(prefix="bench-lowbw-") as tmp:
        root = Path(args.keep or tmp)
        d, s, tuned = suite.DILOCO_OUTER_LR, suite.SPARSELOCO_OUTER_LR, suite.TUNED_ADAMW_LR
        if args.sweep_from:
            chosen = json.loads((Path(args.sweep_from) / "sweep" / "chosen.json").read_text())
            report.add(chosen["text"] + f"\n\n(The sweep ran earlier: {chosen['command']})")
            base = dataclasses.replace(base, lr=chosen["lr"])
            d, s, tuned = chosen["diloco_lr"], chosen["sparseloco_lr"], chosen["tuned_lr"]
        elif args.skip_sweep or args.quick:
            report.add("### 1. The learning-rate sweep: not run (--skip-sweep or --quick)\n\nThe suite's built-in "
                       f"lrs: the text task's inner lr, DiLoCo {d:g} (the paper's), SparseLoCo {s:g} (the authors' "
                       "code's)")
        else:
            chosen = sweep(root / "sweep", base, [float(x) for x in args.inner_lrs.split(",")],
                           [float(x) for x in args.diloco_lrs.split(",")],
                           [float(x) for x in args.sparseloco_lrs.split(",")], launch)
            report.add(chosen["text"])
            if args.sweep_only:
                chosen["command"] = report.command
                (root / "sweep" / "chosen.json").write_text(json.dumps(chosen, indent=1))
                print(chosen["text"])
                return 0
            base = dataclasses.replace(base, lr=chosen["lr"])
            d, s, tuned = chosen["diloco_lr"], chosen["sparseloco_lr"], chosen["tuned_lr"]
        races(report, root / "suite", base, d, s, launch, minutes, tuned)
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

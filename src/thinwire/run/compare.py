"""``thinwire compare``: race methods on one task and say which pays off on which link.

Every method runs as a full ``thinwire train`` run (same task, workers, steps, seed, links),
one after the other, into ``OUT/runs/NN-name/``; a method that fails is reported as failed
and the race goes on. Then ``OUT/results.csv`` (one row per method: the summary's figures
and the time to the target accuracy at each link), ``OUT/report.md`` (the table, the best
method per link in bold) and the plots of :mod:`thinwire.run.plots`. An ``OUT`` already holding
any of these files, or a non-empty ``runs/``, is refused unless ``--overwrite``.

The target accuracy defaults to 95% of the best final accuracy any method reached (ours);
``--target`` sets it. Times at a link are modeled: measured compute and codec time plus the
link's alpha-beta time for the bytes each worker sent (see ``thinwire train --link``).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from thinwire.run.config import TrainConfig
from thinwire.run.labels import labels, slug

DEFAULT_LINKS = ("1gbit,50us", "100mbit,1ms")
TARGET_SHARE = 0.95  # default target: this share of the best final accuracy
# What a comparison writes at the top of --out (glob patterns; the plots' names are those of
# thinwire.run.plots), besides the runs under runs/.
OUTPUTS = ("report.md", "results.csv", "accuracy_vs_step.png", "accuracy_vs_bytes.png", "accuracy_vs_time_*.png",
           "time_breakdown.png")


def split_methods(texts: list[str]) -> list[str]:
    """Method specs from ``--methods`` values (repeatable), separated by commas; a
    ``key=value`` token continues the spec before it (``topk:ratio=0.01,ef=false,bf16`` is
    two methods)."""
    specs: list[str] = []
    for text in texts:
        fresh = True  # each --methods value starts a new spec
        for token in (t.strip() for t in text.split(",")):
            if not token:
                continue
            if not fresh and "=" in token and ":" not in token.split("=")[0] and ":" in specs[-1]:
                specs[-1] += "," + token
            else:
                specs.append(token)
            fresh = False
    return specs


@dataclasses.dataclass
class Race:
    """A validated race: the shared run settings and the resolved method specs."""

    base: TrainConfig
    specs: list[str]
    out: Path
    target: float | None = None
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # spec -> why it cannot run here (suites)
    typed: dict[str, str] = dataclasses.field(default_factory=dict)  # resolved spec -> as the user wrote it

    @property
    def links(self) -> tuple[str, ...]:
        return self.base.links


def prepare(base: TrainConfig, methods: list[str], out: str, target: float | None = None,
            overwrite: bool = False) -> Race:
    """Validate everything before any run: raises ``ValueError`` naming the rule broken.
    Unless ``overwrite``, an ``out`` holding any file a comparison writes (:func:`earlier_output`)
    is refused before anything is created there."""
    specs = split_methods(methods)
    if not specs:
        raise ValueError("--methods names no method")
    if target is not None and not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    path = Path(out)
    found = None if overwrite else earlier_output(path)
    if found is not None:
        raise ValueError(f"--out {out} already holds a comparison ({found.relative_to(path).as_posix()}); "
                         "pass --overwrite or choose another --out")
    base = dataclasses.replace(base, links=base.links or DEFAULT_LINKS, out=None, policy=None, policy_rules=())
    base, resolved = resolve_methods(base, specs)
    try:
        (path / "runs").mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {out} is not writable: {e.strerror or e}") from None
    return Race(base, resolved, path, target, typed=dict(zip(resolved, specs, strict=True)))


def earlier_output(path: Path) -> Path | None:
    """The first file in ``path`` that a comparison writes (:data:`OUTPUTS`), or the first
    entry of a non-empty ``runs/``; None when there is none. Other files (a user's notes) do
    not count, nor does an empty ``runs/``: only these would an ``--overwrite`` replace."""
    if not path.is_dir():
        return None
    for pattern in OUTPUTS:
        found = sorted(path.glob(pattern))
        if found:
            return found[0]
    runs = path / "runs"
    return min(runs.iterdir(), default=None) if runs.is_dir() else None


def resolve_methods(base: TrainConfig, specs: list[str]) -> tuple[TrainConfig, list[str]]:
    """``base`` with the task's defaults filled, and every spec resolved; raises
    ``ValueError`` for an unknown or bad spec, a duplicate, or a method that cannot run on
    the task's model or the workers."""
    from thinwire.algorithms.registry import check_model
    from thinwire.tasks import get as get_task

    resolved: list[str] = []
    for spec in specs:
        try:
            cfg = for_method(base, spec).resolve()
        except ValueError as e:
            raise ValueError(f"method {spec!r}: {e}") from None
        if cfg.method in resolved:
            raise ValueError(f"method {spec!r} appears twice (as {cfg.method})")
        resolved.append(cfg.method)
        # task defaults filled once (the optimizer by a method that is not one)
        base = dataclasses.replace(cfg, method=base.method, label=base.label,
                                   optimizer=base.optimizer if _owns(spec) else cfg.optimizer)
    task = get_task(base.task)(seed=base.seed, data_dir=base.data_dir, **base.task_options)
    for spec in resolved:
        try:
            check_model(spec, task.build_model())
        except ValueError as e:
            raise ValueError(f"method {spec.split(':')[0]} cannot run on task {base.task}: {e}") from None
    return base, resolved


def for_method(base: TrainConfig, spec: str, **changes: Any) -> TrainConfig:
    """``base`` running ``spec``: a method that is an optimizer itself (DeMo) replaces the
    race's ``--optimizer`` (its runs say so in their summary), the others train with it."""
    optimizer = spec.partition(":")[0].strip() if _owns(spec) else base.optimizer
    return dataclasses.replace(base, method=spec, optimizer=optimizer, **changes)


def _owns(spec: str) -> bool:
    from thinwire.algorithms.registry import own_optimizer

    return own_optimizer(spec)  # False for a bad spec too: resolving it names the problem


def run(race: Race, *, launch: Callable[..., Any] | None = None, show_progress: bool = True,
        say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every method into ``OUT/runs/NN-SLUG`` (SLUG: the spec as typed,
    :func:`thinwire.run.labels.slug`), each named by its label (:func:`thinwire.run.labels.labels`);
    returns one result per method: ``label``, ``spec``, ``status``
    (``ok`` / ``failed``), ``error``, ``summary``, ``rows`` (metrics.jsonl), ``seconds``."""
    if launch is None:
        from thinwire.run.launch import launch as default_launch

        launch = default_launch
    results = []
    n = len(race.specs)
    t_race = time.perf_counter()
    typed = [race.typed.get(spec, spec) for spec in race.specs]  # labels and folders: what the user wrote
    names = labels(typed)
    for i, (spec, label) in enumerate(zip(race.specs, names, strict=True), 1):
        out = race.out / "runs" / f"{i:02d}-{slug(typed[i - 1])}"
        cfg = for_method(race.base, spec, out=str(out), overwrite=True, label=typed[i - 1])
        say(f"[{i}/{n}] {label} ({race.base.task}, {race.base.workers} workers, {race.base.steps} steps)")
        t0 = time.perf_counter()
        result: dict[str, Any] = {"label": label, "spec": spec, "out": str(out), "rows": [], "summary": None}
        try:
            summary = launch(cfg, show_progress=show_progress)
            if summary is not None and summary.get("stopped_at") is not None:
                raise KeyboardInterrupt  # a signal stopped the run: the race ends here
            if summary is not None and summary.get("status") == "diverged":  # it ran, but did not train
                result.update(status="failed", error=f"diverged: {summary['failure']}"[:300], summary=summary)
            else:
                result.update(status="ok", error="", summary=summary, rows=_rows(out))
        except Exception as e:  # noqa: BLE001  (a failed method is reported; the race goes on)
            result.update(status="failed", error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        result["seconds"] = time.perf_counter() - t0
        results.append(result)
        done = f"done in {result['seconds']:.0f} s" if result["status"] == "ok" else f"FAILED: {result['error']}"
        say(f"[{i}/{n}] {label}: {done}; race {time.perf_counter() - t_race:.0f} s so far")
    return results


def _rows(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- figures -----------------------------------------------------------------------------------
def target_of(results: list[dict[str, Any]], target: float | None) -> float | None:
    if target is not None:
        return target
    accs = [r["summary"]["final_accuracy"] for r in results if r["status"] == "ok"
            and r["summary"].get("final_accuracy") is not None]
    return round(TARGET_SHARE * max(accs), 4) if accs else None


def to_target(rows: list[dict[str, Any]], target: float | None, link: str) -> tuple[int | None, float | None]:
    """(step, modeled seconds at ``link``) of the first evaluation at ``target`` accuracy."""
    if target is None:
        return None, None
    for r in rows:
        if (r.get("test_accuracy") or 0.0) >= target:
            return r["step"], r.get(f"modeled_seconds@{link}")
    return None, None


CSV_FIELDS = ["method", "spec", "status", "error", "task", "workers", "steps", "final_accuracy", "final_loss",
              "final_bpc", "bytes_sent_per_worker", "fp32_bytes_per_worker", "compression_ratio", "wall_seconds",
              "compute_seconds", "codec_seconds", "comm_seconds"]


def table_rows(results: list[dict[str, Any]], links: tuple[str, ...], target: float | None) -> list[dict[str, Any]]:
    """One flat record per method (the CSV's rows)."""
    out = []
    for r in results:
        s = r["summary"] or {}
        rec: dict[str, Any] = {"method": r["label"], "spec": r["spec"], "status": r["status"], "error": r["error"]}
        for key in CSV_FIELDS[4:]:
            rec[key] = s.get(key)
        for link in links:
            rec[f"modeled_seconds@{link}"] = (s.get("modeled_seconds_by_link") or {}).get(link)
            step, seconds = to_target(r["rows"], target, link)
            rec["step_to_target"] = step
            rec[f"modeled_seconds_to_target@{link}"] = seconds
        out.append(rec)
    return out


def write_csv(path: Path, records: list[dict[str, Any]], links: tuple[str, ...]) -> None:
    fields = CSV_FIELDS + [f"modeled_seconds@{link}" for link in links] + ["step_to_target"]
    fields += [f"modeled_seconds_to_target@{link}" for link in links]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for rec in records:
            w.writerow({k: ("" if rec.get(k) is None else rec.get(k)) for k in fields})


def best_per_link(records: list[dict[str, Any]], links: tuple[str, ...]) -> dict[str, str | None]:
    """Per link: the method with the least modeled time to the target (if any reached it),
    else the best final accuracy."""
    best: dict[str, str | None] = {}
    ok = [r for r in records if r["status"] == "ok"]
    for link in links:
        timed = [r for r in ok if r.get(f"modeled_seconds_to_target@{link}") is not None]
        if timed:
            best[link] = min(timed, key=lambda r: r[f"modeled_seconds_to_target@{link}"])["method"]
        else:
            scored = [r for r in ok if r.get("final_accuracy") is not None]
            best[link] = max(scored, key=lambda r: r["final_accuracy"])["method"] if scored else None
    return best


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def write_report(path: Path, race: Race, records: list[dict[str, Any]], target: float | None,
                 plots: list[str], command: str) -> None:
    links = race.links
    best = best_per_link(records, links)
    b = race.base
    target_note = "" if race.target is not None else f" ({int(TARGET_SHARE * 100)}% of the best final accuracy)"
    lines = [f"# thinwire compare: {b.task}, {b.workers} workers, {b.steps} steps", "",
             f"- command: `{command}`",
             f"- seed {b.seed}, optimizer {b.optimizer} (lr {b.lr}), batch {b.batch_size} per worker",
             f"- target test accuracy: {_num(target, '.4f')}" + target_note,
             "- modeled time = measured compute + codec time + the link's alpha-beta time for the bytes sent", ""]
    headers = ["method", "final acc", "final test loss", "MB sent / worker", "compression", "wall s"]
    headers += [f"modeled s @ {link}" for link in links] + [f"to target @ {link}" for link in links]
    lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | failed: {r['error']} |" + " - |" * (len(headers) - 2))
            continue
        final_loss = (_num(r["final_bpc"], ".4f") + " bpc" if r.get("final_bpc") is not None
                      else _num(r["final_loss"], ".4f"))
        cells = [r["method"], _num(r["final_accuracy"], ".4f"), final_loss,
                 _num((r["bytes_sent_per_worker"] or 0) / 1e6, ".2f"), _num(r["compression_ratio"], ".1f") + "x",
                 _num(r["wall_seconds"], ".1f")]
        cells += [_num(r[f"modeled_seconds@{link}"], ".1f") for link in links]
        for link in links:
            t = r.get(f"modeled_seconds_to_target@{link}")
            text = f"{t:.1f} (step {r['step_to_target']})" if t is not None else "not reached"
            cells.append(f"**{text}**" if best.get(link) == r["method"] and t is not None else text)
        if r["method"] in best.values():
            cells[0] = f"**{cells[0]}**"
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for link in links:
        lines.append(f"- best at {link}: **{best.get(link) or 'none'}**")
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        lines += ["", "Failed runs (the race went on): " + "; ".join(f"{r['method']}: {r['error']}" for r in failed)]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    lines += ["", "Per-run metrics and summaries: `runs/*/metrics.jsonl`, `runs/*/summary.json`; every row: "
              "`results.csv`.", ""]
    path.write_text("\n".join(lines))


def finish(race: Race, results: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """Write results.csv, the plots and report.md; returns their paths and the best per link."""
    from thinwire.run.plots import plot_all

    target = target_of(results, race.target)
    records = table_rows(results, race.links, target)
    write_csv(race.out / "results.csv", records, race.links)
    plots = plot_all(race.out, results, race.links, target)
    write_report(race.out / "report.md", race, records, target, plots, command)
    return {"report": str(race.out / "report.md"), "csv": str(race.out / "results.csv"), "plots": plots,
            "best": best_per_link(records, race.links), "target": target, "records": records}


def command_line(argv: list[str]) -> str:
    return "thinwire " + " ".join(a if re.fullmatch(r"[A-Za-z0-9_.,:=/@+-]+", a) else repr(a) for a in argv)


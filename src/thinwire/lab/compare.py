"""``thinwire compare``: race methods on one task and say which pays off on which link.

Every method runs as a full ``thinwire train`` run (same task, workers, steps, seed, links),
one after the other, into ``OUT/runs/NN-name/``; a method that fails is reported as failed
and the race goes on. Then ``OUT/results.csv`` (one row per run: the summary's figures
and the time to the target accuracy at each link), ``OUT/report.md`` (the table, the winner
per link in bold, or a tie) and the plots of :mod:`thinwire.lab.plots`. An ``OUT`` already holding
any of these files, or a non-empty ``runs/``, is refused unless ``--overwrite``.

**The figure that judges** is the task's own (:attr:`thinwire.tasks.Task.metric`): a classifier's
test accuracy (higher is better), a language model's test loss (``bpc`` tasks; lower is better).
The target accuracy defaults to 95% of the best final accuracy any method reached (ours; with
several seeds, of the best median), ``--target`` sets it; the target loss defaults to the best
final test loss plus 2% (:data:`LOSS_BAND`, ours), ``--target-loss`` sets it. Each is refused
on a task judged by the other figure. Times at a link are modeled: compute and codec time
plus the link's alpha-beta time for the bytes each worker sent (see ``thinwire train
--link``). The time to the target interpolates linearly between the two evaluations that
straddle it (:func:`crossing`).

**One compute figure** (:mod:`thinwire.lab.compute`). Methods that run the task's plain
forward, backward and optimizer step do the same work per step; the compute their runs
measured differs only by the machine's noise, which would otherwise decide a race on a fast
link. Their modeled times use one shared figure: the median per-step compute over every
evaluation window of every such run (the runs alternate, so a burst of load spreads over
them), with the windows' interquartile range as its range; a method with
:attr:`~thinwire.algorithms.base.Method.own_compute` (AB-training, DeMo) keeps its own.
Overlap credited against the compute (DaSGD, buckets averaged in backward) stays as the
run measured it.

``--seeds S`` runs every method with the seeds ``seed``, ``seed + 1``, ... (in rounds: every
method with one seed, then the next), into ``runs/NN-name-seedK/``; results.csv keeps one row
per run, and the report shows the median of each figure with its range over the seeds.

**Winners** (:func:`decide`). Per link the methods are ranked by their (median) time to the
target, or, when no method reaches it, by their (median) final figure. The leader is the
winner (in bold) only when it beats every other method beyond the noise; otherwise the report
says ``tie`` and names the methods it does not beat. With one run per method: a time to the
target more than :data:`TIME_TOLERANCE` (10%) shorter, an accuracy more than
:data:`ACCURACY_NOISE_PTS` (0.5 points) higher, a loss more than :data:`LOSS_NOISE` (1%)
lower. With several seeds: the leader's slowest seed faster than the other's fastest
(a final figure: its worst better than the other's best), the ranges not overlapping. And
the verdict must hold at both ends of the shared compute's range (:func:`decide_over`): a
leader that changes within it is a tie.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from thinwire import jsonfile
from thinwire.algorithms.methods import own_optimizer
from thinwire.lab.compute import SharedCompute
from thinwire.lab.tables import spread
from thinwire.run import outdir
from thinwire.run.config import TrainConfig, check_out, for_method
from thinwire.run.labels import labels, slug
from thinwire.run.summary import Summary

DEFAULT_LINKS = ("1gbit,50us", "100mbit,1ms")
TARGET_SHARE = 0.95  # default target: this share of the best final accuracy
# One run per method: what separates a winner from a tie (ours, a floor rather than a measured spread). The
# modeled times hold measured compute and codec seconds, which move from run to run (two back-to-back
# `thinwire cost --repeats 3` runs on mnist1d on a loaded 2-core machine: medians 10-25% apart), and a time
# interpolated between evaluations is exact only for a straight curve: times to the target within 10% are a tie;
# a larger gap on one busy run is no proof either, which --seeds measures. A final accuracy moves by about half a
# point between seeds at this scale.
TIME_TOLERANCE = 0.10
ACCURACY_NOISE_PTS = 0.5
LOSS_NOISE = 0.01  # ours: one seed's final test loss moves by well under 1% at these budgets (charlm, 3 seeds)
LOSS_BAND = 0.02  # default target loss: the best final test loss + 2% (ours, as the suites' to-target claims)
FIGURES = ("accuracy", "loss")  # what judges a race: the task's Task.metric ("accuracy"; "bpc" is a loss)
# What a comparison writes at the top of --out (glob patterns; the plots' names are those of
# thinwire.lab.plots), besides the runs under runs/.
OUTPUTS = ("report.md", "results.csv", "accuracy_vs_step.png", "accuracy_vs_bytes.png", "accuracy_vs_time_*.png",
           "loss_vs_step.png", "loss_vs_bytes.png", "loss_vs_time_*.png", "time_breakdown*.png")


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
    seeds: int = 1  # runs per method: seeds base.seed, base.seed + 1, ...
    warnings: list[str] = dataclasses.field(default_factory=list)  # one line each, in the report (a busy machine)
    target_loss: float | None = None  # a loss-judged race's target test loss (None: the default band)
    figure: str = "accuracy"  # what judges the race: "accuracy" or "loss" (the task's metric)

    @property
    def links(self) -> tuple[str, ...]:
        return self.base.links


def prepare(base: TrainConfig, methods: list[str], out: str, target: float | None = None,
            overwrite: bool = False, seeds: int = 1, create: bool = True, target_loss: float | None = None) -> Race:
    """Validate everything before any run: raises ``ValueError`` naming the rule broken.
    Unless ``overwrite``, an ``out`` holding any file a comparison writes (:func:`earlier_output`)
    is refused before anything is created there. ``create``: make ``OUT/runs/`` now (a suite
    checks every race before it makes any: :func:`make`). ``target`` (a test accuracy) and
    ``target_loss`` (a test loss) each apply only to a task judged by that figure."""
    specs = split_methods(methods)
    if not specs:
        raise ValueError("--methods names no method")
    if target is not None and not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target}")
    if target_loss is not None and not (math.isfinite(target_loss) and target_loss > 0):
        raise ValueError(f"target-loss must be a finite number > 0, got {target_loss}")
    figure = figure_of(base.task)
    if figure == "loss" and target is not None:
        raise ValueError(f"--target is a test accuracy, but task {base.task} is judged by its test loss; "
                         "use --target-loss")
    if figure == "accuracy" and target_loss is not None:
        raise ValueError(f"--target-loss is a test loss, but task {base.task} is judged by its test accuracy; "
                         "use --target")
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    path = Path(out)
    found = None if overwrite else earlier_output(path)
    if found is not None:
        raise ValueError(f"--out {out} already holds a comparison ({found.relative_to(path).as_posix()}); "
                         "pass --overwrite or choose another --out")
    base = dataclasses.replace(base, links=base.links or DEFAULT_LINKS, out=None, policy=None, policy_rules=())
    base, resolved = resolve_methods(base, specs)
    race = Race(base, resolved, path, target, typed=dict(zip(resolved, specs, strict=True)), seeds=seeds,
                target_loss=target_loss, figure=figure)
    check_out(str(path))
    foreign_output(race)
    if create:
        make(race)
    return race


def figure_of(task: str) -> str:
    """``"accuracy"`` or ``"loss"``: the figure that judges a race on ``task`` (its metric)."""
    from thinwire.tasks import get as get_task

    return "accuracy" if get_task(task).metric == "accuracy" else "loss"


def make(race: Race) -> None:
    """Create the race's ``OUT/runs/`` (recorded as thinwire's), checking ``OUT`` is writable."""
    path = race.out
    try:
        outdir.mkdir(path, path / "runs")
        with tempfile.NamedTemporaryFile(dir=path, prefix=".thinwire-write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"--out {path} is not writable: {e.strerror or e}") from None


def foreign_output(race: Race) -> None:
    """Refuse, before anything runs, a comparison that would replace a file thinwire did not
    write (:mod:`thinwire.run.outdir`): its report, CSV or plots, or a run's files in the run
    folders it writes."""
    from thinwire.lab.plots import plot_names
    from thinwire.run.config import check_own_outputs

    own = outdir.owned(race.out) if race.out.is_dir() else set()
    for name in ["report.md", "results.csv", *plot_names(race.links, race.figure)]:
        if os.path.lexists(race.out / name) and (name not in own or os.path.islink(race.out / name)):
            raise ValueError(f"--out {race.out}: {name} was not written by thinwire (it is not in "
                             f"{outdir.MANIFEST}), so the comparison would replace it; move it away or choose "
                             "another --out")
    for _, _, _, folder in run_folders(race):
        check_own_outputs(str(folder))


def run_folders(race: Race) -> list[tuple[int, int, str, Path]]:
    """Every run of the race, in order: (seed, method number from 1, spec, its folder
    ``OUT/runs/NN-SLUG[-seedK]``)."""
    seeds = [race.base.seed + k for k in range(race.seeds)]
    typed = [race.typed.get(spec, spec) for spec in race.specs]
    return [(seed, i, spec, race.out / "runs" / (f"{i:02d}-{slug(typed[i - 1])}"
                                                  + (f"-seed{seed}" if len(seeds) > 1 else "")))
            for seed in seeds for i, spec in enumerate(race.specs, 1)]


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
    from thinwire.algorithms.methods import check_model
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
                                   optimizer=base.optimizer if own_optimizer(spec) else cfg.optimizer)
    task = get_task(base.task)(seed=base.seed, data_dir=base.data_dir, **base.task_options)
    for spec in resolved:
        try:
            check_model(spec, task.build_model())
        except ValueError as e:
            raise ValueError(f"method {spec.split(':')[0]} cannot run on task {base.task}: {e}") from None
    return base, resolved


def run(race: Race, *, launch: Callable[..., Any] | None = None, show_progress: bool = True,
        say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run every method, once per seed (in rounds: every method with one seed, then the next),
    into ``OUT/runs/NN-SLUG`` (SLUG: the spec as typed, :func:`thinwire.run.labels.slug`; with
    several seeds ``-seedK`` after it), each named by its label
    (:func:`thinwire.run.labels.labels`); returns one result per run: ``label``, ``spec``,
    ``seed``, ``status`` (``ok`` / ``failed``), ``error``, ``summary``, ``rows``
    (metrics.jsonl), ``seconds``."""
    if launch is None:
        from thinwire.run.launch import launch as default_launch

        launch = default_launch
    results = []
    seeds = [race.base.seed + k for k in range(race.seeds)]
    n = len(race.specs) * len(seeds)
    t_race = time.perf_counter()
    typed = [race.typed.get(spec, spec) for spec in race.specs]  # labels and folders: what the user wrote
    names = labels(typed)
    for j, (seed, i, spec, out) in enumerate(run_folders(race), 1):
        label = names[i - 1]
        cfg = for_method(race.base, spec, out=str(out), overwrite=True, seed=seed, label=typed[i - 1])
        with_seed = f", seed {seed}" if len(seeds) > 1 else ""
        say(f"[{j}/{n}] {label} ({race.base.task}, {race.base.workers} workers, {race.base.steps} steps{with_seed})")
        t0 = time.perf_counter()
        result: dict[str, Any] = {"label": label, "spec": spec, "seed": seed, "out": str(out), "rows": [],
                                  "summary": None}
        try:
            summary = launch(cfg, show_progress=show_progress)
            if summary is not None and summary.stopped_at is not None:
                raise KeyboardInterrupt  # a signal stopped the run: the race ends here
            if summary is not None and summary.status == "diverged":  # it ran, but did not train
                result.update(status="failed", error=f"diverged: {summary.failure}"[:300], summary=summary)
            else:
                result.update(status="ok", error="", summary=summary, rows=_rows(out))
        except Exception as e:  # noqa: BLE001  (a failed method is reported; the race goes on)
            result.update(status="failed", error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        result["seconds"] = time.perf_counter() - t0
        results.append(result)
        done = f"done in {result['seconds']:.0f} s" if result["status"] == "ok" else f"FAILED: {result['error']}"
        say(f"[{j}/{n}] {label}: {done}; race {time.perf_counter() - t_race:.0f} s so far")
    return results


def _rows(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return jsonfile.read_lines(path)


# -- figures -----------------------------------------------------------------------------------
def key_of(figure: str) -> str:
    """The metrics rows' key of a race's figure: ``test_accuracy`` or ``test_loss``."""
    return "test_accuracy" if figure == "accuracy" else "test_loss"


def target_of(results: list[dict[str, Any]], target: float | None, figure: str = "accuracy") -> float | None:
    """``target``, or the default: :data:`TARGET_SHARE` of the best final accuracy, or the best
    final test loss plus :data:`LOSS_BAND` (each method's median over its seeds)."""
    if target is not None:
        return target
    by_method: dict[str, list[float]] = {}
    for r in results:
        value = r["summary"].final(figure) if r["status"] == "ok" else None
        if value is not None:
            by_method.setdefault(r["label"], []).append(value)
    values = [statistics.median(v) for v in by_method.values()]
    if not values:
        return None
    return round(TARGET_SHARE * max(values), 4) if figure == "accuracy" else round((1 + LOSS_BAND) * min(values), 4)


def crossing(rows: list[dict[str, Any]], key: str, target: float, link: str,
             higher: bool = True) -> tuple[float | None, float | None]:
    """(step, modeled seconds at ``link``) where ``key`` (``test_accuracy``; ``test_loss`` with
    ``higher`` False) first reaches ``target``, linearly interpolated between the evaluation
    before and the first at or past the target: with values ``v0 < target <= v1`` at steps
    ``s0, s1`` and seconds ``t0, t1``, ``f = (target - v0) / (v1 - v0)``, step ``s0 + f (s1 - s0)``,
    seconds ``t0 + f (t1 - t0)``. The first evaluation itself when it is already there (nothing
    before it to interpolate from); (None, None) when no evaluation gets there. Rows without
    the key are not evaluations."""
    at = f"modeled_seconds@{link}"
    before: dict[str, Any] | None = None
    for row in rows:
        value = row.get(key)
        if value is None:
            continue
        if (value >= target) if higher else (value <= target):
            if before is None:
                return row["step"], row.get(at)
            f = (target - before[key]) / (value - before[key])
            step = before["step"] + f * (row["step"] - before["step"])
            t0, t1 = before.get(at), row.get(at)
            return step, (None if t0 is None or t1 is None else t0 + f * (t1 - t0))
        before = row
    return None, None


def to_target(rows: list[dict[str, Any]], target: float | None, link: str,
              figure: str = "accuracy") -> tuple[float | None, float | None]:
    """(step, modeled seconds at ``link``) at which the test accuracy rises to ``target``, or
    the test loss comes down to it (:func:`crossing`)."""
    if target is None:
        return None, None
    return crossing(rows, key_of(figure), target, link, higher=figure == "accuracy")


# -- one compute figure for the methods that run the same step ----------------------------------
def shares_compute(result: dict[str, Any]) -> bool:
    """Whether a completed run's compute is the task's plain step (its figure the race's shared one)."""
    from thinwire.algorithms.methods import own_compute

    return result["status"] == "ok" and not own_compute(result["spec"])


def shared_compute(results: list[dict[str, Any]]) -> SharedCompute | None:
    """The race's shared per-step compute (:mod:`thinwire.lab.compute`) over the evaluation
    windows of every run that shares it; None when no run recorded its compute."""
    from thinwire.lab.compute import summarize, window_blocks

    shared = [r for r in results if shares_compute(r)]
    blocks = [b for r in shared for b in window_blocks(r["rows"])]
    return summarize(blocks, tuple(dict.fromkeys(r["label"] for r in shared)))


def with_compute(results: list[dict[str, Any]], per_step: float | None) -> list[dict[str, Any]]:
    """``results`` with every sharing run's compute replaced by ``per_step`` seconds a step:
    its rows' and summary's ``compute_seconds`` and every modeled time move by the difference
    (the run's own figure kept as ``measured_compute_seconds``). Unchanged when ``per_step``
    is None."""
    if per_step is None:
        return results
    out = []
    for r in results:
        if not shares_compute(r):
            out.append(r)
            continue
        rows = [_recomputed(row, row.get("step"), per_step) for row in r["rows"]]
        s = r["summary"]
        if s is not None:
            steps = s.steps_run or s.steps
            delta = steps * per_step - s.compute_seconds
            s = dataclasses.replace(
                s, compute_seconds=steps * per_step, measured_compute_seconds=s.compute_seconds,
                modeled_seconds=None if s.modeled_seconds is None else s.modeled_seconds + delta,
                modeled_seconds_by_link={k: v + delta for k, v in s.modeled_seconds_by_link.items()})
        out.append({**r, "rows": rows, "summary": s})
    return out


def _recomputed(rec: dict[str, Any], steps: float | None, per_step: float) -> dict[str, Any]:
    if rec.get("compute_seconds") is None or steps is None:
        return rec
    delta = steps * per_step - rec["compute_seconds"]
    new = {k: (v + delta if (k.startswith("modeled_seconds@") or k == "modeled_seconds") and v is not None else v)
           for k, v in rec.items()}
    new["measured_compute_seconds"] = rec["compute_seconds"]
    new["compute_seconds"] = steps * per_step
    return new


RUN_FIELDS = ["method", "spec", "seed", "status", "error"]
SUMMARY_FIELDS = ["task", "workers", "steps", "final_accuracy", "final_loss", "final_bpc", "bytes_sent_per_worker",
                  "fp32_bytes_per_worker", "compression_ratio", "wall_seconds", "compute_seconds",
                  "measured_compute_seconds", "codec_seconds", "comm_seconds"]
# how the race was judged, the same on every row: the figure (test_accuracy or test_loss), its target, and
# whether compute_seconds is the race's shared figure or the run's own (own_compute methods, no shared figure)
JUDGE_FIELDS = ["judged_by", "target", "compute_figure"]
CSV_FIELDS = RUN_FIELDS + SUMMARY_FIELDS + JUDGE_FIELDS


def table_rows(results: list[dict[str, Any]], links: tuple[str, ...], target: float | None,
               figure: str = "accuracy") -> list[dict[str, Any]]:
    """One flat record per run (the CSV's rows)."""
    out = []
    for r in results:
        s = r["summary"]
        rec: dict[str, Any] = {"method": r["label"], "spec": r["spec"], "seed": r.get("seed"), "status": r["status"],
                               "error": r["error"]}
        for key in SUMMARY_FIELDS:
            rec[key] = getattr(s, key) if s is not None else None
        rec.update(judged_by=key_of(figure), target=target,
                   compute_figure=None if r["status"] != "ok" else
                   "shared" if s is not None and s.measured_compute_seconds is not None else "own")
        for link in links:
            rec[f"modeled_seconds@{link}"] = s.modeled_seconds_by_link.get(link) if s is not None else None
            step, seconds = to_target(r["rows"], target, link, figure)
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


def standings(records: list[dict[str, Any]], links: tuple[str, ...]) -> list[dict[str, Any]]:
    """One entry per method (in race order) over its runs: ``method``, ``status`` (``ok`` when
    any run completed), ``runs`` (the completed runs' records), ``failed`` (the others),
    ``final_accuracy`` and ``final_loss`` (lists over the completed runs; runs without one
    left out) and ``to_target`` (per link, the seconds of every completed run, ``inf`` where a
    run did not reach the target)."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        m = out.setdefault(rec["method"], {"method": rec["method"], "runs": [], "failed": []})
        (m["runs"] if rec["status"] == "ok" else m["failed"]).append(rec)
    for m in out.values():
        m["status"] = "ok" if m["runs"] else "failed"
        m["final_accuracy"] = [r["final_accuracy"] for r in m["runs"] if r.get("final_accuracy") is not None]
        m["final_loss"] = [r["final_loss"] for r in m["runs"] if r.get("final_loss") is not None]
        m["to_target"] = {link: [_or_inf(r.get(f"modeled_seconds_to_target@{link}")) for r in m["runs"]]
                          for link in links}
    return list(out.values())


def _or_inf(x: float | None) -> float:
    return math.inf if x is None else float(x)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Who wins at one link: ``best`` (the winner, beyond the noise) or ``tied`` (the leader
    and every method it does not beat beyond the noise), ranked ``by`` ``time`` (to the
    target), ``accuracy`` or ``loss`` (final; no method reached the target), or ``none`` (no
    method completed). ``compute``: the tie is one because the leader changes within the
    shared compute's range (:func:`decide_over`)."""

    by: str
    best: str | None = None
    tied: tuple[str, ...] = ()
    ranged: bool = False  # the tie compared ranges over seeds (a method with several runs), not single values
    compute: bool = False

    def text(self) -> str:
        """``bf16``, ``tie between torch-ddp and bf16 (...)`` or ``none``."""
        if self.best is not None:
            return self.best
        if not self.tied:
            return "none"
        names = ", ".join(self.tied[:-1]) + f" and {self.tied[-1]}"
        final = {"accuracy": "final accuracy", "loss": "final test loss"}.get(self.by, "")
        if self.compute:
            why = "the leader changes within the measured range of the shared compute figure"
        elif self.ranged:
            why = ("overlapping ranges over the seeds of the time to the target" if self.by == "time" else
                   f"overlapping ranges over the seeds of the {final}")
        elif self.by == "time":
            why = f"times to the target within {TIME_TOLERANCE:.0%} of the fastest"
        elif self.by == "accuracy":
            why = f"final accuracies within {ACCURACY_NOISE_PTS} pts of the best (no method reached the target)"
        else:
            why = f"final test losses within {LOSS_NOISE:.0%} of the best (no method reached the target)"
        return f"tie between {names} ({why})"


def _beats(lead: list[float], other: list[float], lower: bool, by: str = "time") -> bool:
    """Does ``lead`` beat ``other`` beyond the noise? One value each: by more than
    :data:`TIME_TOLERANCE` (times, ``lower`` better; ``inf``: not reached),
    :data:`ACCURACY_NOISE_PTS` (accuracies) or :data:`LOSS_NOISE` (losses, ``by`` "loss");
    several: their ranges do not overlap (a time never reached beats nothing, and is beaten
    by any median that was reached)."""
    if len(lead) == 1 and len(other) == 1:
        a, b = lead[0], other[0]
        if by == "loss":
            return b > a if a <= 0 else round(b / a - 1, 9) > LOSS_NOISE
        if lower:
            if b == math.inf or a == math.inf:
                return b == math.inf and a < math.inf
            return b > a if a <= 0 else round(b / a - 1, 9) > TIME_TOLERANCE
        return round(100 * (a - b), 9) > ACCURACY_NOISE_PTS
    if lower:
        return max(lead) < min(other) or (min(other) == math.inf and statistics.median(lead) < math.inf)
    return min(lead) > max(other)


def decide(table: list[dict[str, Any]], links: tuple[str, ...], figure: str = "accuracy") -> dict[str, Decision]:
    """Per link, the winner or the tie (:class:`Decision`) among the :func:`standings`: the
    method with the least (median) time to the target when any median reached it, else the
    best (median) final figure (``figure``: accuracy, or loss); the winner when it beats
    every other beyond the noise (:func:`_beats`), else a tie of it and every method it does
    not beat (equal medians: the race's order)."""
    ok = [m for m in table if m["status"] == "ok"]
    out: dict[str, Decision] = {}
    for link in links:
        times = {m["method"]: m["to_target"][link] for m in ok}
        if any(statistics.median(t) < math.inf for t in times.values()):
            ranked = sorted(times, key=lambda k: statistics.median(times[k]))
            values, lower, by = times, True, "time"
        elif figure == "loss":
            values = {m["method"]: m["final_loss"] for m in ok if m["final_loss"]}
            ranked = sorted(values, key=lambda k: statistics.median(values[k]))
            lower, by = True, "loss"
        else:
            values = {m["method"]: m["final_accuracy"] for m in ok if m["final_accuracy"]}
            ranked = sorted(values, key=lambda k: -statistics.median(values[k]))
            lower, by = False, "accuracy"
        if not ranked:
            out[link] = Decision("none")
            continue
        lead = ranked[0]
        tied = tuple(k for k in ranked[1:] if not _beats(values[lead], values[k], lower, by))
        ranged = any(len(values[k]) > 1 for k in (lead, *tied))  # _beats compared ranges, not single values
        out[link] = Decision(by, tied=(lead, *tied), ranged=ranged) if tied else Decision(by, best=lead)
    return out


def decide_over(tables: list[list[dict[str, Any]]], links: tuple[str, ...],
                figure: str = "accuracy") -> dict[str, Decision]:
    """:func:`decide` on the race's standings at the shared compute's median (``tables[0]``)
    and at the ends of its range (the others): a winner must win at every one of them; where
    the leader changes, a tie of every method that led or tied at any of them (in the median's
    order), marked ``compute``."""
    each = [decide(t, links, figure) for t in tables]
    out: dict[str, Decision] = {}
    for link in links:
        first = each[0][link]
        if all(d[link] == first for d in each[1:]) or first.by == "none":
            out[link] = first
            continue
        members: list[str] = []
        for d in each:
            best = d[link].best
            for name in (best,) if best is not None else d[link].tied:
                if name not in members:
                    members.append(name)
        if len(members) == 1:  # the same winner everywhere, the ties' details aside
            out[link] = first
        else:
            out[link] = Decision(first.by, tied=tuple(members), ranged=first.ranged, compute=True)
    return out


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _step(x: float) -> str:
    """An (interpolated) step: whole from 100 on, where a tenth of a step says nothing."""
    return f"{x:.0f}" if float(x).is_integer() or x >= 100 else f"{x:.1f}"


def win_rule(seeds: int, figure: str = "accuracy") -> str:
    """The rule that makes a winner, in words (the report and the docs state it)."""
    final = (f"a final accuracy more than {ACCURACY_NOISE_PTS} pts higher" if figure == "accuracy" else
             f"a final test loss more than {LOSS_NOISE:.0%} lower")
    worst = "lowest final accuracy above every other's highest" if figure == "accuracy" else \
        "highest final test loss below every other's lowest"
    compute = ("; the verdict must also hold at both ends of the shared compute figure's range, else it is a tie")
    if seeds > 1:
        return ("a method wins at a link (in bold) only when its slowest seed reaches the target before the fastest "
                f"seed of every other method (no method reaching it: its {worst}); otherwise the report says tie and "
                "names the methods whose ranges overlap the leader's" + compute)
    return (f"a method wins at a link (in bold) only when its time to the target is more than "
            f"{TIME_TOLERANCE:.0%} shorter than every other method's (no method reaching it: {final}); otherwise "
            f"the report says tie and names the methods within that of the leader" + compute +
            f". One seed: the codec times in a modeled time move from run to run, and a final figure from seed to "
            f"seed; {TIME_TOLERANCE:.0%} is a floor of ours, not a measured spread: --seeds S replaces this rule by "
            "the runs' own spread")


def _target_text(race: Race, target: float | None, records: list[dict[str, Any]]) -> str:
    if race.figure == "accuracy":
        note = "" if race.target is not None else f" ({int(TARGET_SHARE * 100)}% of the best final accuracy)"
        return f"judged by test accuracy (higher is better); target test accuracy: {_num(target, '.4f')}{note}"
    note = "" if race.target_loss is not None else f" (the best final test loss + {LOSS_BAND:.0%})"
    bpc = "" if target is None or not any(r.get("final_bpc") is not None for r in records) else \
        f" = {target / math.log(2):.4f} bits per character"
    return (f"judged by test loss (lower is better; the task's figure is a loss, so accuracy decides nothing); "
            f"target test loss: {_num(target, '.4f')} nats{bpc}{note}")


def dominant(summary: Summary, link: str) -> tuple[str, float] | None:
    """What most of a run's modeled time at ``link`` went to: (``compute`` | ``codec`` |
    ``communication``, its share), communication being the modeled time less compute and
    codec (what overlap hid is not counted); None without a modeled time."""
    modeled = summary.modeled_seconds_by_link.get(link)
    if modeled is None or modeled <= 0:
        return None
    compute, codec = summary.compute_seconds, summary.codec_seconds
    parts = {"compute": compute, "codec": codec, "communication": max(0.0, modeled - compute - codec)}
    name = max(parts, key=lambda k: parts[k])
    return name, parts[name] / modeled


def write_report(path: Path, race: Race, records: list[dict[str, Any]], target: float | None,
                 plots: list[str], command: str, decisions: dict[str, Decision] | None = None,
                 compute: SharedCompute | None = None, summaries: dict[str, Summary] | None = None) -> None:
    links = race.links
    table = standings(records, links)
    decisions = decisions if decisions is not None else decide(table, links, race.figure)
    winners = {d.best for d in decisions.values() if d.best is not None}
    b = race.base
    seeds = (f"seed {b.seed}" if race.seeds == 1 else
             f"seeds {', '.join(str(b.seed + k) for k in range(race.seeds))} (each figure: median [min–max] over "
             "the seeds; ∞: a seed did not reach the target)")
    shared = ("- compute: none of the runs recorded its compute" if compute is None else
              f"- compute: one figure shared by {', '.join(compute.methods)}: {compute.text()} (each run's "
              "evaluation windows; the range is their interquartile range); the other methods keep their own")
    lines = [f"# thinwire compare: {b.task}, {b.workers} workers, {b.steps} steps", "",
             f"- command: `{command}`",
             f"- {seeds}, optimizer {b.optimizer} (lr {b.lr}), batch {b.batch_size} per worker",
             f"- {_target_text(race, target, records)}",
             "- modeled time = compute + codec time + the link's alpha-beta time for the bytes sent; the "
             "time to the target interpolates linearly between the two evaluations that straddle it",
             shared,
             f"- winner: {win_rule(race.seeds, race.figure)}",
             *[f"- {w}" for w in race.warnings], ""]
    lines += _table_lines(table, links, decisions, winners, compute)
    lines.append("")
    for link in links:
        d = decisions[link]
        lines.append(f"- best at {link}: " + (f"**{d.best}**" if d.best else d.text()))
    lines += _why_lines(race, table, target, links, summaries or {})
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        seed = (lambda r: f" (seed {r['seed']})") if race.seeds > 1 else (lambda r: "")
        lines += ["", "Failed runs (the race went on): " + "; ".join(f"{r['method']}{seed(r)}: {r['error']}"
                                                                    for r in failed)]
    if plots:
        shown = "" if race.seeds == 1 else f" (seed {b.seed}'s runs)"
        lines += ["", f"## Plots{shown}", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    lines += ["", "Per-run metrics and summaries: `runs/*/metrics.jsonl`, `runs/*/summary.json`; every row: "
              "`results.csv`. Which method family for which link and model: thinwire's docs/choosing.md.", ""]
    path.write_text("\n".join(lines))


def _table_lines(table: list[dict[str, Any]], links: tuple[str, ...], decisions: dict[str, Decision],
                 winners: set[str], compute: SharedCompute | None) -> list[str]:
    """The report's table: a row per method (its figures over the seeds), the winners in bold."""
    headers = ["method", "final acc", "final test loss", "MB sent / worker", "compression", "compute s", "wall s"]
    headers += [f"modeled s @ {link}" for link in links] + [f"to target @ {link}" for link in links]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for m in table:
        if m["status"] != "ok":
            lines.append(f"| {m['method']} | failed: {m['failed'][0]['error']} |" + " - |" * (len(headers) - 2))
            continue
        runs = m["runs"]
        bpc = _median(runs, "final_bpc")
        final_loss = spread(m["final_loss"], ".4f") if m["final_loss"] else "-"
        if bpc is not None:
            final_loss += f" ({bpc:.4f} bpc)"
        sent = _median(runs, "bytes_sent_per_worker")
        own = "" if all(r.get("compute_figure") != "own" for r in runs) or compute is None else " (own)"
        cells = [m["method"], spread(m["final_accuracy"], ".4f") if m["final_accuracy"] else "-", final_loss,
                 _num((sent or 0) / 1e6, ".2f"), _num(_median(runs, "compression_ratio"), ".1f") + "x",
                 _num(_median(runs, "compute_seconds"), ".1f") + own, _num(_median(runs, "wall_seconds"), ".1f")]
        cells += [_num(_median(runs, f"modeled_seconds@{link}"), ".1f") for link in links]
        steps = [_or_inf(r.get("step_to_target")) for r in runs]
        for link in links:
            t = m["to_target"][link]
            if min(t) == math.inf:
                text = "not reached"
            else:
                step = statistics.median(steps)
                text = spread(t, ".1f") + (f" (step {_step(step)})" if step < math.inf else "")
            cells.append(f"**{text}**" if decisions[link].best == m["method"] and decisions[link].by == "time"
                         else text)
        if m["method"] in winners:
            cells[0] = f"**{cells[0]}**"
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _why_lines(race: Race, table: list[dict[str, Any]], target: float | None, links: tuple[str, ...],
               summaries: dict[str, Summary]) -> list[str]:
    """The report's "why" section: per link what most of each method's modeled time went to,
    and for a method that never reached the target, its final figure against it."""
    ok = [m for m in table if m["status"] == "ok"]
    if not ok:
        return []
    lines = ["", "## Why", "", "What most of each method's modeled time went to, per link (communication: what "
             "the link model adds after any overlap):", "",
             "| method | " + " | ".join(links) + " |", "|---|" + "---|" * len(links)]
    for m in ok:
        s = summaries.get(m["method"])
        cells = []
        for link in links:
            d = dominant(s, link) if s is not None else None
            cells.append("-" if d is None else f"{d[0]} {d[1]:.0%}")
        lines.append(f"| {m['method']} | " + " | ".join(cells) + " |")
    final = "final_accuracy" if race.figure == "accuracy" else "final_loss"
    name = "test accuracy" if race.figure == "accuracy" else "test loss"
    lines.append("")
    for m in ok:
        if target is None or any(min(t) < math.inf for t in m["to_target"].values()) or not m[final]:
            continue
        lines.append(f"- {m['method']} never reached the target: its final {name} {statistics.median(m[final]):.4f} "
                     f"against {target:.4f}. It lost on quality, not on time: a setting that sends more (a larger "
                     "rank, ratio or number of bits, a shorter period) trades bytes for quality")
    return lines


def finish(race: Race, results: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """Write results.csv, the plots (of the first seed's runs) and report.md; returns their
    paths, the winner per link (None on a tie: ``decisions`` holds the tied methods), the
    per-link :class:`Decision` and the shared compute figure (``compute``)."""
    from thinwire.lab.plots import plot_all, plot_names

    target_value = race.target if race.figure == "accuracy" else race.target_loss
    target = target_of(results, target_value, race.figure)
    compute = shared_compute(results)
    views = [with_compute(results, c) for c in
             ((compute.per_step, compute.lo, compute.hi) if compute is not None else (None,))]
    records = table_rows(views[0], race.links, target, race.figure)
    decisions = decide_over([standings(table_rows(v, race.links, target, race.figure), race.links) for v in views],
                            race.links, race.figure)
    outdir.claim(race.out, "results.csv", "report.md", *plot_names(race.links, race.figure))  # thinwire's own
    write_csv(race.out / "results.csv", records, race.links)
    first = [r for r in views[0] if r.get("seed", race.base.seed) == race.base.seed]
    plots = plot_all(race.out, first, race.links, target, race.figure)
    summaries = {r["label"]: r["summary"] for r in first if r["status"] == "ok"}
    write_report(race.out / "report.md", race, records, target, plots, command, decisions, compute, summaries)
    return {"report": str(race.out / "report.md"), "csv": str(race.out / "results.csv"), "plots": plots,
            "best": {link: d.best for link, d in decisions.items()}, "decisions": decisions, "target": target,
            "records": records, "compute": compute}


def command_line(argv: list[str]) -> str:
    return "thinwire " + " ".join(a if re.fullmatch(r"[A-Za-z0-9_.,:=/@+-]+", a) else repr(a) for a in argv)


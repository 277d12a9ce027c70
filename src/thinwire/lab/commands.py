"""The lab's commands: ``thinwire compare`` (a race, or a suite of races), ``thinwire cost`` (a
prediction before training) and ``thinwire bench`` (codecs, consensus, memory). :mod:`thinwire.cli`
adds their parsers and hands them the parsed options."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from thinwire.run.arguments import (
    BadInput,
    Parser,
    config_from,
    import_option,
    max_workers_option,
    node_options,
    nodes_resolved,
    optimizer_options,
    outdir_errors,
    per_task,
    task_options_help,
    tasks_by_name,
)
from thinwire.run.summary import Summary

COMMANDS = ("compare", "cost", "bench")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the lab command ``args.command`` (one of :data:`COMMANDS`)."""
    if args.command == "cost":
        return _cost(args)
    if args.command == "compare":
        return _compare(args, argv)
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    if args.bench == "codecs":
        from thinwire.lab.bench_codecs import main as bench_codecs

        return bench_codecs(quick=args.quick, methods=args.methods, repeats=args.repeats)
    if args.bench == "consensus":
        from thinwire.lab.bench_consensus import main as bench_consensus

        return bench_consensus(quick=args.quick, methods=args.methods, workers=args.workers, size=args.size,
                               topology=args.topology, max_steps=args.max_steps, out=args.out)
    from thinwire.lab.bench_memory import main as bench_memory
    from thinwire.run.config import check_workers

    if args.workers < 1 or args.steps < 1:
        raise BadInput("bench memory: --workers and --steps must be >= 1")
    try:
        check_workers(args.workers, args.max_workers)
    except ValueError as e:
        raise BadInput(str(e)) from None
    try:
        return bench_memory(methods=args.methods, workers=args.workers, steps=args.steps, out=args.out)
    except outdir_errors() as e:
        raise BadInput(str(e)) from None


def compare_parser(sub: Any) -> None:
    c = sub.add_parser("compare", help="race methods on one task: report.md, results.csv and plots of accuracy "
                       "against steps, bytes and modeled time per link")
    c.add_argument("--methods", action="append", metavar="M1,M2,...",
                   help="method specs separated by commas (a key=value token continues the spec before it: "
                   "identity,topk:ratio=0.01,ef=false,torch-ddp); repeatable")
    c.add_argument("--suite", choices=["seeds", "lowbandwidth", "transform"], help="instead of --methods: a preset "
                   "of races; seeds = each of the five seed methods against its paper's peers, with the measured ratio "
                   "next to the paper's headline claim; lowbandwidth (give --task text) = DiLoCo, its 4-bit and "
                   "streamed forms, SparseLoCo, MuLoCo and DeMo against synchronous AdamW (also at its own best lr), "
                   "local SGD and torchft's DiLoCo; transform = DeMo "
                   "(bf16 and 1-bit) against detonation's DeMo, the dct codec, fft, top-k, PowerSGD and fp32 "
                   "all_reduce (the last two: each figure against a target, PASS/MISS, times to a target loss per "
                   "link; all: OUT/report.md, OUT/claims.csv; one race per group in OUT/<group>/)")
    c.add_argument("--task", default="mnist1d", help=f"{' | '.join(tasks_by_name())} (default: mnist1d); or a "
                   "task of your own that --import FILE.py registers (docs/your_own_task.md)")
    c.add_argument("--workers", type=int, help="local ranks per run (default: 2; 4 with --suite)")
    c.add_argument("--steps", type=int,
                   help=f"training steps per run (default: the task's budget: {per_task('steps')}); a suite "
                   "refuses steps that end inside a method's warm-up or before its first average")
    c.add_argument("--link", action="append", dest="links", metavar="LINK",
                   help="network to model, one report column each (default: 1gbit,50us and 100mbit,1ms)")
    c.add_argument("--emulate-link", action="store_true",
                   help="delay real collectives by the first --link's modeled time")
    node_options(c)
    c.add_argument("--out", required=True, help="directory for report.md, results.csv, the PNGs and runs/")
    c.add_argument("--overwrite", action="store_true", help="allow --out to replace an earlier comparison")
    _judging_options(c)
    c.add_argument("--eval-every", type=int,
                   help=f"evaluate every K steps (default: the task's: {per_task('eval_every')})")
    optimizer_options(c)
    c.add_argument("--data", "--data-dir", dest="data_dir", metavar="PATH",
                   help="the task's data (text: a UTF-8 file, a folder of them or a uint16 token file; cifar10: the "
                   "CIFAR-10 binary files' folder)")
    c.add_argument("--option", action="append", dest="task_options", metavar="KEY=VALUE",
                   help=f"task option, e.g. model=vgg (repeatable); {task_options_help()}")
    c.add_argument("--bucket-mb", type=float, default=25.0, help="fuse tensors into buckets of this size (default: 25)")
    c.add_argument("--threads", type=int, help="torch threads per spawned worker (default: cores / workers)")
    c.add_argument("--quiet", action="store_true", help="no progress bars (one line per method still)")
    c.add_argument("--tensorboard", action=argparse.BooleanOptionalAction,
                   help="TensorBoard event files in every run's folder: tensorboard --logdir OUT/runs (default: when "
                        "the tensorboard package is installed)")
    max_workers_option(c)
    import_option(c)


def _judging_options(p: Any) -> None:
    """How a race is judged: its target, its seeds."""
    p.add_argument("--target", type=float,
                   help="a classifier's test accuracy to time each method to (default: 95%% of the best final "
                   "accuracy)")
    p.add_argument("--target-loss", type=float, metavar="LOSS",
                   help="a language model's test loss (nats) to time each method to (default: the best final test "
                   "loss + 2%%); a race is judged by the task's own figure: loss for language models, accuracy for "
                   "classifiers")
    p.add_argument("--seed", type=int, default=0, help="seed of every run (default: 0)")
    p.add_argument("--seeds", type=int, default=1, metavar="S",
                   help="run every method with S seeds (--seed, --seed + 1, ...): the report shows each figure as "
                   "median [min-max], results.csv one row per run, and a method wins at a link only when its "
                   "range beats every other's, else it is a tie (default: 1; with one seed a win needs a time to "
                   "the target more than 10%% shorter, or an accuracy more than 0.5 pts higher; --methods races "
                   "only)")


def cost_parser(sub: Any) -> None:
    k = sub.add_parser("cost", help="predict each method's step time on a link from a short probe, and where "
                       "compression pays off against bf16")
    k.add_argument("--task", default="mnist1d", help=f"{' | '.join(tasks_by_name())} (default: mnist1d); or a "
                   "task of your own that --import FILE.py registers (docs/your_own_task.md)")
    k.add_argument("--link", action="append", dest="links", metavar="LINK",
                   help="network to predict for, one column each (default: 1gbit,50us and 100mbit,1ms)")
    k.add_argument("--workers", type=int, default=4, help="local ranks of each probe (default: 4)")
    k.add_argument("--methods", action="append", metavar="M1,M2,...",
                   help="method specs separated by commas, as for compare (default: identity,bf16,"
                   "topk:ratio=0.01,powersgd:rank=2,fft,hylo); bf16 is always probed as the reference")
    k.add_argument("--probe-steps", type=int, default=20,
                   help="timed training steps of each probe, after as many warm-up steps, or fewer where "
                   "--probe-seconds does not hold them (default: 20)")
    k.add_argument("--probe-seconds", type=float, default=PROBE_SECONDS, metavar="S",
                   help="at most S seconds of training steps per probe, at the step time measured so far: a probe "
                   "whose steps do not fit times as many as fit after one warm-up step, at least one (a periodic "
                   "method: one period); the ranks' start-up is not counted; inf: no bound (default: "
                   f"{PROBE_SECONDS:g})")
    k.add_argument("--compute-ms", type=float, metavar="MS",
                   help="the compute of one training step on your own hardware, in milliseconds: it replaces the "
                   "compute measured here in every prediction (methods with their own compute: scaled by MS over "
                   "the measured figure); the codec and wait times stay this machine's")
    k.add_argument("--compute-from", metavar="RUN_DIR|GPU_JSON",
                   help="as --compute-ms, from a finished run's summary.json (compute_seconds / steps): a run of "
                   "the same task, options and batch size on the hardware to predict; or from the results of "
                   "benchmarks/bench_gpu.py (its .json, or the .md beside it): the compute step of the model "
                   "that matches the probe (task, options, batch size, parameters), and, for a probe with as "
                   "many workers as the file's, its measured codec time of each method it holds")
    k.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="probe every method R times, in rounds, and show each figure as median [min-max] and "
                   "each bandwidth of the verdict (from the medians) with its range over the repeats (default: 1)")
    k.add_argument("--seed", type=int, default=0, help="seed of the probes (default: 0)")
    k.add_argument("--batch-size", type=int,
                   help=f"batch size per worker (default: the task's: {per_task('batch_size')})")
    k.add_argument("--data", "--data-dir", dest="data_dir", metavar="PATH",
                   help="the task's data (text: a UTF-8 file, a folder of them or a uint16 token file; cifar10: the "
                   "CIFAR-10 binary files' folder)")
    k.add_argument("--option", action="append", dest="task_options", metavar="KEY=VALUE",
                   help=f"task option, e.g. model=vgg (repeatable); {task_options_help()}")
    k.add_argument("--threads", type=int, help="torch threads per spawned worker (default: cores / workers)")
    node_options(k)
    max_workers_option(k)
    import_option(k)


def bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", metavar="BENCH", parser_class=Parser)
    bc = bsub.add_parser("codecs", help="encode+decode speed, error and bytes of every codec")
    bc.add_argument("--quick", action="store_true", help="small tensors and few repeats")
    bc.add_argument("--methods", help="comma-separated codec specs (default: every codec at its defaults)")
    bc.add_argument("--repeats", type=int, help="timed repeats per codec (median reported)")
    bn = bsub.add_parser("consensus", help="gossip alone: consensus error vs bits sent (dpsgd, powergossip ranks)")
    bn.add_argument("--quick", action="store_true", help="at most 200 steps per method")
    bn.add_argument("--methods", help="';'-separated gossip specs (default: dpsgd;powergossip:rank=1;...=2;...=4)")
    bn.add_argument("--workers", type=int, default=8, help="in-process workers (default: 8)")
    bn.add_argument("--size", type=int, default=100, help="each worker's matrix is SIZE x SIZE (default: 100)")
    bn.add_argument("--topology", default="ring", help="ring | torus | complete | exponential | FILE (default: ring)")
    bn.add_argument("--max-steps", type=int, help="steps per method at most (default: 3000; 200 with --quick)")
    bn.add_argument("--out", help="write every curve to this CSV file (method, step, bits_per_worker, relative_error)")
    bm = bsub.add_parser("memory", help="peak memory of every method beyond identity's, in model copies, against "
                         "the documented figure")
    bm.add_argument("--methods", help="comma-separated method specs (default: every method that runs here)")
    bm.add_argument("--workers", type=int, default=2, help="spawned ranks per run (default: 2)")
    bm.add_argument("--steps", type=int, default=12, help="training steps per run (default: 12)")
    bm.add_argument("--out", help="also write the table to this markdown file")
    max_workers_option(bm)


COMPARE_FIELDS = ("task", "workers", "steps", "batch_size", "lr", "optimizer", "seed", "data_dir", "links",
                  "emulate_link", "eval_every", "bucket_mb", "threads", "task_options", "imports", "max_workers",
                  "ranks_per_node", "intra_link", "intra_dtype", "shard", "tensorboard", "lr_schedule", "warmup_steps",
                  "min_lr", "muon_lr")


PROBE_SECONDS = 20.0  # thinwire cost: seconds of training steps per probe, by default


COST_FIELDS = ("task", "workers", "batch_size", "seed", "data_dir", "links", "threads", "task_options", "imports",
               "max_workers", "ranks_per_node", "intra_link", "intra_dtype", "shard")


def _compare(args: argparse.Namespace, argv: list[str]) -> int:
    from thinwire.lab import compare

    if bool(args.methods) == bool(args.suite):
        raise BadInput("compare needs exactly one of --methods and --suite")
    if args.suite and (args.target is not None or args.target_loss is not None):
        raise BadInput(f"--{'target' if args.target is not None else 'target-loss'} applies to --methods races "
                       "(each suite race sets its own)")
    if args.suite and args.seeds != 1:
        raise BadInput("--seeds applies to --methods races (a suite's claims are read on one seed)")
    from thinwire.lab import suite

    workers = args.workers if args.workers is not None else (suite.SUITE_WORKERS if args.suite else 2)
    base = config_from(args, COMPARE_FIELDS, workers=workers)
    from thinwire.run import outdir

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(outdir.hold(args.out))  # one comparison at a time in a folder, to its end
            for group in suite.SUITES[args.suite] if args.suite else ():  # and in each race's folder
                stack.enter_context(outdir.hold(os.path.join(args.out, group.key)))
            base = nodes_resolved(base)
            if args.suite:
                races = suite.prepare(base, args.out, args.overwrite, suite.SUITES[args.suite])
            else:
                race = compare.prepare(base, args.methods, args.out, args.target, args.overwrite, seeds=args.seeds,
                                       target_loss=args.target_loss)
        except ValueError as e:
            raise BadInput(str(e)) from None
        return _compare_locked(args, argv, races if args.suite else [race])


def _compare_locked(args: argparse.Namespace, argv: list[str], races: list[Any]) -> int:
    from thinwire.lab import compare

    warning = _warn_load("thinwire compare")
    for each in races:
        each.warnings += [warning] if warning else []
    if args.suite:
        return _suite(args, argv, races)
    race = races[0]
    results = compare.run(race, show_progress=not args.quiet, say=lambda line: print(line, flush=True))
    done = compare.finish(race, results, compare.command_line(argv))
    for link, decision in done["decisions"].items():
        print(f"best at {link}: {decision.text()}")
    print(f"wrote {done['report']}, {done['csv']} and {len(done['plots'])} plots")
    failed = [r["label"] + (f" (seed {r['seed']})" if race.seeds > 1 else "") for r in results if r["status"] != "ok"]
    if failed:
        print(f"thinwire: {len(failed)} of {len(results)} runs failed: {', '.join(failed)} (see the report)",
              file=sys.stderr)
    return 1 if len(failed) == len(results) else 0


def _suite(args: argparse.Namespace, argv: list[str], races) -> int:
    from thinwire.lab import compare, suite

    groups = suite.SUITES[args.suite]
    say = lambda line: print(line, flush=True)  # noqa: E731
    results = suite.run(races, groups, show_progress=not args.quiet, say=say)
    done = suite.finish(args.out, races, results, compare.command_line(argv), groups)
    for line in suite.summary_lines(done["rows"]):
        print(line)
    print(f"wrote {done['report']}, {done['csv']} and one race per group in {args.out}/<group>/")
    failed = [r["label"] for res in results for r in res if r["status"] != "ok"]
    if failed:
        print(f"thinwire: runs failed: {', '.join(sorted(set(failed)))} (see the reports)", file=sys.stderr)
    return 1 if all(r["status"] != "ok" for res in results for r in res) else 0


def _cost(args: argparse.Namespace) -> int:
    from thinwire.lab import cost
    from thinwire.lab.compare import DEFAULT_LINKS, resolve_methods, split_methods

    if args.probe_steps < 2:
        raise BadInput(f"probe-steps must be >= 2, got {args.probe_steps}")
    if args.repeats < 1:
        raise BadInput(f"repeats must be >= 1, got {args.repeats}")
    if not args.probe_seconds > 0:  # nan too
        raise BadInput(f"--probe-seconds must be a number of seconds > 0 (inf: no bound), got {args.probe_seconds}")
    given = _given_compute(args)
    base = config_from(args, COST_FIELDS, steps=args.probe_steps, eval_every=args.probe_steps,
                   links=tuple(args.links or DEFAULT_LINKS))
    specs = split_methods(args.methods or [cost.DEFAULT_METHODS])
    try:
        base = nodes_resolved(base)
        typed = [cost.REFERENCE] + [s for s in specs if s != cost.REFERENCE]
        base, resolved = resolve_methods(base, typed)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if given is not None and given.summary is not None:
        _check_compute_run(given.summary, base, args.compute_from)
    if given is not None and given.gpu is not None:
        given = _from_gpu_results(given.gpu, base, resolved, args.compute_from)
    from thinwire.run.labels import labels

    table = _CostTable(args, base, resolved, labels(typed), given)
    _warn_load("thinwire cost")
    collected: dict[str, list[Any]] = {spec: [] for spec in resolved}
    failed: dict[str, str] = {}

    def on_result(spec: str, result: Any) -> None:
        if isinstance(result, str):
            failed[spec] = result
            print(f"thinwire: the probe of {spec.split(':')[0]} failed: {result}", file=sys.stderr, flush=True)
            return
        collected[spec].append(result)
        line = table.line(spec, {s: cs for s, cs in collected.items() if cs and s not in failed})
        if line:
            print(line, flush=True)

    restore = _sigterm_interrupts()
    try:
        pace = cost.Pace.first(base, args.probe_seconds)
        runs, _ = cost.probe_repeats(base, resolved, args.probe_steps, args.repeats, pace=pace,
                                     say=lambda line: print(line, flush=True), on_result=on_result)
    except KeyboardInterrupt as e:
        name = getattr(e, "signal", None) or "SIGINT"
        done = {s: cs for s, cs in collected.items() if cs and s not in failed}
        if resolved[0] in done:
            print(f"thinwire cost: stopped by {name}; the methods probed so far:", flush=True)
            table.print(done, interrupted=True)
        else:
            print(f"thinwire cost: stopped by {name} before the reference ({cost.REFERENCE}) was probed", flush=True)
        print(f"thinwire: stopped by {name}", file=sys.stderr)
        return 143 if name == "SIGTERM" else 130
    finally:
        restore()
    if resolved[0] not in runs:
        return 1  # no reference to compare against
    table.print(runs)
    return 0


@dataclass
class _Given:
    """What the user gave of their own hardware: the compute of a step (seconds; None until a
    GPU results file's model is matched to the probe), the run it came from (``--compute-from
    RUN_DIR``), or the GPU results file (``--compute-from GPU_JSON``) and, once matched, the
    codec seconds it measured per resolved spec and a line saying where they came from."""

    compute_s: float | None
    summary: Summary | None = None
    gpu: dict[str, Any] | None = None
    codec_s: dict[str, float] = field(default_factory=dict)
    source: str = ""
    codec_note: str = ""  # where the codec seconds came from, when a results file could give them


def _given_compute(args: argparse.Namespace) -> _Given | None:
    """The compute a step takes on the user's hardware (``--compute-ms`` or ``--compute-from``:
    a run's summary, or a bench_gpu results file, read here and matched to the probe later),
    or None: the one measured here."""
    if args.compute_ms is not None and args.compute_from is not None:
        raise BadInput("give one of --compute-ms and --compute-from")
    if args.compute_ms is not None:
        if not (math.isfinite(args.compute_ms) and args.compute_ms > 0):
            raise BadInput(f"--compute-ms must be a finite number of milliseconds > 0, got {args.compute_ms}")
        return _Given(args.compute_ms / 1e3, source="--compute-ms")
    if args.compute_from is not None:
        from thinwire.lab.cost import compute_from_run
        from thinwire.lab.gpu_results import read_if_results

        try:
            gpu = read_if_results(args.compute_from)
            if gpu is not None:
                return _Given(None, gpu=gpu)
            seconds, summary = compute_from_run(args.compute_from)
        except ValueError as e:
            raise BadInput(str(e)) from None
        return _Given(seconds, summary, source=f"--compute-from {args.compute_from}")
    return None


def _from_gpu_results(data: dict[str, Any], base: Any, resolved: list[str], where: str) -> _Given:
    """The probe's model in a bench_gpu results file: its compute step, and its codec seconds
    for the probed methods it measured where the probe has as many workers as the file's
    codec times are for (a gathered codec decodes one payload per worker)."""
    from thinwire.lab.gpu_results import model_for

    try:
        model = model_for(data, where, task=base.task, options=dict(base.task_options), batch_size=base.batch_size,
                          parameters=_parameters(base))
    except ValueError as e:
        raise BadInput(str(e)) from None
    codecs = {spec: s for spec, s in model.codec_s.items() if spec in resolved}
    if model.workers != base.workers:
        note = (f"codec ms: this machine's (the file's are one rank's of {model.workers} workers, this probe has "
                f"{base.workers})")
        codecs = {}
    elif codecs:
        names = ", ".join(spec.split(":")[0] for spec in resolved if spec in codecs)
        note = f"codec ms of {names}: the file's ({model.workers} workers), the others' this machine's"
    else:
        note = "codec ms: this machine's (the file measured none of these methods)"
    return _Given(model.compute_s, gpu=data, codec_s=codecs, source=f"--compute-from {where}: {model.name} on "
                  f"{model.device}", codec_note=note)


def _parameters(base: Any) -> int:
    """Parameters of the probe's model (built without memory: on the meta device)."""
    import torch

    from thinwire.tasks import get as get_task

    task = get_task(base.task)(seed=base.seed, data_dir=base.data_dir, **base.task_options)
    with torch.device("meta"):
        return sum(p.numel() for p in task.build_model().parameters())


def _check_compute_run(summary: Summary, base: Any, where: str) -> None:
    """A ``--compute-from`` run must have computed this probe's step: the same task, task
    options and batch size per worker, and a method that runs the task's plain step."""
    from thinwire.algorithms.methods import own_compute

    config = summary.config if isinstance(summary.config, dict) else {}
    ran = {"task": summary.task, "task options": config.get("task_options") or {},
           "batch size": config.get("batch_size")}
    here = {"task": base.task, "task options": dict(base.task_options), "batch size": base.batch_size}
    for what, value in ran.items():
        if value != here[what]:
            raise BadInput(f"--compute-from {where}: that run's {what} is {value!r}, this probe's {here[what]!r}: its "
                           "compute is another step's")
    method = summary.method
    if isinstance(method, str) and own_compute(method):
        raise BadInput(f"--compute-from {where}: its method {method.split(':')[0]} computes a step of its own, not "
                       "the task's plain one")


def _sigterm_interrupts() -> Any:
    """SIGTERM raises :class:`thinwire.lab.cost.ProbeInterrupted` (as SIGINT raises
    KeyboardInterrupt) until the returned undo is called; a launch in flight takes both
    signals itself meanwhile. Nothing off the main thread."""
    import signal
    import threading

    from thinwire.lab.cost import ProbeInterrupted

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum: int, frame: Any) -> None:
        raise ProbeInterrupted("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous)


class _CostTable:
    """``thinwire cost``'s rows, from the per-step costs probed so far: a line per method as
    its probe ends, the table at the end (or at an interrupt)."""

    def __init__(self, args: argparse.Namespace, base: Any, resolved: list[str], names: list[str],
                 given: _Given | None) -> None:
        from thinwire.comm.link import Link
        from thinwire.lab import cost

        self.args, self.base, self.resolved, self.given = args, base, resolved, given
        self.given_s = None if given is None else given.compute_s
        self.codec_s = {} if given is None else given.codec_s  # codec seconds the user's hardware measured
        self.names = dict(zip(resolved, names, strict=True))  # rows named as typed: two variants stay apart
        self.shares = {spec: cost.shares_compute(spec) for spec in resolved}
        self.links = [Link.parse(text) for text in base.links]
        self.repeats = args.repeats

    def _compute(self, runs: dict[str, list[Any]]) -> Any:
        from thinwire.lab import cost

        return cost.shared_compute(runs, lambda spec: self.shares[spec])

    def rows(self, runs: dict[str, list[Any]]) -> tuple[list[str], list[list[str]]]:
        """The columns and a row per method of ``runs`` (the reference among them)."""
        from thinwire.lab import cost
        from thinwire.lab.tables import spread

        shared = self._compute(runs)
        ref_spec = self.resolved[0]
        at = {spec: [self._codec(spec, cost.at_compute(c, self.shares[spec], shared, self.given_s)) for c in cs]
              for spec, cs in runs.items()}
        ref_raw = cost.median_cost(runs[ref_spec])
        latency = self.links[0].latency_s
        columns = ["method", "MB / step", "peak MB", "messages", "compute ms", "codec ms", "wait ms", "window ms",
                   *[f"ms @ {text}" for text in self.base.links], "beats bf16",
                   *(["its bandwidths over the repeats"] if self.repeats > 1 else [])]
        rows = []
        for spec, each in at.items():
            c = cost.median_cost(each)

            def ms(of: Any, each: list[Any] = each) -> str:
                return spread([1e3 * of(x) for x in each])

            if self.given_s is not None:
                beats = cost.verdict(c, cost.median_cost(at[ref_spec]), latency) if spec != ref_spec \
                    else "(the reference)"
            else:
                beats = cost.ranged_verdict(cost.median_cost(runs[spec]), ref_raw, latency, shared,
                                            m_shares=self.shares[spec], ref_shares=self.shares[ref_spec])
            compute = f"{1e3 * c.compute_s:.1f}" if self.shares[spec] else ms(lambda x: x.compute_s)
            peak = "-" if c.peak_bytes is None else f"{c.peak_bytes / 1e6:.3f}"
            n = min(len(each), len(at[ref_spec]))  # an interrupted round: the repeats both have
            rows.append([self.names[spec], f"{c.bytes / 1e6:.3f}", peak, f"{c.messages:.0f}", compute,
                         ms(lambda x: x.codec_s), ms(lambda x: x.wait_s), ms(lambda x: x.window_s),
                         *[ms(lambda x, link=link: x.seconds(link)) for link in self.links], beats,
                         *([cost.bounds_text(each[:n], at[ref_spec][:n], latency)] if self.repeats > 1 else [])])
        return columns, rows

    def _codec(self, spec: str, c: Any) -> Any:
        """``c`` with the codec seconds the user's hardware measured for ``spec``, where given."""
        import dataclasses

        return dataclasses.replace(c, codec_s=self.codec_s[spec]) if spec in self.codec_s else c

    def compute_line(self, runs: dict[str, list[Any]]) -> str:
        """``compute: 48.1 ms a step [46.0–51.2] over 8 blocks, shared by identity, bf16, ...``."""
        shared = self._compute(runs)
        own = [self.names[spec] for spec in runs if not self.shares[spec]]
        if shared is None:
            measured = "none measured here"
        else:
            measured = f"{shared.text()}, shared by {', '.join(self.names[spec] for spec in shared.methods)}"
        if self.given_s is None:
            line = f"compute: {measured}"
            return line + (f"; {', '.join(own)}: their own" if own else "")
        assert self.given is not None  # given_s comes with it
        line = (f"compute: {1e3 * self.given_s:.1f} ms a step ({self.given.source}) in every prediction; measured "
                f"here: {measured}")
        if own and shared is not None:
            line += f"; {', '.join(own)}: their own, scaled by {1e3 * self.given_s:.1f} / {1e3 * shared.per_step:.1f}"
        return line + (f"; {self.given.codec_note}" if self.given.codec_note else "")

    def line(self, spec: str, runs: dict[str, list[Any]]) -> str | None:
        """One method's row as ``figure value`` pairs, the moment its probe ends (None before
        the reference is probed)."""
        if self.resolved[0] not in runs or spec not in runs:
            return None
        columns, rows = self.rows(runs)
        row = rows[list(runs).index(spec)]
        return f"  {row[0]}: " + ", ".join(f"{col} {cell}" for col, cell in zip(columns[1:], row[1:], strict=True))

    def print(self, runs: dict[str, list[Any]], interrupted: bool = False) -> None:
        from rich.console import Console

        base, args = self.base, self.args
        columns, rows = self.rows(runs)
        per_node = int(base.ranks_per_node or 1)  # resolved: a number
        nodes = (f" ({base.workers // per_node} nodes; inside them {base.intra_link}, whose time is in G; "
                 "MB and messages: between nodes)" if per_node > 1 else "")
        repeats = (f"; median \\[min-max] of {args.repeats} repeats, the verdict from the medians"
                   if args.repeats > 1 else "")
        budget = (f", or what {args.probe_seconds:g} s of steps allow" if math.isfinite(args.probe_seconds) else "")
        title = (f"{base.task} · {base.workers} workers{nodes} · predicted milliseconds per step (probe: "
                 f"{args.probe_steps} timed steps each, after as many warm-up{budget}; whole periods for periodic "
                 f"methods{repeats}{'; interrupted' if interrupted else ''})")
        caption = (f"step = compute + G - min(window, early x G), G = codec + max(wait, messages x latency + "
                   f"bytes / bandwidth{' + intra-node time' if nodes else ''}); compute = the one figure above for "
                   f"the methods that share it, the window scaled with it; wait = the collectives' time here, "
                   f"with no link; window = the backward time after the first bucket went, early = the share of "
                   f"it sent during backward. beats bf16: the bandwidths at which the method's step is faster than "
                   f"bf16's, at the latency of {base.links[0]}, at the compute figure and both ends of its range. "
                   f"A periodic method's sync is spread over its period's steps; peak MB = the most sent in one "
                   f"step (the DiLoCo family), what the link must carry at once; averages hidden behind whole "
                   f"steps (DaSGD, streaming-diloco) are not credited")
        widths = [max(len(col), *(len(row[i]) for row in rows)) for i, col in enumerate(columns)]
        wide = max(160 if args.repeats == 1 else 260, sum(widths) + 3 * len(columns) + 1)
        console = Console()
        if not console.is_terminal:  # a log or a pipe: the whole table, however wide
            console = Console(width=wide)
        print(self.compute_line(runs), flush=True)  # one line, however long
        print_cost(console, title, caption, columns, rows, wide)


def print_cost(console: Any, title: str, caption: str, columns: list[str], rows: list[list[str]], wide: int) -> None:
    """The cost table on a console at least ``wide`` columns wide; on a narrower one each
    method as a block of ``figure: value`` lines, which wrap between words."""
    from rich.table import Table

    if console.width >= wide:
        table = Table(title=title, caption=caption)
        for col in columns:
            left = col in ("method", "beats bf16", "its bandwidths over the repeats")
            table.add_column(col, justify="left" if left else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    console.print(title, style="bold")  # markup: the title escapes its brackets as the table's does
    for row in rows:
        console.print()
        console.print(row[0], style="bold cyan", markup=False)
        for col, cell in zip(columns[1:], row[1:]):
            console.print(f"  {col}: {cell}", markup=False)
    console.print()
    console.print(caption, markup=False)


def _warn_load(command: str) -> str | None:
    """One line on stderr when the machine is busy before ``command`` times anything; the
    warning, or None."""
    from thinwire.lab.load import load_warning

    warning = load_warning(command)
    if warning:
        print(f"thinwire: {warning}", file=sys.stderr, flush=True)
    return warning

"""``thinwire`` command line: train, list methods, benchmark codecs.

Bad input never shows a traceback: one line naming the rule broken, exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

EXIT_BAD_INPUT = 2


class BadInput(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sub = self.prog.removeprefix("thinwire").strip()  # "thinwire: error: " comes first already
        raise BadInput(f"{sub}: {message}" if sub else message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="thinwire", description="Communication-efficient data-parallel training on torch.distributed.")
    p.add_argument("--version", action="store_true", help="print thinwire's version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in (_train_parser, _compare_parser, _cost_parser, _methods_parser, _bench_parser, _lighthouse_parser):
        add(sub)
    return p


def _train_parser(sub: Any) -> None:
    t = sub.add_parser("train", help="train a bundled task across N workers with a method (default: mnist1d, "
                       "identity, 2 workers)",
                       description="Train a task across N workers with a method. With --resume, every option not "
                       "given again keeps the run's own value (its checkpoint's saved config: the checkpoint interval, "
                       "links, method, hyperparameters, imports...); an option given again replaces it, and options "
                       "that decide the run (task, method, world size, seed, batch size, optimizer, lr, task options) "
                       "must match the checkpoint's.")
    # default None (filled by TrainConfig): a resume tells the options typed from those to keep
    t.add_argument("--task", help=f"{' | '.join(_tasks())} (default: mnist1d); or a task of your own that "
                   "--import FILE.py registers (docs/your_own_task.md)")
    t.add_argument("--method", help="method spec name[:key=value,...], e.g. topk:ratio=0.01 or hylo "
                   "(see `thinwire methods`; "
                   "default: identity)")
    t.add_argument("--policy", metavar="FILE", help="TOML policy file: ordered rules giving each parameter its codec "
                   "(instead of --method)")
    t.add_argument("--workers", type=int, help="local ranks to spawn (ignored under torchrun; default: 2)")
    t.add_argument("--steps", type=int, help=f"total training steps (default: the task's budget: {_per_task('steps')})")
    t.add_argument("--batch-size", type=int,
                   help=f"batch size per worker (default: the task's: {_per_task('batch_size')})")
    t.add_argument("--lr", type=float, help=f"learning rate (default: the task's: {_per_task('lr')})")
    t.add_argument("--optimizer", choices=["adam", "adamw", "sgd", "muon"],
                   help="adam, adamw (decoupled weight decay), sgd with momentum 0.9, or muon (Muon for the hidden "
                   "weight matrices, AdamW for embeddings, the output layer, norms and biases) (default: the task's: "
                   f"{_per_task('optimizer')})")
    _schedule_options(t)
    t.add_argument("--seed", type=int, help="seed for data order and model initialisation (codec seeds are knobs of "
                   "the method; default: 0)")
    t.add_argument("--data", "--data-dir", dest="data_dir", metavar="PATH",
                   help="the task's data (text: a UTF-8 file, a folder of them or a uint16 token file; cifar10: the "
                   "CIFAR-10 binary files' folder)")
    t.add_argument("--link", action="append", dest="links", metavar="LINK",
                   help="network to model, e.g. 1gbit,50us or 100mbit,1ms; repeat for several")
    t.add_argument("--emulate-link", action=argparse.BooleanOptionalAction,
                   help="delay real collectives by the first --link's modeled time (default: no)")
    _node_options(t)
    t.add_argument("--out", help="write metrics.jsonl and summary.json here")
    t.add_argument("--overwrite", action="store_true", help="allow --out to replace an existing run")
    t.add_argument("--eval-every", type=int,
                   help=f"evaluate and log every K steps (default: the task's: {_per_task('eval_every')})")
    t.add_argument("--bucket-mb", type=float, help="fuse tensors into buckets of this size (default: 25)")
    t.add_argument("--threads", type=int, help="torch threads per spawned worker (default: cores / workers; under "
                   "torchrun, torch's own default)")
    t.add_argument("--option", action="append", dest="task_options", metavar="KEY=VALUE",
                   help="task option, e.g. model=vgg (repeatable; on --resume, added to the run's own); "
                   f"{_task_options()}")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--tensorboard", action=argparse.BooleanOptionalAction,
                   help="TensorBoard event files beside metrics.jsonl in --out (default: when the tensorboard package "
                        "is installed)")
    t.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="write a checkpoint into OUT/checkpoints every K steps and at the last one (needs --out; "
                   "the newest two are kept; default: 0, none)")
    t.add_argument("--resume", metavar="DIR", help="continue from a run directory's latest checkpoint (or from one "
                   "checkpoint directory) up to --steps, the total (default: the run's own); writes to --out, DIR "
                   "itself when omitted; a run that already finished there says so and exits 0")
    t.add_argument("--on-nonfinite", choices=["raise", "skip"],
                   help="a NaN/Inf gradient: stop naming the parameter and step (raise, the default), or skip that "
                   "step on every rank before anything is encoded (skip; counted as skipped_steps; a run that skipped "
                   "most of its steps ends with exit code 1)")
    e = t.add_argument_group("elastic training (workers leave and join; docs/fault_tolerance.md)")
    e.add_argument("--elastic", action="store_true", default=None,
                   help="run elastic on torchft: a worker that ends does not end the job, one that starts joins it "
                   "and takes a present worker's state (without --lighthouse: a Lighthouse and --workers workers "
                   "here, each writing OUT/worker-K)")
    e.add_argument("--min-workers", type=int, metavar="N",
                   help="no step commits with fewer workers; with fewer left the job waits --elastic-wait seconds, "
                   "then stops (exit 3) with its last committed state checkpointed (default: 1)")
    e.add_argument("--lighthouse", metavar="HOST:PORT",
                   help="the Lighthouse of a running job (`thinwire lighthouse`): run one worker of it here")
    e.add_argument("--replica", type=int, metavar="K",
                   help="this worker's number with --lighthouse, 0..workers-1: its data shard (default: $RANK, else 0)")
    e.add_argument("--elastic-timeout", type=float, metavar="S",
                   help="a collective, commit vote or state transfer taking longer fails and the step is discarded; "
                   "a silent worker is dropped after this long (default: 4)")
    e.add_argument("--elastic-wait", type=float, metavar="S",
                   help="how long a worker waits for a quorum of --min-workers before it stops (default: 60)")
    _max_workers_option(t)
    _import_option(t)


def _lighthouse_parser(sub: Any) -> None:
    h = sub.add_parser("lighthouse", help="run torchft's Lighthouse for an elastic job over several machines, until "
                       "stopped (Ctrl-C)",
                       description="Run torchft's Lighthouse: it forms the quorum of an elastic job at every step. "
                       "Workers join with `thinwire train --elastic --lighthouse HOST:PORT --replica K`. Any process "
                       "that reaches it can join the job: see docs/security.md.")
    h.add_argument("--min-workers", type=int, required=True, metavar="N", help="form no quorum of fewer workers")
    h.add_argument("--bind", default="127.0.0.1:29510", metavar="HOST:PORT",
                   help="where to listen (default: 127.0.0.1:29510, this machine only; 0.0.0.0:29510 for every "
                   "interface)")
    h.add_argument("--heartbeat-timeout", type=float, default=4.0, metavar="S",
                   help="a worker silent this long is left out of the next quorum (default: 4; give the workers' "
                   "--elastic-timeout the same)")


def _tasks() -> dict[str, Any]:
    """The bundled tasks by name (the registry's, so the help cannot go stale)."""
    from thinwire.tasks import available

    return available()


def _per_task(field: str) -> str:
    """A task default for every task: ``mnist1d 800, charlm 600, ...``."""
    return ", ".join(f"{name} {getattr(cls.defaults, field)}" for name, cls in _tasks().items())


def _task_options() -> str:
    """The options (``--option KEY=VALUE``) every task accepts: ``mnist1d: size; ...``."""
    return "keys: " + "; ".join(f"{name}: {', '.join(f.name for f in dataclasses.fields(cls.Config)) or 'none'}"
                                for name, cls in _tasks().items())


def _node_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks-per-node", metavar="L|auto",
                   help="ranks per node (auto: torchrun's LOCAL_WORLD_SIZE): average uncompressed inside each node and "
                   "through the method's codec between nodes; with --workers N, N/L emulated nodes (default: flat)")
    p.add_argument("--intra-link", metavar="LINK",
                   help="the link inside a node, modeled and emulated as --link is between nodes (default: "
                   "100gbit,10us; needs --ranks-per-node)")
    p.add_argument("--intra-dtype", metavar="fp32|bf16",
                   help="the dtype of the collectives inside a node (default fp32; bf16 halves their bytes, rounding "
                   "each gradient before the node's sum and the mean after the codec; needs --ranks-per-node)")


def _schedule_options(p: Any) -> None:
    p.add_argument("--lr-schedule", choices=["constant", "cosine", "wsd"],
                   help="the learning rate over the run: constant, cosine decay or wsd (stable, then a linear decay "
                   "over the last 20%% of the steps), each after --warmup-steps (default: constant)")
    p.add_argument("--warmup-steps", type=int, metavar="W", help="linear warm-up to --lr over W steps (default: 0)")
    p.add_argument("--min-lr", type=float, metavar="R",
                   help="the share of --lr that cosine and wsd decay to, in [0, 1] (default: 0)")
    p.add_argument("--muon-lr", type=float, metavar="LR",
                   help="--optimizer muon: Muon's own learning rate (default: --lr, Muon's update rescaled to "
                   "AdamW's RMS)")


def _compare_parser(sub: Any) -> None:
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
    c.add_argument("--task", default="mnist1d", help=f"{' | '.join(_tasks())} (default: mnist1d); or a "
                   "task of your own that --import FILE.py registers (docs/your_own_task.md)")
    c.add_argument("--workers", type=int, help="local ranks per run (default: 2; 4 with --suite)")
    c.add_argument("--steps", type=int,
                   help=f"training steps per run (default: the task's budget: {_per_task('steps')}); a suite "
                   "refuses steps that end inside a method's warm-up or before its first average")
    c.add_argument("--link", action="append", dest="links", metavar="LINK",
                   help="network to model, one report column each (default: 1gbit,50us and 100mbit,1ms)")
    c.add_argument("--emulate-link", action="store_true",
                   help="delay real collectives by the first --link's modeled time")
    _node_options(c)
    c.add_argument("--out", required=True, help="directory for report.md, results.csv, the PNGs and runs/")
    c.add_argument("--overwrite", action="store_true", help="allow --out to replace an earlier comparison")
    c.add_argument("--target", type=float,
                   help="a classifier's test accuracy to time each method to (default: 95%% of the best final "
                   "accuracy)")
    c.add_argument("--target-loss", type=float, metavar="LOSS",
                   help="a language model's test loss (nats) to time each method to (default: the best final test "
                   "loss + 2%%); a race is judged by the task's own figure: loss for language models, accuracy for "
                   "classifiers")
    c.add_argument("--seed", type=int, default=0, help="seed of every run (default: 0)")
    c.add_argument("--seeds", type=int, default=1, metavar="S",
                   help="run every method with S seeds (--seed, --seed + 1, ...): the report shows each figure as "
                   "median [min-max], results.csv one row per run, and a method wins at a link only when its "
                   "range beats every other's, else it is a tie (default: 1; with one seed a win needs a time to "
                   "the target more than 10%% shorter, or an accuracy more than 0.5 pts higher; --methods races "
                   "only)")
    c.add_argument("--eval-every", type=int,
                   help=f"evaluate every K steps (default: the task's: {_per_task('eval_every')})")
    c.add_argument("--batch-size", type=int,
                   help=f"batch size per worker (default: the task's: {_per_task('batch_size')})")
    c.add_argument("--lr", type=float, help=f"learning rate (default: the task's: {_per_task('lr')})")
    c.add_argument("--optimizer", choices=["adam", "adamw", "sgd", "muon"],
                   help="adam, adamw (decoupled weight decay), sgd with momentum 0.9, or muon (Muon for the hidden "
                   "weight matrices, AdamW for embeddings, the output layer, norms and biases) (default: the task's: "
                   f"{_per_task('optimizer')})")
    _schedule_options(c)
    c.add_argument("--data", "--data-dir", dest="data_dir", metavar="PATH",
                   help="the task's data (text: a UTF-8 file, a folder of them or a uint16 token file; cifar10: the "
                   "CIFAR-10 binary files' folder)")
    c.add_argument("--option", action="append", dest="task_options", metavar="KEY=VALUE",
                   help=f"task option, e.g. model=vgg (repeatable); {_task_options()}")
    c.add_argument("--bucket-mb", type=float, default=25.0, help="fuse tensors into buckets of this size (default: 25)")
    c.add_argument("--threads", type=int, help="torch threads per spawned worker (default: cores / workers)")
    c.add_argument("--quiet", action="store_true", help="no progress bars (one line per method still)")
    c.add_argument("--tensorboard", action=argparse.BooleanOptionalAction,
                   help="TensorBoard event files in every run's folder: tensorboard --logdir OUT/runs (default: when "
                        "the tensorboard package is installed)")
    _max_workers_option(c)
    _import_option(c)


def _cost_parser(sub: Any) -> None:
    k = sub.add_parser("cost", help="predict each method's step time on a link from a short probe, and where "
                       "compression pays off against bf16")
    k.add_argument("--task", default="mnist1d", help=f"{' | '.join(_tasks())} (default: mnist1d); or a "
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
    k.add_argument("--compute-from", metavar="RUN_DIR",
                   help="as --compute-ms, from a finished run's summary.json (compute_seconds / steps): a run of "
                   "the same task, options and batch size on the hardware to predict")
    k.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="probe every method R times, in rounds, and show each figure as median [min-max] and "
                   "each bandwidth of the verdict (from the medians) with its range over the repeats (default: 1)")
    k.add_argument("--seed", type=int, default=0, help="seed of the probes (default: 0)")
    k.add_argument("--batch-size", type=int,
                   help=f"batch size per worker (default: the task's: {_per_task('batch_size')})")
    k.add_argument("--data", "--data-dir", dest="data_dir", metavar="PATH",
                   help="the task's data (text: a UTF-8 file, a folder of them or a uint16 token file; cifar10: the "
                   "CIFAR-10 binary files' folder)")
    k.add_argument("--option", action="append", dest="task_options", metavar="KEY=VALUE",
                   help=f"task option, e.g. model=vgg (repeatable); {_task_options()}")
    k.add_argument("--threads", type=int, help="torch threads per spawned worker (default: cores / workers)")
    _node_options(k)
    _max_workers_option(k)
    _import_option(k)


def _methods_parser(sub: Any) -> None:
    m = sub.add_parser("methods", help="every method and knob, with default and allowed range (or only the NAMEs "
                       "given)")
    m.add_argument("names", nargs="*", metavar="NAME", help="list only these methods (a codec, policy preset or "
                   "method name, e.g. topk powersgd; default: every one)")
    m.add_argument("--markdown", action="store_true", help="print the index of every method (or of the NAMEs given) "
                   "as a markdown table (the one in docs/methods.md)")
    _import_option(m)


def _bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", metavar="BENCH", parser_class=_Parser)
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
    _max_workers_option(bm)


def _max_workers_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-workers", type=int, metavar="N",
                   help="allow up to N local ranks (default: what this machine can hold: 8 per core, and "
                   "0.5 GB of available memory per rank)")


def _import_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import", action="append", dest="imports", metavar="MODULE",
                   help="import MODULE first, in this process and in every rank: a dotted name (found on "
                   "PYTHONPATH or in the current directory) or a path to a .py file; the codecs and algorithms "
                   "it registers become methods, the tasks it registers tasks (docs/your_own_task.md; "
                   "repeatable)")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        if args.version:
            from thinwire.version import __version__

            print(f"thinwire {__version__}")
            return 0
        if args.command == "train":
            return _train(args)
        if args.command == "lighthouse":
            return _lighthouse(args)
        if args.command == "methods":
            return _methods(args.imports or [], markdown=args.markdown, names=args.names)
        if args.command == "cost":
            return _cost(args)
        if args.command == "compare":
            return _compare(args, list(argv) if argv is not None else sys.argv[1:])
        if args.command == "bench" and args.bench == "codecs":
            from thinwire.lab.bench_codecs import main as bench_codecs

            return bench_codecs(quick=args.quick, methods=args.methods, repeats=args.repeats)
        if args.command == "bench" and args.bench == "consensus":
            from thinwire.lab.bench_consensus import main as bench_consensus

            return bench_consensus(quick=args.quick, methods=args.methods, workers=args.workers, size=args.size,
                                   topology=args.topology, max_steps=args.max_steps, out=args.out)
        if args.command == "bench" and args.bench == "memory":
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
        _parser().print_help()
        return EXIT_BAD_INPUT if args.command is None else 0
    except BadInput as e:
        print(f"thinwire: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("thinwire: interrupted", file=sys.stderr)
        return 130


def outdir_errors() -> tuple[type[Exception], ...]:
    """What writing into an output folder refuses with (a file of someone else's, a folder in use)."""
    from thinwire.run.outdir import ForeignFile, OutputLocked

    return (ForeignFile, OutputLocked)


def _train(args: argparse.Namespace) -> int:
    from thinwire.run import outdir
    from thinwire.run.config import planned_out

    if args.elastic:
        return _train_elastic(args)

    with contextlib.ExitStack() as stack:
        try:
            cfg = _config(args, TRAIN_FIELDS)
            # one run at a time in a folder: its lock is held from before its files are checked to the end
            stack.enter_context(outdir.hold(planned_out(cfg) if os.environ.get("RANK", "0") == "0" else None))
        except ValueError as e:
            raise BadInput(str(e)) from None
        return _train_locked(args, cfg)


def _train_locked(args: argparse.Namespace, cfg: Any) -> int:
    from thinwire.run.config import RunFinished
    from thinwire.run.launch import RunFailed, launch

    try:
        cfg = cfg.resolve()
        _check_task(cfg)
    except RunFinished as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 says it
            print(f"thinwire: {e}")
        return 0
    except ValueError as e:  # TaskError is a ValueError
        raise BadInput(str(e)) from None
    try:
        summary = launch(cfg, show_progress=not args.quiet)
    except RunFailed as e:
        print(f"thinwire: {e}", file=sys.stderr)
        return 1
    if summary is not None and summary.get("stopped_at") is not None:
        where = (f"; checkpoint in {cfg.out}/checkpoints: continue with --resume {cfg.out}" if cfg.out
                 else " (no --out, so no checkpoint)")
        if summary.get("unfinished"):  # ranks ended before they could checkpoint the stop
            why = summary.get("unfinished_why") or ("a rank ended before it could write a checkpoint (the signal "
                                                    "reached it while it was starting up)")
            where = f"; {why}, so nothing after the last checkpoint was kept"
        print(f"thinwire: stopped by {summary.get('signal', 'a signal')} after step {summary['stopped_at']}{where}",
              file=sys.stderr)
        return 143 if summary.get("signal") == "SIGTERM" else 130
    if summary is not None:
        _print_summary(summary, cfg.out)
        if summary.get("status") == "diverged":
            where = f"; {cfg.out}/summary.json records it" if cfg.out else ""
            print(f"thinwire: the run did not train: {summary['failure']}{where}", file=sys.stderr)
            return 1
    return 0


def _train_elastic(args: argparse.Namespace) -> int:
    """``thinwire train --elastic``: a local job, or one worker of a job with ``--lighthouse``."""
    import dataclasses

    from thinwire.run import outdir
    from thinwire.run.config import TrainConfig
    from thinwire.run.elastic import EXIT_QUORUM_LOST, launch_elastic

    given = _given(args, TRAIN_FIELDS)
    resume = given.pop("resume", None)
    with contextlib.ExitStack() as stack:
        try:
            cfg = TrainConfig(**given)
            stack.enter_context(outdir.hold(cfg.out))
            cfg = dataclasses.replace(cfg.resolve(), resume=resume)
            _check_task(cfg)
            if resume is not None and not os.path.isdir(resume):
                raise ValueError(f"--resume {resume}: no such directory")
            summary = launch_elastic(cfg, show_progress=not args.quiet)
        except ValueError as e:
            raise BadInput(str(e)) from None
    if cfg.lighthouse is not None:  # one worker
        final = summary.get("final") or {}
        print(f"thinwire: worker {summary['replica']} {summary['status']} at step {summary['committed_step']}"
              + (f", test loss {final['test_loss']:.4f}" if final.get("test_loss") is not None else "")
              + f"; {summary['elastic']['discarded']} step(s) discarded, {len(summary['elastic']['changes'])} quorum "
              "change(s)" + (f"; {cfg.out}/summary.json" if cfg.out else ""))
        if summary["status"] != "ok":
            print(f"thinwire: {summary['failure']}", file=sys.stderr)
            return EXIT_QUORUM_LOST
        return 0
    workers = summary["workers"]
    finished = [r for r, w in workers.items() if w["summary"] and w["summary"]["status"] == "ok"]
    for r, w in sorted(workers.items(), key=lambda kv: int(kv[0])):
        s = w["summary"]
        if s is None:
            print(f"thinwire: worker {r}: ended without a summary ({w['error'] or 'exit ' + str(w['exit'])})")
            continue
        final = s.get("final") or {}
        print(f"thinwire: worker {r}: {s['status']} at step {s['committed_step']}"
              + (f", test loss {final['test_loss']:.4f}" if final.get("test_loss") is not None else "")
              + f"; {s['elastic']['discarded']} discarded, {len(s['elastic']['changes'])} quorum change(s)")
    if cfg.out:
        print(f"thinwire: {cfg.out}/summary.json, and each worker's in {cfg.out}/worker-K/")
    if finished:
        return 0
    stopped = [w["summary"] for w in workers.values() if w["summary"] and w["summary"]["status"] == "stopped"]
    if stopped:
        print(f"thinwire: {stopped[0]['failure']}", file=sys.stderr)
        return EXIT_QUORUM_LOST
    print("thinwire: no worker finished the job", file=sys.stderr)
    return 1


def _lighthouse(args: argparse.Namespace) -> int:
    """``thinwire lighthouse``: torchft's Lighthouse for workers on several machines, until stopped."""
    import signal
    import threading

    from thinwire.elastic.lighthouse import serve

    try:
        lighthouse = serve(args.min_workers, args.bind, heartbeat_timeout_s=args.heartbeat_timeout)
    except ValueError as e:
        raise BadInput(str(e)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    host, port = lighthouse.address.split("://", 1)[1].rsplit(":", 1)
    reach = "HOST" if host in ("0.0.0.0", "[::]") else host  # every interface: the workers use the machine's name
    print(f"thinwire: Lighthouse at {lighthouse.address} (quorums of >= {args.min_workers} workers); "
          f"workers join with: thinwire train --elastic --lighthouse {reach}:{port} --replica K ...", flush=True)
    stop.wait()
    lighthouse.shutdown()
    print("thinwire: Lighthouse stopped", flush=True)
    return 0


TRAIN_FIELDS = ("task", "method", "policy", "workers", "steps", "batch_size", "lr", "optimizer", "seed", "data_dir",
                "links", "emulate_link", "out", "overwrite", "eval_every", "bucket_mb", "threads", "task_options",
                "checkpoint_every", "resume", "on_nonfinite", "imports", "max_workers", "ranks_per_node",
                "intra_link", "intra_dtype", "tensorboard", "lr_schedule", "warmup_steps", "min_lr",
                "muon_lr", "elastic", "min_workers", "lighthouse", "replica", "elastic_timeout",
                "elastic_wait")  # train's options, by field


COMPARE_FIELDS = ("task", "workers", "steps", "batch_size", "lr", "optimizer", "seed", "data_dir", "links",
                  "emulate_link", "eval_every", "bucket_mb", "threads", "task_options", "imports", "max_workers",
                  "ranks_per_node", "intra_link", "intra_dtype", "tensorboard", "lr_schedule", "warmup_steps",
                  "min_lr", "muon_lr")
PROBE_SECONDS = 20.0  # thinwire cost: seconds of training steps per probe, by default
COST_FIELDS = ("task", "workers", "batch_size", "seed", "data_dir", "links", "threads", "task_options", "imports",
               "max_workers", "ranks_per_node", "intra_link", "intra_dtype")


def _config(args: argparse.Namespace, fields: Sequence[str], **fixed: Any) -> Any:
    """The TrainConfig of a command: the options of ``fields`` that were typed (on
    ``--resume``, over the run's saved config), then ``fixed``; the rest its defaults."""
    from thinwire.run.config import from_options

    return from_options({**_given(args, fields), **fixed})


def _given(args: argparse.Namespace, fields: Sequence[str]) -> dict[str, Any]:
    """The TrainConfig fields whose options were typed (an option left out is None)."""
    given = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    for name in ("links", "imports"):
        if name in given:
            given[name] = tuple(given[name])
    if "task_options" in given:
        given["task_options"] = _options(given["task_options"])
    if not given.get("overwrite"):
        given.pop("overwrite", None)
    return given


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
    base = _config(args, COMPARE_FIELDS, workers=workers)
    from thinwire.run import outdir

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(outdir.hold(args.out))  # one comparison at a time in a folder, to its end
            for group in suite.SUITES[args.suite] if args.suite else ():  # and in each race's folder
                stack.enter_context(outdir.hold(os.path.join(args.out, group.key)))
            base = _nodes_resolved(base)
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
    base = _config(args, COST_FIELDS, steps=args.probe_steps, eval_every=args.probe_steps,
                   links=tuple(args.links or DEFAULT_LINKS))
    specs = split_methods(args.methods or [cost.DEFAULT_METHODS])
    try:
        base = _nodes_resolved(base)
        typed = [cost.REFERENCE] + [s for s in specs if s != cost.REFERENCE]
        base, resolved = resolve_methods(base, typed)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if given is not None and given[1] is not None:
        _check_compute_run(given[1], base, args.compute_from)
    from thinwire.run.labels import labels

    table = _CostTable(args, base, resolved, labels(typed), None if given is None else given[0])
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


def _given_compute(args: argparse.Namespace) -> tuple[float, dict[str, Any] | None] | None:
    """The compute a step takes on the user's hardware (seconds; ``--compute-ms`` or
    ``--compute-from``, with that run's summary), or None: the one measured here."""
    if args.compute_ms is not None and args.compute_from is not None:
        raise BadInput("give one of --compute-ms and --compute-from")
    if args.compute_ms is not None:
        if not (math.isfinite(args.compute_ms) and args.compute_ms > 0):
            raise BadInput(f"--compute-ms must be a finite number of milliseconds > 0, got {args.compute_ms}")
        return args.compute_ms / 1e3, None
    if args.compute_from is not None:
        from thinwire.lab.cost import compute_from_run

        try:
            seconds, summary = compute_from_run(args.compute_from)
        except ValueError as e:
            raise BadInput(str(e)) from None
        return seconds, summary
    return None


def _check_compute_run(summary: dict[str, Any], base: Any, where: str) -> None:
    """A ``--compute-from`` run must have computed this probe's step: the same task, task
    options and batch size per worker, and a method that runs the task's plain step."""
    from thinwire.algorithms.methods import own_compute

    config: dict[str, Any] = summary["config"] if isinstance(summary.get("config"), dict) else {}
    ran = {"task": summary.get("task", config.get("task")), "task options": config.get("task_options") or {},
           "batch size": config.get("batch_size")}
    here = {"task": base.task, "task options": dict(base.task_options), "batch size": base.batch_size}
    for what, value in ran.items():
        if value != here[what]:
            raise BadInput(f"--compute-from {where}: that run's {what} is {value!r}, this probe's {here[what]!r}: its "
                           "compute is another step's")
    method = summary.get("method")
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
                 given_s: float | None) -> None:
        from thinwire.comm.link import Link
        from thinwire.lab import cost

        self.args, self.base, self.resolved, self.given_s = args, base, resolved, given_s
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
        at = {spec: [cost.at_compute(c, self.shares[spec], shared, self.given_s) for c in cs]
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
        source = (f"--compute-from {self.args.compute_from}" if self.args.compute_from is not None
                  else "--compute-ms")
        line = f"compute: {1e3 * self.given_s:.1f} ms a step ({source}) in every prediction; measured here: {measured}"
        if own and shared is not None:
            line += f"; {', '.join(own)}: their own, scaled by {1e3 * self.given_s:.1f} / {1e3 * shared.per_step:.1f}"
        return line

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


def _options(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise BadInput(f"--option must look like key=value, got {item!r}")
        out[key] = _number(value)
    return out


def _number(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _nodes_resolved(base):
    """``base`` checked (the task built once) with its nodes resolved: ranks per node a
    number, the intra-node link filled in (the runs' configs are resolved one by one later)."""
    resolved = base.resolve()
    _check_task(resolved)
    return dataclasses.replace(base, ranks_per_node=resolved.ranks_per_node, intra_link=resolved.intra_link,
                               intra_dtype=resolved.intra_dtype)


def _check_task(cfg) -> None:
    """Build the task once here so a missing or corrupt data directory fails before any rank starts."""
    from thinwire.algorithms.methods import check_model
    from thinwire.tasks import get as get_task

    try:
        task = get_task(cfg.task)(seed=cfg.seed, data_dir=cfg.data_dir, **cfg.task_options)
    except TypeError as e:
        raise ValueError(f"bad --option for task {cfg.task}: {e}") from None
    if cfg.workers is not None and cfg.batch_size is not None:
        task.check_world(cfg.workers, cfg.batch_size)  # e.g. a corpus smaller than one window per rank
    model = task.build_model()
    if cfg.optimizer == "muon":
        from thinwire.optim.muon import split

        split(model)  # a model without hidden weight matrices is refused here, not in a rank
    check_model(cfg.method_spec(), model)


def _print_summary(s: dict[str, Any], out: str | None, console: Any = None) -> None:
    from rich.console import Console

    console = console or Console()
    for table in _summary_tables(s):
        console.print(table)
    for warning in s.get("warnings") or []:
        print(f"thinwire: warning: {warning}", file=sys.stderr)
    if out:
        console.print(f"wrote {out}/summary.json and {out}/metrics.jsonl", markup=False, overflow="fold")


def _summary_tables(s: dict[str, Any]) -> list[Any]:
    """The run's figures, and with a policy the per-parameter table: labels never split."""
    from rich.markup import escape
    from rich.table import Table

    from thinwire.run.labels import short

    label = short((s.get("config") or {}).get("label") or s["method"])
    nodes = "" if (s.get("ranks_per_node") or 1) == 1 else f" ({s['workers'] // s['ranks_per_node']} nodes)"
    table = Table(title=escape(f"{s['task']} · {label} · {s['workers']} workers{nodes} · {s['steps']} steps"))
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("method", escape(label))
    table.add_row("resolved", escape(spaced(s["method"])))
    for key in ("final_accuracy", "final_bpc", "final_loss"):
        if s.get(key) is not None:
            table.add_row(FIGURE_NAMES.get(key, key.replace("_", " ")), f"{s[key]:.4f}")
    table.add_row("bytes sent per worker", _size(s["bytes_sent_per_worker"]))
    by_link = s.get("bytes_by_link_per_worker") or {}
    if (s.get("ranks_per_node") or 1) > 1:
        table.add_row(f"of which inside ({s.get('intra_dtype') or 'fp32'}) / between nodes",
                      f"{_size(by_link.get('intra', 0))} / {_size(by_link.get('inter', 0))}")
    table.add_row("fp32 all_reduce would send", _size(s["fp32_bytes_per_worker"]))
    if s.get("compression_ratio"):
        table.add_row("compression ratio", f"{s['compression_ratio']:.1f}x")
    table.add_row("wall / compute / codec / comm s",
                  f"{s['wall_seconds']:.1f} / {s['compute_seconds']:.1f} / {s['codec_seconds']:.1f} / "
                  f"{s['comm_seconds']:.1f}")
    for link, sec in (s.get("modeled_seconds_by_link") or {}).items():
        table.add_row(f"modeled time at {link}", f"{sec:.1f} s")
    tables = [table]
    if (s.get("method_report") or {}).get("policy") and s.get("per_parameter"):
        tables.append(_per_parameter_table(s["per_parameter"]))
    return tables


FIGURE_NAMES = {"final_accuracy": "final test accuracy", "final_bpc": "final test bpc",
                "final_loss": "final test loss"}  # summary.json's final_* are the last evaluation's test figures


def spaced(spec: str) -> str:
    """A resolved spec with a space after each ``,`` and ``;`` (between knobs and rules), so
    a narrow table wraps it between knobs, never inside one."""
    return re.sub(r"([,;])(?=\S)", r"\1 ", spec)


def _per_parameter_table(rows: list[dict[str, Any]]):
    """The codec each parameter got and the bytes it cost (runs with a policy)."""
    from rich.table import Table

    from thinwire.run.labels import short

    table = Table(title="per parameter: codec and bytes sent per worker over the run")
    for col, right in (("parameter", False), ("shape", False), ("codec", False), ("sent", True), ("vs fp32", True)):
        table.add_column(col, justify="right" if right else "left", no_wrap=True, overflow="ellipsis")
    for r in rows:
        ratio = r["fp32_bytes_per_worker"] / r["bytes_sent_per_worker"] if r["bytes_sent_per_worker"] else 0.0
        table.add_row(short(r["name"]), "x".join(map(str, r["shape"])), r["codec"].split(":")[0],
                      _size(r["bytes_sent_per_worker"]), f"{ratio:.1f}x" if ratio else "-")
    return table


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _methods(imports: list[str], markdown: bool = False, names: Sequence[str] = ()) -> int:
    """Every method and knob, or only those of ``names`` (an unknown name: BadInput)."""
    from rich.console import Console

    from thinwire.algorithms.methods import METHODS, method_names
    from thinwire.codecs.specs import CODECS
    from thinwire.policy import PRESETS
    from thinwire.run.config import import_modules

    try:
        import_modules(imports)
    except ValueError as e:
        raise BadInput(str(e)) from None
    known = method_names()
    wanted = [name.partition(":")[0] for name in names]  # a whole spec names its method
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise BadInput(f"methods: unknown name {unknown[0]!r} (NAME must be a codec, policy preset or method); "
                       f"known: {', '.join(known)}")
    shown = set(wanted or known)
    if markdown:
        from thinwire.algorithms.methods import markdown_table

        print(markdown_table(shown if wanted else None), end="")
        return 0
    console = Console()
    console.print("[bold]thinwire methods[/bold]: spec name[:key=value,...], e.g. topk:ratio=0.01,ef=false")
    console.print("Every method below runs in `thinwire train --method SPEC` and, in your own loop, with "
                  "thinwire.attach(model, optimizer, SPEC). Each codec runs under synchronous gradient averaging "
                  "(also SyncReducer, ddp.register).\n")
    codecs = [e for e in CODECS.entries() if e.name in shown]
    presets = [e for e in PRESETS.entries() if e.name in shown]
    algorithms = [e for e in METHODS.entries() if e.name in shown and not e.value.peer]
    peers = [e for e in METHODS.entries() if e.name in shown and e.value.peer]
    for codec in codecs:
        _method(console, codec.name, codec.value.aggregation.value + _origin(codec.value), codec.summary, codec.Config)
    if presets:
        console.print("[bold]policy presets[/bold]: a codec per parameter by layer type and size "
                      "(train --method NAME[:knobs], SyncReducer, ddp.register; rules of your own: train --policy "
                      "FILE)\n")
    for preset in presets:
        _method(console, preset.name, "per layer", preset.summary, preset.Config)
    if algorithms:
        console.print("[bold]algorithms[/bold]: model averaging, gossip and AB-training on their own schedule "
                      "(train --method NAME[:knobs]; thinwire.attach, not SyncReducer or ddp.register)\n")
    for entry in algorithms:
        _method(console, entry.name, "algorithm" + _origin(entry.value), entry.summary, entry.Config)
    if peers:
        console.print("[bold]PyTorch built-ins[/bold]: DDP with PyTorch's own communication hooks, in the same "
                      "harness and byte meter (train --method NAME[:knobs], thinwire.attach; the peers to compare "
                      "against)\n")
    for entry in peers:
        _method(console, entry.name, "PyTorch", entry.summary, entry.Config)
    return 0


def _origin(cls: type) -> str:
    """``, from MODULE`` (or ``, from FILE``) for a class from outside thinwire (an
    ``--import``), else nothing."""
    from thinwire.run.config import FILE_MODULE

    module = cls.__module__
    if module.split(".")[0] == "thinwire":
        return ""
    if module.startswith(FILE_MODULE):  # imported from a .py path: name the file
        return f", from {getattr(sys.modules.get(module), '__file__', module)}"
    return f", from {module}"


def _method(console, name: str, kind: str, summary: str, config_cls: type) -> None:
    """One method's heading and its knob table: knob, default, allowed range, meaning."""
    from rich.table import Table

    from thinwire.codecs.specs import knob_table

    console.print(f"[bold cyan]{name}[/bold cyan]  ({kind})  {summary}")
    table = Table(show_header=True, box=None, padding=(0, 2), pad_edge=True)
    for col, width in (("knob", None), ("default", None), ("allowed", 24), ("meaning", None)):
        table.add_column(col, overflow="fold", no_wrap=col in ("knob", "default"), max_width=width)
    for knob, default, allowed, help_ in knob_table(config_cls):
        # a long list of choices wraps between them, not inside one: "fp32 | bf16 | rangefloat | sign"
        table.add_row(knob, default, allowed.replace("|", " | ") if len(allowed) > 24 else allowed, help_)
    console.print(table)
    console.print()


if __name__ == "__main__":
    sys.exit(main())

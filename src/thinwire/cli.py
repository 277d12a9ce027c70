"""The ``thinwire`` command line: ``train`` (and ``--elastic``), ``methods`` and ``lighthouse`` here;
``compare``, ``cost`` and ``bench`` are the lab's (:mod:`thinwire.lab.commands`).

Bad input never shows a traceback: one line naming the rule broken, exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Any

from thinwire.elastic.lighthouse import HEARTBEAT_TIMEOUT_S
from thinwire.elastic.worker import RENDEZVOUS_S
from thinwire.lab import commands as lab
from thinwire.run.arguments import (
    EXIT_BAD_INPUT,
    BadInput,
    Parser,
    check_task,
    config_from,
    given_options,
    import_option,
    max_workers_option,
    node_options,
    optimizer_options,
    per_task,
    task_options_help,
    tasks_by_name,
)
from thinwire.run.console import print_summary


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="thinwire", description="Communication-efficient data-parallel training on torch.distributed.")
    p.add_argument("--version", action="store_true", help="print thinwire's version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for add in (_train_parser, lab.compare_parser, lab.cost_parser, _methods_parser, lab.bench_parser,
                _lighthouse_parser):
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
    t.add_argument("--task", help=f"{' | '.join(tasks_by_name())} (default: mnist1d); or a task of your own that "
                   "--import FILE.py registers (docs/your_own_task.md)")
    t.add_argument("--method", help="method spec name[:key=value,...], e.g. topk:ratio=0.01 or hylo "
                   "(see `thinwire methods`; "
                   "default: identity)")
    t.add_argument("--policy", metavar="FILE", help="TOML policy file: ordered rules giving each parameter its codec "
                   "(instead of --method)")
    t.add_argument("--workers", type=int, help="local ranks to spawn (ignored under torchrun; default: 2)")
    t.add_argument("--steps", type=int, help=f"total training steps (default: the task's budget: {per_task('steps')})")
    optimizer_options(t)
    t.add_argument("--seed", type=int, help="seed for data order and model initialisation (codec seeds are knobs of "
                   "the method; default: 0)")
    t.add_argument("--data", "--data-dir", dest="data_dir", metavar="PATH",
                   help="the task's data (text: a UTF-8 file, a folder of them or a uint16 token file; cifar10: the "
                   "CIFAR-10 binary files' folder)")
    t.add_argument("--link", action="append", dest="links", metavar="LINK",
                   help="network to model, e.g. 1gbit,50us or 100mbit,1ms; repeat for several")
    t.add_argument("--emulate-link", action=argparse.BooleanOptionalAction,
                   help="delay real collectives by the first --link's modeled time (default: no)")
    node_options(t)
    t.add_argument("--out", help="write metrics.jsonl and summary.json here")
    t.add_argument("--overwrite", action="store_true", help="allow --out to replace an existing run")
    t.add_argument("--eval-every", type=int,
                   help=f"evaluate and log every K steps (default: the task's: {per_task('eval_every')})")
    t.add_argument("--bucket-mb", type=float, help="fuse tensors into buckets of this size (default: 25)")
    t.add_argument("--threads", type=int, help="torch threads per spawned worker (default: cores / workers; under "
                   "torchrun, torch's own default)")
    t.add_argument("--option", action="append", dest="task_options", metavar="KEY=VALUE",
                   help="task option, e.g. model=vgg (repeatable; on --resume, added to the run's own); "
                   f"{task_options_help()}")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--tensorboard", action=argparse.BooleanOptionalAction,
                   help="TensorBoard event files beside metrics.jsonl in --out (default: when the tensorboard package "
                        "is installed)")
    _checkpoint_options(t)
    _elastic_options(t)
    max_workers_option(t)
    import_option(t)


def _checkpoint_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-every", type=int, metavar="K",
                   help="write a checkpoint into OUT/checkpoints every K steps and at the last one (needs --out; "
                   "the newest two are kept; default: 0, none)")
    p.add_argument("--resume", metavar="DIR", help="continue from a run directory's latest checkpoint (or from one "
                   "checkpoint directory) up to --steps, the total (default: the run's own); writes to --out, DIR "
                   "itself when omitted; a run that already finished there says so and exits 0")
    p.add_argument("--on-nonfinite", choices=["raise", "skip"],
                   help="a NaN/Inf gradient: stop naming the parameter and step (raise, the default), or skip that "
                   "step on every rank before anything is encoded (skip; counted as skipped_steps; a run that skipped "
                   "most of its steps ends with exit code 1)")


def _elastic_options(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("elastic training (workers leave and join; docs/fault_tolerance.md)")
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
                   help="a collective, commit vote or state transfer taking longer fails and the step is discarded "
                   "(default: 4); a dead worker is left out sooner, by its heartbeat (the Lighthouse's heartbeat "
                   f"timeout: {HEARTBEAT_TIMEOUT_S:g} s for a local job) and by the {RENDEZVOUS_S:g} s bound on "
                   "setting up a quorum's group")
    e.add_argument("--elastic-wait", type=float, metavar="S",
                   help="how long a worker waits for a quorum of --min-workers before it stops (default: 60)")
    e.add_argument("--worker-host", metavar="HOST",
                   help="with --lighthouse: the address this worker's store and torchft's manager server listen on, "
                   "alone, and the other workers reach it at (default: this machine's address on the way to the "
                   "Lighthouse)")
    e.add_argument("--job-secret-file", metavar="PATH",
                   help="the job's secret (at least 16 bytes; chmod 600): only workers that prove they hold it take "
                   "part, and the state a joiner takes is checked with it before it is loaded (default: "
                   "$THINWIRE_JOB_SECRET, else none: any process that reaches the job's ports can take part; "
                   "docs/security.md)")


def _lighthouse_parser(sub: Any) -> None:
    h = sub.add_parser("lighthouse", help="run torchft's Lighthouse for an elastic job over several machines, until "
                       "stopped (Ctrl-C)",
                       description="Run torchft's Lighthouse: it forms the quorum of an elastic job at every step that "
                       "communicates. "
                       "Workers join with `thinwire train --elastic --lighthouse HOST:PORT --replica K`. With a job "
                       "secret only processes that prove they hold it reach it; without one, any process that reaches "
                       "it can join the job: see docs/security.md.")
    h.add_argument("--min-workers", type=int, required=True, metavar="N", help="form no quorum of fewer workers")
    h.add_argument("--bind", default="127.0.0.1:29510", metavar="HOST:PORT",
                   help="where to listen (default: 127.0.0.1:29510, this machine only; 0.0.0.0:29510 for every "
                   "interface)")
    h.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S, metavar="S",
                   help="a worker whose heartbeat (every 100 ms) is silent this long is left out of the next quorum "
                   f"(default: {HEARTBEAT_TIMEOUT_S:g}; raise it where a link can hold a packet up longer)")
    h.add_argument("--join-timeout", type=float, default=60.0, metavar="S",
                   help="how long a quorum that could form waits for a worker that is alive (its heartbeat heard) "
                   "but has not asked yet: a DiLoCo-family worker asks only at its averages, so the workers may be "
                   "up to a round apart (default: 60; give the workers' --elastic-wait the same)")
    h.add_argument("--job-secret-file", metavar="PATH",
                   help="the job's secret (at least 16 bytes; chmod 600): a connection that does not prove it holds "
                   "it is refused before it reaches the Lighthouse, and named (default: $THINWIRE_JOB_SECRET, else "
                   "none); give the workers the same")


def _methods_parser(sub: Any) -> None:
    m = sub.add_parser("methods", help="every method and knob, with default and allowed range (or only the NAMEs "
                       "given)")
    m.add_argument("names", nargs="*", metavar="NAME", help="list only these methods (a codec, policy preset or "
                   "method name, e.g. topk powersgd; default: every one)")
    m.add_argument("--markdown", action="store_true", help="print the index of every method (or of the NAMEs given) "
                   "as a markdown table (the one in docs/methods.md)")
    import_option(m)


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
        if args.command in lab.COMMANDS and getattr(args, "bench", "") is not None:
            return lab.run(args, list(argv) if argv is not None else sys.argv[1:])
        _parser().print_help()
        return EXIT_BAD_INPUT if args.command is None else 0
    except BadInput as e:
        print(f"thinwire: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("thinwire: interrupted", file=sys.stderr)
        return 130


def _train(args: argparse.Namespace) -> int:
    from thinwire.run import outdir
    from thinwire.run.config import planned_out

    if args.elastic:
        return _train_elastic(args)

    with contextlib.ExitStack() as stack:
        try:
            cfg = config_from(args, TRAIN_FIELDS)
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
        check_task(cfg)
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
    if summary is not None and summary.stopped_at is not None:
        where = (f"; checkpoint in {cfg.out}/checkpoints: continue with --resume {cfg.out}" if cfg.out
                 else " (no --out, so no checkpoint)")
        if summary.unfinished:  # ranks ended before they could checkpoint the stop
            why = summary.unfinished_why or ("a rank ended before it could write a checkpoint (the signal "
                                             "reached it while it was starting up)")
            where = f"; {why}, so nothing after the last checkpoint was kept"
        print(f"thinwire: stopped by {summary.signal or 'a signal'} after step {summary.stopped_at}{where}",
              file=sys.stderr)
        return 143 if summary.signal == "SIGTERM" else 130
    if summary is not None:
        print_summary(summary, cfg.out)
        if summary.status == "diverged":
            where = f"; {cfg.out}/summary.json records it" if cfg.out else ""
            print(f"thinwire: the run did not train: {summary.failure}{where}", file=sys.stderr)
            return 1
    return 0


def _train_elastic(args: argparse.Namespace) -> int:
    """``thinwire train --elastic``: a local job, or one worker of a job with ``--lighthouse``."""

    from thinwire.run import outdir
    from thinwire.run.config import TrainConfig
    from thinwire.run.elastic import EXIT_QUORUM_LOST, launch_elastic
    from thinwire.run.summary import WorkerSummary

    given = given_options(args, TRAIN_FIELDS)
    resume = given.pop("resume", None)
    with contextlib.ExitStack() as stack:
        try:
            cfg = TrainConfig(**given)
            stack.enter_context(outdir.hold(cfg.out))
            cfg = dataclasses.replace(cfg.resolve(), resume=resume)
            check_task(cfg)
            if resume is not None and not os.path.isdir(resume):
                raise ValueError(f"--resume {resume}: no such directory")
            summary = launch_elastic(cfg, show_progress=not args.quiet)
        except ValueError as e:
            raise BadInput(str(e)) from None
    if isinstance(summary, WorkerSummary):  # one worker (--lighthouse)
        print(f"thinwire: worker {summary.replica} {_worker_line(summary)}"
              + (f"; {cfg.out}/summary.json" if cfg.out else ""))
        if summary.status != "ok":
            print(f"thinwire: {summary.failure}", file=sys.stderr)
            return EXIT_QUORUM_LOST
        return 0
    for r, w in sorted(summary.workers.items()):
        if w.summary is None:
            print(f"thinwire: worker {r}: ended without a summary ({w.error or 'exit ' + str(w.exit)})")
        else:
            print(f"thinwire: worker {r}: {_worker_line(w.summary)}")
    if cfg.out:
        print(f"thinwire: {cfg.out}/summary.json, and each worker's in {cfg.out}/worker-K/")
    ended = [w.summary for w in summary.workers.values() if w.summary is not None]
    if any(s.status == "ok" for s in ended):
        return 0
    stopped = [s for s in ended if s.status == "stopped"]
    if stopped:
        print(f"thinwire: {stopped[0].failure}", file=sys.stderr)
        return EXIT_QUORUM_LOST
    print("thinwire: no worker finished the job", file=sys.stderr)
    return 1


def _worker_line(s: Any) -> str:
    """``ok at step 40, test loss 0.1234; 1 step(s) discarded, 3 quorum change(s)``: how an
    elastic worker (a :class:`~thinwire.run.summary.WorkerSummary`) ended."""
    loss = s.final.get("test_loss")
    return (f"{s.status} at step {s.committed_step}" + (f", test loss {loss:.4f}" if loss is not None else "")
            + f"; {s.elastic['discarded']} step(s) discarded, {len(s.elastic['changes'])} quorum change(s)")


def _lighthouse(args: argparse.Namespace) -> int:
    """``thinwire lighthouse``: torchft's Lighthouse for workers on several machines, until stopped."""
    import signal
    import threading

    from thinwire.elastic import secret
    from thinwire.elastic.lighthouse import serve, split_address

    try:
        key = secret.read(args.job_secret_file)
        lighthouse = serve(args.min_workers, args.bind, heartbeat_timeout_s=args.heartbeat_timeout,
                           join_timeout_s=args.join_timeout, secret=key)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if key is None and not secret.is_loopback(split_address(args.bind)[0]):
        print(f"thinwire: warning: this Lighthouse has no job secret and listens beyond this machine: any process "
              f"that reaches it can join the job; {secret.HOW}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    host, port = lighthouse.address.split("://", 1)[1].rsplit(":", 1)
    reach = "HOST" if host in ("0.0.0.0", "[::]") else host  # every interface: the workers use the machine's name
    print(f"thinwire: Lighthouse at {lighthouse.address} (quorums of >= {args.min_workers} workers"
          f"{'; only workers holding the job secret' if key is not None else ''}); "
          f"workers join with: thinwire train --elastic --lighthouse {reach}:{port} --replica K ...", flush=True)
    stop.wait()
    lighthouse.shutdown()
    print("thinwire: Lighthouse stopped", flush=True)
    return 0


TRAIN_FIELDS = ("task", "method", "policy", "workers", "steps", "batch_size", "lr", "optimizer", "seed", "data_dir",
                "links", "emulate_link", "out", "overwrite", "eval_every", "bucket_mb", "threads", "task_options",
                "checkpoint_every", "resume", "on_nonfinite", "imports", "max_workers", "ranks_per_node",
                "intra_link", "intra_dtype", "shard", "tensorboard", "lr_schedule", "warmup_steps", "min_lr",
                "muon_lr", "elastic", "min_workers", "lighthouse", "replica", "elastic_timeout",
                "elastic_wait", "job_secret_file", "worker_host")  # train's options, by field


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
    sections = (
        (None, codecs, lambda e: e.value.aggregation.value + _origin(e.value)),
        ("[bold]policy presets[/bold]: a codec per parameter by layer type and size (train --method NAME[:knobs], "
         "SyncReducer, ddp.register; rules of your own: train --policy FILE)\n", presets, lambda e: "per layer"),
        ("[bold]algorithms[/bold]: model averaging, gossip and AB-training on their own schedule (train --method "
         "NAME[:knobs]; thinwire.attach, not SyncReducer or ddp.register)\n", algorithms,
         lambda e: "algorithm" + _origin(e.value)),
        ("[bold]PyTorch built-ins[/bold]: DDP with PyTorch's own communication hooks, in the same harness and byte "
         "meter (train --method NAME[:knobs], thinwire.attach; the peers to compare against)\n", peers,
         lambda e: "PyTorch"),
    )
    for title, entries, kind in sections:
        if title and entries:
            console.print(title)
        for entry in entries:
            _method(console, entry.name, kind(entry), entry.summary, entry.Config)
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

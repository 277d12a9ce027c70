"""The command line's shared parts: one-line errors (exit code 2), the options several commands
take, and turning typed options into a :class:`~thinwire.run.config.TrainConfig`.

``thinwire train`` (:mod:`thinwire.cli`) and the lab's commands (:mod:`thinwire.lab.commands`)
build their parsers from these.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, NoReturn

EXIT_BAD_INPUT = 2


class BadInput(Exception):
    """A user error: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sub = self.prog.removeprefix("thinwire").strip()  # "thinwire: error: " comes first already
        raise BadInput(f"{sub}: {message}" if sub else message)


def tasks_by_name() -> dict[str, Any]:
    """The bundled tasks by name (the registry's, so the help cannot go stale)."""
    from thinwire.tasks import available

    return available()


def per_task(field: str) -> str:
    """A task default for every task: ``mnist1d 800, charlm 600, ...``."""
    return ", ".join(f"{name} {getattr(cls.defaults, field)}" for name, cls in tasks_by_name().items())


def task_options_help() -> str:
    """The options (``--option KEY=VALUE``) every task accepts: ``mnist1d: size; ...``."""
    return "keys: " + "; ".join(f"{name}: {', '.join(f.name for f in dataclasses.fields(cls.Config)) or 'none'}"
                                for name, cls in tasks_by_name().items())


def node_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group-size", "--ranks-per-node", dest="ranks_per_node", metavar="G|auto",
                   help="a worker is a group of G consecutive ranks (a node; auto: torchrun's LOCAL_WORLD_SIZE) that "
                   "trains one replica in step over --intra-link; the method runs between the groups over --link; "
                   "--workers still counts ranks (default: every rank a worker of its own)")
    p.add_argument("--shard", action=argparse.BooleanOptionalAction, default=None,
                   help="shard each group's replica over its ranks with FSDP2 (fully_shard), each rank exchanging only "
                   "its shard between groups (default: no, the group's ranks hold replicas, averaged in fp32 inside "
                   "the group, or what a resumed run was saved with; needs --group-size)")
    p.add_argument("--intra-link", metavar="LINK",
                   help="the link inside a group, modeled and emulated as --link is between groups (default: "
                   "100gbit,10us; needs --group-size)")
    p.add_argument("--intra-dtype", metavar="fp32|bf16",
                   help="the dtype of thinwire's collectives inside a group of replicas (default fp32; bf16 halves "
                   "their bytes, rounding each gradient before the group's sum and the mean after the codec; needs "
                   "--group-size)")


def optimizer_options(p: argparse.ArgumentParser) -> None:
    """The batch, the learning rate, the optimizer and its schedule (train and compare)."""
    p.add_argument("--batch-size", type=int,
                   help=f"batch size per worker (default: the task's: {per_task('batch_size')})")
    p.add_argument("--lr", type=float, help=f"learning rate (default: the task's: {per_task('lr')})")
    p.add_argument("--optimizer", choices=["adam", "adamw", "sgd", "muon"],
                   help="adam, adamw (decoupled weight decay), sgd with momentum 0.9, or muon (Muon for the hidden "
                   "weight matrices, AdamW for embeddings, the output layer, norms and biases) (default: the task's: "
                   f"{per_task('optimizer')})")
    schedule_options(p)


def schedule_options(p: Any) -> None:
    p.add_argument("--lr-schedule", choices=["constant", "cosine", "wsd"],
                   help="the learning rate over the run: constant, cosine decay or wsd (stable, then a linear decay "
                   "over the last 20%% of the steps), each after --warmup-steps (default: constant)")
    p.add_argument("--warmup-steps", type=int, metavar="W", help="linear warm-up to --lr over W steps (default: 0)")
    p.add_argument("--min-lr", type=float, metavar="R",
                   help="the share of --lr that cosine and wsd decay to, in [0, 1] (default: 0)")
    p.add_argument("--muon-lr", type=float, metavar="LR",
                   help="--optimizer muon: Muon's own learning rate (default: --lr, Muon's update rescaled to "
                   "AdamW's RMS)")


def max_workers_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-workers", type=int, metavar="N",
                   help="allow up to N local ranks (default: what this machine can hold: 8 per core, and "
                   "0.5 GB of available memory per rank)")


def import_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--import", action="append", dest="imports", metavar="MODULE",
                   help="import MODULE first, in this process and in every rank: a dotted name (found on "
                   "PYTHONPATH or in the current directory) or a path to a .py file; the codecs and algorithms "
                   "it registers become methods, the tasks it registers tasks (docs/your_own_task.md; "
                   "repeatable)")


def config_from(args: argparse.Namespace, fields: Sequence[str], **fixed: Any) -> Any:
    """The TrainConfig of a command: the options of ``fields`` that were typed (on
    ``--resume``, over the run's saved config), then ``fixed``; the rest its defaults."""
    from thinwire.run.config import from_options

    return from_options({**given_options(args, fields), **fixed})


def given_options(args: argparse.Namespace, fields: Sequence[str]) -> dict[str, Any]:
    """The TrainConfig fields whose options were typed (an option left out is None)."""
    given = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    for name in ("links", "imports"):
        if name in given:
            given[name] = tuple(given[name])
    if "task_options" in given:
        given["task_options"] = parse_options(given["task_options"])
    if not given.get("overwrite"):
        given.pop("overwrite", None)
    return given


def parse_options(items: list[str]) -> dict[str, Any]:
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


def nodes_resolved(base):
    """``base`` checked (the task built once) with its nodes resolved: ranks per node a
    number, the intra-node link filled in (the runs' configs are resolved one by one later)."""
    resolved = base.resolve()
    check_task(resolved)
    return dataclasses.replace(base, ranks_per_node=resolved.ranks_per_node, intra_link=resolved.intra_link,
                               intra_dtype=resolved.intra_dtype, shard=resolved.shard)


def check_task(cfg) -> None:
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


def outdir_errors() -> tuple[type[Exception], ...]:
    """What writing into an output folder refuses with (a file of someone else's, a folder in use)."""
    from thinwire.run.outdir import ForeignFile, OutputLocked

    return (ForeignFile, OutputLocked)

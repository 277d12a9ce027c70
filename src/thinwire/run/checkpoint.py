"""Checkpoints of a training run: every rank's whole state, written atomically, loaded safely.

Layout under a run's ``--out`` directory::

    checkpoints/
        latest.json            {"step": 120, "dir": "step-00000120"}: the newest complete one
        step-00000120/
            meta.json          step, world size, task, method, seed, config
            rank-0.pt ...      one file per rank (gossip ranks hold different models)
            group-0/ ...       with --shard: each worker group's model and optimizer, sharded over
                               its ranks, through torch.distributed.checkpoint (.metadata,
                               __R_0.distcp: one file per rank of the group)

Each rank writes its file to a temporary name and renames it; after every rank has written
(a barrier), rank 0 writes ``meta.json`` and then replaces ``latest.json``. A crash at any
moment therefore leaves ``latest.json`` naming a complete checkpoint. The newest
:data:`KEEP` checkpoints are kept, so the one before the newest can still be loaded by its
directory if the newest is damaged.

A rank's file holds the model, the optimizer, the method's own state (error-feedback
residuals, factors, schedules, snapshots, phases, per-edge state), the byte meter, the
clock, the seconds spent so far and the RNG states; the data position is the step itself
(every task's batch stream is a pure function of the step). Between sharded groups
(``--shard``) the model and the optimizer are not in it: each group writes them through
``torch.distributed.checkpoint`` over its own ranks (the groups' inner optimizers differ, so
one checkpoint over the world would keep one group's), and each rank's file records the SHA-256
and size of every file of its group's folder (:func:`write_group`, :func:`load_group`).

Trust: ``meta.json`` records the SHA-256 and size of every rank's file as written, and a
checkpoint is used only after :func:`verify` (the launcher, before any rank starts) and
:func:`load_rank` (each rank, on the bytes it loads) find them unchanged; torch does not
check its own zip CRCs on load, so a flipped byte would otherwise pass. ``meta.json`` and
``latest.json`` are checked against their schema (:func:`read_meta`, :func:`locate`), and
``latest.json`` can only name a ``step-NNNNNNNN`` directory of its own run. Files are read
with ``torch.load(weights_only=True)``: tensors and plain containers only, never arbitrary
pickled objects.

Deleting: thinwire removes only what it wrote: ``latest.json`` and the ``step-NNNNNNNN/``
directories its manifest records (:mod:`thinwire.run.outdir`), and inside those only
``meta.json``, ``rank-R.pt`` and their temporary files, and the ``group-K/`` folders it created
with the checkpoint's own files in them; a file of anyone else's inside ``checkpoints/`` stays,
and so does the directory holding it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
from pathlib import Path
from typing import Any

import torch

from thinwire import jsonfile
from thinwire.run import outdir

FORMAT = 2  # 2: meta.json records every rank file's checksum
KEEP = 2  # checkpoints kept on disk: the newest and the one before it
LATEST = "latest.json"
STEP_NAME = re.compile(r"step-\d{8,}")  # a checkpoint directory's name (step_dir: at least 8 digits)
OWN_FILE = re.compile(r"\.?(meta\.json|rank-\d+\.pt)(\.tmp)?")  # the files thinwire writes into one
GROUP_NAME = re.compile(r"group-\d+")  # a sharded group's folder in one (--shard)
DCP_FILE = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp")  # what torch.distributed.checkpoint writes
CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, damaged, or from a different run."""


def root(out: str | os.PathLike) -> Path:
    return Path(out) / "checkpoints"


def step_dir(out: str | os.PathLike, step: int) -> Path:
    return root(out) / f"step-{step:08d}"


# -- writing ----------------------------------------------------------------------------------
def write_rank(out: str | os.PathLike, step: int, rank: int, state: dict[str, Any]) -> dict[str, Any]:
    """This rank's file of the checkpoint at ``step`` (temporary file, fsync, rename); returns
    its record for ``meta.json``: ``{"sha256": hex digest, "bytes": size}`` of the bytes on
    disk."""
    d = step_dir(out, step)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank-{rank}.pt"
    tmp = d / f".rank-{rank}.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return file_record(path)


def file_record(path: Path) -> dict[str, Any]:
    """``{"sha256": ..., "bytes": ...}`` of the file at ``path``."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"sha256": h.hexdigest(), "bytes": size}


def commit(out: str | os.PathLike, step: int, meta: dict[str, Any],
           files: dict[str, dict[str, Any]] | None = None) -> None:
    """Rank 0, after every rank wrote its file: ``meta.json`` (with ``files``, each rank
    file's record from :func:`write_rank`; read back from disk when not given), then
    ``latest.json`` (each atomically), then older checkpoints beyond :data:`KEEP` are
    removed."""
    d = step_dir(out, step)
    if files is None:
        files = {f"rank-{r}.pt": file_record(d / f"rank-{r}.pt") for r in range(int(meta["world_size"]))}
    _write_json(d / "meta.json", dict(meta, format=FORMAT, step=step, files=files))
    outdir.claim(out, root(out) / LATEST, root(out) / f".{LATEST}.tmp")
    _write_json(root(out) / LATEST, {"step": step, "dir": d.name})
    # keep the newest KEEP complete ones at or below this step; any above it belong to an
    # earlier, longer run (a directory left holding only someone else's file is no checkpoint)
    steps = _step_dirs(out)
    older = [p for p in steps if _step_of(p) <= step]
    kept = [p for p in older if (p / "meta.json").is_file()][-KEEP:]
    for old in [p for p in older if p not in kept] + [p for p in steps if _step_of(p) > step]:
        remove_step(old)


def prepare(out: str | os.PathLike, step: int, groups: int = 0) -> None:
    """Rank 0, before any rank writes the checkpoint at ``step``: the directory is created
    and recorded in the folder's manifest (:mod:`thinwire.run.outdir`), with a ``group-K``
    folder for each of ``groups`` sharded groups; an existing one of that step (an earlier
    run's) is emptied of thinwire's files first, so none can mix with this one. A directory
    of that name thinwire did not create is refused (:class:`~thinwire.run.outdir.ForeignFile`)."""
    _prepare_step(out, step)
    for k in range(groups):
        outdir.mkdir(out, group_dir(out, step, k))


def group_dir(out: str | os.PathLike, step: int, group: int) -> Path:
    return step_dir(out, step) / f"group-{group}"


def write_group(out: str | os.PathLike, step: int, group: int, state: dict[str, Any], process_group: Any,
                ) -> dict[str, dict[str, Any]]:
    """Every rank of sharded group ``group``, after :func:`prepare`: ``state`` (DTensors
    sharded over the group) through ``torch.distributed.checkpoint`` over ``process_group``
    into ``group-K``; returns the record (:func:`file_record`) of every file in that folder,
    for each rank's own file."""
    import torch.distributed.checkpoint as dcp

    g = group_dir(out, step, group)
    dcp.save(state, checkpoint_id=g, process_group=process_group)  # returns once .metadata is written
    return {p.name: file_record(p) for p in sorted(g.iterdir()) if DCP_FILE.fullmatch(p.name) and p.is_file()}


def load_group(d: Path, group: int, state: dict[str, Any], process_group: Any,
               records: dict[str, dict[str, Any]]) -> None:
    """Load sharded group ``group``'s part of checkpoint ``d`` into ``state`` (in place, as
    ``torch.distributed.checkpoint.load`` does), after checking every file of its folder
    against ``records`` (this rank's own file holds them, and ``meta.json`` that file's)."""
    import torch.distributed.checkpoint as dcp

    g = d / f"group-{group}"
    if not g.is_dir() or g.is_symlink():
        raise CheckpointError(f"checkpoint {d}: group-{group} is missing (a checkpoint of sharded groups holds one "
                              "folder per group)")
    present = sorted(p.name for p in g.iterdir() if DCP_FILE.fullmatch(p.name))
    if present != sorted(records):
        raise CheckpointError(f"checkpoint {d}: group-{group} holds {present[:4]}, its record names "
                              f"{sorted(records)[:4]}")
    for name, record in records.items():
        _check_record(g / name, file_record(g / name), record, d)
    dcp.load(state, checkpoint_id=g, process_group=process_group)


def _prepare_step(out: str | os.PathLike, step: int) -> None:
    d = step_dir(out, step)
    if d.is_dir() and not d.is_symlink():
        remove_step(d)
    outdir.mkdir(out, root(out))
    if d.is_dir() and not d.is_symlink() and not outdir.owns(out, d):  # someone else's folder of that name
        theirs = [p.name for p in d.iterdir() if OWN_FILE.fullmatch(p.name) or GROUP_NAME.fullmatch(p.name)]
        if theirs:
            raise outdir.ForeignFile(f"{d} holds {theirs[0]}, which thinwire did not write; move it away or "
                                     "choose another --out")
        outdir.record(out, d)  # none of its files has a checkpoint's name: every one written there is thinwire's
        return
    outdir.mkdir(out, d)


def clear(out: str | os.PathLike) -> None:
    """Rank 0, when a fresh run (not a resume) starts in ``out``: an earlier run's
    checkpoints go, so ``latest.json`` can only ever name one of this run's. Only
    thinwire's own files go (:func:`remove_step`); ``checkpoints/`` itself goes when that
    leaves it empty and thinwire created it."""
    r = root(out)
    if not r.is_dir():
        return
    for d in _step_dirs(out):
        remove_step(d)
    for name in (LATEST, f".{LATEST}.tmp"):
        outdir.remove(out, r / name)
    outdir.rmdir(out, r)


def remove_step(d: Path) -> None:
    """Remove a checkpoint directory's files that thinwire wrote (``meta.json``,
    ``rank-R.pt`` and their temporary files), then the directory if nothing else is left in
    it. Only a directory thinwire's manifest records is touched: a file someone else put
    there, or a directory of that name thinwire did not create, is never deleted."""
    out = d.parent.parent
    if d.is_symlink() or not d.is_dir() or not outdir.owns(out, d):
        return
    for p in d.iterdir():
        if OWN_FILE.fullmatch(p.name) and p.is_file() and not p.is_symlink():
            p.unlink()
        elif GROUP_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink() and outdir.owns(out, p):
            for f in p.iterdir():
                if DCP_FILE.fullmatch(f.name) and f.is_file() and not f.is_symlink():
                    f.unlink()
            outdir.rmdir(out, p)
    outdir.rmdir(out, d)


def _step_dirs(out: str | os.PathLike) -> list[Path]:
    """This run's checkpoint directories (``step-NNNNNNNN``, not links), oldest first."""
    r = root(out)
    if not r.is_dir():
        return []
    return sorted((p for p in r.iterdir() if STEP_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink()),
                  key=_step_of)


def _step_of(d: Path) -> int:
    return int(d.name[5:])


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- finding and checking -----------------------------------------------------------------------
def locate(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``--resume PATH`` means: ``PATH`` itself when it is one (holds
    ``meta.json``), else the one ``PATH/checkpoints/latest.json`` names."""
    p = Path(path)
    if (p / "meta.json").exists():
        return p
    pointer = root(p) / LATEST
    if not p.exists():
        raise CheckpointError(f"--resume {path}: no such directory")
    if not pointer.exists():
        raise CheckpointError(f"--resume {path}: no checkpoint there (neither meta.json nor checkpoints/{LATEST}); "
                              "write one with --checkpoint-every")
    try:
        latest = jsonfile.read(pointer)
        name, step = latest["dir"], latest["step"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"--resume {path}: checkpoints/{LATEST} is damaged ({_reason(e)})") from None
    if not (isinstance(name, str) and STEP_NAME.fullmatch(name) and _is_int(step) and step >= 0
            and name == f"step-{step:08d}"):
        raise CheckpointError(f"--resume {path}: checkpoints/{LATEST} is damaged: it must name one of this run's "
                              f"checkpoints as step-NNNNNNNN with its step, got dir={name!r:.80}, step={step!r:.20}")
    d = root(p) / name
    if d.is_symlink() or not (d / "meta.json").exists():
        raise CheckpointError(f"--resume {path}: checkpoints/{LATEST} names {name}, which is missing, incomplete "
                              "or not a directory of this run")
    return d


META_FIELDS = (("step", int), ("world_size", int), ("task", str), ("method", str), ("seed", int),
               ("task_options", dict), ("config", dict), ("files", dict))  # meta.json's schema


def read_meta(d: Path) -> dict[str, Any]:
    """A checkpoint's ``meta.json``, checked against its schema (:data:`META_FIELDS`, a
    checksum record for each rank's file); raises :class:`CheckpointError` naming the field."""
    where = f"checkpoint {d}: meta.json"
    try:
        meta = jsonfile.read(d / "meta.json")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{where} is unreadable ({_reason(e)})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where} must hold an object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        older = _is_int(meta.get("format")) and meta["format"] < FORMAT
        raise CheckpointError(f"{where}: format {meta.get('format')!r:.20}, this thinwire reads format {FORMAT}"
                              + (" (an older thinwire wrote it without checksums; resume it with that version)"
                                 if older else ""))
    for key, kind in META_FIELDS:
        if key not in meta:
            raise CheckpointError(f"{where} is damaged: it has no {key!r}")
        value = meta[key]
        if not (_is_int(value) if kind is int else isinstance(value, kind)):
            expected = "an integer" if kind is int else kind.__name__
            raise CheckpointError(f"{where} is damaged: {key} must be {expected}, got {value!r:.40}")
    if meta["step"] < 0 or meta["world_size"] < 1:
        raise CheckpointError(f"{where} is damaged: step {meta['step']}, world size {meta['world_size']}")
    n = meta["world_size"]
    if len(meta["files"]) != n or set(meta["files"]) != {f"rank-{r}.pt" for r in range(n)}:
        raise CheckpointError(f"{where} is damaged: its files are {sorted(meta['files'])[:4]}, expected a record for "
                              f"each of rank-0.pt .. rank-{meta['world_size'] - 1}.pt")
    for name, record in meta["files"].items():
        if not (isinstance(record, dict) and isinstance(record.get("sha256"), str)
                and re.fullmatch(r"[0-9a-f]{64}", record["sha256"]) and _is_int(record.get("bytes"))):
            raise CheckpointError(f"{where} is damaged: the record of {name} must be "
                                  '{"sha256": 64 hex digits, "bytes": an integer}')
    return meta


def verify(d: Path, meta: dict[str, Any], ranks: list[int] | None = None) -> None:
    """The rank files of checkpoint ``d`` (``ranks``, default all) against their records in
    ``meta`` (size, then SHA-256): raises :class:`CheckpointError` naming the first file that
    differs. The launcher runs it before any rank starts (under torchrun, each rank for its
    own file)."""
    wanted = range(meta["world_size"]) if ranks is None else ranks
    for name, record in ((f"rank-{r}.pt", meta["files"].get(f"rank-{r}.pt")) for r in wanted):
        if record is None:
            raise CheckpointError(f"checkpoint {d}: meta.json records no {name} (a {meta['world_size']}-rank run)")
        path = d / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint {d}: {name} is missing")
        _check_record(path, file_record(path), record, d)


def _check_record(path: Path, got: dict[str, Any], record: dict[str, Any], d: Path) -> None:
    if got["bytes"] != record["bytes"] or got["sha256"] != record["sha256"]:
        what = (f"{got['bytes']} bytes, {record['bytes']} when written" if got["bytes"] != record["bytes"]
                else "its SHA-256 differs from the one recorded when it was written")
        raise CheckpointError(f"checkpoint file {path} is damaged ({what}); the previous checkpoint, if kept, "
                              f"is beside it in {d.parent}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


def run_dir(d: Path) -> Path | None:
    """The run directory a checkpoint directory belongs to (``RUN/checkpoints/step-N``), or
    None for one that lies anywhere else."""
    return d.parent.parent if d.parent.name == "checkpoints" else None


def in_place(d: Path, out: str | os.PathLike | None) -> bool:
    """Whether a run resumed from checkpoint ``d`` writes to ``out`` = the run directory ``d``
    belongs to (it continues that run rather than starting one elsewhere)."""
    own = run_dir(d)
    return own is not None and out is not None and os.path.realpath(own) == os.path.realpath(out)


def later_results(run: Path, step: int) -> str | None:
    """What continuing run directory ``run`` from its checkpoint at ``step`` would replace:
    a newer checkpoint, or a summary of a run that went past ``step``; None when nothing."""
    try:
        newest = jsonfile.read(root(run) / LATEST)["step"]
    except (OSError, ValueError, KeyError, TypeError):
        newest = None
    if isinstance(newest, int) and newest > step:
        return f"its checkpoint at step {newest}"
    finished = _summary_steps(Path(run))
    if isinstance(finished, int) and finished > step:
        return f"the summary of its finished {finished}-step run"
    return None


def check_matches(meta: dict[str, Any], *, workers: int, task: str, method: str, steps: int,
                  task_options: dict[str, Any] | None = None, seed: int | None = None,
                  batch_size: int | None = None, optimizer: str | None = None, lr: float | None = None) -> None:
    """Refuse a checkpoint from a different run (:func:`check_same_run`) or one with nothing
    left to train up to ``steps`` (:func:`check_steps`)."""
    check_same_run(meta, workers=workers, task=task, method=method, task_options=task_options, seed=seed,
                   batch_size=batch_size, optimizer=optimizer, lr=lr)
    check_steps(meta, steps)


def check_same_run(meta: dict[str, Any], *, workers: int, task: str, method: str,
                   task_options: dict[str, Any] | None = None, seed: int | None = None,
                   batch_size: int | None = None, optimizer: str | None = None, lr: float | None = None,
                   schedule: dict[str, Any] | None = None, groups: tuple[int, bool] | None = None) -> None:
    """Refuse a checkpoint from a different run, naming every field that differs (the seed
    and the batch size decide the data stream a resume continues; the optimizer's kind and
    learning rate travel in its saved state, which a resume restores; the learning-rate
    ``schedule``'s settings decide the rate at each step; ``groups``, (ranks per group,
    sharded): a sharded run's state is its shards, which another layout would cut elsewhere,
    so it resumes only with the same layout, and is not resharded). A checkpoint written
    before a setting existed holds its default."""
    diffs = []
    saved = meta.get("config", {})
    if groups is not None:
        was = (int(saved.get("ranks_per_node") or 1), bool(saved.get("shard", False)))
        if (was[1] or groups[1]) and was != groups:
            diffs.append(f"worker groups {_layout(*was)} (this run: {_layout(*groups)})")
    defaults = {"lr_schedule": "constant", "warmup_steps": 0, "min_lr": 0.0}
    for key, value in (schedule or {}).items():
        if saved.get(key, defaults.get(key)) != value:
            diffs.append(f"{key.replace('_', ' ')} {saved.get(key, defaults.get(key))} (this run: {value})")
    for name, value, key in (("seed", seed, "seed"), ("batch size", batch_size, "batch_size"),
                             ("optimizer", optimizer, "optimizer"), ("learning rate", lr, "lr")):
        if value is not None and saved.get(key, value) != value:
            diffs.append(f"{name} {saved[key]} (this run: {value})")
    if meta["world_size"] != workers:
        diffs.append(f"world size {meta['world_size']} (this run: {workers})")
    if meta["task"] != task:
        diffs.append(f"task {meta['task']} (this run: {task})")
    if meta["method"] != method:
        diffs.append(f"method {meta['method']} (this run: {method})")
    if task_options is not None and meta.get("task_options", {}) != task_options:
        diffs.append(f"task options {meta.get('task_options')} (this run: {task_options})")
    if diffs:
        raise CheckpointError("the checkpoint is from a different run: " + "; ".join(diffs))


def _layout(size: int, shard: bool) -> str:
    return f"of {size} rank(s), {'sharded' if shard else 'replicated'}" if size > 1 else "of 1 rank"


def check_steps(meta: dict[str, Any], steps: int) -> None:
    """Refuse a checkpoint already at or past ``steps``, the total, and a new total that
    would change the rates of the run's learning-rate schedule
    (:func:`thinwire.optim.schedule.refuse_new_span`)."""
    if meta["step"] >= steps:
        raise CheckpointError(f"the checkpoint is at step {meta['step']} and --steps is {steps} (the total): "
                              "nothing left to train; raise --steps")
    saved = meta.get("config", {})
    if isinstance(saved.get("steps"), int) and isinstance(saved.get("lr"), (int, float)):
        from thinwire.optim import schedule

        why = schedule.refuse_new_span(saved.get("lr_schedule", "constant"), int(saved.get("warmup_steps", 0)),
                                       float(saved.get("min_lr", 0.0)), float(saved["lr"]), int(meta["step"]),
                                       saved["steps"], steps)
        if why is not None:
            raise CheckpointError(why)


def finished(run: Path | None, step: int, steps: int) -> bool:
    """Whether run directory ``run``, resumed from its checkpoint at ``step``, already
    finished a run of ``steps`` steps: the checkpoint is at that step and ``summary.json``
    says so (a stopped or crashed run has no summary)."""
    if run is None or step != steps:
        return False
    return _summary_steps(Path(run)) == steps


def _summary_steps(run: Path) -> Any:
    """The ``steps`` a run directory's ``summary.json`` records (None when it has none); a
    summary that is there but unusable (damaged, not JSON, nested too deep, too large) is a
    :class:`CheckpointError`: what resuming would replace must be known."""
    path = run / "summary.json"
    if not path.exists():
        return None
    try:
        summary = jsonfile.read(path)
    except jsonfile.JsonFileError as e:
        raise CheckpointError(f"--resume {run}: {e}; move it away to continue this run") from None
    return summary.get("steps") if isinstance(summary, dict) else None


def saved_config(path: str | os.PathLike) -> dict[str, Any]:
    """The run config saved with the checkpoint ``--resume PATH`` means (``{}`` for a
    checkpoint that holds none)."""
    config = read_meta(locate(path)).get("config")
    return dict(config) if isinstance(config, dict) else {}


def load_rank(d: Path, rank: int, map_location: torch.device | str = "cpu",
              meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's state from checkpoint ``d``: the bytes read are checked against the
    checksum in ``meta`` (``d``'s ``meta.json`` when not given), then loaded with
    ``weights_only`` (no arbitrary code runs)."""
    meta = read_meta(d) if meta is None else meta
    path = d / f"rank-{rank}.pt"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {d}: {path.name} is missing")
    if path.name not in meta["files"]:
        raise CheckpointError(f"checkpoint {d}: meta.json records no {path.name} (a {meta['world_size']}-rank run)")
    data = path.read_bytes()
    _check_record(path, {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}, meta["files"][path.name], d)
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001  (truncated zip, bad pickle, a forbidden global...)
        # torch's own message advises loading with weights_only=False: never, for a file that fails here
        what = ("it holds objects other than tensors and plain containers, refused because loading them could run "
                "code" if isinstance(e, pickle.UnpicklingError) else type(e).__name__)
        raise CheckpointError(f"checkpoint file {path} is damaged or not a thinwire checkpoint ({what}); "
                              f"the previous checkpoint, if kept, is beside it in {d.parent}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("rank") != rank:
        raise CheckpointError(f"checkpoint file {path} does not hold rank {rank}'s state")
    return state


# -- random number generators -------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state` (generator states must be CPU byte tensors, wherever the
    checkpoint was loaded to)."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])

"""Checkpoints of a training run: every rank's whole state, written atomically, loaded safely.

Layout under a run's ``--out`` directory::

    checkpoints/
        latest.json            {"step": 120, "dir": "step-00000120"}: the newest complete one
        step-00000120/
            meta.json          step, world size, task, method, seed, config
            rank-0.pt ...      one file per rank (gossip ranks hold different models)

Each rank writes its file to a temporary name and renames it; after every rank has written
(a barrier), rank 0 writes ``meta.json`` and then replaces ``latest.json``. A crash at any
moment therefore leaves ``latest.json`` naming a complete checkpoint. The newest
:data:`KEEP` checkpoints are kept, so the one before the newest can still be loaded by its
directory if the newest is damaged.

A rank's file holds the model, the optimizer, the method's own state (error-feedback
residuals, factors, schedules, snapshots, phases, per-edge state), the byte meter, the
clock, the seconds spent so far and the RNG states; the data position is the step itself
(every task's batch stream is a pure function of the step). Files are read with
``torch.load(weights_only=True)``: tensors and plain containers only, never arbitrary
pickled objects.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
KEEP = 2  # checkpoints kept on disk: the newest and the one before it
LATEST = "latest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, damaged, or from a different run."""


def root(out: str | os.PathLike) -> Path:
    return Path(out) / "checkpoints"


def step_dir(out: str | os.PathLike, step: int) -> Path:
    return root(out) / f"step-{step:08d}"


# -- writing ----------------------------------------------------------------------------------
def write_rank(out: str | os.PathLike, step: int, rank: int, state: dict[str, Any]) -> Path:
    """This rank's file of the checkpoint at ``step`` (temporary file, fsync, rename)."""
    d = step_dir(out, step)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"rank-{rank}.pt"
    tmp = d / f".rank-{rank}.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def commit(out: str | os.PathLike, step: int, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote its file: ``meta.json``, then ``latest.json`` (each
    atomically), then older checkpoints beyond :data:`KEEP` are removed."""
    d = step_dir(out, step)
    _write_json(d / "meta.json", dict(meta, format=FORMAT, step=step))
    _write_json(root(out) / LATEST, {"step": step, "dir": d.name})
    # keep the newest KEEP at or below this step; any above it belong to an earlier, longer run
    older = sorted(p for p in root(out).glob("step-*") if p.is_dir() and p.name <= d.name)
    stale = [p for p in root(out).glob("step-*") if p.is_dir() and p.name > d.name]
    for old in older[:-KEEP] + stale:
        shutil.rmtree(old, ignore_errors=True)


def prepare(out: str | os.PathLike, step: int) -> None:
    """Rank 0, before any rank writes the checkpoint at ``step``: an existing directory of
    that step (an earlier run's) is removed, so no file of it can mix with this one."""
    d = step_dir(out, step)
    if d.exists():
        shutil.rmtree(d)


def clear(out: str | os.PathLike) -> None:
    """Rank 0, when a fresh run (not a resume) starts in ``out``: an earlier run's
    checkpoints go, so ``latest.json`` can only ever name one of this run's."""
    shutil.rmtree(root(out), ignore_errors=True)


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
        name = json.loads(pointer.read_text())["dir"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"--resume {path}: checkpoints/{LATEST} is damaged ({e})") from None
    d = root(p) / str(name)
    if not (d / "meta.json").exists():
        raise CheckpointError(f"--resume {path}: checkpoints/{LATEST} names {name}, which is missing or incomplete")
    return d


def read_meta(d: Path) -> dict[str, Any]:
    try:
        meta = json.loads((d / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {d}: meta.json is unreadable ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {d}: format {meta.get('format')!r}, this thinwire reads format {FORMAT}")
    return meta


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
        newest = json.loads((root(run) / LATEST).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        newest = None
    if isinstance(newest, int) and newest > step:
        return f"its checkpoint at step {newest}"
    try:
        finished = json.loads((Path(run) / "summary.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        finished = None
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
                   batch_size: int | None = None, optimizer: str | None = None, lr: float | None = None) -> None:
    """Refuse a checkpoint from a different run, naming every field that differs (the seed
    and the batch size decide the data stream a resume continues; the optimizer's kind and
    learning rate travel in its saved state, which a resume restores)."""
    diffs = []
    saved = meta.get("config", {})
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


def check_steps(meta: dict[str, Any], steps: int) -> None:
    """Refuse a checkpoint already at or past ``steps``, the total."""
    if meta["step"] >= steps:
        raise CheckpointError(f"the checkpoint is at step {meta['step']} and --steps is {steps} (the total): "
                              "nothing left to train; raise --steps")


def finished(run: Path | None, step: int, steps: int) -> bool:
    """Whether run directory ``run``, resumed from its checkpoint at ``step``, already
    finished a run of ``steps`` steps: the checkpoint is at that step and ``summary.json``
    says so (a stopped or crashed run has no summary)."""
    if run is None or step != steps:
        return False
    try:
        return json.loads((Path(run) / "summary.json").read_text()).get("steps") == steps
    except (OSError, ValueError, AttributeError):
        return False


def saved_config(path: str | os.PathLike) -> dict[str, Any]:
    """The run config saved with the checkpoint ``--resume PATH`` means (``{}`` for a
    checkpoint that holds none)."""
    config = read_meta(locate(path)).get("config")
    return dict(config) if isinstance(config, dict) else {}


def load_rank(d: Path, rank: int, map_location: torch.device | str = "cpu") -> dict[str, Any]:
    """This rank's state from checkpoint ``d`` (``weights_only``: no arbitrary code runs)."""
    path = d / f"rank-{rank}.pt"
    if not path.exists():
        raise CheckpointError(f"checkpoint {d}: {path.name} is missing")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001  (truncated zip, bad pickle, a forbidden global...)
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint file {path} is damaged or not a thinwire checkpoint ({first}); "
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

"""What ``thinwire cost --compute-from`` reads from a GPU results file: the JSON that
``benchmarks/bench_gpu.py`` writes (``benchmarks/results/gpu.json`` beside ``gpu.md``).

The file names itself (``"kind": "thinwire bench_gpu"``, ``"schema"``) and holds, per model it
measured (``models``), what the probe is matched on and what the prediction takes from it::

    "models": {"transformer": {
        "task": "text",                        # the thinwire task whose model it is (null: none)
        "task_options": {"model": "gpt-small", "layers": 12, ...},   # as resolved by the task
        "batch_size": 8,                       # per worker
        "parameters": 86235648,
        "compute": {"ms": 61.2, ...},          # median compute step: forward, backward, optimizer
        "codecs": {"topk": {"spec": "topk", "kind": "gradient", "ms": 4.1, ...}, ...}}}
    "workers": 8                               # the codec times are one rank's of this many
    "machine": {"device_name": "NVIDIA H200", ...}

A probe's model is the file's model when the task is the same, every task option the file
records equals the probe's (both resolved through the task's own option class, so a preset
and its spelled-out knobs agree; options the file does not record, such as a corpus's
held-out share, are free), the batch size per worker is the same and the models have as
many parameters (a token file's vocabulary, for instance, changes that). Its ``compute``
ms replaces the compute measured here; its codec times replace this machine's for the
methods it measured (gradient codecs and presets, matched on their resolved specs), when
the probe has as many workers as the file's codec times were measured for (a gathered
codec decodes one payload per worker).

Every problem is a :class:`ValueError` of one line naming the rule.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KIND = "thinwire bench_gpu"
SCHEMA = 1


@dataclass(frozen=True)
class GpuModel:
    """The probe's model as the results file measured it."""

    name: str  # its key in the file's ``models``
    compute_s: float  # seconds per compute step
    workers: int  # the worker count its codec times are one rank's of
    device: str  # the machine's device name, for the compute line
    codec_s: dict[str, float] = field(default_factory=dict)  # resolved spec -> seconds per step


def results_file(path: str) -> Path:
    """The JSON file that ``path`` names: the path itself, or for a ``.md`` results file its
    sibling ``.json`` (bench_gpu writes both)."""
    file = Path(path)
    if file.suffix.lower() == ".md":
        sibling = file.with_suffix(".json")
        if not sibling.is_file():
            raise ValueError(f"--compute-from {path}: no {sibling.name} beside it (bench_gpu.py writes the two "
                             "together; give the .json)")
        return sibling
    return file


def read_if_results(path: str) -> dict[str, Any] | None:
    """The results file ``path`` names when it is one (:func:`read`), or None when it names a
    run instead (a folder, or a ``summary.json``, which :func:`thinwire.lab.cost.compute_from_run`
    reads). A ``.md`` path must be a results file's; any other file is told apart by what it
    holds: a ``kind`` makes it a results file (which must be bench_gpu's), ``compute_seconds``
    a run's summary, and neither is an error."""
    file = Path(path)
    if file.is_dir() or file.name == "summary.json" or not file.is_file() and file.suffix.lower() != ".md":
        return None
    if file.suffix.lower() == ".md":
        return read(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # the run summary's reader names what is wrong with it
    if isinstance(data, dict) and "kind" in data:
        return checked(data, path)
    if isinstance(data, dict) and "compute_seconds" in data:
        return None
    raise ValueError(f"--compute-from {path}: neither a run summary (no compute_seconds) nor a bench_gpu result "
                     f"(no kind {KIND!r})")


def is_results(data: Any) -> bool:
    """Whether ``data`` (a parsed JSON document) says it is a bench_gpu results file."""
    return isinstance(data, dict) and data.get("kind") == KIND


def read(path: str) -> dict[str, Any]:
    """The results file that ``path`` names (:func:`results_file`), parsed and checked to be
    one: its kind, a schema this thinwire reads, and models."""
    file = results_file(path)
    if not file.is_file():
        raise ValueError(f"--compute-from {path}: no such file")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--compute-from {file}: not a readable JSON file: {str(e).splitlines()[0]}") from None
    return checked(data, str(file))


def checked(data: Any, where: str) -> dict[str, Any]:
    """``data`` if it is a bench_gpu results file this thinwire reads, else ValueError."""
    if not is_results(data):
        kind = data.get("kind") if isinstance(data, dict) else None
        got = f"its kind is {kind!r}" if kind is not None else "it has no kind"
        raise ValueError(f"--compute-from {where}: not a bench_gpu result ({got}, not {KIND!r}); give a run's "
                         "folder or summary.json, or the JSON benchmarks/bench_gpu.py writes")
    schema = data.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema < 1:
        raise ValueError(f"--compute-from {where}: a bench_gpu result without a schema number")
    if schema > SCHEMA:
        raise ValueError(f"--compute-from {where}: bench_gpu schema {schema} is newer than this thinwire reads "
                         f"({SCHEMA}): upgrade thinwire")
    if not isinstance(data.get("models"), dict):
        raise ValueError(f"--compute-from {where}: a bench_gpu result without models")
    return data


def model_for(data: dict[str, Any], where: str, *, task: str, options: dict[str, Any], batch_size: int,
              parameters: int) -> GpuModel:
    """The model of ``data`` (a checked results file) that the probe runs: the same task,
    every option the file records equal to the probe's (both resolved by the task), the same
    batch size per worker and as many parameters; ValueError naming what the file holds when
    none is, or when that model's compute step was not measured."""
    mine = _resolved(task, options)
    held = []
    for name, entry in data["models"].items():
        if not isinstance(entry, dict):
            continue
        held.append(_describe(name, entry))
        if not _matches(entry, task, mine, batch_size, parameters):
            continue
        compute = entry.get("compute") or {}
        ms: Any = compute.get("ms") if isinstance(compute, dict) else None
        if not _positive(ms):
            raise ValueError(f"--compute-from {where}: its {name} has no compute step measured (> 0 ms)")
        workers = data.get("workers")
        return GpuModel(name, ms / 1e3, workers if isinstance(workers, int) else 0,
                        str((data.get("machine") or {}).get("device_name") or "unknown device"),
                        _codec_seconds(entry))
    given = ", ".join(f"{k}={v}" for k, v in options.items())
    probe = f"task {task}{f' ({given})' if given else ''}, batch size {batch_size}, {parameters / 1e6:.2f}M parameters"
    raise ValueError(f"--compute-from {where}: it holds no model of this probe ({probe}); it holds: "
                     f"{'; '.join(held) or 'none'}")


def _matches(entry: dict[str, Any], task: str, mine: Any, batch_size: int, parameters: int) -> bool:
    if entry.get("task") != task or entry.get("batch_size") != batch_size or entry.get("parameters") != parameters:
        return False
    recorded = entry.get("task_options") or {}
    if not isinstance(recorded, dict):
        return False
    try:
        theirs = _resolved(task, recorded)
    except ValueError:
        return False
    return all(getattr(mine, key, _MISSING) == getattr(theirs, key) for key in recorded)


_MISSING = object()


def _resolved(task: str, options: dict[str, Any]) -> Any:
    """The task's option object for ``options`` (defaults and presets filled)."""
    from thinwire.tasks import get as get_task
    from thinwire.tasks.base import parse_options

    cls = get_task(task)
    return parse_options(task, cls.Config, dict(options))


def _describe(name: str, entry: dict[str, Any]) -> str:
    """One model of the file in words, for the error that lists them."""
    task = entry.get("task")
    if not task:
        return f"{name} (no thinwire task)"
    options = ", ".join(f"{k}={v}" for k, v in (entry.get("task_options") or {}).items())
    params = entry.get("parameters")
    size = f", {params / 1e6:.2f}M parameters" if isinstance(params, (int, float)) else ""
    return f"{name} (task {task}{f' ({options})' if options else ''}, batch size {entry.get('batch_size')}{size})"


def _codec_seconds(entry: dict[str, Any]) -> dict[str, float]:
    """Seconds per step of each gradient codec or preset the file measured on this model,
    keyed by its resolved spec (as ``thinwire cost`` resolves a method)."""
    from thinwire.algorithms.methods import kind_of, resolve_method

    out: dict[str, float] = {}
    for row in (entry.get("codecs") or {}).values():
        if not isinstance(row, dict) or row.get("kind") != "gradient" or not _positive(row.get("ms")):
            continue
        spec = row.get("spec")
        try:
            if not isinstance(spec, str) or kind_of(spec) == "method":
                continue
            out[resolve_method(spec)] = row["ms"] / 1e3
        except ValueError:
            continue  # a codec this thinwire does not know: nothing to put in place
    return out


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0

"""A run's summary, typed: what ``thinwire train`` writes to ``OUT/summary.json`` and what
:func:`thinwire.run.launch.launch` returns (:class:`Summary`); an elastic worker's
(:class:`WorkerSummary`) and a local elastic job's (:class:`JobSummary`).

The file is one flat JSON object: every field below by its name, the method's own figures
beside them (``method_fields``: DaSGD's delay, AB-training's ranks...), ``schema`` (this
module's :data:`SCHEMA`) and, where a figure was NaN or infinite, ``non_finite`` naming it
(the figure itself is ``null``: strict JSON). :meth:`Summary.read` takes a file of this
schema or of the unversioned layout before it (schema 0, the same keys); a newer schema is
refused by name. The elastic records are nested instead (a worker's ``final`` evaluation and
``elastic`` membership figures; a job's workers), with the same ``schema`` and refusals.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from thinwire.run.metrics import NON_FINITE, finite

SCHEMA = 1  # raised when a field changes meaning or goes; a new field keeps it


@dataclass
class Summary:
    # what ran
    task: str
    method: str  # the resolved spec
    workers: int
    steps: int  # asked for; ``steps_run`` ran in this process, ``stopped_at`` where a signal stopped it
    config: dict[str, Any] = field(default_factory=dict)  # RunConfig.to_dict(): resumes and races read it
    data: dict[str, Any] | None = None  # the task's data facts (a text corpus's size and SHA-256)
    ranks_per_node: int = 1
    intra_link: str | None = None
    intra_dtype: str | None = None
    shard: bool = False  # each group's replica sharded over its ranks with FSDP2 (--shard)
    # how it ended: ``ok``, ``diverged`` (``failure`` says why) or ``stopped`` (by ``signal``)
    status: str = "ok"
    failure: str | None = None
    signal: str | None = None
    stopped_at: int | None = None
    unfinished: bool = False  # stopped, and a rank ended before it wrote the stop's checkpoint
    unfinished_why: str | None = None
    resumed_from: int | None = None
    steps_run: int = 0
    skipped_steps: int = 0  # skipped for a non-finite gradient (GradScaler's overflow)
    first_nonfinite: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    # the last evaluation's test figures (None where the task has no such figure)
    final_loss: float | None = None
    final_accuracy: float | None = None
    final_bpc: float | None = None
    final_train_loss: float | None = None
    # what crossed the wire, per worker (the mean over ranks)
    bytes_sent_per_worker: float = 0.0
    fp32_bytes_per_worker: float = 0.0  # what an fp32 all_reduce sends for the steps that communicated
    compression_ratio: float | None = None
    messages_per_worker: int = 0
    bytes_by_link_per_worker: dict[str, float] = field(default_factory=dict)  # ``intra`` / ``inter``
    messages_by_link_per_worker: dict[str, float] = field(default_factory=dict)
    # clocks (rank 0's, seconds)
    wall_seconds: float = 0.0  # the training steps, evaluation excluded
    compute_seconds: float = 0.0
    measured_compute_seconds: float | None = None  # the run's own, where a race put its shared figure in its place
    backward_seconds: float = 0.0
    codec_seconds: float = 0.0
    comm_seconds: float = 0.0
    checkpoints_written: int = 0
    checkpoint_seconds: float = 0.0
    # the cost model: the run's time on each ``--link`` (compute + codec + modeled communication)
    modeled_seconds: float | None = None  # on the first link
    modeled_seconds_by_link: dict[str, float] = field(default_factory=dict)
    modeled_comm_seconds_by_link: dict[str, float] = field(default_factory=dict)  # before overlap
    hidden_seconds_by_link: dict[str, float] = field(default_factory=dict)
    hidden_fraction: float | None = None
    # the method
    method_report: dict[str, Any] = field(default_factory=dict)
    per_parameter: list[dict[str, Any]] = field(default_factory=list)
    method_state_bytes: int = 0
    method_fields: dict[str, Any] = field(default_factory=dict)  # flat in the file
    # the machine, by nothing that names it
    peak_rss_bytes: int | None = None
    # rank 0's bytes of model state: parameters, gradients, optimizer, method, FSDP's unsharded working set,
    # their sum (model_state_peak), and apart the activations one forward pass saved (thinwire.run.memory)
    memory: dict[str, int | None] | None = None
    version: str = ""
    torch_version: str = ""
    python_version: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    started_at: str | None = None
    ended_at: str | None = None
    non_finite: dict[str, str] | None = None  # figures that were NaN or infinite, by dotted path

    def final(self, figure: str) -> float | None:
        """A final figure by its name (``loss``, ``accuracy``, ``bpc``, ``train_loss``)."""
        return getattr(self, f"final_{figure}")

    @property
    def label(self) -> str:
        """The run's name in tables: its ``--label``, else its method."""
        return (self.config or {}).get("label") or self.method

    def to_json(self) -> dict[str, Any]:
        """The flat, strict-JSON object ``summary.json`` holds."""
        record = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("method_fields", NON_FINITE)}
        clash = sorted(set(self.method_fields) & set(record))
        if clash:
            raise ValueError(f"a method's summary fields may not reuse the summary's own names: {', '.join(clash)}")
        return finite({"schema": SCHEMA, **record, **self.method_fields,
                       **({NON_FINITE: self.non_finite} if self.non_finite else {})})

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Summary:
        """A summary from ``summary.json``'s object; keys not of this class are the method's."""
        _check(record, "a run summary", ("task", "method", "workers", "steps"))
        names = {f.name for f in dataclasses.fields(cls)} - {"method_fields"}
        own = {k: v for k, v in record.items() if k in names}
        return cls(**own, method_fields={k: v for k, v in record.items() if k not in names and k != "schema"})

    @classmethod
    def read(cls, path: str) -> Summary:
        """``path`` (a ``summary.json``) as a summary."""
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))


def _check(record: dict[str, Any], what: str, required: tuple[str, ...]) -> None:
    """Refuse a record of a newer schema, or one without the ``required`` fields."""
    schema = record.get("schema", 0)
    if not isinstance(schema, int) or schema > SCHEMA:
        raise ValueError(f"summary schema {schema!r} is newer than this thinwire reads ({SCHEMA}): upgrade thinwire")
    missing = [n for n in required if n not in record]
    if missing:
        raise ValueError(f"not {what}: no {', '.join(missing)}")


def _known(cls: type, record: dict[str, Any], what: str) -> dict[str, Any]:
    """``record``'s fields of the dataclass ``cls``; a field it does not have is refused by name."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(record) - names - {"schema"})
    if unknown:
        raise ValueError(f"not {what}: unknown field(s) {', '.join(unknown)}")
    return {k: v for k, v in record.items() if k in names}


@dataclass
class WorkerSummary:
    """One elastic worker's summary: what it writes to its ``summary.json`` (a local job's
    ``OUT/worker-K/``) and what :func:`thinwire.run.elastic.run_worker` returns."""

    # what ran
    task: str
    method: str
    replica: int
    workers: int  # the job's --workers (the quorum's size varies: ``elastic["present"]``)
    steps: int
    min_workers: int = 1
    seed: int = 0
    lr: float | None = None
    optimizer: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    # how it ended: ``ok`` (the job committed ``steps``) or ``stopped`` (too few workers: ``failure``)
    status: str = "ok"
    failure: str | None = None
    committed_step: int = 0
    final: dict[str, Any] = field(default_factory=dict)  # the last evaluation's record (metrics.jsonl's)
    # membership: ``changes`` (each quorum change), ``committed``, ``discarded``, ``heals``,
    # ``present`` (runs ``[first step, last step, workers]``), ``seconds_to_first_commit``,
    # ``timeout_seconds``, ``wait_seconds``
    elastic: dict[str, Any] = field(default_factory=dict)
    # the wire and the model
    bytes_sent: float = 0.0
    messages: int = 0
    model_sha256: str = ""  # equal on two workers exactly when their models are equal bit for bit
    # clocks and the machine
    wall_seconds: float = 0.0
    train_seconds: float = 0.0  # the steps alone (quorum, forward, backward, average, vote; not the data's reading)
    started_at: str | None = None
    ended_at: str | None = None
    version: str = ""
    torch_version: str = ""
    python_version: str = ""
    machine: dict[str, Any] = field(default_factory=dict)
    non_finite: dict[str, str] | None = None  # figures that were NaN or infinite, by dotted path

    def to_json(self) -> dict[str, Any]:
        record = {k: v for k, v in dataclasses.asdict(self).items() if k != NON_FINITE or v}
        return finite({"schema": SCHEMA, **record})

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> WorkerSummary:
        _check(record, "an elastic worker's summary", ("task", "method", "replica", "workers", "steps"))
        return cls(**_known(cls, record, "an elastic worker's summary"))

    @classmethod
    def read(cls, path: str) -> WorkerSummary:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))


@dataclass
class WorkerExit:
    """How one worker process of a local elastic job ended."""

    exit: int | None  # the process's exit code
    error: str | None = None  # the one line of a worker that raised
    summary: WorkerSummary | None = None  # None: it ended before it wrote one


@dataclass
class JobSummary:
    """A local elastic job's summary (``thinwire train --elastic``'s ``OUT/summary.json``):
    each worker's exit and summary, by replica."""

    lighthouse: str
    workers: dict[int, WorkerExit] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return finite({"schema": SCHEMA, "elastic": True, "lighthouse": self.lighthouse, "workers": {
            str(r): {"exit": w.exit, "error": w.error, "summary": None if w.summary is None else w.summary.to_json()}
            for r, w in sorted(self.workers.items())}})

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> JobSummary:
        _check(record, "an elastic job's summary", ("lighthouse", "workers"))
        return cls(record["lighthouse"], {int(r): WorkerExit(w["exit"], w.get("error"), None if w.get("summary") is None
                                                              else WorkerSummary.from_json(w["summary"]))
                                           for r, w in record["workers"].items()})

    @classmethod
    def read(cls, path: str) -> JobSummary:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))

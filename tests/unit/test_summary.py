"""The typed run summary: what summary.json holds, read back field for field; the method's own
figures flat beside the summary's; strict JSON; the schema version checked. The same for an
elastic worker's summary and a local elastic job's."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from thinwire.run.summary import SCHEMA, JobSummary, Summary, WorkerExit, WorkerSummary


def _summary(**kw) -> Summary:
    return Summary(task="synthetic", method="topk:ratio=0.1", workers=2, steps=8, **kw)


def test_the_file_is_flat_versioned_and_reads_back_equal(tmp_path):
    s = _summary(final_loss=0.25, bytes_sent_per_worker=1.5e6, modeled_seconds_by_link={"1gbit,50us": 3.0},
                 method_fields={"overlap": {"steps": 7}, "delay": 2}, config={"label": "mine"})
    record = s.to_json()
    assert record["schema"] == SCHEMA == 1
    assert record["overlap"] == {"steps": 7} and record["delay"] == 2  # the method's figures beside the summary's
    assert "method_fields" not in record and record["final_loss"] == 0.25
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(record, allow_nan=False))
    back = Summary.read(str(path))
    assert back == s
    assert back.final("loss") == 0.25 and back.final("accuracy") is None and back.label == "mine"
    assert _summary().label == "topk:ratio=0.1"  # no --label: its method


def test_a_non_finite_figure_is_null_and_named():
    record = _summary(final_loss=math.nan, modeled_seconds_by_link={"1gbit": math.inf}).to_json()
    assert record["final_loss"] is None and record["modeled_seconds_by_link"] == {"1gbit": None}
    assert record["non_finite"] == {"final_loss": "nan", "modeled_seconds_by_link.1gbit": "inf"}
    json.dumps(record, allow_nan=False)  # strict JSON
    back = Summary.from_json(record)
    assert back.final_loss is None and back.non_finite == record["non_finite"] and back.method_fields == {}


def test_a_file_without_a_schema_reads_as_the_layout_before_it():
    # the unversioned summary.json had the same keys: what it lacks takes the default
    back = Summary.from_json({"task": "mnist1d", "method": "identity", "workers": 2, "steps": 4,
                              "final_accuracy": 0.5, "hidden_fraction": None})
    assert back.final_accuracy == 0.5 and back.status == "ok" and back.modeled_seconds_by_link == {}


@pytest.mark.parametrize("record, needle", [
    ({"schema": 2, "task": "t", "method": "m", "workers": 1, "steps": 1},
     "summary schema 2 is newer than this thinwire reads (1): upgrade thinwire"),
    ({"schema": "1", "task": "t", "method": "m", "workers": 1, "steps": 1}, "summary schema '1' is newer"),
    ({"task": "t", "steps": 1}, "not a run summary: no method, workers"),
])
def test_what_is_not_a_summary_of_this_schema_is_refused_by_name(record, needle):
    with pytest.raises(ValueError, match="^" + needle.replace("(", r"\(").replace(")", r"\)")):
        Summary.from_json(record)


def test_a_method_field_may_not_take_a_summary_name():
    with pytest.raises(ValueError, match="may not reuse the summary's own names: final_loss, status"):
        _summary(method_fields={"status": "mine", "final_loss": 0.0}).to_json()


def test_every_field_has_a_default_but_what_names_the_run():
    required = [f.name for f in dataclasses.fields(Summary)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    assert required == ["task", "method", "workers", "steps"]


def _worker(replica: int, **kw) -> WorkerSummary:
    return WorkerSummary(task="synthetic", method="powersgd", replica=replica, workers=2, steps=30, **kw)


def test_an_elastic_jobs_summary_and_its_workers_read_back_equal(tmp_path):
    ok = _worker(0, committed_step=30, final={"step": 30, "test_loss": 0.5},
                 elastic={"discarded": 1, "changes": [], "present": [[1, 30, 2]]}, model_sha256="ab", bytes_sent=1e6)
    job = JobSummary("http://127.0.0.1:1", {0: WorkerExit(0, None, ok), 1: WorkerExit(1, "RuntimeError: x", None)})
    record = job.to_json()
    assert record["schema"] == SCHEMA and record["elastic"] is True and sorted(record["workers"]) == ["0", "1"]
    assert record["workers"]["0"]["summary"]["elastic"]["present"] == [[1, 30, 2]]  # nested, as written
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(record, allow_nan=False))
    assert JobSummary.read(str(path)) == job
    (tmp_path / "w.json").write_text(json.dumps(ok.to_json(), allow_nan=False))
    assert WorkerSummary.read(str(tmp_path / "w.json")) == ok


def test_an_elastic_workers_non_finite_figure_is_null_named_and_reads_back():
    record = _worker(1, final={"test_loss": math.nan}, train_seconds=math.inf).to_json()
    assert record["final"] == {"test_loss": None} and record["train_seconds"] is None
    assert record["non_finite"] == {"final.test_loss": "nan", "train_seconds": "inf"}
    json.dumps(record, allow_nan=False)
    back = WorkerSummary.from_json(record)
    assert back.non_finite == record["non_finite"] and back.to_json() == record
    assert "non_finite" not in _worker(0).to_json()


@pytest.mark.parametrize("record, needle", [
    ({"schema": 2, "task": "t", "method": "m", "replica": 0, "workers": 1, "steps": 1}, "summary schema 2 is newer"),
    ({"task": "t", "method": "m", "workers": 1, "steps": 1}, "not an elastic worker's summary: no replica"),
    ({"task": "t", "method": "m", "replica": 0, "workers": 1, "steps": 1, "delay": 2},
     "not an elastic worker's summary: unknown field(s) delay"),
])
def test_what_is_not_an_elastic_workers_summary_is_refused_by_name(record, needle):
    with pytest.raises(ValueError, match="^" + needle.replace("(", r"\(").replace(")", r"\)")):
        WorkerSummary.from_json(record)

"""Nothing the user owns is deleted, a damaged checkpoint is never taken, a dead run never
reports success: checksummed checkpoints verified before any rank starts, checked
``meta.json`` / ``latest.json``, deletion of thinwire's own files only, strict JSON for a
run that diverged, and bad input refused before the ranks start (one line, exit 2).

Runs in-process (LocalWorld threads); the command-line cases that must reach spawned ranks
(signals, a stopped rank, exit codes of a run) are in tests/distributed/test_faults.py."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from clicheck import files as _files
from clicheck import refused as _refused
from thinwire.comm.local import LocalWorld
from thinwire.run import checkpoint, config, metrics, outdir
from thinwire.run.checkpoint import CheckpointError
from thinwire.run.config import TrainConfig
from thinwire.run.launch import _start_step
from thinwire.run.summary import Summary
from thinwire.run.trainer import train_rank

SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}
K = 4
TASK = ["--task", "synthetic", "--batch-size", "16", *[a for k, v in SMALL.items() for a in ("--option", f"{k}={v}")]]


def _cfg(out: Path | None, **kw) -> TrainConfig:
    base = dict(task="synthetic", method="identity", workers=2, steps=2 * K, eval_every=K,
                out=None if out is None else str(out),
                checkpoint_every=K, task_options=SMALL, batch_size=16)
    base.update(kw)
    return TrainConfig(**base).resolve()


def _train(cfg: TrainConfig) -> list:
    return LocalWorld(cfg.workers).run(lambda comm: train_rank(cfg, comm))




@pytest.fixture()
def finished(tmp_path) -> Path:
    """A finished run: checkpoints at K and 2K, summary.json and metrics.jsonl."""
    cfg = _cfg(tmp_path / "a")
    _train(cfg)
    return Path(cfg.out)


# -- 1, 5: checksums, verified before any rank starts ---------------------------------------------
def _flip_tensor_bytes(path: Path, tensor: torch.Tensor) -> None:
    """Flip 4 bytes inside ``tensor``'s data where it lies in the file (not the zip's
    structure: torch still loads the file, with a wrong value)."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.detach().contiguous().numpy().tobytes()[:64])
    assert at > 0
    for i in range(at + 16, at + 20):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.spawns
def test_a_flipped_byte_in_tensor_data_is_refused_before_any_rank_starts(finished, capsys):
    d = checkpoint.step_dir(finished, 2 * K)
    target = d / "rank-1.pt"
    state = torch.load(target, weights_only=True)
    _flip_tensor_bytes(target, state["model"]["fc1.weight"])
    flipped = torch.load(target, weights_only=True)  # torch takes it: its zip CRCs are not checked on load
    assert not torch.equal(flipped["model"]["fc1.weight"], state["model"]["fc1.weight"])
    before = _files(finished)
    _refused(capsys, ["train", "--resume", str(finished), "--steps", str(3 * K)],
             "rank-1.pt is damaged", "SHA-256 differs")
    assert _files(finished) == before  # the finished run's summary.json and metrics.jsonl are untouched
    with pytest.raises(CheckpointError, match="SHA-256 differs"):  # and a rank never loads it either
        checkpoint.load_rank(d, 1)
    assert checkpoint.load_rank(checkpoint.step_dir(finished, K), 1)["step"] == K  # the one before still loads


@pytest.mark.spawns
def test_checkpoint_files_are_recorded_with_their_checksum(finished):
    d = checkpoint.step_dir(finished, 2 * K)
    meta = checkpoint.read_meta(d)
    assert meta["format"] == checkpoint.FORMAT
    for r in range(2):
        assert meta["files"][f"rank-{r}.pt"] == checkpoint.file_record(d / f"rank-{r}.pt")
    checkpoint.verify(d, meta)  # intact: passes


@pytest.mark.spawns
def test_a_rank_that_cannot_load_leaves_the_finished_runs_files_alone(finished):
    d = checkpoint.step_dir(finished, 2 * K)
    target = d / "rank-1.pt"  # loads by checksum, fails as a state: only a rank finds out
    torch.save({"format": checkpoint.FORMAT, "rank": 0}, target)
    meta = json.loads((d / "meta.json").read_text())
    meta["files"]["rank-1.pt"] = checkpoint.file_record(target)
    (d / "meta.json").write_text(json.dumps(meta))
    before = _files(finished)
    resumed = _cfg(None, steps=3 * K, resume=str(finished))  # back into its own directory
    with pytest.raises(CheckpointError, match="does not hold rank 1's state"):
        _train(resumed)
    assert _files(finished) == before  # rank 0 waited for every rank's load before touching the run


# -- 9: meta.json and latest.json are checked ----------------------------------------------------
@pytest.mark.parametrize("damage, needle", [
    (lambda m: m.pop("step"), "has no 'step'"),
    (lambda m: m.update(step="8"), "step must be an integer, got '8'"),
    (lambda m: m.update(world_size=True), "world_size must be an integer"),
    (lambda m: m.update(config=[1, 2]), "config must be dict"),
    (lambda m: m["files"].pop("rank-1.pt"), "expected a record for each of rank-0.pt .. rank-1.pt"),
    (lambda m: m["files"]["rank-0.pt"].update(sha256="beef"), "the record of rank-0.pt must be"),
    (lambda m: m.update(format=1), "format 1, this thinwire reads format 2"),
])
@pytest.mark.spawns
def test_a_malformed_meta_json_is_one_line_and_exit_2(finished, capsys, damage, needle):
    path = checkpoint.step_dir(finished, 2 * K) / "meta.json"
    meta = json.loads(path.read_text())
    damage(meta)
    path.write_text(json.dumps(meta))
    _refused(capsys, ["train", "--resume", str(finished), "--steps", str(3 * K)], "meta.json", needle)


@pytest.mark.spawns
@pytest.mark.parametrize("text", ["[1, 2]", '"step-00000008"', "{not json"])
def test_a_meta_json_that_is_not_an_object_is_refused(finished, capsys, text):
    (checkpoint.step_dir(finished, 2 * K) / "meta.json").write_text(text)
    _refused(capsys, ["train", "--resume", str(finished), "--steps", str(3 * K)], "meta.json")


@pytest.mark.spawns
def test_latest_json_can_only_name_a_checkpoint_of_its_own_run(finished, tmp_path, capsys):
    other = _cfg(tmp_path / "other")
    _train(other)
    theirs = _files(Path(other.out))
    latest = finished / "checkpoints" / "latest.json"
    for pointer in ({"step": 2 * K, "dir": f"../../other/checkpoints/step-{2 * K:08d}"},
                    {"step": 2 * K, "dir": str(checkpoint.step_dir(other.out, 2 * K))},
                    {"step": K, "dir": f"step-{2 * K:08d}"},  # step and directory disagree
                    {"dir": f"step-{2 * K:08d}"}):
        latest.write_text(json.dumps(pointer))
        _refused(capsys, ["train", "--resume", str(finished), "--steps", str(3 * K)], "latest.json")
    assert _files(Path(other.out)) == theirs


# -- 3: --overwrite deletes only thinwire's own files ---------------------------------------------
@pytest.mark.spawns
def test_overwrite_leaves_every_file_thinwire_did_not_write(finished):
    mine = finished / "checkpoints" / "resnet50" / "epoch90.pth"
    mine.parent.mkdir()
    mine.write_bytes(b"a user's weights")
    note = checkpoint.step_dir(finished, K) / "notes.txt"
    note.write_text("a note beside a checkpoint")
    _train(_cfg(finished, steps=K, checkpoint_every=0, overwrite=True))  # a fresh run, no checkpoints
    assert mine.read_bytes() == b"a user's weights" and note.read_text() == "a note beside a checkpoint"
    left = sorted(p.relative_to(finished).as_posix() for p in (finished / "checkpoints").rglob("*"))
    assert left == ["checkpoints/resnet50", "checkpoints/resnet50/epoch90.pth", f"checkpoints/step-{K:08d}",
                    f"checkpoints/step-{K:08d}/notes.txt"]


@pytest.mark.spawns
def test_a_run_without_checkpoints_over_a_foreign_checkpoints_folder_deletes_nothing(tmp_path):
    out = tmp_path / "proj"
    mine = out / "checkpoints" / "resnet50" / "epoch90.pth"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"weights")
    _train(_cfg(out, steps=K, checkpoint_every=0))  # no --overwrite needed: that folder is not a run's
    assert mine.read_bytes() == b"weights"
    with pytest.raises(ValueError, match="already holds a run"):  # the run it just wrote is one
        _cfg(out, steps=K)


@pytest.mark.spawns
def test_pruning_old_checkpoints_keeps_a_foreign_file_in_them(tmp_path):
    cfg = _cfg(tmp_path / "a", steps=K, checkpoint_every=1)
    note = checkpoint.step_dir(cfg.out, 1)
    note.mkdir(parents=True)
    (note / "keep.txt").write_text("mine")
    _train(cfg)  # writes 1..K, keeps the newest two: step 1's own files go, keep.txt stays
    assert sorted(p.name for p in note.iterdir()) == ["keep.txt"]


@pytest.mark.spawns
def test_a_folder_of_someone_elses_among_the_newest_does_not_cost_a_kept_checkpoint(tmp_path):
    cfg = _cfg(tmp_path / "a", steps=6, checkpoint_every=2)
    foreign = checkpoint.step_dir(cfg.out, 5)  # named like a checkpoint, never one
    foreign.mkdir(parents=True)
    (foreign / "keep.txt").write_text("mine")
    _train(cfg)  # checkpoints at 2, 4, 6: the newest two complete ones are 4 and 6
    for step in (4, 6):
        assert (checkpoint.step_dir(cfg.out, step) / "meta.json").is_file(), step
    assert not checkpoint.step_dir(cfg.out, 2).exists() and (foreign / "keep.txt").read_text() == "mine"


def test_a_checkpoint_directory_that_is_a_link_is_never_written_through_nor_removed(tmp_path):
    cfg = _cfg(tmp_path / "a", steps=K, checkpoint_every=K)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "rank-0.pt").write_bytes(b"a user's file that happens to have this name")
    checkpoint.root(cfg.out).mkdir(parents=True)
    link = checkpoint.step_dir(cfg.out, K)
    link.symlink_to(mine, target_is_directory=True)
    with pytest.raises(ValueError, match=f"checkpoints/{link.name} is a symbolic link"):
        cfg.resolve()  # refused before any rank starts
    with pytest.raises(outdir.ForeignFile, match="is a symbolic link"):
        _train(cfg)  # and by rank 0 itself, had the link appeared after the checks
    assert sorted(p.name for p in mine.iterdir()) == ["rank-0.pt"]
    assert (mine / "rank-0.pt").read_bytes() == b"a user's file that happens to have this name"
    assert link.is_symlink()


# -- 2: a run that did not train ends non-zero, in strict JSON -------------------------------------
def _strict(text: str):
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.spawns
def test_a_run_that_skipped_most_steps_is_diverged_names_the_parameter_and_writes_strict_json(tmp_path):
    cfg = _cfg(tmp_path / "a", steps=20, eval_every=10, checkpoint_every=0, lr=1e6, on_nonfinite="skip",
               optimizer="sgd")
    s = _train(cfg)[0]
    assert s.status == "diverged" and s.skipped_steps > 10
    first = s.first_nonfinite
    assert first["parameter"] in dict(_named(cfg)) and first["rank"] in (0, 1) and 1 <= first["step"] <= 20
    assert f"{s.skipped_steps} of 20 steps were skipped" in s.failure and first["parameter"] in s.failure
    assert s.compression_ratio == 1.0  # identity: what fp32 sends for the steps that communicated
    summary = _strict((Path(cfg.out) / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["final_loss"] is None
    assert summary["non_finite"]["final_loss"] == "nan"
    for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines():
        _strict(line)


def _named(cfg: TrainConfig):
    from thinwire.tasks import get

    return get(cfg.task)(seed=cfg.seed, **cfg.task_options).build_model().named_parameters()


@pytest.mark.spawns
def test_a_run_that_trains_is_ok(tmp_path):
    s = _train(_cfg(tmp_path / "a", checkpoint_every=0))[0]
    assert s.status == "ok" and s.failure is None and s.first_nonfinite is None
    assert Summary.read(str(tmp_path / "a" / "summary.json")) == s  # the file holds what the run returned


def test_finite_replaces_every_non_finite_figure_and_says_which():
    record = {"a": 1.5, "b": float("nan"), "c": {"d": float("-inf"), "e": [1.0, float("inf")]}, "f": "text"}
    out = metrics.finite(record)
    assert out == {"a": 1.5, "b": None, "c": {"d": None, "e": [1.0, None]}, "f": "text",
                   "non_finite": {"b": "nan", "c.d": "-inf", "c.e.1": "inf"}}
    json.dumps(out, allow_nan=False)
    assert math.isnan(record["b"])  # the caller's record is left as it was


# -- 7: local workers are bounded by the machine ------------------------------------------------
def test_more_workers_than_the_machine_holds_are_refused_and_max_workers_overrides(capsys, monkeypatch):
    monkeypatch.setattr(config, "_available_memory", lambda: 64e9)  # fixed: the limit must not move between reads
    limit, why = config.worker_limit()
    assert 1 <= limit <= config.WORKERS_PER_CORE * (os.cpu_count() or 1) and why
    _refused(capsys, ["train", "--workers", "100000"],
             "--workers 100000 is more local ranks than this machine can hold", f"at most {limit}", "--max-workers")
    _refused(capsys, ["compare", "--methods", "identity", "--workers", "100000", "--out", "/tmp/never-made"],
             "--max-workers")
    _refused(capsys, ["cost", "--workers", "100000"], "--max-workers")
    _refused(capsys, ["train", "--workers", "3", "--max-workers", "2"], "workers must be <= --max-workers 2, got 3")
    config.check_workers(limit + 1, max_workers=limit + 1)  # the user's own bound replaces the machine's


# -- 10: bad input that used to reach the ranks -------------------------------------------------
def test_bad_input_found_only_by_the_ranks_before_is_refused_before_they_start(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    _refused(capsys, ["train", *TASK, "--out", str(a_file)], f"--out {a_file} is a file, not a directory")
    _refused(capsys, ["train", *TASK, "--out", str(a_file / "run")], f"{a_file} is a file, not a directory")
    for value in ("inf", "nan", "-inf"):
        _refused(capsys, ["train", *TASK, f"--bucket-mb={value}"], "bucket-mb must be a finite number > 0")
        _refused(capsys, ["train", *TASK, f"--lr={value}"], "lr must be a finite number >= 0")
    assert a_file.read_text() == "not a directory"


def test_the_default_collective_timeout_keeps_the_promise_of_a_hang_ending_within_60_s(monkeypatch):
    from thinwire.comm import torch_dist

    monkeypatch.delenv(torch_dist.TIMEOUT_ENV, raising=False)
    assert torch_dist.collective_timeout() == torch_dist.COLLECTIVE_TIMEOUT_S == 50.0
    assert torch_dist.hang_limit() == torch_dist.HANG_LIMIT_S == 60.0
    monkeypatch.setenv(torch_dist.TIMEOUT_ENV, "3")  # the timeout set: the limit follows it, margins kept
    assert torch_dist.collective_timeout() == 3.0 and torch_dist.hang_limit() == 13.0


@pytest.mark.parametrize("name, value", [("THINWIRE_COLLECTIVE_TIMEOUT", "soon"), ("THINWIRE_STOP_GRACE", "0"),
                                         ("THINWIRE_STOP_GRACE", "inf")])
def test_a_bad_collective_timeout_or_stop_grace_in_the_environment_is_refused(monkeypatch, capsys, name, value):
    monkeypatch.setenv(name, value)
    _refused(capsys, ["train", *TASK], f"{name} must be a number of seconds > 0, got {value!r}")


def test_the_stop_grace_is_10_s_unless_the_environment_sets_it(monkeypatch):
    from thinwire.run import config

    monkeypatch.delenv(config.STOP_GRACE_ENV, raising=False)
    assert config.stop_grace() == config.STOP_GRACE_S == 10.0
    monkeypatch.setenv(config.STOP_GRACE_ENV, "2.5")
    assert config.stop_grace() == 2.5


@pytest.mark.spawns
def test_a_resumed_runs_failure_counts_from_its_checkpoint(finished):
    assert _start_step(_cfg(finished.parent / "b", steps=3 * K, resume=str(finished))) == 2 * K
    assert _start_step(_cfg(finished.parent / "c")) == 0


# -- 12: local ranks listen on this machine only ---------------------------------------------
def test_local_ranks_listen_on_the_loopback_interface_only(monkeypatch):
    import socket

    from thinwire.run import launch

    names = {name for _, name in socket.if_nameindex()}
    assert launch.loopback_interface() == next(n for n in ("lo", "lo0") if n in names)
    calls = []

    def record(*args, **kwargs):  # the rank's process group: capture the environment it starts in
        calls.append(os.environ.get("GLOO_SOCKET_IFNAME"))
        raise SystemExit  # stand in for the rest of the rank

    monkeypatch.setattr(launch.torch.distributed, "init_process_group", record)
    for key in ("GLOO_SOCKET_IFNAME", "RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the rank sets them: undone after
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(launch.torch, "set_num_threads", lambda n: None)  # this process's threads stay

    class Queue:
        def put(self, item):
            pass

        def close(self):
            pass

        def join_thread(self):
            pass

    monkeypatch.setattr(launch.os, "_exit", lambda code: None)
    monkeypatch.setattr(launch, "begin_rank", lambda env: None)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        launch._rank_main(0, TrainConfig(workers=2), "/nonexistent", Queue(), dict(os.environ))
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    assert calls == [launch.loopback_interface()]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # a user's own choice is kept
    try:
        launch._rank_main(0, TrainConfig(workers=2), "/nonexistent", Queue(), dict(os.environ))
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    assert calls[-1] == "eth7"


# -- 6: one signal counts once per delivery --------------------------------------------------
def test_a_repeated_signal_is_one_delivery_within_a_second_and_stops_at_once_after(monkeypatch, capsys):
    from thinwire.run import launch

    now = [100.0]
    monkeypatch.setattr(launch.time, "monotonic", lambda: now[0])
    asked, received = [], []
    restore = launch._on_stop_signals(asked.append, received)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # a wrapper: to the launcher, then to its whole group
        os.kill(os.getpid(), signal.SIGTERM)
        assert asked == [signal.SIGTERM] and received == ["SIGTERM"]
        now[0] += 0.9
        os.kill(os.getpid(), signal.SIGINT)  # still the same delivery's moment: ignored
        assert asked == [signal.SIGTERM]
        now[0] += 0.2
        with pytest.raises(KeyboardInterrupt):  # a second signal, a second later: stop at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # the handler runs at the next bytecode; this gives it one
    finally:
        restore()
    assert "stopping after the current step" in capsys.readouterr().err
    asked.clear()
    restore = launch._on_stop_signals(asked.append, [], escalate=False)  # under torchrun: repeats are ignored
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        now[0] += 5
        os.kill(os.getpid(), signal.SIGTERM)
        assert asked == [signal.SIGTERM]
    finally:
        restore()

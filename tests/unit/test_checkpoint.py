"""Checkpoints and exact resume: for every method in the registry, K steps + resume for K
steps end bit-identical to 2K straight steps; damaged, foreign and tampered checkpoints are
refused with a clear error while the previous one still loads."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from resumes import assert_same
from thinwire.algorithms.methods import method_names
from thinwire.comm.local import LocalWorld
from thinwire.peers.detonation_demo import detonation_available
from thinwire.run import checkpoint, outdir
from thinwire.run.checkpoint import CheckpointError
from thinwire.run.config import RunFinished, TrainConfig, from_options, merge_saved
from thinwire.run.trainer import train_rank

SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}
K = 4
# PyTorch's DDP hooks need a real process group: tests/distributed/test_resume_gloo.py
# every method but PyTorch's peers, and detonation's where it is installed (Python >= 3.11)
METHODS = sorted(n for n in method_names()
                 if not n.startswith("torch-") and (n != "peer-demo" or detonation_available()))
# schedules short enough that the checkpoint at step K falls inside them: AB-training mid group
# phase (factorised at step 1, synced at 6), DaSGD with an average in flight (launched at 4,
# merged at 6), local SGD between averages, streaming DiLoCo with a fragment in flight (fragment 0
# launched at step 4, merged at 5)
SHORT = {"ab": "ab:warmup=1,cycle=6,full_steps=1", "dasgd": "dasgd:warmup=1,period=3,delay=2",
         "localsgd": "localsgd:warmup=1,period=3", "diloco": "diloco:warmup=1,period=2",
         "streaming-diloco": "streaming-diloco:warmup=1,period=3,fragments=2,delay=1",
         "sparseloco": "sparseloco:warmup=1,period=3"}


def _cfg(tmp: Path, method: str, **kw) -> TrainConfig:
    base = dict(task="synthetic", method=method, workers=2, steps=2 * K, eval_every=K, out=str(tmp / "a"),
                checkpoint_every=K, task_options=SMALL, batch_size=16)
    base.update(kw)
    return TrainConfig(**base).resolve()


def _train(cfg: TrainConfig) -> list:
    return LocalWorld(cfg.workers).run(lambda comm: train_rank(cfg, comm))


def _state(out: Path, step: int, rank: int) -> dict:
    return checkpoint.load_rank(checkpoint.step_dir(out, step), rank)


@pytest.mark.spawns
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", METHODS)
def test_k_steps_and_a_resume_end_bit_identical_to_2k_straight_steps(name, tmp_path):
    cfg = _cfg(tmp_path, SHORT.get(name, name))
    straight = _train(cfg)[0]
    resumed_cfg = dataclasses.replace(cfg, out=str(tmp_path / "b"), resume=str(checkpoint.step_dir(cfg.out, K)))
    resumed = _train(resumed_cfg)[0]
    for rank in range(cfg.workers):
        a, b = _state(Path(cfg.out), 2 * K, rank), _state(tmp_path / "b", 2 * K, rank)
        for part in ("model", "optimizer", "meter", "rng"):
            assert_same(a[part], b[part], f"rank {rank} {part}", clocks=False)
        # everything of the method's but DaSGD's warm-up clock readings (they size delay=auto)
        assert_same({k: v for k, v in a["method"].items() if k != "warm"},
                     {k: v for k, v in b["method"].items() if k != "warm"}, f"rank {rank} method", clocks=False)
        # clocks differ: times, and DaSGD's hidden fraction (a ratio of two of them)
        untimed = lambda ev: {k: v for k, v in ev.items() if "seconds" not in k and k != "hidden_fraction"}  # noqa: E731
        assert_same(untimed(a["last_eval"]), untimed(b["last_eval"]), f"rank {rank} last_eval", clocks=False)
    for key in ("final_loss", "final_accuracy", "bytes_sent_per_worker", "messages_per_worker"):
        assert getattr(resumed, key) == getattr(straight, key), key
    assert resumed.resumed_from == K and straight.resumed_from is None
    # the resumed run's metrics hold the whole history, as the straight run's do
    rows = lambda out: [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert [r["step"] for r in rows(resumed_cfg.out)] == [r["step"] for r in rows(cfg.out)] == [K, 2 * K]
    assert [r["train_loss"] for r in rows(resumed_cfg.out)] == [r["train_loss"] for r in rows(cfg.out)]


@pytest.mark.spawns
def test_resume_into_its_own_directory_continues_there(tmp_path):
    cfg = _cfg(tmp_path, "topk:ratio=0.1", steps=K)
    _train(cfg)
    more = _cfg(tmp_path, "topk:ratio=0.1", resume=cfg.out)  # its own --out: no --overwrite needed
    summary = _train(more)[0]
    assert summary.steps == 2 * K and summary.resumed_from == K
    latest = json.loads((Path(cfg.out) / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == 2 * K
    assert sorted(p.name for p in (Path(cfg.out) / "checkpoints").glob("step-*")) == [
        f"step-{K:08d}", f"step-{2 * K:08d}"]  # the newest two are kept


@pytest.mark.spawns
def test_only_the_newest_checkpoints_are_kept(tmp_path):
    cfg = _cfg(tmp_path, "identity", steps=4 * K, checkpoint_every=K)
    _train(cfg)
    kept = sorted(p.name for p in (Path(cfg.out) / "checkpoints").glob("step-*"))
    assert kept == [f"step-{3 * K:08d}", f"step-{4 * K:08d}"]


@pytest.mark.spawns
def test_a_damaged_checkpoint_is_refused_and_the_previous_one_still_loads(tmp_path):
    cfg = _cfg(tmp_path, "identity")
    _train(cfg)
    newest = checkpoint.step_dir(cfg.out, 2 * K) / "rank-1.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    more = dataclasses.replace(cfg, steps=3 * K, resume=cfg.out, out=str(tmp_path / "c"))
    with pytest.raises(CheckpointError, match=r"rank-1.pt is damaged \(\d+ bytes, \d+ when written\)"):
        _train(more)
    older = dataclasses.replace(more, resume=str(checkpoint.step_dir(cfg.out, K)))
    assert _train(older)[0].resumed_from == K


@pytest.mark.spawns
def test_a_crash_mid_write_leaves_the_previous_checkpoint_in_charge(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "identity")
    _train(cfg)
    states = [_state(Path(cfg.out), 2 * K, r) for r in range(2)]
    meta = checkpoint.read_meta(checkpoint.step_dir(cfg.out, 2 * K))

    def save_then_die(obj, f):  # the disk fills half-way through a rank's file
        f.write(b"PK\x03\x04 partial")
        raise OSError("No space left on device")

    with monkeypatch.context() as m:
        m.setattr(torch, "save", save_then_die)
        with pytest.raises(OSError):
            checkpoint.write_rank(cfg.out, 3 * K, 0, states[0])
    assert not (checkpoint.step_dir(cfg.out, 3 * K) / "rank-0.pt").exists()  # only the temporary file
    assert checkpoint.locate(cfg.out) == checkpoint.step_dir(cfg.out, 2 * K)

    for r in range(2):  # every rank's file written, then rank 0 is killed while committing
        checkpoint.write_rank(cfg.out, 3 * K, r, states[r])
    real_replace = os.replace

    def killed_at_latest(src, dst):
        if Path(dst).name == checkpoint.LATEST:
            raise KeyboardInterrupt
        return real_replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", killed_at_latest)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.commit(cfg.out, 3 * K, meta)
    assert checkpoint.locate(cfg.out) == checkpoint.step_dir(cfg.out, 2 * K)
    assert checkpoint.load_rank(checkpoint.locate(cfg.out), 1)["step"] == 2 * K


@pytest.mark.spawns
def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "identity")
    _train(cfg)
    target = checkpoint.step_dir(cfg.out, 2 * K) / "rank-0.pt"
    torch.save({"format": checkpoint.FORMAT, "rank": 0, "payload": Path("/")}, target)  # an object, not weights
    meta_path = target.parent / "meta.json"  # one who can write both files: the checksum matches
    meta = json.loads(meta_path.read_text())
    meta["files"]["rank-0.pt"] = checkpoint.file_record(target)
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="holds objects other than tensors and plain containers") as e:
        checkpoint.load_rank(target.parent, 0)
    assert "weights_only" not in str(e.value) and "\n" not in str(e.value)  # never torch's advice to load it anyway


@pytest.mark.parametrize("change, message", [
    ({"method": "bf16"}, "different run: method identity"),
    ({"workers": 4}, "world size 2 (this run: 4)"),
    ({"task_options": dict(SMALL, hidden=16)}, "task options"),
    ({"steps": 2 * K}, "nothing left to train"),
    ({"seed": 3}, "seed 0 (this run: 3)"),
    ({"batch_size": 8}, "batch size 16 (this run: 8)"),
    ({"optimizer": "adam"}, "optimizer sgd (this run: adam)"),
    ({"lr": 0.5}, "learning rate 0.05 (this run: 0.5)"),
])
@pytest.mark.spawns
def test_a_checkpoint_from_another_run_says_what_differs(change, message, tmp_path):
    cfg = _cfg(tmp_path, "identity")
    _train(cfg)
    other = _cfg(tmp_path, **{"method": "identity", "steps": 3 * K, **change, "out": str(tmp_path / "d")})
    meta = checkpoint.read_meta(checkpoint.locate(cfg.out))
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checkpoint.check_matches(meta, workers=other.workers, task=other.task, method=other.method,
                                 steps=other.steps, task_options=other.task_options, seed=other.seed,
                                 batch_size=other.batch_size, optimizer=other.optimizer, lr=other.lr)


def test_locate_names_what_is_missing(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        checkpoint.locate(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        checkpoint.locate(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="latest.json is damaged"):
        checkpoint.locate(tmp_path)


def test_an_earlier_longer_runs_checkpoints_never_outlive_a_new_commit(tmp_path):
    out = tmp_path / "run"
    for step in (900, 1000):  # left by an earlier, longer run (its manifest records them)
        d = checkpoint.step_dir(out, step)
        d.mkdir(parents=True)
        (d / "meta.json").write_text("{}")
        outdir.record(out, d)
    checkpoint.step_dir(out, 100).mkdir()
    (checkpoint.step_dir(out, 100) / "rank-0.pt").write_bytes(b"an earlier run's file")
    outdir.record(out, checkpoint.step_dir(out, 100))
    theirs = checkpoint.step_dir(out, 1100)  # named like one, but no thinwire run made it
    theirs.mkdir()
    (theirs / "meta.json").write_text("mine")
    checkpoint.prepare(out, 100)  # rank 0, before anyone writes step 100
    assert not (checkpoint.step_dir(out, 100) / "rank-0.pt").exists()
    checkpoint.write_rank(out, 100, 0, {"format": checkpoint.FORMAT, "rank": 0})
    checkpoint.commit(out, 100, {"world_size": 1, "task": "t", "method": "m"})
    assert checkpoint.locate(out) == checkpoint.step_dir(out, 100)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-00000100", "step-00001100"]
    assert (theirs / "meta.json").read_text() == "mine"


@pytest.mark.spawns
def test_resuming_in_place_from_an_older_checkpoint_needs_overwrite(tmp_path):
    cfg = _cfg(tmp_path, "identity")  # checkpoints at K and 2K, a summary of 2K steps
    _train(cfg)
    older = dict(task="synthetic", workers=2, steps=3 * K, task_options=SMALL, batch_size=16,
                 resume=str(checkpoint.step_dir(cfg.out, K)))
    with pytest.raises(ValueError, match=f"from step {K} would replace its checkpoint at step {2 * K}; "
                                         "pass --overwrite, or write elsewhere with --out"):
        TrainConfig(**older).resolve()
    (Path(cfg.out) / "checkpoints" / "latest.json").unlink()  # a finished run whose newest pointer is gone
    with pytest.raises(ValueError, match=f"would replace the summary of its finished {2 * K}-step run"):
        TrainConfig(**older).resolve()
    assert TrainConfig(**older, overwrite=True).resolve().out == cfg.out
    assert TrainConfig(**older, out=str(tmp_path / "elsewhere")).resolve().resume == older["resume"]


@pytest.mark.spawns
def test_resuming_elsewhere_replaces_the_old_checkpoints_there(tmp_path):
    cfg = _cfg(tmp_path, "identity")
    _train(cfg)
    other = _cfg(tmp_path, "identity", steps=5 * K, out=str(tmp_path / "b"))
    _train(other)  # checkpoints at 4K and 5K in b
    _train(dataclasses.replace(cfg, steps=3 * K, resume=cfg.out, out=other.out, overwrite=True))
    assert sorted(p.name for p in (Path(other.out) / "checkpoints").glob("step-*")) == [f"step-{3 * K:08d}"]


@pytest.mark.spawns
def test_a_copied_checkpoint_needs_an_out(tmp_path):
    cfg = _cfg(tmp_path, "identity")
    _train(cfg)
    import shutil

    shutil.copytree(checkpoint.step_dir(cfg.out, K), tmp_path / "copy")
    with pytest.raises(ValueError, match="not inside a run's checkpoints/ directory: say where to write with --out"):
        TrainConfig(task="synthetic", workers=2, steps=3 * K, task_options=SMALL, batch_size=16,
                    resume=str(tmp_path / "copy")).resolve()
    ok = TrainConfig(task="synthetic", workers=2, steps=3 * K, task_options=SMALL, batch_size=16,
                     resume=str(tmp_path / "copy"), out=str(tmp_path / "next")).resolve()
    assert _train(ok)[0].resumed_from == K


@pytest.mark.spawns
def test_a_fresh_run_over_an_old_one_starts_without_its_checkpoints(tmp_path):
    cfg = _cfg(tmp_path, "identity", steps=3 * K)
    _train(cfg)
    again = _cfg(tmp_path, "identity", steps=K, overwrite=True)
    _train(again)
    assert sorted(p.name for p in (Path(cfg.out) / "checkpoints").glob("step-*")) == [f"step-{K:08d}"]


# -- a resume continues the run's own settings --------------------------------------------------
SETTINGS = dict(task="synthetic", method="topk:ratio=0.1", workers=2, steps=K, eval_every=2, task_options=SMALL,
                batch_size=16, lr=0.02, optimizer="adam", seed=3, links=("1gbit,50us",), bucket_mb=1.0, threads=1,
                checkpoint_every=2, on_nonfinite="skip")


@pytest.mark.spawns
def test_a_resume_takes_every_setting_not_given_from_its_checkpoint(tmp_path):
    first = from_options(dict(SETTINGS, out=str(tmp_path / "a"))).resolve()
    _train(first)
    resumed = from_options({"resume": first.out, "steps": 2 * K}).resolve()  # --resume DIR --steps 2K, nothing else
    keep = set(SETTINGS) - {"steps"}
    assert {k: getattr(resumed, k) for k in keep} == {k: getattr(first, k) for k in keep}
    assert resumed.out == first.out and resumed.steps == 2 * K
    summary = _train(resumed)[0]
    assert summary.checkpoints_written == K // 2 and summary.config["checkpoint_every"] == 2
    assert json.loads((Path(first.out) / "checkpoints" / "latest.json").read_text())["step"] == 2 * K


@pytest.mark.parametrize("given, field, value", [
    ({"checkpoint_every": 1}, "checkpoint_every", 1),
    ({"checkpoint_every": 0}, "checkpoint_every", 0),
    ({"links": ("100mbit,1ms",)}, "links", ("100mbit,1ms",)),
    ({"eval_every": 3}, "eval_every", 3),
    ({"on_nonfinite": "raise"}, "on_nonfinite", "raise"),
    ({"task_options": {"hidden": 32}}, "task_options", SMALL),  # merged into the run's own
    ({"method": "topk:ef=true,ratio=0.1"}, "method", None),  # written otherwise, resolves to the run's own spec
])
@pytest.mark.spawns
def test_an_option_given_again_on_a_resume_replaces_the_saved_one(given, field, value, tmp_path):
    first = from_options(dict(SETTINGS, out=str(tmp_path / "a"))).resolve()
    _train(first)
    resumed = from_options({"resume": first.out, "steps": 2 * K, **given}).resolve()
    assert getattr(resumed, field) == (value if field != "method" else first.method)


@pytest.mark.parametrize("given, message", [
    ({"seed": 5}, "seed 3 (this run: 5)"),
    ({"lr": 0.5}, "learning rate 0.02 (this run: 0.5)"),
    ({"method": "topk:ratio=0.2"}, "different run: method topk"),
    ({"task_options": {"hidden": 16}}, "task options"),
    ({"workers": 4}, "world size 2 (this run: 4)"),
    ({"steps": K}, "nothing left to train"),  # elsewhere (--out): the checkpoint is at the total already
])
@pytest.mark.spawns
def test_an_option_given_again_is_still_checked_against_the_checkpoint(given, message, tmp_path):
    first = from_options(dict(SETTINGS, out=str(tmp_path / "a"))).resolve()
    _train(first)
    options = {"resume": first.out, "steps": 2 * K, "out": str(tmp_path / "b"), **given}
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        from_options(options).resolve()


def test_a_policy_run_resumes_with_its_rules_and_a_method_given_replaces_them():
    saved = {"method": "policy[...]", "policy": "/gone/policy.toml", "policy_rules": [{"codec": "identity"}],
             "links": ["1gbit,50us"], "out": "/runs/a", "resume": None, "overwrite": True, "seed": 3}
    kept = merge_saved(saved, {"resume": "/runs/a"})
    assert (kept["policy"] is None and kept["policy_rules"] == ({"codec": "identity"},)
            and kept["links"] == ("1gbit,50us",))
    assert "out" not in kept and "overwrite" not in kept and kept["seed"] == 3  # where to write: each command's own
    for given in ({"method": "topk"}, {"policy": "/new/policy.toml"}):
        merged = merge_saved(saved, {"resume": "/runs/a", **given})
        assert not {"method", "policy", "policy_rules"} - set(given) & set(merged), merged


@pytest.mark.spawns
def test_resuming_a_finished_run_in_place_is_nothing_to_do(tmp_path):
    first = from_options(dict(SETTINGS, out=str(tmp_path / "a"))).resolve()
    _train(first)
    before = {p: p.read_bytes() for p in Path(first.out).rglob("*") if p.is_file()}
    with pytest.raises(RunFinished, match=f"already finished its {K} steps"):
        from_options({"resume": first.out, "steps": K}).resolve()
    with pytest.raises(RunFinished):  # --steps left out: the run's own total
        from_options({"resume": first.out}).resolve()
    assert {p: p.read_bytes() for p in Path(first.out).rglob("*") if p.is_file()} == before


@pytest.mark.spawns
def test_the_last_step_is_checkpointed_so_a_finished_run_extends_from_its_end(tmp_path):
    cfg = _cfg(tmp_path, "identity", steps=K + 1)  # every K: at K, and at the last step K + 1
    assert _train(cfg)[0].checkpoints_written == 2
    assert checkpoint.locate(cfg.out) == checkpoint.step_dir(cfg.out, K + 1)
    longer = _train(from_options({"resume": cfg.out, "steps": 2 * K}).resolve())[0]
    assert longer.resumed_from == K + 1 and longer.steps_run == K - 1


@pytest.mark.spawns
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", METHODS)
def test_extending_a_finished_run_ends_bit_identical_to_the_straight_run(name, tmp_path):
    """A run of K steps checkpoints its last step before the method's end-of-run work
    (streaming DiLoCo's merge of the fragments in flight, AB-training's final sync), so
    extending it to 2K steps retraces the straight 2K-step run bit for bit."""
    straight_cfg = _cfg(tmp_path, SHORT.get(name, name), checkpoint_every=2 * K)
    straight = _train(straight_cfg)[0]
    finished_cfg = _cfg(tmp_path, SHORT.get(name, name), steps=K, out=str(tmp_path / "k"))
    _train(finished_cfg)
    longer = _train(from_options({"resume": finished_cfg.out, "steps": 2 * K}).resolve())[0]
    assert longer.resumed_from == K
    for rank in range(straight_cfg.workers):
        a, b = _state(Path(straight_cfg.out), 2 * K, rank), _state(tmp_path / "k", 2 * K, rank)
        for part in ("model", "optimizer"):
            assert_same(a[part], b[part], f"rank {rank} {part}", clocks=False)
        assert_same({k: v for k, v in a["method"].items() if k != "warm"},
                     {k: v for k, v in b["method"].items() if k != "warm"}, f"rank {rank} method", clocks=False)
    for key in ("final_loss", "final_accuracy", "bytes_sent_per_worker"):
        assert getattr(longer, key) == getattr(straight, key), key


def test_a_sharded_groups_folders_are_removed_with_their_checkpoint_but_nobody_elses_file(tmp_path):
    out = tmp_path / "run"
    checkpoint.prepare(out, 4, groups=2)
    d = checkpoint.step_dir(out, 4)
    for k in (0, 1):  # what torch.distributed.checkpoint writes into a group's folder
        for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
            (d / f"group-{k}" / name).write_bytes(b"x")
    (d / "group-1" / "notes.txt").write_text("mine")  # someone else's file in thinwire's folder
    (d / "rank-0.pt").write_bytes(b"x")
    checkpoint.remove_step(d)
    assert not (d / "group-0").exists()
    assert sorted(p.name for p in (d / "group-1").iterdir()) == ["notes.txt"]


def test_a_sharded_groups_files_are_checked_before_they_are_read(tmp_path):
    out = tmp_path / "run"
    checkpoint.prepare(out, 4, groups=1)
    g = checkpoint.group_dir(out, 4, 0)
    (g / ".metadata").write_bytes(b"meta")
    (g / "__0_0.distcp").write_bytes(b"shard")
    records = {p.name: checkpoint.file_record(p) for p in g.iterdir()}
    (g / "__0_0.distcp").write_bytes(b"shard!")  # changed after it was recorded
    with pytest.raises(CheckpointError, match="__0_0.distcp"):
        checkpoint.load_group(checkpoint.step_dir(out, 4), 0, {}, None, records)
    with pytest.raises(CheckpointError, match="group-1 is missing"):
        checkpoint.load_group(checkpoint.step_dir(out, 4), 1, {}, None, records)
    (g / "__1_0.distcp").write_bytes(b"extra")
    with pytest.raises(CheckpointError, match="group-0 holds"):
        checkpoint.load_group(checkpoint.step_dir(out, 4), 0, {}, None, records)


@pytest.mark.parametrize("saved, ours, message", [
    ({"ranks_per_node": 2, "shard": True}, (2, False), "worker groups of 2 rank(s), sharded (this run: of 2 rank(s), "
                                                       "replicated)"),
    ({"ranks_per_node": 2, "shard": True}, (4, True), "(this run: of 4 rank(s), sharded)"),
    ({"ranks_per_node": 2}, (2, True), "worker groups of 2 rank(s), replicated (this run: of 2 rank(s), sharded)"),
    ({}, (2, True), "worker groups of 1 rank (this run: of 2 rank(s), sharded)"),
])
def test_a_sharded_checkpoint_resumes_only_with_its_own_layout(saved, ours, message):
    meta = {"world_size": 4, "task": "text", "method": "identity", "config": saved}
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checkpoint.check_same_run(meta, workers=4, task="text", method="identity", groups=ours)
    checkpoint.check_same_run(meta, workers=4, task="text", method="identity",
                              groups=(int(saved.get("ranks_per_node", 1)), bool(saved.get("shard"))))

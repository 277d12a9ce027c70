"""An output folder: thinwire replaces or deletes only what its manifest records, one run holds
a folder at a time, and the files it reads back, the knobs it parses and the --out it is given
are checked before any rank starts (one line, exit 2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clicheck import files as _files
from clicheck import refused as _refused
from thinwire import jsonfile
from thinwire.cli import main
from thinwire.comm.local import LocalWorld
from thinwire.run import checkpoint, outdir
from thinwire.run.config import TrainConfig
from thinwire.run.trainer import train_rank

SMALL = ["--task", "synthetic", "--option", "dim=24", "--option", "hidden=32", "--option", "classes=4",
         "--option", "samples=256", "--option", "test_samples=64", "--batch-size", "16", "--quiet"]
K = 4




def _train(out: Path, *extra: str) -> int:
    """The command itself: spawned ranks, the lock, the checks before them."""
    return main(["train", *SMALL, "--steps", str(K), "--eval-every", str(K), "--out", str(out), *extra])


def _run(out: Path, **kw) -> None:
    """The same run in this process (quicker): what its rank 0 writes."""
    base = dict(task="synthetic", workers=2, steps=K, eval_every=K, out=str(out), batch_size=16, tensorboard=True,
                task_options={"dim": 24, "hidden": 32, "classes": 4, "samples": 256, "test_samples": 64})
    cfg = TrainConfig(**{**base, **kw}).resolve()
    LocalWorld(2).run(lambda comm: train_rank(cfg, comm))


# -- 1. a user's file is never deleted or replaced -------------------------------------------------
@pytest.mark.spawns
def test_a_users_event_file_survives_a_run_and_an_overwrite_while_thinwires_own_is_replaced(tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    theirs = out / "events.out.tfevents.1700000000.userhost.4242.0"
    theirs.write_bytes(b"x\n")
    assert _train(out) == 0
    first = [p for p in out.glob("events.out.tfevents.*") if p != theirs]
    assert len(first) == 1 and outdir.owns(out, first[0].name)
    _run(out, overwrite=True)
    second = [p for p in out.glob("events.out.tfevents.*") if p != theirs]
    assert len(second) == 1 and second != first  # thinwire's earlier one went, its new one is recorded
    assert outdir.owns(out, second[0].name) and not outdir.owns(out, first[0].name)
    assert theirs.read_bytes() == b"x\n" and not outdir.owns(out, theirs.name)


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl", "checkpoints/latest.json",
                                  "checkpoints/step-00000004/rank-0.pt"])
def test_overwrite_never_replaces_a_file_thinwire_did_not_write(name, tmp_path, capsys):
    out = tmp_path / "d"
    (out / name).parent.mkdir(parents=True)
    (out / name).write_bytes(b"mine")
    before = _files(out)
    _refused(capsys, ["train", *SMALL, "--steps", str(K), "--out", str(out), "--overwrite", "--checkpoint-every",
                      str(K)], f"{name} was not written by thinwire")
    assert _files(out) == before  # nothing written, not even the lock or a manifest


def test_a_file_of_thinwires_name_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, capsys):
    out, target = tmp_path / "d", tmp_path / "precious.txt"
    out.mkdir()
    target.write_text("keep\n")
    (out / "summary.json").symlink_to(target)
    _refused(capsys, ["train", *SMALL, "--steps", str(K), "--out", str(out), "--overwrite"],
             "summary.json is a symbolic link")
    assert target.read_text() == "keep\n" and (out / "summary.json").is_symlink()


def test_claim_records_before_writing_and_remove_touches_only_recorded_files(tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(outdir.ForeignFile, match="notes.txt was not written by thinwire"):
        outdir.claim(out, "notes.txt")
    assert not outdir.remove(out, "notes.txt") and (out / "notes.txt").read_text() == "mine"
    outdir.claim(out, "report.md")
    assert outdir.owns(out, "report.md") and not (out / "report.md").exists()  # recorded first
    (out / "report.md").write_text("thinwire's")
    outdir.claim(out, "report.md")  # its own: may be replaced
    assert outdir.remove(out, out / "report.md") and not (out / "report.md").exists()
    assert not outdir.owns(out, "report.md")
    made = outdir.mkdir(out, "sub")
    (made / "theirs.txt").write_text("x")
    assert not outdir.rmdir(out, "sub") and (made / "theirs.txt").exists()  # never a folder with others' files


@pytest.mark.spawns
def test_a_damaged_manifest_is_one_line_naming_it(tmp_path, capsys):
    out = tmp_path / "d"
    _run(out)
    (out / outdir.MANIFEST).write_text("[" * 5000 + "]" * 5000)
    _refused(capsys, ["train", *SMALL, "--steps", str(K), "--out", str(out), "--overwrite"],
             outdir.MANIFEST, "nests 5000 levels deep", "cannot tell its files")


def test_bench_outputs_never_replace_a_users_file(tmp_path, capsys):
    target = tmp_path / "table.md"
    target.write_text("mine\n")
    _refused(capsys, ["bench", "memory", "--methods", "identity", "--steps", "1", "--out", str(target)],
             "table.md exists; thinwire writes a new file only")
    assert main(["bench", "consensus", "--quick", "--out", str(target)]) == 2
    assert "table.md exists" in capsys.readouterr().err
    assert target.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["table.md"]
    with pytest.raises(outdir.ForeignFile, match="appeared while thinwire ran"):
        outdir.write_new(target, "new")
    outdir.write_new(tmp_path / "fresh.md", "new\n")
    assert (tmp_path / "fresh.md").read_text() == "new\n"


@pytest.mark.parametrize("text, needle", [("[]", "is not a thinwire manifest"),
                                          ('{"format": 1, "files": "x"}', "is not a thinwire manifest"),
                                          ("{", "is not valid JSON")])
def test_a_manifest_that_is_not_one_is_one_line(text, needle, tmp_path, capsys):
    out = tmp_path / "d"
    out.mkdir()
    (out / outdir.MANIFEST).write_text(text)
    _refused(capsys, ["train", *SMALL, "--steps", str(K), "--out", str(out)], needle)


@pytest.mark.parametrize("make, needle", [
    (lambda out: (out / outdir.LOCK).mkdir(), "is not a file: thinwire keeps its lock there"),
    (lambda out: (out / outdir.LOCK).write_text("someone's notes"), "was not written by thinwire"),
    (lambda out: (out / "summary.json").mkdir(), "summary.json is not a file"),
    (lambda out: (out / "checkpoints").symlink_to(out.parent), "checkpoints is a symbolic link"),
])
def test_what_stands_in_the_way_of_the_lock_or_the_outputs_is_one_line(make, needle, tmp_path, capsys):
    out = tmp_path / "d"
    out.mkdir()
    make(out)
    before = sorted(p.name for p in out.iterdir())
    _refused(capsys, ["train", *SMALL, "--steps", str(K), "--out", str(out), "--checkpoint-every", "2"], needle)
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.spawns
def test_pruning_and_clearing_leave_a_checkpoint_named_folder_thinwire_did_not_make(tmp_path):
    cfg = TrainConfig(task="synthetic", workers=2, steps=2 * K, eval_every=K, out=str(tmp_path / "a"),
                      checkpoint_every=1, task_options={"dim": 24, "hidden": 32, "classes": 4, "samples": 256,
                                                        "test_samples": 64}, batch_size=16).resolve()
    LocalWorld(2).run(lambda comm: train_rank(cfg, comm))
    assert {p.name for p in checkpoint.root(cfg.out).iterdir()} == {"latest.json", "step-00000007", "step-00000008"}
    users = checkpoint.step_dir(cfg.out, 3)  # a folder named like one, made after the run
    users.mkdir()
    checkpoint.clear(cfg.out)
    assert sorted(p.name for p in checkpoint.root(cfg.out).iterdir()) == ["step-00000003"]


# -- 2. one run at a time in a folder --------------------------------------------------------------
HOLD = """
import sys, time
from thinwire.run import outdir
with outdir.hold(sys.argv[1], command="holder-under-test"):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.mark.spawns
def test_a_folder_in_use_is_refused_naming_its_holder_and_a_killed_holder_is_named_on_take_over(tmp_path, capsys):
    out = tmp_path / "d"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        _refused(capsys, ["train", *SMALL, "--steps", str(K), "--out", str(out)],
                 f"--out {out} is in use by another thinwire run", f"pid {holder.pid}", "holder-under-test")
        _refused(capsys, ["compare", *SMALL, "--methods", "identity", "--steps", str(K), "--out", str(out)],
                 "is in use by another thinwire run", f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    assert _train(out) == 0  # the kernel dropped the dead holder's lock
    err = capsys.readouterr().err
    assert f"previous holder of its lock (pid {holder.pid}" in err and "ended without releasing it" in err
    assert not (out / outdir.LOCK).exists()  # a holder that ends normally removes it


@pytest.mark.spawns
def test_two_runs_started_together_on_one_out_one_runs_and_the_other_is_refused(tmp_path):
    out = tmp_path / "X"
    cmd = [sys.executable, "-m", "thinwire", "train", *SMALL, "--steps", "40", "--checkpoint-every", "20",
           "--out", str(out)]
    procs = [subprocess.Popen(cmd + ["--seed", str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for seed in (0, 4)]
    results = [(p.wait(timeout=240), p.stderr.read() if p.stderr else "") for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "is in use by another thinwire run" in refused and len(refused.strip().splitlines()) == 1
    winner = next(p for p, (code, _) in zip(procs, results) if code == 0)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["seed"] == (0 if winner is procs[0] else 4)
    assert len(list(out.glob("events.out.tfevents.*"))) <= 1  # one run's files only


def test_a_refused_command_leaves_a_new_folder_uncreated(tmp_path, capsys):
    out = tmp_path / "new" / "deeper"
    _refused(capsys, ["train", *SMALL, "--method", "nosuchmethod", "--out", str(out)], "nosuchmethod")
    assert not (tmp_path / "new").exists()


# -- 6. JSON read back with a depth and a size bound -----------------------------------------------
@pytest.mark.spawns
def test_deeply_nested_json_is_refused_in_one_line(tmp_path, capsys):
    deep = "[" * 100000 + "]" * 100000
    _run(tmp_path / "run", checkpoint_every=K)
    for name in ("checkpoints/latest.json", "summary.json", "meta"):
        out = tmp_path / name.replace("/", "_")
        shutil.copytree(tmp_path / "run", out)
        path = checkpoint.step_dir(out, K) / "meta.json" if name == "meta" else out / name
        path.write_text(deep)
        _refused(capsys, ["train", "--resume", str(out), "--steps", str(2 * K)], "nests 100000 levels deep")


def test_json_reading_bounds_depth_and_size(tmp_path):
    assert jsonfile.depth('{"a": [1, {"b": "[[[["}]}') == 3  # brackets inside strings do not count
    assert jsonfile.loads('{"a": [[1]]}', "x") == {"a": [[1]]}
    with pytest.raises(jsonfile.JsonFileError, match="nests 65 levels deep"):
        jsonfile.loads("[" * 65 + "]" * 65, "x")
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 600 + "0]")
    with pytest.raises(jsonfile.JsonFileError, match="larger than"):
        jsonfile.read(big, max_bytes=1000)
    lines = tmp_path / "m.jsonl"
    lines.write_text('{"step": 1}\n\n' + "[" * 80 + "]" * 80 + "\n")
    with pytest.raises(jsonfile.JsonFileError, match="line 3 nests 80 levels deep"):
        jsonfile.read_lines(lines)


# -- 7. float knobs: finite and within float32 -----------------------------------------------------
@pytest.mark.parametrize("spec, needle", [
    ("diloco:outer_lr=inf", "outer_lr must be a finite number"),
    ("streaming-diloco:outer_lr=inf", "outer_lr must be a finite number"),
    ("powergossip:gamma=inf", "gamma must be a finite number"),
    ("diloco:outer_lr=nan", "outer_lr must be a finite number"),
    ("diloco:outer_lr=1e308", "outer_lr must be within float32's range"),
    ("diloco:outer_lr=-1e39", "outer_lr must be within float32's range"),
    ("topk:ratio=1e999", "ratio must be a finite number"),
])
def test_a_float_knob_that_is_not_finite_or_beyond_float32_is_refused_at_parse_time(spec, needle, capsys):
    _refused(capsys, ["train", *SMALL, "--method", spec, "--steps", "1"], needle)


# -- 8. --out resolved before the ranks start ------------------------------------------------------
def test_a_dangling_symlink_out_is_refused_naming_where_it_points(tmp_path, capsys):
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "nowhere")
    _refused(capsys, ["train", *SMALL, "--steps", "1", "--out", str(link)],
             f"{link} is a symbolic link to {tmp_path / 'nowhere'}, which does not exist")
    _refused(capsys, ["train", *SMALL, "--steps", "1", "--out", str(link / "sub")], "which does not exist")
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()


@pytest.mark.spawns
def test_a_symlink_out_to_a_directory_is_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "out").symlink_to(real)
    assert _train(tmp_path / "out") == 0
    assert (real / "summary.json").is_file() and outdir.owns(real, "summary.json")


@pytest.mark.spawns
def test_lock_is_reentrant_in_one_process_and_refused_from_another(tmp_path):
    out = tmp_path / "d"
    with outdir.hold(out, command="outer"):
        with outdir.hold(out):
            assert outdir.held(out)
        assert outdir.held(out) and outdir.holder(out)["command"] == "outer"
        code = subprocess.run([sys.executable, "-c", "import sys; from thinwire.run import outdir\n"
                               "try:\n    outdir.hold(sys.argv[1]).__enter__()\nexcept outdir.OutputLocked as e:\n"
                               "    print(e); sys.exit(3)", str(out)], capture_output=True, text=True)
        assert code.returncode == 3 and f"pid {os.getpid()}" in code.stdout and "`outer`" in code.stdout
    assert not outdir.held(out) and not out.exists()  # nothing was written: the folder made for the lock went

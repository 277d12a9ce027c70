"""The `text` task: corpora of the user's own (a file, a folder, a nanoGPT token file) and the
bundled default (the stdlib's source); windows dealt disjointly, each once an epoch,
resumable; the split by file; the figures a run records; one-line errors for bad input."""

from __future__ import annotations

import builtins
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from thinwire import tasks
from thinwire.comm.local import LocalWorld
from thinwire.run.config import TrainConfig
from thinwire.run.trainer import train_rank
from thinwire.tasks import TaskError
from thinwire.tasks import text as text_mod
from thinwire.tasks.base import index_batches
from thinwire.tasks.charlm import TinyTransformer
from thinwire.tasks.text import Text

SMALL = dict(context=8, d_model=16, heads=2, layers=1)
T = 8  # SMALL's context


def make(data=None, **options):
    return Text(seed=0, data_dir=None if data is None else str(data), **{**SMALL, **options})


def prose(n: int, seed: int) -> bytes:
    """About ``n`` bytes of UTF-8 text (letters, spaces, newlines and a two-byte é), seeded."""
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list("abcdefgh ij\né"), size=n)).encode()[:n].decode("utf-8", "ignore").encode()


def window(data, i: int, t: int = T) -> tuple[int, ...]:
    """Window ``i`` by the documented rule: tokens [i*t, i*t + t] of ``data``."""
    return tuple(int(v) for v in data[i * t : i * t + t + 1])


def rows(x: torch.Tensor, y: torch.Tensor) -> list[tuple[int, ...]]:
    """A batch as its windows: each input row and its last target."""
    assert torch.equal(x[:, 1:], y[:, :-1])  # the targets are the inputs shifted by one
    return [(*a.tolist(), b[-1].item()) for a, b in zip(x, y)]


def unique_tokens(tmp_path: Path, n: int, name: str = "ids.bin") -> tuple[Path, np.ndarray]:
    """A token file of ``n`` ids, all different, so a window's content names it."""
    ids = np.random.default_rng(0).permutation(n).astype("<u2")
    path = tmp_path / name
    ids.tofile(path)
    return path, ids


# -- a text file -------------------------------------------------------------------------------
def test_a_text_file_holds_out_its_end_and_windows_follow_the_documented_rule(tmp_path):
    raw = prose(4000, 1)
    (tmp_path / "book.txt").write_bytes(raw)
    task = make(tmp_path / "book.txt")
    cut = len(raw) - math.ceil(len(raw) * 0.05)
    assert bytes(task.corpus.train) == raw[:cut] and bytes(task.corpus.test) == raw[cut:]
    assert task.n_train == (cut - 1) // T and task.n_test == (len(raw) - cut - 1) // T
    path = str(tmp_path / "book.txt")
    assert task.data_facts() == {
        "format": "text", "source": path, "path": path, "files": 1, "test_files": 0, "bytes": len(raw),
        "vocab": 256, "train_tokens": cut, "test_tokens": len(raw) - cut, "sha256": hashlib.sha256(raw).hexdigest(),
        "context": T, "train_windows": task.n_train, "eval_windows": task.n_test, "eval_split": "test"}
    x, y = next(task.train_batches(1, 2, 5, start=3))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (5, T)
    idx = next(index_batches("text", 0, task.n_train, 1, 2, 5, start=3)).tolist()
    assert rows(x, y) == [window(raw[:cut], i) for i in idx]
    assert "bits per byte" in task.describe() and "bits per token" not in task.describe()


def test_the_test_set_is_the_first_eval_windows_of_the_test_split_in_order(tmp_path):
    raw = prose(20000, 2)
    (tmp_path / "a.txt").write_bytes(raw)
    task = make(tmp_path / "a.txt", eval_windows=70)
    test = bytes(task.corpus.test)
    assert [len(x) for x, _ in task.test_batches()] == [64, 6]
    assert [w for x, y in task.test_batches() for w in rows(x, y)] == [window(test, i) for i in range(70)]
    everything = make(tmp_path / "a.txt", eval_windows=10**6)
    assert sum(len(x) for x, _ in everything.test_batches()) == everything.n_test == (len(test) - 1) // T
    assert task.data_facts()["eval_windows"] == 70


def test_the_validation_set_is_the_next_eval_windows_disjoint_from_the_test_set_and_fixed(tmp_path):
    path, ids = unique_tokens(tmp_path, 20000)  # every window's content names it
    test = make(path, eval_windows=50)
    valid = make(path, eval_windows=50, eval_split="valid")
    held = np.asarray(test.corpus.test)
    test_set = [w for x, y in test.test_batches() for w in rows(x, y)]
    valid_set = [w for x, y in valid.test_batches() for w in rows(x, y)]
    assert test_set == [window(held, i) for i in range(50)]
    assert valid_set == [window(held, i) for i in range(50, 100)]
    assert not {t for w in test_set for t in w[:-1]} & {t for w in valid_set for t in w[:-1]}  # no shared token
    again = make(path, eval_windows=50, eval_split="valid")
    assert [w for x, y in again.test_batches() for w in rows(x, y)] == valid_set  # the same every time
    assert valid.data_facts()["eval_split"] == "valid" and "50 validation windows" in valid.describe()
    assert test.data_facts()["eval_split"] == "test"


def test_a_validation_set_is_refused_when_the_held_out_split_is_too_short(tmp_path):
    path, _ = unique_tokens(tmp_path, 20000)
    n = make(path).n_test  # 1000 held-out tokens: 124 windows of 8 + 1
    make(path, eval_windows=n // 2, eval_split="valid")  # exactly two sets fit
    with pytest.raises(TaskError, match=r"eval_split=valid needs 2 x eval_windows") as e:
        make(path, eval_windows=n // 2 + 1, eval_split="valid")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="eval_split must be one of test, valid"):
        make(path, eval_split="train")


# -- windows: disjoint, each once an epoch, resumable ----------------------------------------------
@pytest.mark.parametrize("world, batch", [(1, 4), (2, 5), (4, 3)])
def test_ranks_read_disjoint_windows_and_every_window_once_an_epoch(tmp_path, world, batch):
    train = 1 + T * 120  # 120 windows: a whole number of batches per rank for every case
    path, ids = unique_tokens(tmp_path, train + 100)
    task = make(path, vocab=65536, test_share=100 / (train + 100))
    assert task.n_train == 120 and len(task.corpus.train) == train
    per_rank = 120 // world
    shards = []
    for rank in range(world):
        stream = task.train_batches(rank, world, batch)
        read = [w for _ in range(per_rank // batch) for w in rows(*next(stream))]
        assert len(set(read)) == len(read) == per_rank  # no window twice in a rank's epoch
        shards.append(set(read))
    for rank, shard in enumerate(shards):
        for other in shards[rank + 1 :]:
            assert not shard & other, "two ranks read the same window"
    assert set().union(*shards) == {window(ids[:train], i) for i in range(120)}  # all of it, once


def test_an_uneven_world_reads_no_window_twice_in_an_epoch(tmp_path):
    train = 1 + T * 121  # 121 windows over 2 ranks: 60 each, one left out (a different one each epoch)
    path, ids = unique_tokens(tmp_path, train + 100)
    task = make(path, vocab=65536, test_share=100 / (train + 100))
    every = {window(ids[:train], i) for i in range(121)}
    left_out = []
    for epoch in range(3):
        read = []
        for rank in range(2):
            stream = task.train_batches(rank, 2, 4, start=epoch * 15)  # 60 windows = 15 batches of 4
            read += [w for _ in range(15) for w in rows(*next(stream))]
        assert len(set(read)) == len(read) == 120 and set(read) <= every
        left_out.append(every - set(read))
    assert all(len(s) == 1 for s in left_out) and len({next(iter(s)) for s in left_out}) > 1


def test_start_k_gives_batch_k_of_the_unbroken_stream_across_epochs(tmp_path):
    raw = prose(3000, 3)
    (tmp_path / "t.txt").write_bytes(raw)
    task = make(tmp_path / "t.txt")
    per_rank = task.n_train // 2
    assert per_rank % 7  # batches of 7 straddle epochs
    for rank in (0, 1):
        straight = task.train_batches(rank, 2, 7)
        unbroken = [next(straight) for _ in range(3 * per_rank // 7 + 2)]  # past three epochs
        for k in sorted({0, 1, per_rank // 7, per_rank // 7 + 1, 2 * per_rank // 7, len(unbroken) - 1}):
            x, y = next(task.train_batches(rank, 2, 7, start=k))
            assert torch.equal(x, unbroken[k][0]) and torch.equal(y, unbroken[k][1]), (rank, k)
        again = task.train_batches(rank, 2, 7)  # the same stream every time it is made
        assert all(torch.equal(next(again)[0], b[0]) for b in unbroken)


def test_the_order_follows_the_seed_and_the_data_does_not(tmp_path):
    raw = prose(3000, 4)
    (tmp_path / "t.txt").write_bytes(raw)
    a, b = make(tmp_path / "t.txt"), Text(seed=1, data_dir=str(tmp_path / "t.txt"), **SMALL)
    assert a.data_facts() == b.data_facts()
    assert not torch.equal(next(a.train_batches(0, 1, 16))[0], next(b.train_batches(0, 1, 16))[0])


# -- a folder: the split by file -----------------------------------------------------------------
def write_folder(root: Path, n: int = 40) -> dict[str, bytes]:
    """``n`` files under ``root`` (some nested), each starting with a marker naming it, plus
    files the reader skips (hidden ones, a hidden folder) and an empty one."""
    files = {}
    for i in range(n):
        rel = f"{'sub/' if i % 3 == 0 else ''}{'deep/' if i % 7 == 0 else ''}f{i:02d}.txt"
        files[rel] = f"<<FILE {rel}>>\n".encode() + prose(200 + 13 * i, 100 + i)
    files["z-empty.txt"] = b""
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / ".hidden.txt").write_bytes(b"\xff not text, never read")
    (root / ".git").mkdir()
    (root / ".git" / "index").write_bytes(b"\xff\xfe binary")
    return files


def test_a_folder_is_split_by_file_and_test_files_are_never_trained_on(tmp_path):
    files = write_folder(tmp_path)
    task = make(tmp_path, test_share=0.1)
    order = sorted(files)  # relative POSIX paths in Python string order
    nonempty = [r for r in order if files[r]]
    scores = {r: int.from_bytes(hashlib.blake2b(r.encode(), digest_size=8).digest(), "little") / 2**64
              for r in nonempty}
    held = [r for r in nonempty if scores[r] < 0.1]
    assert 1 <= len(held) < len(nonempty)  # this folder's hashes put a few files in the test share
    train = [r for r in nonempty if r not in held]
    assert bytes(task.corpus.train) == b"".join(files[r] for r in train)
    assert bytes(task.corpus.test) == b"".join(files[r] for r in held)
    for r in held:
        assert f"<<FILE {r}>>".encode() not in bytes(task.corpus.train)
    f = task.data_facts()
    assert (f["files"], f["test_files"], f["bytes"]) == (41, len(held), sum(map(len, files.values())))
    assert f["sha256"] == hashlib.sha256(b"".join(files[r] for r in order)).hexdigest()  # `cat` in path order
    assert f["source"] == f["path"] == str(tmp_path) and f["format"] == "text"
    # every training window is read from the training files only, whatever the rank
    train_bytes = b"".join(files[r] for r in train)
    x, y = next(task.train_batches(0, 2, 16, start=5))
    idx = next(index_batches("text", 0, task.n_train, 0, 2, 16, start=5)).tolist()
    assert rows(x, y) == [window(train_bytes, i) for i in idx]


def test_the_held_out_files_are_at_least_one_and_never_all():
    assert text_mod.held_out_files(["a", "b"], 1e-9) != set()  # none in the share: the lowest hash is held out
    assert len(text_mod.held_out_files(["a", "b"], 0.999999)) == 1  # all in it: the highest hash trains
    assert text_mod.held_out_files([f"{i}.txt" for i in range(1000)], 0.05) == {
        i for i in range(1000) if text_mod._split_score(f"{i}.txt") < 0.05}
    assert 30 < len(text_mod.held_out_files([f"{i}.txt" for i in range(1000)], 0.05)) < 70


def test_a_folder_with_one_text_file_is_split_by_position(tmp_path):
    raw = prose(2000, 5)
    (tmp_path / "only.txt").write_bytes(raw)
    (tmp_path / "empty.txt").write_bytes(b"")
    task = make(tmp_path)
    cut = len(raw) - math.ceil(len(raw) * 0.05)
    assert bytes(task.corpus.train) == raw[:cut] and task.data_facts()["files"] == 2


# -- a token file --------------------------------------------------------------------------------
def test_a_token_file_is_read_in_place_and_holds_out_its_end(tmp_path):
    ids = np.random.default_rng(1).integers(0, 50304, 5000).astype("<u2")
    path = tmp_path / "train.bin"
    ids.tofile(path)
    task = make(path)
    cut = 5000 - math.ceil(5000 * 0.05)
    assert task.vocab == 50304 and np.array_equal(task.corpus.train, ids[:cut])
    assert np.array_equal(task.corpus.test, ids[cut:])
    f = task.data_facts()
    assert (f["format"], f["train_tokens"], f["test_tokens"], f["bytes"], f["vocab"]) == (
        "tokens", cut, 5000 - cut, 10000, 50304)
    assert f["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    x, y = next(task.train_batches(0, 1, 3, start=2))
    idx = next(index_batches("text", 0, task.n_train, 0, 1, 3, start=2)).tolist()
    assert rows(x, y) == [window(ids[:cut], i) for i in idx]
    assert "bits per token" in task.describe()
    model = task.build_model()
    assert model(x).shape == (3, T, 50304)
    small = make(path, vocab=50304 + 64)
    assert small.build_model().head.out_features == 50368


# -- the bundled default: Python's standard library ----------------------------------------------
def stdlib_files() -> list[Path]:
    """The documented rule, written out again: .py files of the stdlib, sorted by relative path,
    without site-/dist-packages, __pycache__, test suites, _sysconfigdata_*.py and config-*."""
    root = Path(os.path.realpath(sysconfig.get_paths()["stdlib"]))
    out = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
        if any(d in skip or d.startswith((".", "config-")) for d in parts[:-1]):
            continue
        if parts[-1].startswith((".", "_sysconfigdata")) or not p.is_file():
            continue
        out.append(p)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def test_the_default_corpus_is_the_stdlib_source_and_the_same_every_time():
    text_mod.stdlib_corpus.cache_clear()
    t0 = time.perf_counter()
    a = Text(seed=0)
    seconds = time.perf_counter() - t0
    assert seconds < 2.0, f"building the default corpus took {seconds:.2f} s"
    files = stdlib_files()
    joined = b"".join(p.read_bytes() for p in files)
    f = a.data_facts()
    assert f["sha256"] == hashlib.sha256(joined).hexdigest() and f["bytes"] == len(joined)
    assert f["files"] == len(files) and f["format"] == "text" and f["vocab"] == 256
    assert f["source"] == f"python {'.'.join(map(str, sys.version_info[:3]))} stdlib"
    assert f["train_tokens"] + f["test_tokens"] == len(joined) and 0.01 < f["test_tokens"] / len(joined) < 0.1
    assert f["context"] == 128 and a.options.model == "tiny"
    text_mod.stdlib_corpus.cache_clear()  # read again from disk: the same corpus
    b = Text(seed=0)
    assert b.corpus is not a.corpus and b.data_facts() == f
    assert np.array_equal(a.corpus.train, b.corpus.train) and np.array_equal(a.corpus.test, b.corpus.test)
    assert Text(seed=0).corpus is b.corpus  # one read per process
    assert all(torch.equal(u, v) for u, v in zip(next(a.train_batches(1, 4, 8, start=9)),
                                                 next(b.train_batches(1, 4, 8, start=9))))


def test_the_tiny_preset_is_charlms_model_over_bytes_with_a_context_of_128():
    task = Text(seed=0)
    model = task.build_model()
    ref = TinyTransformer(256, 128, 2, 128, 4, 0.0)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters()) == 478720
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    rng = torch.get_rng_state()
    assert torch.equal(flat(model), flat(Text(seed=0).build_model()))  # the same on every rank
    assert not torch.equal(flat(model), flat(Text(seed=1).build_model()))
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left alone
    big = Text(seed=0, model="gpt-small", context=64)
    assert (big.options.layers, big.options.d_model, big.options.heads, big.options.context) == (8, 512, 8, 64)


# -- what a run records --------------------------------------------------------------------------
def test_progress_gives_the_epoch_and_the_tokens_each_worker_trained_on(tmp_path):
    raw = prose(8 * 200 + 1 + 200, 6)
    (tmp_path / "t.txt").write_bytes(raw)
    task = make(tmp_path / "t.txt")
    n = task.n_train
    assert task.progress(0, 2, 4) == {"epoch": 0.0, "tokens_seen_per_worker": 0}
    assert task.progress(10, 2, 4) == {"epoch": 40 / (n // 2), "tokens_seen_per_worker": 10 * 4 * T}
    steps = n // 2 // 4 + 1  # just into the second epoch
    assert 1 < task.progress(steps, 2, 4)["epoch"] < 2
    # the base class records nothing
    assert tasks.get("synthetic")(samples=64, test_samples=16).progress(5, 2, 4) == {}
    assert tasks.get("synthetic")(samples=64, test_samples=16).data_facts() is None


@pytest.mark.spawns
def test_a_run_records_the_corpus_in_summary_and_the_epoch_in_every_row(tmp_path):
    raw = prose(6000, 7)
    (tmp_path / "t.txt").write_bytes(raw)
    cfg = TrainConfig(task="text", method="identity", workers=2, steps=6, eval_every=3, batch_size=4,
                      data_dir=str(tmp_path / "t.txt"), out=str(tmp_path / "run"),
                      task_options={**SMALL, "eval_windows": 8}).resolve()
    summary = LocalWorld(2).run(lambda comm: train_rank(cfg, comm))[0]
    task = make(tmp_path / "t.txt", eval_windows=8)
    assert summary.data == task.data_facts()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["data"]["sha256"] == hashlib.sha256(
        raw).hexdigest()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    got = [(r["step"], r["epoch"], r["tokens_seen_per_worker"]) for r in map(json.loads, lines)]
    assert got == [(s, s * 4 / (task.n_train // 2), s * 4 * T) for s in (3, 6)]
    assert summary.final_bpc == pytest.approx(summary.final_loss / math.log(2))


def test_check_world_needs_a_window_per_rank(tmp_path):
    (tmp_path / "t.txt").write_bytes(prose(8 * 3 + 1 + 100, 8))
    task = make(tmp_path / "t.txt", test_share=0.5)
    n = task.n_train
    task.check_world(n, 64)  # one window each is enough
    with pytest.raises(TaskError, match=rf"^text: .* has {n} training windows of context \+ 1 = 9 tokens, "
                                        rf"fewer than the {n + 1} ranks \(one window per rank at least\)"):
        task.check_world(n + 1, 1)
    tasks.get("synthetic")(samples=64, test_samples=16).check_world(1000, 1)  # the default checks nothing


# -- bad input: one line, naming the task and the rule ------------------------------------------
def one_line_error(data, match: str, **options) -> str:
    with pytest.raises(TaskError) as e:
        make(data, **options)
    message = str(e.value)
    assert "\n" not in message and message.startswith("text: "), message
    assert match in message, message
    return message


def test_missing_empty_and_odd_paths_are_refused(tmp_path):
    one_line_error(tmp_path / "nope.txt", f"--data {tmp_path / 'nope.txt'}: no such file or directory")
    one_line_error("", "--data is empty")
    (tmp_path / "empty.txt").write_bytes(b"")
    one_line_error(tmp_path / "empty.txt", f"--data {tmp_path / 'empty.txt'} is empty: no text to train on")
    (tmp_path / "void").mkdir()
    one_line_error(tmp_path / "void", "holds no files to read")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_bytes(b"")
    (tmp_path / "blank" / ".b.txt").write_bytes(b"hidden text is skipped")
    one_line_error(tmp_path / "blank", "is empty: no text to train on")
    os.mkfifo(tmp_path / "pipe")
    one_line_error(tmp_path / "pipe", "is neither a regular file nor a folder")


def test_unreadable_files_are_named(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_bytes(prose(500, 9))
    (tmp_path / "d" / "b.txt").write_bytes(prose(500, 10))
    real_open = builtins.open

    def refuse(path, *args, **kwargs):  # root reads a chmod 000 file, so refuse it here
        if str(path).endswith("b.txt"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refuse)
    one_line_error(tmp_path / "d", f"cannot read {tmp_path / 'd' / 'b.txt'}: Permission denied")
    one_line_error(tmp_path / "d" / "b.txt", f"cannot read {tmp_path / 'd' / 'b.txt'}: Permission denied")


def test_text_that_is_not_utf8_names_the_file_and_the_byte_offset(tmp_path, monkeypatch):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_bytes(prose(300, 11))
    (tmp_path / "d" / "sub" / "latin1.txt").write_bytes(b"caf\xe9 au lait")
    one_line_error(tmp_path / "d", f"{tmp_path / 'd' / 'sub' / 'latin1.txt'} is not UTF-8: "
                   "invalid continuation byte (byte 0xe9) at byte offset 3")
    # a character split between two read chunks is fine; the bad byte's offset counts from the file's start
    monkeypatch.setattr(text_mod, "CHUNK", 4)
    good = "aéé€b".encode() * 30  # 2- and 3-byte characters across every chunk boundary
    (tmp_path / "ok.txt").write_bytes(good)
    assert bytes(make(tmp_path / "ok.txt", context=4).corpus.train) == good[: len(good) - math.ceil(len(good) * .05)]
    (tmp_path / "bad.txt").write_bytes(good + b"xy\x80" + good)
    one_line_error(tmp_path / "bad.txt", f"invalid start byte (byte 0x80) at byte offset {len(good) + 2}")
    (tmp_path / "cut.txt").write_bytes(good + "€".encode()[:2])
    one_line_error(tmp_path / "cut.txt", f"unexpected end of data (byte 0xe2) at byte offset {len(good)}")
    (tmp_path / "d2").mkdir()
    (tmp_path / "d2" / "a.txt").write_bytes(prose(300, 12))
    np.array([50000, 60000, 255], dtype="<u2").tofile(tmp_path / "d2" / "train.bin")  # bytes 50 c3 60 ea: not UTF-8
    one_line_error(tmp_path / "d2", "(a token file is read when --data names the .bin file itself)")


def test_bad_token_files_are_refused(tmp_path, monkeypatch):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    one_line_error(tmp_path / "odd.bin", f"token file {tmp_path / 'odd.bin'} has 3 bytes, not a whole number "
                   "of uint16 tokens")
    (tmp_path / "empty.bin").write_bytes(b"")
    one_line_error(tmp_path / "empty.bin", "is empty")
    monkeypatch.setattr(text_mod, "CHUNK", 64)  # the id is found past the first chunk
    ids = np.full(1000, 7, dtype="<u2")
    ids[[300, 700]] = [50304, 60000]
    ids.tofile(tmp_path / "big.bin")
    one_line_error(tmp_path / "big.bin", "has id 50304 at token 300, not below vocab 50304")
    one_line_error(tmp_path / "big.bin", "has id 60000 at token 700, not below vocab 50305", vocab=50305)
    assert make(tmp_path / "big.bin", vocab=60001).vocab == 60001


def test_corpora_too_small_for_a_window_are_refused(tmp_path):
    (tmp_path / "short.txt").write_bytes(b"tiny")
    one_line_error(tmp_path / "short.txt", "the training split of")  # 3 training bytes < context + 1
    one_line_error(tmp_path / "short.txt", "fewer than one window of context + 1 = 9")
    (tmp_path / "mid.txt").write_bytes(prose(100, 13))  # 5 test bytes
    one_line_error(tmp_path / "mid.txt", "the test split of")
    one_line_error(tmp_path / "mid.txt", "raise test_share")
    assert make(tmp_path / "mid.txt", test_share=0.2).n_test == 2


def test_options_are_checked(tmp_path):
    (tmp_path / "t.txt").write_bytes(prose(1000, 14))
    for options, match in [({"vocab": 300}, "option vocab applies to a .bin token file"),
                           ({"vocab": 1}, "vocab must be in [2, 65536]"),
                           ({"eval_windows": 0}, "eval_windows must be >= 1"),
                           ({"test_share": 0}, "test_share must be in (0, 0.5]"),
                           ({"test_share": 0.6}, "test_share must be in (0, 0.5]"),
                           ({"model": "huge"}, "model must be one of tiny, gpt-small"),
                           ({"heads": 3}, "d_model must be a multiple of heads")]:
        one_line_error(tmp_path / "t.txt", match, **options)
    with pytest.raises(TaskError, match="option vocab applies to a .bin token file"):
        Text(vocab=512)
    assert Text(seed=0, data_dir=str(tmp_path / "t.txt"), **{"context": "16", "test_share": "0.2"}).options.context \
        == 16

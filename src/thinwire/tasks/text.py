"""Language model of your own text: a byte-level causal transformer over ``--data PATH``.

The model is charlm's (:class:`thinwire.tasks.charlm.TinyTransformer`, its ``PRESETS``
and option checks), here over bytes (vocabulary 256) or over a token file's ids.

What ``--data`` may be (it arrives as ``data_dir``):

* a file whose name ends in ``.bin`` (any case): a token file in nanoGPT's layout, flat
  little-endian uint16 token ids (``vocab``, default 50304, bounds them: every id must be
  below it). The last ``test_share`` of the tokens by position is the test split.
* any other file: UTF-8 text, read as bytes (one token per byte, vocabulary 256). The last
  ``test_share`` of its bytes by position is the test split.
* a directory: every regular file below it, recursively, in the order of their relative
  POSIX paths (Python string order), skipping names that start with ``.`` (hidden files and
  folders such as ``.git``) at any depth; symbolic links to files are read, links to folders
  are not followed. Every file must be UTF-8 (an empty one adds nothing). The held-out
  split is by file: a file is a test file when the hash (BLAKE2b) of its relative path falls
  in the ``test_share`` of the hash range, at least one file and never all of them; test
  files are never trained on. A directory with one non-empty file is split by position.
* nothing: Python's own standard library source, the ``.py`` files under
  ``sysconfig.get_paths()["stdlib"]`` (about 12 MB, 730 files on CPython 3.11), split by file
  as a directory. Left out: ``site-packages``, ``dist-packages``, ``__pycache__``, the test
  suites (folders named ``test``, ``tests`` or ``idle_test``: 19 MB of tests, some of them
  deliberately not UTF-8) and the build-specific ``_sysconfigdata_*.py`` and ``config-*``
  folder (they hold the paths of the machine Python was built on). Nothing is downloaded, and
  the corpus is the same on every machine with the same Python version; its size and SHA-256
  are in ``data_facts()`` (summary.json's ``data``).

``data_facts()`` (summary.json's ``data``): ``format`` (text | tokens), ``source`` (the path,
or ``python X.Y.Z stdlib``), ``path``, ``files``, ``test_files`` (held out by file; 0 when
split by position), ``bytes`` (the corpus's size on disk), ``vocab``, ``train_tokens``,
``test_tokens``, ``sha256`` (of every file's bytes in path order: for a folder, the SHA-256 of
its files concatenated in that order; empty and skipped files add nothing), ``context``,
``train_windows``, ``eval_windows`` and ``eval_split``.

The training text of a corpus (a directory's training files concatenated in path order, so
a window may span two files) is cut into windows of ``context + 1`` tokens at stride
``context``: window ``i`` is tokens ``[i*T, i*T + T]``, its first ``T`` the inputs and its last
``T`` the targets, so every training target is predicted exactly once per epoch. Windows
are dealt with :func:`thinwire.tasks.base.index_batches`: each epoch one shuffle seeded from
``(text, seed, epoch)`` shared by the ranks, each rank its own contiguous slice (disjoint),
batches running on into the next epoch; ``start=k`` gives batch ``k`` without building the
ones before. The test set is the first ``eval_windows`` windows of the test split, in order;
``eval_split=valid`` evaluates on the validation set instead, the next ``eval_windows``
windows (disjoint from the test set, fixed; refused when the held-out split has fewer than
``2 * eval_windows`` windows), for tuning that never reads the test windows.

``evaluate`` reports ``bpc`` = test loss / ln 2: bits per byte for text, bits per token for a
token file; ``accuracy`` is next-byte (next-token) accuracy. ``progress`` gives every
metrics row the epoch (epochs of training windows each rank has read) and the tokens each
worker has trained on.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import math
import os
import stat
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from thinwire.tasks.base import Task, TaskDefaults, TaskError, index_batches, register
from thinwire.tasks.charlm import EVAL_BATCH, PRESETS, CharLMOptions, TinyTransformer

CONTEXT = 128  # tokens per window unless `context` says otherwise (charlm's presets use 64)
BYTE_VOCAB = 256
TOKEN_VOCAB = 50304  # nanoGPT's GPT-2 vocabulary (50257) rounded up to a multiple of 64
CHUNK = 1 << 24  # elements per pass when validating, hashing or scanning a large file
EVAL_SPLITS = ("test", "valid")  # option eval_split: which eval_windows windows of the held-out split evaluate
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


@dataclass(frozen=True, kw_only=True)
class TextOptions(CharLMOptions):
    """charlm's knobs (``model`` tiny | gpt-small, ``layers``, ``d_model``, ``heads``,
    ``dropout``; ``context`` defaults to 128 here) and the corpus's own."""

    vocab: int | None = None  # token files only: ids must be < vocab (default 50304); text is bytes (256)
    eval_windows: int = 256  # test windows per evaluation (the first ones of the test split, in order)
    test_share: float = 0.05  # held out: this share of a directory's files (by path hash) or of a file's end
    eval_split: str = "test"  # test: the held-out split's first eval_windows windows; valid: the next eval_windows

    def __post_init__(self) -> None:
        if self.context is None and self.model in PRESETS:
            object.__setattr__(self, "context", CONTEXT)  # frozen: the text preset's context, once
        super().__post_init__()
        if self.vocab is not None and not 2 <= self.vocab <= 65536:
            raise ValueError(f"vocab must be in [2, 65536] (uint16 token ids), got {self.vocab}")
        if self.eval_windows < 1:
            raise ValueError(f"eval_windows must be >= 1, got {self.eval_windows}")
        if not 0 < self.test_share <= 0.5:
            raise ValueError(f"test_share must be in (0, 0.5], got {self.test_share}")
        if self.eval_split not in EVAL_SPLITS:
            raise ValueError(f"eval_split must be one of {', '.join(EVAL_SPLITS)}, got {self.eval_split!r}")


@dataclass(frozen=True)
class Corpus:
    """A corpus as loaded: read-only 1-D token arrays (uint8 bytes or uint16 ids) and its facts."""

    train: np.ndarray
    test: np.ndarray
    facts: dict[str, Any]


@register
class Text(Task):
    """Byte-level (or token-file) causal transformer on your own text, or on Python's stdlib source."""

    name: ClassVar[str] = "text"
    metric: ClassVar[str] = "bpc"
    Config: ClassVar[type] = TextOptions
    summary: ClassVar[str] = ("byte-level transformer (tiny or gpt-small) on --data (UTF-8 files or a uint16 "
                              ".bin token file; default: Python's stdlib source), bits per byte")
    # Measured on the default corpus, 2 workers x 32 windows of 128 bytes, seed 0 (2 CPU cores): test bpc
    # 3.50 at step 100 -> 1.81 at step 600 (next-byte accuracy 0.65, 0.42 epochs), about 2 minutes;
    # ~0.15 s CPU per rank-step on one thread.
    defaults: ClassVar[TaskDefaults] = TaskDefaults(steps=600, batch_size=32, lr=1e-3, optimizer="adam", eval_every=100)

    def __init__(self, *, seed: int = 0, data_dir: str | None = None, **options: Any) -> None:
        super().__init__(seed=seed, data_dir=data_dir, **options)
        o = self.options
        if data_dir is None:
            if o.vocab is not None:
                raise TaskError("text: option vocab applies to a .bin token file; the default corpus is bytes")
            corpus = stdlib_corpus(o.test_share)
        else:
            corpus = load(data_dir, o.test_share, o.vocab)
        self.corpus = corpus
        self.tokens = corpus.facts["format"] == "tokens"
        self.vocab = int(corpus.facts["vocab"])
        self.context = t = int(o.context)  # filled from the preset by TextOptions
        self.n_train = (len(corpus.train) - 1) // t  # windows of T + 1 tokens at stride T
        self.n_test = (len(corpus.test) - 1) // t
        where = corpus.facts["source"]
        if self.n_train < 1:
            raise TaskError(f"text: the training split of {where} has {len(corpus.train)} tokens, fewer than one "
                            f"window of context + 1 = {t + 1}")
        if self.n_test < 1:
            raise TaskError(f"text: the test split of {where} has {len(corpus.test)} tokens, fewer than one window "
                            f"of context + 1 = {t + 1}; raise test_share, add text or shorten context")
        if o.eval_split == "valid" and self.n_test < 2 * o.eval_windows:
            raise TaskError(f"text: eval_split=valid needs 2 x eval_windows = {2 * o.eval_windows} held-out windows "
                            f"(the first {o.eval_windows} are the test set), {where} has {self.n_test}; lower "
                            "eval_windows, raise test_share or add text")

    def describe(self) -> str:
        f, o = self.corpus.facts, self.options
        unit = "bits per token" if self.tokens else "bits per byte"
        files = f"{f['files']} files ({f['test_files']} held out), " if f["files"] > 1 else ""
        return (f"text ({o.model}): {f['source']}: {files}{f['train_tokens']} train / {f['test_tokens']} test "
                f"{'tokens' if self.tokens else 'bytes'}, vocab {self.vocab}, context {o.context}, "
                f"{self.n_train} training windows, {min(o.eval_windows, self.n_test)} "
                f"{'validation' if o.eval_split == 'valid' else 'test'} windows; bpc is {unit}")

    def build_model(self) -> nn.Module:
        o = self.options
        with self.seeded("model"):
            return TinyTransformer(self.vocab, o.context, o.layers, o.d_model, o.heads, o.dropout)

    # -- data -------------------------------------------------------------------------------
    def windows(self, data: np.ndarray, index: np.ndarray) -> Tensor:
        """Windows ``index`` (window numbers) of ``data``: (len(index), context + 1) int64."""
        t = self.context
        at = index.astype(np.int64)[:, None] * t + np.arange(t + 1)  # (B, T+1) positions
        return torch.from_numpy(np.asarray(data[at], dtype=np.int64))

    def train_batches(
        self, rank: int, world_size: int, batch_size: int, start: int = 0
    ) -> Iterator[tuple[Tensor, Tensor]]:
        for idx in index_batches(self.name, self.seed, self.n_train, rank, world_size, batch_size, start):
            w = self.windows(self.corpus.train, idx.numpy())  # (B, T+1)
            yield w[:, :-1], w[:, 1:]  # (B, T) inputs, (B, T) next tokens

    def eval_range(self) -> tuple[int, int]:
        """The held-out windows ``[first, end)`` that evaluate: the test set (the first
        ``eval_windows``) or, with ``eval_split=valid``, the validation set (the next
        ``eval_windows``, never a test window)."""
        n = min(self.options.eval_windows, self.n_test)
        return (n, 2 * n) if self.options.eval_split == "valid" else (0, n)

    def test_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        start, end = self.eval_range()
        for first in range(start, end, EVAL_BATCH):
            w = self.windows(self.corpus.test, np.arange(first, min(first + EVAL_BATCH, end)))
            yield w[:, :-1], w[:, 1:]

    # -- what the run records ---------------------------------------------------------------
    def data_facts(self) -> dict[str, Any]:
        return dict(self.corpus.facts, context=self.context, train_windows=self.n_train,
                    eval_windows=min(self.options.eval_windows, self.n_test), eval_split=self.options.eval_split)

    def progress(self, step: int, world_size: int, batch_size: int) -> dict[str, Any]:
        """After ``step`` steps each rank has read ``step * batch_size`` windows of its epoch
        shards (``n_train // world_size`` each): ``epoch`` is that in epochs (its integer part
        is the epoch the next window comes from)."""
        per_rank = self.n_train // world_size
        return {"epoch": step * batch_size / per_rank if per_rank else None,
                "tokens_seen_per_worker": step * batch_size * self.context}

    def check_world(self, world_size: int, batch_size: int) -> None:
        if self.n_train < world_size:
            raise TaskError(f"text: {self.corpus.facts['source']} has {self.n_train} training windows of "
                            f"context + 1 = {self.context + 1} tokens, fewer than the {world_size} ranks "
                            "(one window per rank at least): add text, shorten context or use fewer workers")


# -- loading ----------------------------------------------------------------------------------
def load(path: str, share: float, vocab: int | None) -> Corpus:
    """The corpus at ``path``: a ``.bin`` token file, a text file or a directory of text files."""
    if not path:
        raise TaskError("text: --data is empty; give a UTF-8 file, a folder of them or a .bin token file")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TaskError(f"text: --data {path}: no such file or directory") from None
    except OSError as e:
        raise TaskError(f"text: cannot read --data {path}: {e.strerror}") from None
    source = os.path.abspath(path)
    if stat.S_ISDIR(st.st_mode):
        if vocab is not None:
            raise TaskError(f"text: option vocab applies to a .bin token file; {path} is a folder of text")
        return _load_files(source, _list_files(source, _visible), share, fmt="text")
    if not stat.S_ISREG(st.st_mode):
        raise TaskError(f"text: --data {path} is neither a regular file nor a folder")
    if path.lower().endswith(".bin"):
        return _load_tokens(source, share, TOKEN_VOCAB if vocab is None else vocab)
    if vocab is not None:
        raise TaskError(f"text: option vocab applies to a .bin token file; {path} is text (bytes, vocabulary 256)")
    return _load_files(os.path.dirname(source), [os.path.basename(source)], share, fmt="text",
                       path=source)


@functools.lru_cache(maxsize=4)
def stdlib_corpus(share: float) -> Corpus:
    """The default corpus: the standard library's ``.py`` source (see the module docstring)."""
    root = os.path.realpath(sysconfig.get_paths()["stdlib"])

    def keep(rel: str, is_dir: bool) -> bool:
        base = rel.rsplit("/", 1)[-1]
        if is_dir:
            return base not in STDLIB_SKIP_DIRS and not base.startswith((".", "config-"))
        return base.endswith(".py") and not base.startswith((".", "_sysconfigdata"))

    version = ".".join(map(str, sys.version_info[:3]))
    return _load_files(root, _list_files(root, keep), share, fmt="text", source=f"python {version} stdlib")


def _visible(rel: str, is_dir: bool) -> bool:
    """A user's folder: every file and folder whose name does not start with a dot."""
    return not rel.rsplit("/", 1)[-1].startswith(".")


def _list_files(root: str, keep: Any) -> list[str]:
    """Relative POSIX paths of the regular files under ``root`` that ``keep(rel, is_dir)``
    accepts (a refused folder is not entered), sorted."""

    def fail(e: OSError) -> None:
        raise TaskError(f"text: cannot read folder {e.filename}: {e.strerror}")

    found = []
    for here, dirs, files in os.walk(root, onerror=fail):
        rel_here = os.path.relpath(here, root).replace(os.sep, "/")
        prefix = "" if rel_here == "." else rel_here + "/"
        dirs[:] = [d for d in dirs if keep(prefix + d, True)]
        for name in files:
            rel = prefix + name
            if keep(rel, False) and os.path.isfile(os.path.join(here, name)):  # follows a link to a file
                found.append(rel)
    return sorted(found)


def _split_score(rel: str) -> float:
    """Where a relative path falls in [0, 1): a hash, the same in every process and on every machine."""
    digest = hashlib.blake2b(rel.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def held_out_files(rels: list[str], share: float) -> set[int]:
    """Indices of the held-out files: those whose path hash is below ``share``; at least one
    (the lowest hash) and never all of them (the highest hash trains)."""
    scores = [_split_score(r) for r in rels]
    held = {i for i, s in enumerate(scores) if s < share}
    if not held:
        held = {min(range(len(rels)), key=scores.__getitem__)}
    if len(held) == len(rels):
        held.discard(max(range(len(rels)), key=scores.__getitem__))
    return held


def _load_files(root: str, rels: list[str], share: float, fmt: str, source: str | None = None,
                path: str | None = None) -> Corpus:
    """Text files ``rels`` under ``root``, checked as UTF-8, split by file (by position when
    one file holds all the text), hashed in path order. ``path``: what --data named (default
    ``root``); ``source``: how the facts name the corpus (default ``path``)."""
    path = path or root
    where = source or path
    if not rels:
        raise TaskError(f"text: --data {where} holds no files to read (an empty folder?)")
    sizes = []
    for rel in rels:
        try:
            sizes.append(os.path.getsize(os.path.join(root, rel)))
        except OSError as e:
            raise TaskError(f"text: cannot read {os.path.join(root, rel)}: {e.strerror}") from None
    nonempty = [i for i, s in enumerate(sizes) if s > 0]
    if not nonempty:
        raise TaskError(f"text: --data {where} is empty: no text to train on")
    if len(nonempty) == 1:  # one file of text: read in place, the end held out
        name = os.path.join(root, rels[nonempty[0]])
        data = _map(name, np.uint8)
        digest = _check_utf8(data, name)
        cut = len(data) - math.ceil(len(data) * share)
        train, test, held = data[:cut], data[cut:], 0
    else:
        held_idx = {nonempty[i] for i in held_out_files([rels[i] for i in nonempty], share)}
        n_test = sum(sizes[i] for i in held_idx)
        train_buf = np.empty(sum(sizes) - n_test, dtype=np.uint8)
        test_buf = np.empty(n_test, dtype=np.uint8)
        at = {True: 0, False: 0}  # write position in the test / train buffer
        hasher = hashlib.sha256()
        for i in nonempty:  # path order: what the hash covers
            is_test = i in held_idx
            buf = test_buf if is_test else train_buf
            view = buf.data[at[is_test] : at[is_test] + sizes[i]]
            name = os.path.join(root, rels[i])
            _read_into(name, view)
            _check_utf8(view, name, hasher)
            at[is_test] += sizes[i]
        train, test, held, digest = train_buf, test_buf, len(held_idx), hasher.hexdigest()
        train.flags.writeable = test.flags.writeable = False
    facts = {"format": fmt, "source": where, "path": path, "files": len(rels), "test_files": held,
             "bytes": int(sum(sizes)), "vocab": BYTE_VOCAB, "train_tokens": len(train), "test_tokens": len(test),
             "sha256": digest}
    return Corpus(train, test, facts)


def _load_tokens(path: str, share: float, vocab: int) -> Corpus:
    """A nanoGPT token file: little-endian uint16 ids, every one < ``vocab``, the end held out."""
    size = os.path.getsize(path)
    if size % 2:
        raise TaskError(f"text: token file {path} has {size} bytes, not a whole number of uint16 tokens")
    ids = _map(path, np.dtype("<u2"))
    hasher = hashlib.sha256()
    for first in range(0, len(ids), CHUNK):
        chunk = ids[first : first + CHUNK]
        hasher.update(chunk.data.cast("B"))
        if int(chunk.max()) >= vocab:
            pos = int(np.argmax(chunk >= vocab))
            raise TaskError(f"text: token file {path} has id {int(chunk[pos])} at token {first + pos}, not below "
                            f"vocab {vocab} (set --option vocab=N for a larger vocabulary)")
    cut = len(ids) - math.ceil(len(ids) * share)
    facts = {"format": "tokens", "source": path, "path": path, "files": 1, "test_files": 0, "bytes": size,
             "vocab": vocab, "train_tokens": cut, "test_tokens": len(ids) - cut, "sha256": hasher.hexdigest()}
    return Corpus(ids[:cut], ids[cut:], facts)


def _map(path: str, dtype: Any) -> np.ndarray:
    """The file as a read-only memory map of ``dtype`` (empty or unreadable: TaskError)."""
    try:
        if os.path.getsize(path) == 0:
            raise TaskError(f"text: --data {path} is empty: no text to train on")
        return np.memmap(path, dtype=dtype, mode="r")
    except OSError as e:
        raise TaskError(f"text: cannot read {path}: {e.strerror}") from None


def _read_into(path: str, view: memoryview) -> None:
    try:
        with open(path, "rb") as f:
            got = f.readinto(view)
            if got != len(view) or f.read(1):
                raise TaskError(f"text: {path} changed size while being read")
    except OSError as e:
        raise TaskError(f"text: cannot read {path}: {e.strerror}") from None


def _check_utf8(data: Any, path: str, hasher: Any = None) -> str:
    """Raise TaskError naming ``path`` and the byte offset unless ``data`` (bytes-like or a
    uint8 array) is UTF-8; feed it to ``hasher`` (a fresh SHA-256 when None), return its hex digest."""
    hasher = hashlib.sha256() if hasher is None else hasher
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    view = memoryview(data).cast("B")
    for first in range(0, len(view), CHUNK):
        chunk = view[first : first + CHUNK]
        pending = len(decoder.getstate()[0])  # bytes of a character begun in the previous chunk
        try:
            decoder.decode(chunk, final=first + CHUNK >= len(view))
        except UnicodeDecodeError as e:
            at = first - pending + e.start
            raise TaskError(f"text: {path} is not UTF-8: {e.reason} (byte 0x{view[at]:02x}) at byte offset {at}"
                            + (" (a token file is read when --data names the .bin file itself)"
                               if path.lower().endswith(".bin") else "")) from None
        hasher.update(chunk)
    return str(hasher.hexdigest())

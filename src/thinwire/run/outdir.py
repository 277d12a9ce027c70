"""An output folder (``--out``): which of its files thinwire wrote, and one run at a time.

**The manifest.** ``OUT/.thinwire-files.json`` lists, relative to ``OUT``, every file and
folder thinwire created there (``metrics.jsonl``, ``summary.json``, event files, reports,
plots, ``checkpoints/`` and its ``step-NNNNNNNN/`` folders). A path is recorded *before* it
is first created (a crash between the two leaves a record of a file that does not exist,
never a file without a record), and thinwire replaces or deletes a path only when it is
recorded: a file someone else put in ``OUT``, even one bearing a thinwire name such as
``summary.json`` or ``events.out.tfevents.*``, is never touched, with or without
``--overwrite``; a run that would have to replace it is refused, naming it
(:class:`ForeignFile`). Inside a recorded checkpoint folder, files with checkpoint names
(``meta.json``, ``rank-R.pt`` and their temporary files) are thinwire's: the ranks write
them there in parallel, and the folder's record covers them.

Only one process writes a folder's manifest: the one holding its lock (below), or, for a
run, rank 0 of the ranks that process started.

**The lock.** ``OUT/.thinwire.lock`` is held with an exclusive ``flock`` for the life of a
run, a comparison or a suite (:func:`hold`); a second one on the same ``OUT`` is refused
with :class:`OutputLocked`, naming the holder's process, host, command and start time from
the record the holder wrote into the file. The kernel drops the lock when its process ends,
however it ends, so a lock never outlives its holder; a holder that ends normally removes
the file, so a record found by the next holder is one left by a process that ended without
releasing it (killed), and :func:`hold` names it as it takes the lock over. Locks are per
process and re-entrant: a comparison holding its ``OUT`` may start runs in ``OUT/runs/*``,
each holding its own folder's lock. The lock file is told apart from anyone else's by its
content (empty, or a holder's record), so it is not in the manifest.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from thinwire import jsonfile

MANIFEST = ".thinwire-files.json"
LOCK = ".thinwire.lock"
FORMAT = 1


class ForeignFile(ValueError):
    """A path thinwire would have to replace or remove, which it did not write."""


class OutputLocked(ValueError):
    """``--out`` is held by another run, comparison or suite."""


def check(out: str | os.PathLike[str]) -> None:
    """``--out`` must be a directory, or a path where one can be created: every part that
    exists is a directory, and the deepest existing one is writable. A symbolic link is
    followed only to a directory that exists: a dangling one (or a loop) is refused, naming
    where it points."""
    path = os.path.abspath(out)
    probe = path
    while probe != os.path.dirname(probe):  # the first part that is a link to nowhere
        if os.path.islink(probe) and not os.path.exists(probe):
            raise ValueError(f"--out {out}: {probe} is a symbolic link to {os.readlink(probe)}, which does not "
                             "exist (or loops); point it at a directory or choose another --out")
        probe = os.path.dirname(probe)
    _require(not os.path.exists(path) or os.path.isdir(path), f"--out {out} is a file, not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    _require(os.path.isdir(parent), f"--out {out}: {parent} is a file, not a directory")
    _require(os.access(parent, os.W_OK | os.X_OK), f"--out {out}: {parent} is not writable")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# -- the manifest ------------------------------------------------------------------------------
def owned(out: str | os.PathLike[str]) -> set[str]:
    """The paths (relative, ``/``-separated) the manifest of ``out`` records; empty when there is none."""
    path = Path(out) / MANIFEST
    if not path.exists() and not path.is_symlink():
        return set()
    if path.is_symlink():
        raise ForeignFile(f"{path} is a symbolic link: thinwire cannot tell its files from others' there")
    try:
        doc = jsonfile.read(path, max_bytes=64 << 20)
    except jsonfile.JsonFileError as e:
        raise ForeignFile(f"{e}: thinwire cannot tell its files in {out} from others'; move {MANIFEST} "
                          "away only if nothing else is in the folder") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if (not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(files, list)
            or not all(isinstance(f, str) for f in files)):
        raise ForeignFile(f"{path} is not a thinwire manifest (format {FORMAT}, a list of files)")
    return set(files)


def _save(out: Path, files: set[str]) -> None:
    path = out / MANIFEST
    tmp = out / f".{MANIFEST}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "files": sorted(files)}, f, indent=0)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rel(out: Path, path: str | os.PathLike[str]) -> str:
    """``path`` relative to ``out``: a path built from ``out`` (``out / "x"``), an absolute path
    under it, or a name already relative to it."""
    p = Path(path)
    for base in (out, Path(os.path.abspath(out)), Path(os.path.realpath(out))):
        try:
            return p.relative_to(base).as_posix()
        except ValueError:
            continue
    if p.is_absolute():
        raise ValueError(f"{path} is not inside {out}")
    return p.as_posix()


def owns(out: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """Whether thinwire recorded writing ``path`` (relative to ``out``, or a path under it)."""
    return _rel(Path(out), path) in owned(out)


def claim(out: str | os.PathLike[str], *paths: str | os.PathLike[str]) -> None:
    """Record ``paths`` (relative to ``out``, or paths under it) as thinwire's before they
    are written. Raises :class:`ForeignFile` when one exists already without a record, or is
    a symbolic link (writing through it would change a file elsewhere)."""
    root = Path(out)
    files = owned(root)
    new = []
    for path in paths:
        rel = _rel(root, path)
        full = root / rel
        link = _link_in(root, rel)
        if link is not None:
            raise ForeignFile(f"{link} is a symbolic link: thinwire writes only files of its own in {out}")
        if rel not in files:
            if full.exists():
                raise ForeignFile(f"{full} was not written by thinwire (it is not in {root / MANIFEST}); "
                                  "move it away or choose another --out")
            new.append(rel)
    if new:
        root.mkdir(parents=True, exist_ok=True)
        _save(root, files | set(new))


def _link_in(root: Path, rel: str) -> Path | None:
    """The first part of ``root / rel`` below ``root`` that is a symbolic link, or None."""
    here = root
    for part in Path(rel).parts:
        here = here / part
        if here.is_symlink():
            return here
    return None


def record(out: str | os.PathLike[str], *paths: str | os.PathLike[str]) -> None:
    """Record ``paths``, which thinwire has just created under names of its own choosing that
    nobody else's file could have held (an event file named by the time, host and process)."""
    root = Path(out)
    files = owned(root)
    new = {_rel(root, p) for p in paths} - files
    if new:
        _save(root, files | new)


def new_file(path: str | os.PathLike[str]) -> None:
    """Refuse a single output file a user named (``bench memory --out FILE``) that exists
    already: such a file has no folder of thinwire's to record it, so thinwire writes it only
    where nothing is (:func:`write_new` creates it exclusively)."""
    p = Path(path)
    if os.path.lexists(p):
        raise ForeignFile(f"{path} exists; thinwire writes a new file only, never over one (remove it or name "
                          "another)")
    if not p.parent.is_dir():
        raise ForeignFile(f"{path}: {p.parent} is not a directory")


def write_new(path: str | os.PathLike[str], text: str, newline: str | None = None) -> None:
    """Write ``text`` into a file that must not exist yet (created exclusively: a file that
    appeared meanwhile is refused, never replaced)."""
    try:
        with open(path, "x", encoding="utf-8", newline=newline) as f:
            f.write(text)
    except FileExistsError:
        raise ForeignFile(f"{path} appeared while thinwire ran; it was left as it is and nothing was written") from None


def forget(out: str | os.PathLike[str], *paths: str | os.PathLike[str]) -> None:
    """Drop the records of ``paths`` (after they were removed)."""
    root = Path(out)
    files = owned(root)
    gone = {_rel(root, p) for p in paths} & files
    if gone:
        _save(root, files - gone)


def remove(out: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """Delete the file ``path`` when thinwire recorded writing it (a link or a file without a
    record stays); returns whether it is gone."""
    root = Path(out)
    rel = _rel(root, path)
    full = root / rel
    if rel not in owned(root) or _link_in(root, rel) is not None or not full.is_file():
        return False
    full.unlink()
    forget(root, rel)
    return True


def rmdir(out: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """Remove the folder ``path`` when thinwire created it and it is empty; returns whether it is gone."""
    root = Path(out)
    rel = _rel(root, path)
    full = root / rel
    if rel not in owned(root) or _link_in(root, rel) is not None or not full.is_dir():
        return False
    try:
        full.rmdir()
    except OSError:  # not empty: someone else's files are in it
        return False
    forget(root, rel)
    return True


def mkdir(out: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """Create the folder ``path`` under ``out`` (and ``out``), recording it when thinwire
    creates it; an existing folder is used as it is (not recorded: never removed)."""
    root = Path(out)
    rel = _rel(root, path)
    full = root / rel
    link = _link_in(root, rel)
    if link is not None:
        raise ForeignFile(f"{link} is a symbolic link: thinwire writes only into folders of its own in {out}")
    if not full.is_dir():
        claim(root, full)
        full.mkdir(parents=True, exist_ok=True)
    return full


# -- the lock ----------------------------------------------------------------------------------
_held: dict[str, list[Any]] = {}  # realpath -> [open lock file, depth]


def holder(out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The record in ``out``'s lock file (who holds or last held it), None when there is none."""
    try:
        doc = jsonfile.read(Path(out) / LOCK, max_bytes=1 << 16)
    except jsonfile.JsonFileError:
        return None
    return doc if isinstance(doc, dict) else None


def describe(record: dict[str, Any] | None) -> str:
    if not record:
        return "another process"
    cmd = str(record.get("command", ""))[:120]
    return (f"pid {record.get('pid')} on {record.get('host')}, `{cmd}`, since {record.get('started')}")


@contextlib.contextmanager
def hold(out: str | os.PathLike[str] | None, *, command: str | None = None,
         say: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold ``out``'s lock while the block runs (None: no folder, nothing to hold). Raises
    :class:`OutputLocked` naming the holder when another process holds it; re-entrant within
    one process. A record of a holder that ended without releasing the lock is named through
    ``say`` (stderr by default). ``out`` is created when missing; on release the lock file
    goes, and so do the folders made here when the block left them empty."""
    if out is None:
        yield
        return
    key = os.path.realpath(out)
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    check(out)
    root = Path(out)
    made = _missing(root)
    try:
        f = _lock(root, out)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot lock {LOCK} there: {e.strerror or e}") from None
    try:
        _take(root, f, command, say or _stderr)
    except BaseException as e:
        f.close()
        if isinstance(e, OSError):
            raise ValueError(f"--out {out}: cannot lock {LOCK} there: {e.strerror or e}") from None
        raise
    _held[key] = [f, 1]
    try:
        yield
    finally:
        del _held[key]
        _release(root, f, made)


def release_all() -> None:
    """Release every lock this process holds, now: for a process about to end with
    ``os._exit``, which runs no ``finally`` (a torchrun rank ending itself after its stop grace)."""
    for key, (f, _) in list(_held.items()):
        del _held[key]
        _release(Path(key), f, [])


def _missing(root: Path) -> list[Path]:
    """The folders from ``root`` up that do not exist (deepest first): what :func:`hold` creates."""
    missing = []
    here = Path(os.path.abspath(root))
    while not os.path.lexists(here):
        missing.append(here)
        here = here.parent
    return missing


def _lock(root: Path, out: str | os.PathLike[str]) -> Any:
    """The lock file of ``root``, opened and locked (``flock``, exclusive, not waiting). The
    file is removed on release, so a process that opened it just before may hold a lock on a
    file no longer there: the lock counts only while the path still names the locked file."""
    path = root / LOCK
    while True:
        root.mkdir(parents=True, exist_ok=True)  # again after a holder that made it removed it
        if path.is_symlink():
            raise ForeignFile(f"{path} is a symbolic link: thinwire keeps its lock there as a file of its own")
        if os.path.lexists(path) and not path.is_file():
            raise ForeignFile(f"{path} is not a file: thinwire keeps its lock there as a file of its own")
        try:
            f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+", encoding="utf-8")
        except FileNotFoundError:  # the folder went between mkdir and open: a holder that made it ended
            continue
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = holder(root)
            f.close()
            raise OutputLocked(f"--out {out} is in use by another thinwire run ({describe(other)}); wait for it "
                               "to end or choose another --out") from None
        try:
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return f
        f.close()  # released and removed meanwhile: take the new one


def _take(root: Path, f: Any, command: str | None, say: Callable[[str], None]) -> None:
    """Write this process's record into the lock file it now holds (naming a previous holder
    that ended without releasing it). The lock file is thinwire's when it
    is empty (just made) or holds such a record; anything else is refused."""
    path = root / LOCK
    before = holder(root)
    if before is None and path.read_text(encoding="utf-8", errors="replace").strip():
        raise ForeignFile(f"{path} was not written by thinwire; move it away or choose another --out")
    if before is not None:  # a holder's record outlives it only when it ended without releasing the lock
        say(f"thinwire: --out {root}: the previous holder of its lock ({describe(before)}) ended without "
            "releasing it; taking it over")
    mine = {"pid": os.getpid(), "host": socket.gethostname(),
            "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "started": _now()}
    _write_record(f, mine)


def _release(root: Path, f: Any, made: list[Path]) -> None:
    """Remove the lock file and drop the lock (the folders :func:`hold` made, ``made``, go
    too when they were left empty)."""
    try:
        (root / LOCK).unlink()
        for folder in made:  # deepest first; stops at the first that is not empty
            folder.rmdir()
    except OSError:
        pass  # not empty, or someone else changed the folder meanwhile: leave it
    finally:
        f.close()  # closing drops the flock


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def held(out: str | os.PathLike[str]) -> bool:
    """Whether this process holds ``out``'s lock."""
    return os.path.realpath(out) in _held


def _write_record(f: Any, record: dict[str, Any]) -> None:
    f.seek(0)
    f.truncate()
    f.write(json.dumps(record) + "\n")
    f.flush()


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)

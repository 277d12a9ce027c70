"""Helpers for tests of the command line: a refusal in one line, and a folder's files."""

from __future__ import annotations

from pathlib import Path

from thinwire.cli import main


def refused(capsys, argv: list[str], *needles: str) -> str:
    """``thinwire ARGV`` exits 2 with one line, no traceback, holding every needle."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def files(d: Path) -> dict[Path, bytes]:
    """Every file under ``d`` and its bytes."""
    return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}

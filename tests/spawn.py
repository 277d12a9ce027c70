"""Helpers for distributed tests: spawned gloo ranks (with a timeout), a free TCP port and a
process's children (from /proc)."""

from __future__ import annotations

import os
import socket

from thinwire.run.spawn import run_ranks

__all__ = ["children", "free_port", "run_ranks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, with their command lines (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == pid:
            found[int(entry)] = cmdline
    return found

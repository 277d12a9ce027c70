"""Helpers for distributed tests: spawned gloo ranks (with a timeout) and a free TCP port."""

from __future__ import annotations

import socket

from thinwire.run.spawn import run_ranks

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

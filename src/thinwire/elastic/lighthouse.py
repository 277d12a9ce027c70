"""The Lighthouse: torchft's quorum server, started by thinwire.

Every elastic worker's torchft ``Manager`` asks the Lighthouse for a quorum at each step
that communicates and sends it a heartbeat every 100 ms. The Lighthouse decides who is in: a
quorum forms as soon as every worker it has heard from recently asked (or every member of
the last quorum did, the fast path); a worker whose heartbeat stopped for
``heartbeat_timeout_s`` is no longer waited for, and one still heard from but not asking is
waited for up to ``join_timeout_s`` (60 s by default: a DiLoCo-family worker asks only at its
averages, so live workers may be up to a round apart, and a slow one must not be taken for a
dead one). :func:`serve` starts one inside the calling process (``thinwire train --elastic``
on one machine does so), ``thinwire lighthouse`` runs one on its own for workers on several
machines.

It listens only on the address it is given: loopback (``127.0.0.1``) unless the user names
another (see docs/security.md). With a job secret, torchft's server listens on a loopback
port of its own and a :class:`~thinwire.elastic.gate.Gate` on the given address lets
through only connections that prove they hold the secret.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from thinwire.knobs import require

LOCAL = "127.0.0.1"
HEARTBEAT_TIMEOUT_S = 2.0  # a worker silent this long (20 heartbeats) is left out of the next quorum
JOIN_TIMEOUT_S = 60.0  # how long a forming quorum waits for a live worker that has not asked yet
TICK_MS = 10  # how often the Lighthouse looks at who asked; a quorum forms at most this late


@dataclass
class Lighthouse:
    """A running Lighthouse: ``address`` (``http://host:port``) is what workers are given."""

    server: Any
    address: str
    min_workers: int
    gate: Any = None  # a Gate in front of the server (a job with a secret)

    def shutdown(self) -> None:
        if self.gate is not None:
            self.gate.shutdown()
        self.server.shutdown()


def serve(min_workers: int, bind: str = f"{LOCAL}:0", *, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
          join_timeout_s: float = JOIN_TIMEOUT_S, secret: bytes | None = None,
          gate_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> Lighthouse:
    """Start a Lighthouse in this process on ``bind`` (``host:port``; port 0: any free one)
    that forms no quorum of fewer than ``min_workers`` workers; with ``secret``, behind a
    gate that admits only connections proving they hold it (``gate_timeout_s``: how long
    the gate waits for a connection's proof)."""
    require(join_timeout_s > 0, f"the join timeout must be > 0 seconds, got {join_timeout_s}")
    require(min_workers >= 1, f"--min-workers must be >= 1, got {min_workers}")
    require(heartbeat_timeout_s > 0, f"the heartbeat timeout must be > 0 seconds, got {heartbeat_timeout_s}")
    host, port = split_address(bind)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
    from torchft._torchft import LighthouseServer

    inner = f"{LOCAL}:0" if secret is not None else f"{_bracket(host)}:{port}"  # behind the gate: loopback
    try:
        server = LighthouseServer(bind=inner, min_replicas=min_workers,
                                  join_timeout_ms=int(join_timeout_s * 1000), quorum_tick_ms=TICK_MS,
                                  heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
    except Exception as e:  # torchft raises a bare RuntimeError from its Rust server
        raise ValueError(f"the Lighthouse cannot listen on {bind}: {str(e).splitlines()[0] if str(e) else e}") from None
    bound = int(server.address().rsplit(":", 1)[1])
    if secret is None:
        return Lighthouse(server, f"http://{_bracket(host)}:{bound}", min_workers)
    from thinwire.elastic.gate import Gate

    try:
        gate = Gate(host, port, (LOCAL, bound), secret, gate_timeout_s)
    except OSError as e:
        server.shutdown()
        raise ValueError(f"the Lighthouse cannot listen on {bind}: {e.strerror or e}") from None
    return Lighthouse(server, f"http://{_bracket(host)}:{gate.port}", min_workers, gate)


def split_address(text: str) -> tuple[str, int]:
    """``host:port`` (or ``http://host:port``, ``[v6]:port``) as (host, port)."""
    bare = text.split("://", 1)[1] if "://" in text else text
    host, sep, port = bare.rpartition(":")
    require(bool(sep) and port.isdigit() and bool(host), f"an address must be HOST:PORT, got {text!r}")
    number = int(port)
    require(0 <= number <= 65535, f"a port must be in 0..65535, got {number} in {text!r}")
    return host.strip("[]"), number


def url(text: str) -> str:
    """The ``http://host:port`` form torchft's Manager takes."""
    host, port = split_address(text)
    return f"http://{_bracket(host)}:{port}"


def check_reachable(text: str, timeout_s: float) -> str:
    """This machine's address on the way to the Lighthouse at ``text`` (the one the other
    workers can reach this one at); raises ``ValueError`` naming the address when nothing
    accepts a connection on it within ``timeout_s`` seconds (before a worker builds anything)."""
    host, port = split_address(text)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            return str(sock.getsockname()[0])
    except OSError as e:
        raise ValueError(f"no Lighthouse answers at {text} (within {timeout_s:g} s: {e.strerror or e}); start one "
                         "with `thinwire lighthouse` or leave --lighthouse out for a local run") from None


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host

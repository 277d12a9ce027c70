"""The Lighthouse's gate: in a job with a secret, only a process that proves it holds the
secret reaches the Lighthouse at all.

torchft's Lighthouse (a gRPC server) authenticates nobody. With a secret,
:func:`thinwire.elastic.lighthouse.serve` runs it on a loopback port of its own machine and
puts a :class:`Gate` on the address the workers are given; each worker's torchft manager
talks to the Lighthouse through a :class:`Forwarder` of its own, on loopback. Every
connection through the gate opens with a handshake of fresh nonces, before a byte of gRPC:

1. the gate greets: :data:`GREETING` and its nonce;
2. the client sends its nonce and an HMAC, under the job secret, of both;
3. the gate checks it. A client that fails is sent ``0`` and dropped, and the gate names it
   (its address); one that passes is sent ``1`` and the gate's own HMAC of both nonces, which
   the client checks in turn (a gate of another job is named as such);
4. then the bytes flow both ways unchanged, until either side closes.

A process without the secret therefore never joins a quorum, never learns the other workers'
addresses, and cannot stall the job. The handshake authenticates a connection once, at its
start; it encrypts nothing (docs/security.md). Only ``hmac``, ``hashlib`` and ``secrets``
(:mod:`thinwire.elastic.secret`) are used.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable

from thinwire.elastic import secret

GREETING = b"TWG1"
HELLO_BYTES = len(GREETING) + secret.NONCE_BYTES
ANSWER_BYTES = secret.NONCE_BYTES + secret.DIGEST_BYTES
CHUNK = 1 << 16


class GateRefused(ValueError):
    """The gate and this process hold different secrets (or one of them none)."""


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            break
        data += part
    return data


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between ``a`` and ``b`` until both directions end; then close both."""

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    other = threading.Thread(target=pump, args=(b, a), name="thinwire-gate-pump", daemon=True)
    other.start()
    pump(a, b)
    other.join()
    a.close()
    b.close()


def listening(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``host:port`` alone (port 0: a free one); raises ``OSError``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class _Server:
    """Accepts connections on a listening socket, each handled on a thread of its own."""

    def __init__(self, sock: socket.socket, handle: Callable[[socket.socket, tuple], None], name: str) -> None:
        self.sock, self.handle, self.closed = sock, handle, False
        self.thread = threading.Thread(target=self._accept, name=name, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.handle, args=(conn, peer), name="thinwire-gate-conn", daemon=True).start()

    def shutdown(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Gate(_Server):
    """Listens on ``host:port`` and lets through to ``target`` (the Lighthouse's own loopback
    address) only connections that prove they hold ``key``; ``refused`` lists the others
    (``(address, why)``), each also named on stderr."""

    def __init__(self, host: str, port: int, target: tuple[str, int], key: bytes, timeout_s: float) -> None:
        self.target, self.key, self.timeout_s = target, key, timeout_s
        self.refused: list[tuple[str, str]] = []
        super().__init__(listening(host, port), self._admit, "thinwire-gate")

    def _admit(self, conn: socket.socket, peer: tuple) -> None:
        who = f"{peer[0]}:{peer[1]}"
        try:
            conn.settimeout(self.timeout_s)
            mine = secret.nonce()
            conn.sendall(GREETING + mine)
            answer = _read(conn, ANSWER_BYTES)
            theirs, proof = answer[:secret.NONCE_BYTES], answer[secret.NONCE_BYTES:]
            if len(answer) < ANSWER_BYTES or not secret.matches(self.key, proof, "thinwire-gate-client", mine, theirs):
                if answer:  # a connection that only looked (a reachability check, a worker without a secret
                    # that read the greeting) and closed is not named
                    why = "its proof of the job secret fails" if len(answer) == ANSWER_BYTES else \
                        "it sent no proof of the job secret"
                    self.refused.append((who, why))
                    print(f"thinwire: the Lighthouse's gate refused {who}: {why}", file=sys.stderr, flush=True)
                conn.sendall(b"\x00")
                conn.close()
                return
            conn.sendall(b"\x01" + secret.tag(self.key, "thinwire-gate-server", mine, theirs))
            conn.settimeout(None)
            inner = socket.create_connection(self.target, timeout=self.timeout_s)
            inner.settimeout(None)
        except OSError:
            conn.close()
            return
        _splice(conn, inner)


def handshake(sock: socket.socket, key: bytes, where: str) -> None:
    """The client's side of the gate's handshake on a connected ``sock``; raises
    :class:`GateRefused` naming the mismatch (``where``: the Lighthouse's address)."""
    try:
        hello = _read(sock, HELLO_BYTES)
    except TimeoutError:  # torchft's Lighthouse waits for the client to speak first
        hello = b""
    if not hello.startswith(GREETING) or len(hello) < HELLO_BYTES:
        raise GateRefused(f"the Lighthouse at {where} was started without a job secret, and this worker holds one: "
                          "start it with the same --job-secret-file (or leave the secret out of both)")
    theirs = hello[len(GREETING):]
    mine = secret.nonce()
    sock.sendall(mine + secret.tag(key, "thinwire-gate-client", theirs, mine))
    status = _read(sock, 1)
    if status != b"\x01":
        raise GateRefused(f"the Lighthouse at {where} refused this worker: the two hold different job secrets")
    proof = _read(sock, secret.DIGEST_BYTES)
    if not secret.matches(key, proof, "thinwire-gate-server", theirs, mine):
        raise GateRefused(f"the Lighthouse at {where} does not prove it holds this worker's job secret: it is not "
                          "this job's")


def probe(host: str, port: int, key: bytes | None, timeout_s: float, wait_s: float = 0.5) -> None:
    """Check, before a worker starts, that the Lighthouse at ``host:port`` asks for the secret
    this worker holds (``key``), or for none when it holds none; :class:`GateRefused` names a
    mismatch. Without a key, a gate's greeting is waited for ``wait_s`` seconds (torchft's
    Lighthouse itself sends nothing first)."""
    where = f"{host}:{port}"
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        if key is not None:
            handshake(sock, key, where)
            return
        sock.settimeout(wait_s)
        try:
            hello = sock.recv(len(GREETING))
        except (TimeoutError, OSError):
            return
        if hello == GREETING:
            raise GateRefused(f"the Lighthouse at {where} asks for a job secret and this worker has none; "
                              f"{secret.HOW}")


class Forwarder(_Server):
    """A worker's way to the gated Lighthouse at ``target``: listens on loopback, and passes
    each connection (torchft's manager's) on through the gate's handshake under ``key``;
    ``error``: the gate's refusal, when one came (the worker raises it at its next quorum)."""

    def __init__(self, target: tuple[str, int], key: bytes, timeout_s: float) -> None:
        self.target, self.key, self.timeout_s = target, key, timeout_s
        self.error: GateRefused | None = None
        super().__init__(listening("127.0.0.1"), self._forward, "thinwire-forwarder")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _forward(self, conn: socket.socket, peer: tuple) -> None:
        try:
            outer = socket.create_connection(self.target, timeout=self.timeout_s)
            try:
                handshake(outer, self.key, f"{self.target[0]}:{self.target[1]}")
            except GateRefused as e:
                self.error = e
                outer.close()
                conn.close()
                return
            outer.settimeout(None)
        except OSError:
            conn.close()
            return
        _splice(conn, outer)

"""The state a joining elastic worker takes, sent over the quorum's own process group and
authenticated with the job secret before a byte of it is unpickled.

torchft brings a worker that joins (or fell behind) up to date inside its quorum call: the
source sends its state (``send_checkpoint``), the joiner receives it (``recv_checkpoint``)
and torchft applies it through the worker's ``load_state_dict``. torchft's own transports
unpickle what they receive (HTTP: an HTTP server on every worker; its process-group
transport: ``pickle`` of its metadata). :class:`SignedTransport` replaces them, over the
group torchft has just configured for the quorum, so that no worker runs a state server:

1. the source and the joiner swap fresh nonces;
2. the joiner proves it holds the secret: an HMAC over both nonces, the quorum id and the
   step. A joiner without it is sent nothing (the source names it and fails its step);
3. the source sends the state (``torch.save``) with an HMAC over both nonces, the quorum,
   the step and the state's SHA-256. The joiner checks it before anything else, and loads
   the state with ``weights_only=True`` (tensors and plain containers: no code runs). A
   state that fails the check (another secret, one byte changed on the way) is refused and
   its source named; the joiner's step fails, and torchft tries again at the next quorum.

Without a secret the same exchange runs under an empty key: it then guards against
corruption, not against anyone.
"""

from __future__ import annotations

import hashlib
import io
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport

from thinwire.elastic import secret

TAG = 0x7477  # the point-to-point tags of this exchange start here ("tw")
DIGEST = secret.DIGEST_BYTES


class StateRefused(RuntimeError):
    """A state, or a peer asking for one, that failed its authentication; ``ranks``: the
    peers' places in the quorum; ``mine``: the source refused this worker's own proof."""

    def __init__(self, message: str, ranks: list[int], mine: bool = False) -> None:
        super().__init__(message)
        self.ranks, self.mine = ranks, mine


class SignedTransport(CheckpointTransport[Any]):
    """State transfer over ``pg`` (torchft's group of the current quorum: ``send``/``recv``
    of tensors between its ranks) authenticated under ``key`` (the job secret, or ``b""``).
    ``quorum()`` is the current quorum's id and ``name(rank)`` the worker at a rank of it,
    for the messages."""

    def __init__(self, pg: Any, key: bytes | None, quorum: Callable[[], int | None],
                 name: Callable[[int], str]) -> None:
        self.pg, self.key, self.quorum, self.name = pg, key or b"", quorum, name

    def metadata(self) -> str:
        return "thinwire-signed-pg"  # no address: the state travels over the quorum's group

    def disallow_checkpoint(self) -> None:
        return None  # every send has completed when send_checkpoint returns

    def shutdown(self, wait: bool = True) -> None:
        return None

    # -- the source ---------------------------------------------------------------------------
    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        payload = buffer.getvalue()
        refused = [dst for dst in dst_ranks if not self._send_one(dst, step, payload, timeout)]
        if refused:
            raise StateRefused(f"sent no state to {', '.join(self.name(r) for r in refused)}: it did not prove it "
                               "holds the job's secret", refused)

    def _send_one(self, dst: int, step: int, payload: bytes, timeout: timedelta) -> bool:
        mine = secret.nonce()
        theirs = self._swap(dst, mine, timeout)
        proof = self._recv_bytes(dst, DIGEST, TAG + 2, timeout)
        qid = self._qid()
        ok = secret.matches(self.key, proof, "thinwire-heal-ask", qid, _int(step), mine, theirs)
        digest = hashlib.sha256(payload).digest() if ok else b""
        seal = secret.tag(self.key, "thinwire-heal-state", qid, _int(step), theirs, mine, digest) if ok \
            else bytes(DIGEST)
        self._send(dst, torch.tensor([int(ok), len(payload) if ok else 0], dtype=torch.int64), TAG + 3, timeout)
        if ok:
            self._send(dst, _row(seal + payload), TAG + 4, timeout)
        return ok

    # -- the joiner ---------------------------------------------------------------------------
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        mine = secret.nonce()
        theirs = self._swap(src_rank, mine, timeout)
        qid = self._qid()
        self._send(src_rank, _row(secret.tag(self.key, "thinwire-heal-ask", qid, _int(step), theirs, mine)),
                   TAG + 2, timeout)
        head = torch.zeros(2, dtype=torch.int64)
        self._recv(src_rank, head, TAG + 3, timeout)
        ok, size = (int(v) for v in head.tolist())
        source = self.name(src_rank)
        if not ok:
            raise StateRefused(f"{source} sent no state: it refused this worker's proof of the job secret (the two "
                               "hold different secrets)", [src_rank], mine=True)
        body = self._recv_bytes(src_rank, DIGEST + size, TAG + 4, timeout)
        seal, payload = body[:DIGEST], body[DIGEST:]
        if not secret.matches(self.key, seal, "thinwire-heal-state", qid, _int(step), mine, theirs,
                              hashlib.sha256(payload).digest()):
            raise StateRefused(f"the state sent by {source} failed its authentication (another job secret, or "
                               "changed on the way): refused, nothing of it loaded", [src_rank])
        return torch.load(io.BytesIO(payload), weights_only=True)

    # -- the wire -------------------------------------------------------------------------------
    def _qid(self) -> bytes:
        return str(self.quorum()).encode()

    def _swap(self, peer: int, mine: bytes, timeout: timedelta) -> bytes:
        """Send this side's nonce to ``peer`` and receive its own."""
        theirs = torch.zeros(secret.NONCE_BYTES, dtype=torch.uint8)
        send = self.pg.send([_row(mine)], peer, TAG)
        self._recv(peer, theirs, TAG, timeout)
        send.wait(timeout)
        return bytes(theirs.tolist())

    def _send(self, peer: int, t: torch.Tensor, tag: int, timeout: timedelta) -> None:
        self.pg.send([t], peer, tag).wait(timeout)

    def _recv(self, peer: int, t: torch.Tensor, tag: int, timeout: timedelta) -> None:
        self.pg.recv([t], peer, tag).wait(timeout)

    def _recv_bytes(self, peer: int, size: int, tag: int, timeout: timedelta) -> bytes:
        t = torch.zeros(size, dtype=torch.uint8)
        self._recv(peer, t, tag, timeout)
        return t.numpy().tobytes()


class ReportedByThinwire(logging.Filter):
    """Drops torchft's own log record (a traceback on stderr) of a refused state transfer:
    the worker names the peer in its records and on the console instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StateRefused))


def quiet_torchft() -> None:
    """Install :class:`ReportedByThinwire` on torchft's manager logger (once)."""
    log = logging.getLogger("torchft.manager")
    if not any(isinstance(f, ReportedByThinwire) for f in log.filters):
        log.addFilter(ReportedByThinwire())


def _row(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _int(n: int) -> bytes:
    return int(n).to_bytes(8, "big", signed=True)

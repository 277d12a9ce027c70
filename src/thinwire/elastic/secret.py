"""The job secret of an elastic job: what a worker proves it holds, never sends.

Every worker of a job started with a secret (``--job-secret-file PATH``, or the secret itself
in :data:`ENV`) proves at each new quorum that it holds it (:func:`tag` over fresh nonces of
every member, :class:`~thinwire.elastic.worker.ElasticWorker`'s admission), and state sent
to a joining worker travels with a tag of it over a handshake of fresh nonces
(:mod:`thinwire.elastic.transport`): a process without the secret cannot take part, and its
bytes are checked out before any is unpickled. Only the standard library's ``hmac``
(HMAC-SHA-256), ``hashlib`` and ``secrets`` are used; nothing here is cryptography of its own.

A secret file must hold at least :data:`MIN_BYTES` bytes (trailing whitespace, such as the
newline of ``echo``, is not part of it) and must not be readable by every user of the
machine (``chmod 600``). Make one with::

    python -c "import secrets; print(secrets.token_hex(32))" > job.secret && chmod 600 job.secret
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping

ENV = "THINWIRE_JOB_SECRET"  # the secret itself, for a scheduler that hands secrets over in the environment
MIN_BYTES = 16
NONCE_BYTES = 16
DIGEST_BYTES = 32  # an HMAC-SHA-256
HOW = (f"set one with --job-secret-file PATH (a file of at least {MIN_BYTES} bytes, chmod 600) or the "
       f"{ENV} environment variable (docs/security.md)")


class SecretError(ValueError):
    """A job secret that cannot be used: its one line names the rule broken."""


def read(path: str | None, env: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret: the file at ``path``, else :data:`ENV` in ``env`` (default: this
    process's environment), else None (a job without a secret). Raises :class:`SecretError`
    for both at once, and for a file that is missing, unreadable, readable by every user,
    empty, or shorter than :data:`MIN_BYTES`."""
    value = (os.environ if env is None else env).get(ENV)
    if path is not None and value is not None:
        raise SecretError(f"--job-secret-file and {ENV} are both set: give the job secret once")
    if path is None:
        if value is None:
            return None
        secret = value.strip().encode()
        if len(secret) < MIN_BYTES:
            raise SecretError(f"{ENV} holds {len(secret)} byte(s); a job secret needs at least {MIN_BYTES}")
        return secret
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise SecretError(f"--job-secret-file {path}: no such file") from None
    except OSError as e:
        raise SecretError(f"--job-secret-file {path}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise SecretError(f"--job-secret-file {path}: not a file")
    if info.st_mode & stat.S_IROTH:
        raise SecretError(f"--job-secret-file {path}: every user of this machine can read it; make it yours alone "
                          f"(chmod 600 {path})")
    try:
        with open(path, "rb") as f:
            secret = f.read().rstrip()
    except OSError as e:
        raise SecretError(f"--job-secret-file {path}: cannot be read ({e.strerror})") from None
    if not secret:
        raise SecretError(f"--job-secret-file {path}: the file is empty")
    if len(secret) < MIN_BYTES:
        raise SecretError(f"--job-secret-file {path}: it holds {len(secret)} byte(s); a job secret needs at least "
                          f"{MIN_BYTES}")
    return secret


def nonce() -> bytes:
    """A fresh random nonce (``secrets``)."""
    return secrets.token_bytes(NONCE_BYTES)


def tag(key: bytes, purpose: str, *parts: bytes) -> bytes:
    """HMAC-SHA-256 under ``key`` of ``purpose`` and ``parts``, each length-prefixed so that no
    two different sequences of parts read alike."""
    mac = hmac.new(key, purpose.encode(), hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def matches(key: bytes, given: bytes, purpose: str, *parts: bytes) -> bool:
    """Whether ``given`` is :func:`tag` of the parts under ``key`` (compared in constant time)."""
    return hmac.compare_digest(given, tag(key, purpose, *parts))


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine alone (a loopback address or ``localhost``)."""
    import ipaddress

    name = host.strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False

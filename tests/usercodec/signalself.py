"""A codec for fault tests: identity, except that one rank signals its own process.

``SIGNALSELF_RANK`` (the rank, read from ``RANK``), ``SIGNALSELF_AT`` (this process's Nth
encode) and ``SIGNALSELF_SIGNAL`` (``STOP`` or ``TERM``) in the environment choose when; with
them unset it is identity. Used as ``--import usercodec.signalself --method signalself``.
"""

from __future__ import annotations

import os
import signal

from thinwire.codecs.identity import Identity
from thinwire.codecs.specs import register


@register
class SignalSelf(Identity):
    name = "signalself"
    summary = "identity; one rank signals itself at a chosen encode (fault tests)"

    def __init__(self, config) -> None:
        super().__init__(config)
        self._encodes = 0

    def encode(self, x, *, key=""):
        self._encodes += 1
        rank, at = os.environ.get("SIGNALSELF_RANK"), os.environ.get("SIGNALSELF_AT")
        if rank is not None and rank == os.environ.get("RANK") and at is not None and self._encodes == int(at):
            os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("SIGNALSELF_SIGNAL", "STOP")))
        return super().encode(x, key=key)

"""``thinwire train`` that kills itself (SIGKILL) at a chosen point of the quorum protocol.

    python benchmarks/_kill_point.py POINT STEP STAMP -- <arguments of thinwire train>

From the first quorum asked for at or after the job's step STEP, the worker dies at POINT,
after writing ``time.time()`` to the file STAMP (the moment of the fault, read by
bench_elastic). The points, in the order a worker meets them in one quorum call:

* ``before``: about to ask the Lighthouse (the others ask and wait for it);
* ``asking``: 20 ms into the call to its own torchft manager server, which asks the
  Lighthouse (the quorum has usually formed with this worker in it by then, or is forming);
* ``answered``: the Lighthouse's answer received, a quorum with this worker in it;
* ``rendezvous``: inside the new group's set-up, its store reached, before gloo's
  connections (the others wait in gloo's rendezvous for this worker);
* ``configured``: the group set up, before the state transfer and thinwire's admission
  (the others' first exchange over the group meets a closed connection).

Two workers run with the same POINT and STEP die in the same quorum call: "two workers
killed at once, at any point of the quorum protocol".
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

POINTS = ("before", "asking", "answered", "rendezvous", "configured")
ASKING_S = 0.02


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[3] != "--" or argv[0] not in POINTS or not argv[1].isdigit():
        print(f"usage: _kill_point.py {{{','.join(POINTS)}}} STEP STAMP -- ARGS", file=sys.stderr)
        return 2
    point, step, stamp, rest = argv[0], int(argv[1]), argv[2], argv[4:]
    armed = threading.Event()

    def die() -> None:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def at(name: str) -> None:
        if armed.is_set() and point == name:
            die()

    import torchft.manager as tm
    import torchft.process_group as tpg

    from thinwire.elastic import worker

    quorum = worker.ElasticWorker._quorum

    def ask(self: Any) -> None:
        if self.step >= step:
            armed.set()
        at("before")
        quorum(self)

    worker.ElasticWorker._quorum = ask  # type: ignore[method-assign]

    class Client:
        """torchft's manager client, with the points around the quorum call."""

        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def _quorum(self, *args: Any, **kwargs: Any) -> Any:
            if armed.is_set() and point == "asking":
                threading.Timer(ASKING_S, die).start()
            answer = self._inner._quorum(*args, **kwargs)
            at("answered")
            return answer

    init = tm.Manager.__init__

    def manager_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._client = Client(self._client)

    tm.Manager.__init__ = manager_init  # type: ignore[method-assign]
    create, configure = tpg.ProcessGroupGloo._create_pg, tpg.ProcessGroupGloo.configure

    def create_pg(self: Any, *args: Any, **kwargs: Any) -> Any:
        at("rendezvous")
        return create(self, *args, **kwargs)

    def configured(self: Any, *args: Any, **kwargs: Any) -> None:
        configure(self, *args, **kwargs)
        at("configured")

    tpg.ProcessGroupGloo._create_pg = create_pg  # type: ignore[method-assign]
    tpg.ProcessGroupGloo.configure = configured  # type: ignore[method-assign]
    from thinwire.cli import main as thinwire

    return thinwire(["train", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

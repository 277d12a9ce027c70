"""The first import of the fork server that local ranks start from
(:func:`thinwire.run.spawn.rank_context`): the server ignores SIGTERM, and leaves without
tearing its interpreter down.

A scheduler's SIGTERM to the job's process group is for the launcher and the ranks, which
stop the run at a step with a checkpoint; the server ending then would read as every rank's
end. It needs no signal to go: it leaves when its launcher does. Its exit skips the
interpreter's finalization (``os._exit`` once its streams are flushed): with torch and its
compiler front end imported, that teardown takes about a second of CPU, and the server holds
the launcher's stderr until it is gone, so whoever reads the command's output would wait for
it. Imported anywhere else, this module does nothing."""

import atexit
import os
import signal
import sys


def _leave() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules:  # the server's own process
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    atexit.register(_leave)  # the last registered runs first: no other exit handler of the server's is needed

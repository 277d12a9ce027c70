"""The first import of the fork server that local ranks start from
(:func:`thinwire.run.spawn.rank_context`): the server ignores SIGTERM.

A scheduler's SIGTERM to the job's process group is for the launcher and the ranks, which
stop the run at a step with a checkpoint; the server ending then would read as every rank's
end. It needs no signal to go: it leaves when its launcher does. Imported anywhere else, this
module does nothing."""

import signal
import sys

if sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules:  # the server's own process
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

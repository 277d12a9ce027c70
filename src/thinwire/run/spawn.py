"""Start local ranks: where they start from (:func:`rank_context`, a fork server that imported
torch once), how each begins (:func:`begin_rank`) and ends (:func:`leave_rank`); and
:func:`run_ranks`, a function on N local gloo ranks with a hard timeout.

``run_ranks`` is for tests, benchmarks and experiments that need a real ``torch.distributed``
world on one machine: ``run_ranks(fn, 2, *args)`` calls ``fn(rank, world_size, *args)`` in
each rank (``fn`` must be importable: a module-level function) and returns the results by rank.

The fork server's preload is set for the whole process (``set_forkserver_preload``); a server
this process started before thinwire's first run, with a preload of its own, is used as it
is: the ranks then import what they need themselves, and the server does not ignore SIGTERM.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world_size: int, outdir: str, threads: int, args: tuple,
           env: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    begin_rank(env)
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    # a file rendezvous: no TCP port to race for with other runs on the machine
    store = os.path.join(outdir, "rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(("ok", result), f)
    except BaseException:
        with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    else:
        gc.collect()  # what holds the group in a reference cycle (a DDP wrapper, a hook's state) goes while it lives
        dist.barrier()  # nobody tears the group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    leave_rank()


def leave_rank() -> None:
    """End a rank that finished without interpreter finalization: a gloo worker thread that
    still releases a tensor then would need the GIL, and Python ends such a thread in a way
    C++ answers with std::terminate (SIGABRT, "terminate called without an active exception").
    The rank's output is already written."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# what every local rank imports first: the fork server imports it once (thinwire.run.rank_server: it
# ignores SIGTERM, so that a signal to the job's process group leaves it to the launcher and the ranks).
# torch._dynamo: every optimizer's constructor imports it (about 1.4 s of CPU, once per process, else
# in each rank); torch.utils.tensorboard: rank 0 of a run with --out writes its events. An import that
# fails here (tensorboard not installed) is skipped by the server, and a rank that needs it says so.
PRELOAD = ["thinwire.run.rank_server", "torch", "torch.distributed", "torch._dynamo", "torch.utils.tensorboard",
           "thinwire.run.trainer"]


def rank_context() -> Any:
    """The multiprocessing context local ranks start from: ``forkserver`` where there is one
    (Linux; its server imported :data:`PRELOAD` once, so a rank starts in milliseconds instead
    of importing torch again, about 1.5 s of CPU each, and torch's compiler front end, which
    any optimizer imports, about 1.4 s more), else ``spawn``. Neither inherits the
    caller's threads or CUDA state. A rank started from it calls :func:`begin_rank` with the
    caller's ``os.environ``."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def begin_rank(env: dict[str, str]) -> None:
    """The start of a rank started from :func:`rank_context`: the caller's environment
    ``env`` (a fork server's children would otherwise hold the server's, from when it
    started), SIGTERM handled as by default (the server ignores it), and no orphan: the rank
    exits (status 1) as soon as the process that started it is gone (its end of the pipe
    multiprocessing keeps to it closes)."""
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def run_ranks(fn: Callable, world_size: int, *args: Any, threads: int = 1, timeout: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned CPU ranks (``threads`` torch
    threads each), the process group already initialised; the results by rank.

    Raises ``AssertionError`` naming the rank if one fails, ``TimeoutError`` if the run takes
    longer than ``timeout`` seconds (the ranks are then killed).
    """
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory() as outdir:
        started = mp.start_processes(_entry, args=(fn, world_size, outdir, threads, args, dict(os.environ)),
                                     nprocs=world_size, join=False, start_method=rank_context().get_start_method())
        deadline = time.monotonic() + timeout
        try:
            while not started.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout} s")
        except mp.ProcessRaisedException as e:
            raise AssertionError(f"a rank failed:\n{e}") from None
        finally:
            for p in started.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for r in range(world_size):
            with open(os.path.join(outdir, f"{r}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results

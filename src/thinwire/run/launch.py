"""Start the ranks of a run: spawn N local ranks (gloo on 127.0.0.1), or join a torchrun world.

Local spawn: the launcher process shows progress and watches the ranks. When one rank
fails (raises, or dies from a signal), every other rank is terminated at once and the run
ends with :class:`RunFailed` naming the rank; collectives also carry a timeout, and each
rank exits by itself if the launcher disappears, so nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import queue as queue_mod
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from thinwire.run.config import TrainConfig, import_modules
from thinwire.run.progress import ProgressView
from thinwire.run.spawn import leave_rank

COLLECTIVE_TIMEOUT_S = 60.0  # a collective waiting longer than this on a silent peer fails
GRACE_S = 1.0  # after a rank fails, how long to wait for its own error message


class RunFailed(RuntimeError):
    """A rank failed; the message names it."""


def launch(cfg: TrainConfig, *, show_progress: bool = True) -> dict[str, Any] | None:
    """Run ``cfg`` (already resolved). Returns rank 0's summary (None on other torchrun ranks)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _join_torchrun(cfg, show_progress)
    return _spawn_local(cfg, show_progress)


# -- torchrun -------------------------------------------------------------------------------
def _join_torchrun(cfg: TrainConfig, show_progress: bool) -> dict[str, Any] | None:
    from thinwire.comm.torch_dist import init_from_env
    from thinwire.run.trainer import train_rank

    import_modules(cfg.imports)  # the CLI's resolve() did already; a script's launch() may not have
    comm = _maybe_emulate(init_from_env(timeout_s=COLLECTIVE_TIMEOUT_S), cfg)
    cfg = dataclasses.replace(cfg, workers=comm.world_size)  # torchrun's world, not --workers
    device = _device()
    view = ProgressView(cfg) if (show_progress and comm.rank == 0) else None
    stop = threading.Event()  # torchrun forwards SIGINT / SIGTERM to every rank
    received: list[str] = []
    # torchrun forwards the signal it gets to every rank, so a scheduler that signals every
    # process of the job reaches a rank twice: a repeat must not cancel the checkpoint (torchrun
    # kills ranks that outlast its own grace period)
    restore = _on_stop_signals(stop, received, escalate=False)
    try:
        if view:
            view.start()
        summary = train_rank(cfg, comm, view.handle if view else None, device, stop_requested=stop.is_set)
        if summary is not None and received:
            summary["signal"] = received[0]
        gc.collect()  # what holds the group in a reference cycle goes while it lives
        torch.distributed.barrier()
        return summary
    finally:
        restore()
        if view:
            view.stop()
        torch.distributed.destroy_process_group()


def _device() -> torch.device:
    """The rank's device: its GPU under NCCL (init_from_env selected it), else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _maybe_emulate(comm, cfg: TrainConfig):
    if not cfg.emulate_link:
        return comm
    from thinwire.comm.link import EmulatedLink, Link

    return EmulatedLink(comm, Link.parse(cfg.links[0]))


# -- local spawn ----------------------------------------------------------------------------
def _threads(cfg: TrainConfig) -> int:
    return cfg.threads or max(1, (os.cpu_count() or 1) // cfg.workers)


def _rank_main(rank: int, cfg: TrainConfig, rendezvous: str, q: Any, parent: int, stop: Any = None) -> None:
    """Entry point of a spawned rank: gloo on this machine, met through a rendezvous file
    (no TCP port to pick, so concurrent runs cannot collide)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides (Ctrl-C reaches the whole group)
    asked = threading.Event()  # SIGTERM to the whole process group (e.g. a scheduler): stop like the launcher
    signal.signal(signal.SIGTERM, lambda signum, frame: asked.set())
    _exit_with_parent(parent)
    torch.set_num_threads(_threads(cfg))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.workers), LOCAL_RANK=str(rank))
    try:
        from thinwire.comm.torch_dist import TorchComm
        from thinwire.run.trainer import train_rank

        import_modules(cfg.imports)  # a spawned rank starts afresh: the launcher's registrations are not here
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=cfg.workers,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        comm = _maybe_emulate(TorchComm(), cfg)

        def report(kind: str, **fields: Any) -> None:
            q.put((kind, rank, fields))  # every step: the launcher names the last completed one

        summary = train_rank(cfg, comm, report,
                             stop_requested=lambda: asked.is_set() or (stop is not None and stop.is_set()))
        gc.collect()  # what holds the group in a reference cycle (a DDP wrapper, a hook's state) goes while it lives
        torch.distributed.barrier()  # nobody tears the group down while a peer still talks to it
        torch.distributed.destroy_process_group()
        q.put(("done", rank, summary))
        q.close()
        q.join_thread()  # the summary reaches the launcher before the rank leaves
        leave_rank()
    except BaseException as e:  # report, then exit non-zero; the launcher names this rank
        q.put(("error", rank, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))
        q.close()
        q.join_thread()  # flush the report before leaving
        sys.stderr.flush()
        os._exit(1)


def _exit_with_parent(parent: int) -> None:
    """Leave no orphan: exit when the launcher process is gone."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _spawn_local(cfg: TrainConfig, show_progress: bool) -> dict[str, Any] | None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    stop = ctx.Event()  # set by SIGINT / SIGTERM: the ranks finish the step, checkpoint and end
    tmp = tempfile.TemporaryDirectory(prefix="thinwire-")
    rendezvous = os.path.join(tmp.name, "rendezvous")
    procs = [
        ctx.Process(target=_rank_main, args=(r, cfg, rendezvous, q, os.getpid(), stop), daemon=True)
        for r in range(cfg.workers)
    ]
    received: list[str] = []
    restore = _on_stop_signals(stop, received)
    view = ProgressView(cfg) if show_progress else None
    summary = None
    done: set[int] = set()
    errors: dict[int, dict] = {}
    last_step = 0
    try:
        for p in procs:
            p.start()
        if view:
            view.start()
        while len(done) < cfg.workers:
            try:
                kind, rank, fields = q.get(timeout=0.2)
            except queue_mod.Empty:
                kind = None
            if kind == "step":
                last_step = fields["step"]
            if kind in ("step", "eval") and view:
                view.handle(kind, **fields)
            elif kind == "done":
                done.add(rank)
                summary = fields if rank == 0 else summary
            elif kind == "error":
                errors.setdefault(rank, fields)
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
            if errors or failed:
                raise RunFailed(_failure_message(procs, q, errors, failed, last_step))
        for p in procs:
            p.join(timeout=30)
        if summary is not None and received:
            summary["signal"] = received[0]
        return summary
    finally:
        restore()
        if view:
            view.stop()
        _terminate(procs)
        tmp.cleanup()


def _on_stop_signals(stop: Any, received: list[str], escalate: bool = True) -> Callable[[], None]:
    """SIGINT / SIGTERM: the first asks the ranks to stop after their step (with a checkpoint
    when the run has an --out); a second one stops at once when ``escalate``, else it is
    ignored. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signal handlers live in the main thread only

    def handle(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            if not escalate:
                return
            raise KeyboardInterrupt  # the second signal: terminate the ranks now
        received.append(name)
        stop.set()
        sys.stderr.write(f"thinwire: {name}: stopping after the current step (again to stop at once)\n")

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    return restore


def _failure_message(procs, q, errors: dict[int, dict], failed: list[int], last_step: int) -> str:
    """Name the rank that failed first: one killed by a signal, else the first to report."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:  # collect the failing rank's own report if it is coming
        try:
            kind, rank, fields = q.get(timeout=0.1)
            if kind == "error":
                errors.setdefault(rank, fields)
        except queue_mod.Empty:
            pass
    codes = [p.exitcode for p in procs]  # before we terminate the others ourselves
    _terminate(procs)
    for r, code in enumerate(codes):
        if code is not None and code < 0 and r not in errors:
            sig = signal.Signals(-code).name
            return f"rank {r} died ({sig}) after step {last_step}; the other ranks were stopped"
    r = next(iter(errors)) if errors else failed[0]  # the first to report is the cause
    what = errors[r]["error"] if r in errors else f"exit code {procs[r].exitcode}"
    if os.environ.get("THINWIRE_DEBUG") and r in errors:
        sys.stderr.write(errors[r]["traceback"])
    return f"rank {r} failed after step {last_step}: {what}"


def _terminate(procs) -> None:
    """Kill the ranks still alive (SIGKILL: a rank takes SIGTERM as a request to stop after
    its step, and these ones must end now) and reap them."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)

"""Start the ranks of a run: spawn N local ranks (gloo on the loopback interface), or join a torchrun world.

Local spawn: the launcher process shows progress and watches the ranks. When one rank
fails (raises, or dies from a signal), every other rank is terminated at once and the run
ends with :class:`RunFailed` naming the rank; collectives also carry a timeout, and each
rank exits by itself if the launcher disappears, so nothing is left behind.

Every rank beats a heartbeat counter once a second, from a thread (it stops only when the
whole process stops): spawned ranks in an array shared with the launcher, torchrun ranks in
the process group's store. A rank whose collective fails under gloo looks at the counters
before it reports: a peer whose counter stood still is the one that stopped responding
(SIGSTOP, a frozen machine, a process gone), and the run names that peer, not the rank that
timed out waiting for it. Counters rather than clock readings: ranks on different machines
need not agree on the time. (NCCL's own watchdog aborts a rank whose collective times out,
before any of this can run.) The launcher of spawned ranks reads the same counters: a rank
whose counter stands still for the collective timeout and a few seconds more is named and the
run ended by the launcher itself, so a rank that stops while its peers are busy in a long step
(not yet waiting on it) still ends the run within :func:`~thinwire.comm.torch_dist.hang_limit`.

A first SIGINT / SIGTERM asks the ranks to stop at their next stop poll (about once a second
of training) and checkpoint there. Ranks that have not taken the request up within the grace
(:func:`~thinwire.run.config.stop_grace`: a step of minutes, a rank still starting) are ended:
by the launcher for spawned ranks, by a timer in each rank under torchrun; the run then keeps
nothing after its last checkpoint.
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
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from thinwire.comm.base import Communicator
from thinwire.comm.torch_dist import (  # noqa: F401 (public here)
    COLLECTIVE_TIMEOUT_S,
    HANG_LIMIT_S,
    HEARTBEAT_S,
    LAUNCHER_AFTER_TIMEOUT_S,
    SILENT_AFTER_S,
    TIMEOUT_ENV,
    collective_timeout,
    hang_limit,
)
from thinwire.run.config import TrainConfig, import_modules, stop_grace
from thinwire.run.progress import ProgressView
from thinwire.run.spawn import begin_rank, leave_rank, rank_context
from thinwire.run.summary import Summary

GRACE_S = 1.0  # after a rank fails, how long to wait for its own error message
REPEAT_S = 1.0  # a signal repeated within this long of the first is the same delivery (see _on_stop_signals)
LOOK_GAP_S = 1.0  # the launcher's looks at the heartbeats: a longer gap between two counts as this long


class RunFailed(RuntimeError):
    """A rank failed; the message names it."""


def launch(cfg: TrainConfig, *, show_progress: bool = True) -> Summary | None:
    """Run ``cfg`` (already resolved). Returns rank 0's summary (None on other torchrun ranks).
    The run holds its ``--out``'s lock (:func:`thinwire.run.outdir.hold`; re-entrant, so a
    command that took it before resolving keeps it): rank 0 under torchrun, else this process."""
    from thinwire.run import outdir

    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    with outdir.hold(cfg.out if not torchrun or os.environ["RANK"] == "0" else None):
        if torchrun:
            return _join_torchrun(cfg, show_progress)
        return _spawn_local(cfg, show_progress)


# -- heartbeats ------------------------------------------------------------------------------
def _beat_key(rank: int) -> str:
    return f"thinwire/heartbeat/{rank}"


def _store() -> torch.distributed.Store | None:
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001  (no group, or a torch without it: no heartbeats)
        return None


def start_heartbeat(rank: int, beats: Any = None) -> threading.Event:
    """Beat this rank's counter every :data:`HEARTBEAT_S` from a daemon thread: slot ``rank``
    of ``beats`` (a shared array, spawned ranks), else a key in the default group's store
    (torchrun: its store lives in memory; a FileStore would grow with every beat). Returns
    the event that ends the thread (it also ends when the store goes away)."""
    done = threading.Event()
    store = None if beats is not None else _store()
    if beats is None and store is None:
        return done

    def beat() -> None:
        while not done.is_set():
            try:
                if beats is not None:
                    beats[rank] += 1  # only this rank writes its slot
                elif store is not None:  # always, without beats (checked above)
                    store.add(_beat_key(rank), 1)
            except Exception:  # noqa: BLE001  (the group was torn down: the rank is leaving)
                return
            done.wait(HEARTBEAT_S)

    threading.Thread(target=beat, name="thinwire-heartbeat", daemon=True).start()
    return done


def silent_ranks(rank: int, world: int, beats: Any = None, wait: float = SILENT_AFTER_S) -> list[int]:
    """The peers whose heartbeat did not move during ``wait`` seconds: the ranks that
    stopped responding. Empty when there is nothing to read, or when reading does not finish
    in time (a store whose host is itself stopped must not hang the report)."""
    if world < 2:
        return []
    store = None if beats is not None else _store()
    if beats is None and store is None:
        return []

    def counts() -> list[int]:
        if beats is not None:
            return [int(beats[r]) for r in range(world)]
        assert store is not None  # checked above: there is one or the other
        return [store.add(_beat_key(r), 0) for r in range(world)]

    found: list[int] = []

    def watch() -> None:
        try:
            before = counts()
            time.sleep(wait)
            after = counts()
        except Exception:  # noqa: BLE001
            return
        found.extend(r for r in range(world) if r != rank and after[r] == before[r])

    reader = threading.Thread(target=watch, name="thinwire-heartbeat-check", daemon=True)
    reader.start()
    reader.join(wait + 2.0)
    return list(found) if not reader.is_alive() else []


def collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed (a timeout, a peer's connection gone): the
    errors worth checking the heartbeats for before reporting."""
    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in text for w in ("gloo", "nccl", "timed out", "connection"))


def _silent_message(silent: list[int], rank: int | None, step: int | None, error: str, stopped: bool = False,
                    seconds: float = SILENT_AFTER_S) -> str:
    """``rank`` timed out waiting on the ``silent`` peers (``error``); None: the launcher saw
    their heartbeats stand still for ``seconds`` and ended the run itself."""
    who = ", ".join(map(str, silent))
    after = "" if step is None else f" after step {step}"
    how = ("its process is stopped (state T: SIGSTOP or SIGTSTP)" if stopped
           else "stopped, e.g. by SIGSTOP, frozen, or gone")
    then = "the other ranks were stopped" if rank is None else f"rank {rank} timed out waiting: {error}"
    return (f"rank{'s' if len(silent) > 1 else ''} {who} stopped responding{after} (no heartbeat for "
            f"{seconds:.0f} s: {how}); {then}")


# -- torchrun -------------------------------------------------------------------------------
def _join_torchrun(cfg: TrainConfig, show_progress: bool) -> Summary | None:
    from thinwire.comm.torch_dist import init_from_env
    from thinwire.run.trainer import train_rank

    import_modules(cfg.imports)  # the CLI's resolve() did already; a script's launch() may not have
    comm = _maybe_emulate(init_from_env(timeout_s=collective_timeout()), cfg)
    beating = start_heartbeat(comm.rank)
    cfg = dataclasses.replace(cfg, workers=comm.world_size)  # torchrun's world, not --workers
    device = _device()
    view = ProgressView(cfg) if (show_progress and comm.rank == 0) else None
    stop = _TorchrunStop(comm.rank)

    def report(kind: str, **fields: Any) -> None:  # rank 0's: the step its messages name, and the view
        if kind == "step":
            stop.step = fields["step"]
        if view is not None:
            view.handle(kind, **fields)

    # torchrun forwards the signal it gets to every rank, so a scheduler that signals every
    # process of the job reaches a rank twice: a repeat must not cancel the checkpoint (torchrun
    # kills ranks that outlast its own grace period)
    restore = _on_stop_signals(lambda signum: stop.timer.start(), stop.received, escalate=False)
    try:
        if view:
            view.start()
        try:
            summary = train_rank(cfg, comm, report if comm.rank == 0 else None, device,
                                 stop_requested=stop.requested, stop_agreed=lambda: stop.taken.append(True))
            stop.timer.cancel()  # finished: a signal after the last stop poll lets the run end by itself
        except RuntimeError as e:  # a collective that failed: name the peer that went silent, if one did
            silent = silent_ranks(comm.rank, comm.world_size) if collective_failure(e) else []
            if silent:
                raise RunFailed(_silent_message(silent, comm.rank, stop.step, _first_line(e))) from e
            raise
        if summary is not None and stop.received:
            summary.signal = stop.received[0]
        gc.collect()  # what holds the group in a reference cycle goes while it lives
        torch.distributed.barrier()
        return summary
    finally:
        stop.timer.cancel()
        beating.set()
        restore()
        if view:
            view.stop()
        torch.distributed.destroy_process_group()


class _TorchrunStop:
    """A torchrun rank's stop: torchrun forwards SIGINT and SIGTERM to every rank (``received``);
    the rank takes the stop up at its next stop poll (``taken``), or, when the grace
    (:func:`~thinwire.run.config.stop_grace`, ``timer``) runs out before it reaches one, ends
    at once."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.received: list[str] = []
        self.taken: list[bool] = []
        self.step: int | None = None  # the last step rank 0 reported (other ranks do not know it)
        self.timer = threading.Timer(stop_grace(), self.give_up)
        self.timer.daemon = True

    def requested(self) -> int:
        """The stop poll: the signal's number once one came (the stop is taken up), else 0."""
        if not self.received:
            return 0
        self.taken.append(True)
        return int(signal.Signals[self.received[0]])

    def give_up(self) -> None:
        """The grace ran out before this rank reached a stop poll: end it now."""
        if self.taken:
            return
        if self.rank == 0:
            after = "" if self.step is None else f" after step {self.step}"
            sys.stderr.write(f"thinwire: stopped by {self.received[0]}{after}; {_no_stop_in_grace()}, so nothing "
                             "after the last checkpoint was kept\n")
        sys.stderr.flush()
        from thinwire.run import outdir

        outdir.release_all()  # os._exit runs no finally: the lock (rank 0's) is released here
        os._exit(128 + int(signal.Signals[self.received[0]]))


def _no_stop_in_grace() -> str:
    return f"the ranks did not reach a step's end within {stop_grace():g} s of the signal and were ended"


def _device() -> torch.device:
    """The rank's device: its GPU under NCCL (init_from_env selected it), else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _maybe_emulate(comm: Communicator, cfg: TrainConfig) -> Communicator:
    """The run's communicator: delayed by the first link (``--emulate-link``), its ranks
    grouped into worker groups (``--group-size``; with ``--shard``, over a 2-D DeviceMesh whose
    dimension 1 the trainer shards each group's replica over)."""
    if cfg.emulate_link:
        from thinwire.comm.link import EmulatedLink, Link

        comm = EmulatedLink(comm, Link.parse(cfg.links[0]))
    if cfg.ranks_per_node is not None:
        from thinwire.comm.layout import NodeLayout
        from thinwire.comm.nodes import build_hierarchy

        layout = NodeLayout(comm.world_size, int(cfg.ranks_per_node))
        mesh = None
        if cfg.shard:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(_device().type, (layout.count, layout.ranks_per_node),
                                    mesh_dim_names=("cross", "group"))
        build_hierarchy(comm, layout, cfg.intra_link, intra_dtype=cfg.intra_dtype or "fp32", mesh=mesh,
                        sharded=cfg.shard)
    return comm


# -- local spawn ----------------------------------------------------------------------------
def _threads(cfg: TrainConfig) -> int:
    return cfg.threads or max(1, (os.cpu_count() or 1) // cfg.workers)


def _rank_main(rank: int, cfg: TrainConfig, rendezvous: str, q: Any, env: dict[str, str], stop: Any = None,
               beats: Any = None) -> None:
    """Entry point of a started rank: gloo on this machine, met through a rendezvous file
    (no TCP port to pick, so concurrent runs cannot collide). ``env``: the launcher's
    environment; ``stop`` is the launcher's shared signal number (0 until it is asked to stop)."""
    begin_rank(env)  # the launcher's environment; gone with the launcher
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides (Ctrl-C reaches the whole group)
    asked: list[int] = []  # SIGTERM to the whole process group or to this rank: stop like the launcher
    signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))
    step = [0]
    taken: list[int] = []  # the stop this rank took up at a step (its stop poll saw it)
    torch.set_num_threads(_threads(cfg))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(cfg.workers), LOCAL_RANK=str(rank))
    loopback = loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:  # local ranks listen on this machine only
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        from thinwire.comm.torch_dist import TorchComm
        from thinwire.run.trainer import train_rank

        import_modules(cfg.imports)  # a spawned rank starts afresh: the launcher's registrations are not here
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=cfg.workers,
            timeout=datetime.timedelta(seconds=collective_timeout()),
        )
        start_heartbeat(rank, beats)
        comm = _maybe_emulate(TorchComm(), cfg)

        def report(kind: str, **fields: Any) -> None:
            if kind == "step":
                step[0] = fields["step"]
            q.put((kind, rank, fields))  # every step: the launcher names the last completed one

        def took_stop() -> None:  # the launcher's grace for the stop ends for this rank
            if not taken:
                taken.append(1)
                q.put(("stopping", rank, {}))

        def stop_requested() -> int:
            signum = asked[0] if asked else (stop.value if stop is not None else 0)
            if signum:
                took_stop()
            return signum

        summary = train_rank(cfg, comm, report, stop_requested=stop_requested, stop_agreed=took_stop)
        gc.collect()  # what holds the group in a reference cycle (a DDP wrapper, a hook's state) goes while it lives
        torch.distributed.barrier()  # nobody tears the group down while a peer still talks to it
        torch.distributed.destroy_process_group()
        q.put(("done", rank, summary))
        q.close()
        q.join_thread()  # the summary reaches the launcher before the rank leaves
        leave_rank()
    except BaseException as e:  # report, then exit non-zero; the launcher names this rank (or the one it waited on)
        silent = silent_ranks(rank, cfg.workers, beats) if collective_failure(e) else []
        q.put(("error", rank, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                               "silent": silent}))
        q.close()
        q.join_thread()  # flush the report before leaving
        sys.stderr.flush()
        os._exit(1)


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on macOS), or
    None where there is none by those names. Spawned ranks pin gloo to it, unless
    ``GLOO_SOCKET_IFNAME`` is set already: otherwise gloo binds to whatever address the host
    name resolves to, which can be one reachable from the network."""
    import socket

    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _spawn_local(cfg: TrainConfig, show_progress: bool) -> Summary | None:
    ctx = rank_context()
    q = ctx.Queue()
    # the signal number, set by SIGINT / SIGTERM: the ranks finish the step, checkpoint and end (no lock: a
    # rank killed while holding one would block the signal handler that sets it)
    stop = ctx.Value("i", 0, lock=False)
    beats = ctx.Array("q", cfg.workers, lock=False)  # each rank's heartbeat counter
    tmp = tempfile.TemporaryDirectory(prefix="thinwire-")
    rendezvous = os.path.join(tmp.name, "rendezvous")
    procs = [
        ctx.Process(target=_rank_main, args=(r, cfg, rendezvous, q, dict(os.environ), stop, beats), daemon=True)
        for r in range(cfg.workers)
    ]
    received: list[str] = []

    def ask(signum: int) -> None:
        stop.value = signum

    restore = _on_stop_signals(ask, received)
    view = ProgressView(cfg) if show_progress else None
    last_step = _start_step(cfg)
    try:
        for p in procs:
            p.start()
        if view:
            view.start()
        return _watch_ranks(cfg, procs, q, view, received, last_step, beats)
    finally:
        restore()
        if view:
            view.stop()
        _terminate(procs)
        tmp.cleanup()


def _watch_ranks(cfg: TrainConfig, procs: Sequence[BaseProcess], q: Any, view: ProgressView | None,
                 received: list[str], last_step: int, beats: Any = None) -> Summary | None:
    """Relay the started ranks' reports until every rank is done; returns rank 0's summary,
    or the stop record when a signal ended the run. Raises :class:`RunFailed` when a rank
    fails, or when its heartbeat (``beats``) stood still long enough to be taken for a hang
    (:class:`_Heartbeats`). ``last_step``: the step the run starts after. After a signal the
    ranks have the grace (:func:`~thinwire.run.config.stop_grace`) to take the stop up at a
    step; then they are ended."""
    summary: Summary | None = None
    done: set[int] = set()
    errors: dict[int, dict] = {}
    taking: set[int] = set()  # the ranks that took up the stop asked for (at their stop poll)
    asked_at: float | None = None  # when this loop first saw the signal
    hearts = _Heartbeats(beats, cfg.workers) if beats is not None else None
    grace = stop_grace()
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
        elif kind == "stopping":
            taking.add(rank)
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
        if (errors or failed) and received:
            # asked to stop, and a rank ended: a signal to the whole group that reached a rank
            # still starting up, before its handlers were in place, ends it; that is the stop asked for
            _terminate(procs)
            return _unfinished(cfg, received, last_step)
        if errors or failed:
            raise RunFailed(_failure_message(procs, q, errors, failed, last_step))
        if received and asked_at is None:
            asked_at = time.monotonic()
        if asked_at is not None and len(taking | done) < cfg.workers and time.monotonic() - asked_at > grace:
            sys.stderr.write(f"thinwire: {received[0]}: {_no_stop_in_grace()}\n")
            _terminate(procs)
            return _unfinished(cfg, received, last_step, _no_stop_in_grace())
        hung = hearts.look(procs, done) if hearts is not None else []
        if hung and hearts is not None:
            states = [_process_state(procs[r].pid) for r in hung]
            seconds = min(hearts.still[r] for r in hung)
            _terminate(procs)
            raise RunFailed(_silent_message(hung, None, last_step, "", all(s == "T" for s in states), seconds))
    for p in procs:
        p.join(timeout=30)
    if summary is not None and received:
        summary.signal = received[0]
    return summary


def _unfinished(cfg: TrainConfig, received: list[str], last_step: int, why: str | None = None) -> Summary:
    """The stop record of a run whose ranks were ended before they could checkpoint the stop
    (``why``: how, when not a rank still starting up that the signal itself ended)."""
    return Summary(task=cfg.task, method=cfg.method, workers=cfg.workers, steps=cfg.steps or 0, config=cfg.to_dict(),
                   status="stopped", stopped_at=last_step, signal=received[0], unfinished=True, unfinished_why=why)


class _Heartbeats:
    """How long each spawned rank's heartbeat counter has stood still, as the launcher sees it,
    and which ranks have stood still past the collective timeout plus
    :data:`~thinwire.comm.torch_dist.LAUNCHER_AFTER_TIMEOUT_S`: long enough that a peer waiting
    on the rank would have timed out, named it and reported by then; this catches the rank whose
    peers are not waiting on it yet (they are in a long step), and keeps the whole wait within
    :func:`~thinwire.comm.torch_dist.hang_limit`.

    Time counts only while the launcher itself runs: a gap between two looks counts as at most
    :data:`LOOK_GAP_S`, so a launcher stopped together with its ranks (Ctrl-Z of the whole job,
    then ``fg``) does not take its own pause for theirs. A rank counts once it has beaten
    (a rank still starting up has not), and until it is done or gone."""

    def __init__(self, beats: Any, world: int) -> None:
        self.beats = beats
        self.seen = [0] * world
        self.still = [0.0] * world
        self.at = time.monotonic()
        self.after = collective_timeout() + LAUNCHER_AFTER_TIMEOUT_S

    def look(self, procs: Sequence[BaseProcess], done: set[int]) -> list[int]:
        """Count the time since the last look; the ranks standing still too long."""
        now = time.monotonic()
        gap, self.at = min(now - self.at, LOOK_GAP_S), now
        hung = []
        for r, p in enumerate(procs):
            count = int(self.beats[r])
            if count != self.seen[r] or count == 0 or r in done or p.exitcode is not None:
                self.seen[r], self.still[r] = count, 0.0
                continue
            self.still[r] += gap
            if self.still[r] >= self.after:
                hung.append(r)
        return hung


def _start_step(cfg: TrainConfig) -> int:
    """The step a run starts after: its checkpoint's for a resume (read once more; resolve()
    checked it), else 0."""
    if not cfg.resume:
        return 0
    from thinwire.run import checkpoint

    try:
        return int(checkpoint.read_meta(checkpoint.locate(cfg.resume))["step"])
    except (ValueError, OSError):
        return 0


def _on_stop_signals(ask: Callable[[int], None], received: list[str], escalate: bool = True) -> Callable[[], None]:
    """SIGINT / SIGTERM: the first calls ``ask(signum)``, asking the ranks to stop after their
    step (with a checkpoint when the run has an --out). The rule for a repeat: one signal
    counts once per delivery, and a delivery can reach a process twice (a wrapper such as
    ``timeout`` or a batch scheduler signals its child and then the child's whole process
    group), so a repeat within :data:`REPEAT_S` of the first is ignored; a later one stops at
    once when ``escalate``, else it is ignored too. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signal handlers live in the main thread only
    first: list[float] = []

    def handle(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if first:
            if not escalate or time.monotonic() - first[0] < REPEAT_S:
                return  # the same delivery again, or a repeat this launcher does not escalate
            raise KeyboardInterrupt  # a second signal: terminate the ranks now
        first.append(time.monotonic())
        received.append(name)
        ask(int(signum))
        again = " (a second signal, a second or more later, stops at once)" if escalate else ""
        sys.stderr.write(f"thinwire: {name}: stopping after the current step{again}\n")

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore() -> None:
        for sig, h in previous.items():
            signal.signal(sig, h)

    return restore


def _failure_message(procs: Sequence[BaseProcess], q: Any, errors: dict[int, dict], failed: list[int],
                     last_step: int) -> str:
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
    states = [_process_state(p.pid) for p in procs]
    _terminate(procs)
    for r, code in enumerate(codes):
        if code is not None and code < 0 and r not in errors:
            sig = signal.Signals(-code).name
            return f"rank {r} died ({sig}) after step {last_step}; the other ranks were stopped"
    r = next(iter(errors)) if errors else failed[0]  # the first to report is the cause
    what = errors[r]["error"] if r in errors else f"exit code {procs[r].exitcode}"
    silent = errors.get(r, {}).get("silent") or []
    if silent:  # it timed out waiting on a peer that stopped responding: that peer is the cause
        stopped = all(states[s] == "T" for s in silent)
        return _silent_message(silent, r, last_step, _first_line(what), stopped)
    if os.environ.get("THINWIRE_DEBUG") and r in errors:
        sys.stderr.write(errors[r]["traceback"])
    return f"rank {r} failed after step {last_step}: {what}"


def _process_state(pid: int | None) -> str | None:
    """A process's state letter from /proc (``T``: stopped by a signal), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, TypeError):
        return None


def _first_line(e: BaseException | str) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else (type(e).__name__ if isinstance(e, BaseException) else "")


def _terminate(procs: Sequence[BaseProcess]) -> None:
    """Kill the ranks still alive (SIGKILL: a rank takes SIGTERM as a request to stop after
    its step, and these ones must end now) and reap them."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)

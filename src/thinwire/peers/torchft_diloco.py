"""torchft's own DiLoCo as a method in thinwire's harness: the peer to race ``diloco`` against.

``torch-diloco:period=H`` runs ``torchft.local_sgd.DiLoCo`` (torchft >= 0.2, ``pip install
torchft`` or the extra ``thinwire[peers]``) on the same model, data, seed and inner
optimizer as thinwire's methods. What runs, on every rank:

* each thinwire rank is one torchft replica group of size 1 (``replica_id`` from its rank);
  rank 0 runs torchft's lighthouse inside its process (``min_replicas`` = the world size)
  and tells the others its address through thinwire's communicator (meter paused); every
  rank starts its own ``TCPStore`` on a free port and a torchft ``Manager`` over torchft's
  reconfigurable ``ProcessGroupGloo`` (``use_async_quorum=False``, as DiLoCo requires;
  ``init_sync=False``: every rank starts from the same model; ``max_retries=0``: a sync that
  torchft would retry (a failed allreduce or commit) ends the run instead);
* torchft's ``DiLoCo`` wraps the trainable parameters (``fragments`` contiguous groups of
  them, split as thinwire's ``streaming-diloco`` splits them) with one outer
  ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)`` per
  fragment, and hooks the inner optimizer's ``step()``: every ``period / fragments`` inner
  steps one fragment (round robin) syncs, inside ``optimizer.step()``: a quorum, one
  allreduce per parameter tensor of the pseudo-gradient (global minus local weights,
  summed, then divided by the participants), the outer step on the restored global weights,
  a commit vote, then ``lerp`` toward the local weights by ``alpha``. ``delay`` launches the
  allreduce that many inner steps before the sync step (thinwire's ``streaming-diloco``
  launches at its step and merges ``delay`` steps later), and torchft's first sync is
  fragment 0's, after ``period / fragments`` steps. The backup of the global weights lives
  where torchft puts it: host memory (thinwire's ``diloco`` keeps it on the model's device).

What is metered: every allreduce torchft's process group runs (the pseudo-gradients, fp32)
is recorded on thinwire's meter as a ring all_reduce of that payload over the world, so
bytes compare with thinwire's methods; its seconds, launch to completion (overlapping
allreduces counted once), are ``comm_seconds``. Not metered: the lighthouse and manager
RPCs (quorum, heartbeats, commit votes), the TCPStore traffic and the gloo rendezvous of
torchft's process group (control traffic), and the set-up exchange of addresses. One
allreduce per parameter tensor (torchft's default) makes as many messages per sync as the
model has tensors, where ``diloco`` sends one flat all_reduce: the same bytes. The sync
runs inside ``optimizer.step()``, so the trainer's compute clock holds it (the allreduce's
seconds too); ``report()`` gives those seconds as ``sync_seconds``. Float buffers
(BatchNorm statistics) stay local: torchft syncs parameters only (thinwire's ``diloco``
averages them at each outer step).

``--emulate-link`` does not delay this method's traffic: the emulation wraps thinwire's
communicator, and torchft's allreduces go over its own gloo process group, so they run at
the speed of the real network (the modeled times of ``--link`` still count its bytes).

Checkpoints: torchft's state (outer momentum, backup weights, its step) does not travel in
thinwire's checkpoints, so a run of this method cannot be resumed (``load_state_dict``
refuses). ``finish()`` (after the last step) removes the hooks and shuts the manager, its
store, the process group and the lighthouse down; an allreduce still in flight is waited
for first, and a fragment whose sync was launched within the last ``delay`` steps is not
merged (torchft merges only in its hook). torchft's servers log at the level ``RUST_LOG``
sets (``warn`` unless it is set before torchft is first imported).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from thinwire.algorithms.base import Loss, Method
from thinwire.algorithms.methods import METHODS
from thinwire.algorithms.reporting import Reports
from thinwire.comm.base import Communicator
from thinwire.comm.byte_rows import gather_bytes, share_bytes
from thinwire.knobs import knob, require
from thinwire.timing import Timing

INSTALL = "torch-diloco runs torchft's DiLoCo, which is not installed: pip install torchft (or thinwire[peers])"
TEXT_BYTES = 512  # room for a host name or an address exchanged between the ranks


@dataclass(frozen=True, kw_only=True)
class TorchFTDiLoCoConfig:
    period: int = knob(50, "inner steps between outer steps (torchft's sync_every)", ">= 1, a multiple of fragments")
    outer_lr: float = knob(0.7, "outer SGD's learning rate", "> 0")
    outer_momentum: float = knob(0.9, "outer SGD's momentum", "[0, 1)")
    nesterov: bool = knob(True, "Nesterov momentum for outer SGD", "true|false")
    fragments: int = knob(1, "groups of parameter tensors synced in turn, every period/fragments steps (torchft's "
                          "model_fragments; split as streaming-diloco splits them)",
                          ">= 1, at most the model's parameter tensors")
    delay: int = knob(0, "inner steps between a fragment's allreduce and its outer step (fragment_sync_delay)",
                      "0 <= delay < period/fragments")
    alpha: float = knob(0.0, "share of the local weights kept at a sync (fragment_update_alpha; 0: take the "
                        "global value)", "[0, 1]")

    def __post_init__(self) -> None:
        require(self.period >= 1, f"period must be >= 1, got {self.period}")
        require(self.outer_lr > 0, f"outer_lr must be > 0, got {self.outer_lr}")
        require(0 <= self.outer_momentum < 1, f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        require(self.fragments >= 1, f"fragments must be >= 1, got {self.fragments}")
        require(self.period % self.fragments == 0,
                f"period must be a multiple of fragments (torchft's rule): period={self.period}, "
                f"fragments={self.fragments}")
        require(self.delay >= 0, f"delay must be >= 0, got {self.delay}")
        require(self.delay < self.period // self.fragments,
                f"delay must be < period/fragments: delay={self.delay} >= {self.period // self.fragments}")
        require(0.0 <= self.alpha <= 1.0, f"alpha must be in [0, 1], got {self.alpha}")


def torchft_available() -> bool:
    """Whether torchft can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):  # a module set to None, or one without a spec
        return False


@METHODS.register
class TorchFTDiLoCo(Method, Reports):
    """torchft's DiLoCo over its own gloo process group, one replica group per rank; its
    allreduces are metered by thinwire's meter."""

    flat_only = "torchft's DiLoCo averages over its own flat process group"

    name = "torch-diloco"
    summary = ("torchft's DiLoCo (torchft.local_sgd.DiLoCo): every period inner steps, an outer Nesterov SGD step "
               "on the averaged pseudo-gradient, over torchft's own gloo process group")
    Config = TorchFTDiLoCoConfig
    elastic_unsafe = "it runs a torchft Manager of its own, one per rank of a fixed world"
    peer = True

    @classmethod
    def check_world(cls, config: Any, workers: int) -> None:
        """Refuse before any rank starts when torchft is not installed (any world size runs)."""
        if not torchft_available():
            raise ValueError(INSTALL)

    @classmethod
    def check_model(cls, config: Any, model: torch.nn.Module) -> None:
        tensors = sum(1 for p in model.parameters() if p.requires_grad)
        require(config.fragments <= tensors,
                f"fragments must be at most the model's {tensors} trainable parameter tensors, got {config.fragments}")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: Any = None, *, bucket_mb: float = 25.0,
                 overlap: bool = True, **knobs: Any) -> None:
        os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse and manager servers log every quorum at info
        try:
            import torchft  # noqa: F401
        except ImportError:
            raise ImportError(INSTALL) from None
        _quiet_flight_recorder()
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        if optimizer is None:
            raise ValueError(f"{self.name} hooks the inner optimizer's step(): pass the optimizer")
        self.model: torch.nn.Module = model
        self.check_model(self.config, model)
        cfg = self.config
        # per run, not per class: with fragments or alpha the ranks never all agree (the trainer
        # evaluates their mean)
        self.decentralized = cfg.fragments > 1 or cfg.alpha > 0  # type: ignore[misc]
        self.step = 0
        self._timing = Timing()
        self._spans: list[tuple[float, float]] = []  # launch and completion of every allreduce
        self._pending: list[Any] = []  # allreduces not known to be complete
        self.allreduce_calls = 0
        self.sync_seconds = 0.0  # inside torchft's post-step hook (quorum, allreduce, outer step, commit)
        self._closed = False
        self._entered = False
        self.lighthouse: Any = None
        self.store: Any = None
        self.manager: Any = None
        self.transport: Any = None
        self.pg: Any = None
        self.diloco: Any = None
        self._hooks: list[Any] = []
        self._folded, self._comm_total, self._comm_end = 0, 0.0, float("-inf")  # spans folded into the union

        from thinwire.algorithms.streaming_diloco import balanced_split

        trainable = [p for p in model.parameters() if p.requires_grad]
        groups = balanced_split([p.numel() for p in trainable], cfg.fragments)
        self.fragments = [torch.nn.ParameterList(trainable[lo:hi]) for lo, hi in groups]
        self.outer = [torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                      nesterov=cfg.nesterov and cfg.outer_momentum > 0) for f in self.fragments]
        self._start(optimizer, trainable)

    def _start(self, optimizer: torch.optim.Optimizer, trainable: list[torch.nn.Parameter]) -> None:
        """torchft's Lighthouse (rank 0's), a store, its gloo group and Manager per rank, and its
        DiLoCo over the fragments, hooked on ``optimizer``; what was started is stopped again
        when a part fails."""
        from torchft._torchft import LighthouseServer
        from torchft.checkpointing import HTTPTransport
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        from thinwire.comm.torch_dist import collective_timeout

        cfg = self.config
        timeout = timedelta(seconds=collective_timeout())
        device = trainable[0].device
        try:
            with self.comm.meter.paused():  # set-up bookkeeping, not the method's traffic
                names = gather_bytes(self.comm, socket.gethostname().encode(), TEXT_BYTES, device)
                host = "localhost" if len(set(names)) == 1 else socket.gethostname()
                if self.comm.rank == 0:
                    self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=self.comm.world_size)
                port = self.lighthouse.address().rsplit(":", 1)[1] if self.lighthouse is not None else None
                lighthouse_addr = share_bytes(self.comm, f"http://{host}:{port}".encode(), TEXT_BYTES,
                                              device).decode()
            import torch.distributed as dist

            self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
            pg = self.pg = _metered(ProcessGroupGloo, self)(timeout=timeout)
            self.transport = HTTPTransport(timeout=timeout, num_chunks=0)  # torchft's default, kept to stop it
            self.manager = Manager(
                pg=pg, load_state_dict=None, state_dict=None, min_replica_size=self.comm.world_size,
                use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                rank=0, world_size=1, store_addr=host, store_port=self.store.port, lighthouse_addr=lighthouse_addr,
                replica_id=f"thinwire_{self.comm.rank}", hostname=host, init_sync=False, max_retries=0,
                checkpoint_transport=self.transport)
            self.diloco = DiLoCo(self.manager, list(self.fragments), optimizer, self.outer, sync_every=cfg.period,
                                 fragment_sync_delay=cfg.delay, fragment_update_alpha=cfg.alpha)
            # time torchft's post-step hook: one of ours before it, one after it
            self._hooks.append(optimizer.register_step_post_hook(self._hook_starts))
            self.diloco.__enter__()
            self._entered = True
            self._hooks.append(optimizer.register_step_post_hook(self._hook_ends))
        except BaseException:
            self._shutdown(barrier=False)
            raise

    # -- the training loop -------------------------------------------------------------------
    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """Nothing: torchft's hooks on the optimizer's step do the work. A ``GradScaler`` is
        refused: it may skip ``optimizer.step()`` on one rank only, and torchft's schedule,
        counted in those steps, would then wait for a sync the others never start."""
        if scaler is not None and scaler.is_enabled():
            raise ValueError("torch-diloco cannot run with a GradScaler: a step it skips on one rank only leaves "
                             "torchft's sync schedule out of step across the ranks")
        return True

    def after_step(self) -> None:
        """Count the step (torchft's post-step hook synced already, on its schedule)."""
        self.step += 1

    def _hook_starts(self, *args: Any) -> None:
        self._hook_t0 = time.perf_counter()

    def _hook_ends(self, *args: Any) -> None:
        self.sync_seconds += time.perf_counter() - self._hook_t0

    def finish(self) -> None:
        """Remove torchft's hooks and shut its manager, store, process group and lighthouse
        down (every rank calls it, after the last step)."""
        self._shutdown(barrier=True)
        return None

    def _shutdown(self, *, barrier: bool) -> None:
        if self._closed:
            return
        self._closed = True
        for work in self._pending:  # every rank launched it: it completes
            work.wait()
        self._pending = []
        if self._entered:
            self.diloco.__exit__(None, None, None)
            self._entered = False
        for hook in self._hooks:
            hook.remove()
        if self.manager is not None:
            self.manager.shutdown(wait=False)  # its server and its quorum thread
        if self.transport is not None:  # torchft's checkpoint server stops within its 0.5 s poll: not on the clock
            threading.Thread(target=self.transport.shutdown, name="torch-diloco-shutdown", daemon=True).start()
            self.transport = None
        if barrier:
            with self.comm.meter.paused():
                self.comm.barrier()  # no rank still talks to a store, the process group or the lighthouse
        if self.pg is not None:
            self.pg.shutdown()  # drops torchft's gloo group
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
        self.lighthouse = self.store = self.pg = None

    # -- metering ----------------------------------------------------------------------------
    def _allreduce(self, tensors: list[torch.Tensor], launch: Any) -> Any:
        """Meter one allreduce of torchft's process group and time it to completion."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.comm.meter.record("all_reduce", nbytes, self.comm.world_size)
        self.allreduce_calls += 1
        self._pending = [w for w in self._pending if not w.is_completed()]
        t0 = time.perf_counter()
        work = launch()
        spans = self._spans
        work.get_future().add_done_callback(lambda _: spans.append((t0, time.perf_counter())))
        self._pending.append(work)
        return work

    @property
    def timing(self) -> Timing:
        """``comm_seconds``: the union of every allreduce's launch-to-completion interval
        (those completed so far; allreduces launch in order, so each fold sorts only the new)."""
        done = len(self._spans)
        for start, stop in sorted(self._spans[self._folded : done]):
            if stop > self._comm_end:
                self._comm_total += stop - max(start, self._comm_end)
                self._comm_end = stop
        self._folded = done
        return Timing(self._timing.codec_seconds, self._comm_total)

    # -- figures -----------------------------------------------------------------------------
    @property
    def outer_steps(self) -> int:
        """Fragment syncs committed so far (torchft's manager step)."""
        return int(self.manager.current_step()) if self.manager is not None else 0

    def stats(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps}

    def report(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"method": self.spec, "peer": f"torchft {version('torchft')} DiLoCo (torchft.local_sgd.DiLoCo)",
                "outer_steps": self.outer_steps, "allreduce_calls": self.allreduce_calls,
                "sync_seconds": self.sync_seconds,
                "fragments": [sum(p.numel() for p in f.parameters()) for f in self.fragments]}

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Nothing: torchft's state does not travel in thinwire's checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refused: resuming would restart torchft's outer momentum and global weights."""
        raise ValueError(f"resume is not supported for {self.name}: torchft's DiLoCo state (outer momentum, global "
                         "weights) is not in thinwire's checkpoints")


class _NoFlightRecorder(logging.Filter):
    """Drops torchft's warning that NCCL's flight recorder cannot be reset (no NCCL here)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


def _quiet_flight_recorder() -> None:
    log = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _NoFlightRecorder) for f in log.filters):
        log.addFilter(_NoFlightRecorder())


def _metered(base: type, method: TorchFTDiLoCo) -> type:
    """``base`` (torchft's ProcessGroupGloo) whose every allreduce goes through the meter."""

    class MeteredGloo(base):
        def allreduce(self, tensors: list[torch.Tensor], opts: object) -> Any:
            return method._allreduce(tensors, lambda: super(MeteredGloo, self).allreduce(tensors, opts))

    return MeteredGloo


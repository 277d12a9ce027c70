"""detonation's DeMo optimizer as a method in thinwire's harness: the peer to race ``demo`` against.

``peer-demo:chunk=C,topk=K,decay=β,sign=true,weight_decay=λ`` trains with
``detonation.optim.demo.DeMo`` (detonation 0.5.2, ``pip install detonation mltiming`` or
the extra ``thinwire[peers]``; Python >= 3.11), the DeMo optimizer of Peng, Quesnelle and
Kingma (arXiv 2411.19870) as the DeToNATION package ships it. The method *is* the optimizer
(:attr:`~thinwire.algorithms.base.Method.replaces_optimizer`): the trainer builds it with
:meth:`PeerDeMo.make_optimizer` on the run's ``--lr`` in place of Adam or SGD, then the
method around it. What runs, on every rank, in ``optimizer.step()``, parameter by parameter:

* the residual ``δ`` (``demo_delta`` in ``optimizer.state[p]``) decays and takes the
  gradient: ``δ ← β·δ + lr·g``;
* with more than one rank: ``δ`` is cut into blocks whose side along each dimension of
  length ``n`` is the largest divisor of ``n`` that is at most ``C`` (a 1-D tensor: blocks
  of that length; a 2-D one: rectangles), each block goes through an orthonormal DCT-II,
  the ``K`` coefficients of largest magnitude of each block are kept (``K`` clamped to the
  block's size), and their inverse transform is taken out of ``δ``;
* the kept coefficients, values fp32 and positions int32, go to every rank (two
  ``all_gather`` per parameter); every rank places all ranks' coefficients in an empty
  transform, a coefficient that several ranks sent getting the mean of their values (over
  the ranks that sent it, not over the world), and inverts it: the update ``u``;
* ``p ← p·(1 − lr·λ)`` when ``λ > 0``, then ``p ← p − lr·sign(u)`` (``sign=false``:
  ``p − lr·u``; a plain ``torch.optim.SGD`` step, no momentum).

With one rank detonation compresses nothing: the whole ``δ`` is the update and ``δ``
starts again from zero. A dimension whose divisors up to ``C`` are all small (a prime
larger than ``C``) gets blocks of length 1, where every coefficient is kept: 8 bytes per
element, twice fp32.

Metering: detonation calls ``torch.distributed`` itself (``get_world_size`` on its
sharding and replication groups, ``all_gather(list, tensor, group=..., async_op=True)``
and the group's ``size()``). :meth:`PeerDeMo.make_optimizer` hands it two group objects
of this module, a replication group over thinwire's communicator and a sharding group of
one rank (so no FSDP and no process group is needed), and replaces the name ``dist`` in
detonation's two modules that use it (``detonation.detonatiomixin`` and
``detonation.repl.demo_replicator``) with a stand-in that sends these calls, for these
groups only, through thinwire's :class:`~thinwire.comm.base.Communicator`, and passes every
other call (another group, another function) to ``torch.distributed`` unchanged. The
stand-in is installed once and stays, rather than being swapped in around each step: the
ranks of a :class:`~thinwire.comm.local.LocalWorld` are threads of one process, and a
swap would race between them. So the meter counts exactly what detonation sends (per
step and parameter, one all_gather of the int32 positions and one of the fp32 values:
``blocks · min(K, block size) · (4 + 4)`` bytes of payload, ``(n − 1)`` times that sent by
each of ``n`` ranks), ``--emulate-link`` delays it, and the method runs on gloo, NCCL or a
``LocalWorld`` alike. ``comm_seconds`` is the time inside those all_gathers (launch to
completion), ``codec_seconds`` the rest of detonation's replication (transforms, top-k,
decoding); both are spent inside ``optimizer.step()``.

Differences from the paper's reference code (``bloc97/DeMo``), which detonation follows
for the transform (the same block sizes, largest divisor up to ``C``, and the same
averaging over the senders of a coefficient): detonation sends int32 positions where the
reference sends int64 ones (8 bytes per coefficient instead of 12); it compresses nothing
on one rank (the reference always does); ``δ`` lives in the optimizer's state, so
``optimizer.state_dict()`` checkpoints it (and detonation's step count, under the key
``detonation_step``), which is all a resumed run needs: this method keeps only its step
count. detonation 0.5.2's decoupled weight decay reads an attribute its optimizer never
sets (``self.weight_decay``) and fails with any ``λ > 0``; :meth:`make_optimizer` sets it
to ``λ``, which gives the reference's ``p·(1 − lr·λ)``. ``λ`` is this method's own knob,
not the task's ``weight_decay``: that one is an L2 term tuned for Adam or SGD, while DeMo's
is decoupled and scaled by the learning rate of a sign update, so it is not reused.

Refused: parameters that are not 1-D or 2-D (detonation's transform handles those only:
conv kernels and scalars are refused before training), a ``GradScaler`` (a step it skips on
one rank only would leave detonation's all_gathers unmatched), an optimizer other than the
one :meth:`make_optimizer` built, and a communicator other than the optimizer's. A
parameter that got no gradient in a step gets zeros (every rank must send for every
parameter). detonation prints its block sizes when it is built; that line is dropped
(:meth:`PeerDeMo.report` gives them as ``blocks``).
"""

from __future__ import annotations

import builtins
import importlib.util
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

from thinwire.algorithms.base import Loss, Method
from thinwire.algorithms.methods import METHODS
from thinwire.algorithms.reporting import Reports
from thinwire.comm.base import Communicator, Handle
from thinwire.knobs import knob, require
from thinwire.timing import Timing

INSTALL = ("peer-demo runs detonation's DeMo, which is not installed: pip install detonation mltiming "
           "(or thinwire[peers]; Python >= 3.11)")
MLTIMING = ("peer-demo runs detonation's DeMo, whose module detonation.repl.demo_replicator imports mltiming "
            "without declaring it: pip install mltiming (or thinwire[peers])")


@dataclass(frozen=True, kw_only=True)
class PeerDeMoConfig:
    chunk: int = knob(64, "target block side of the DCT (compression_chunk): each dimension of length n is cut "
                      "into blocks of its largest divisor <= chunk", ">= 1")
    topk: int = knob(32, "DCT coefficients each block sends (compression_topk; clamped to the block's size)",
                     "1 <= topk <= chunk²")
    decay: float = knob(0.999, "decay of the residual momentum δ each step (compression_decay)", "[0, 1)")
    sign: bool = knob(True, "step along the sign of the decoded update (detonation_sign); false: the update itself",
                      "true|false")
    weight_decay: float = knob(0.0, "decoupled weight decay: parameters *= 1 - lr*weight_decay each step "
                               "(detonation_weight_decay); the task's weight_decay is not used", ">= 0")

    def __post_init__(self) -> None:
        require(self.chunk >= 1, f"chunk must be >= 1, got {self.chunk}")
        require(1 <= self.topk <= self.chunk * self.chunk,
                f"topk must be in [1, chunk²={self.chunk * self.chunk}] (a block holds at most chunk² coefficients), "
                f"got {self.topk}")
        require(0.0 <= self.decay < 1.0, f"decay must be in [0, 1) (detonation's rule), got {self.decay}")
        require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None, or one without a spec
        return False


def detonation_available() -> bool:
    """Whether detonation and the mltiming it imports can be imported (without importing them)."""
    return _found("detonation") and _found("mltiming")


# -- detonation's torch.distributed, routed through thinwire's communicator -----------------------
class _Group:
    """A process group as detonation uses one: ``size()``, and, for the replication group,
    the communicator its all_gathers go through and the timing they add to. ``comm`` None:
    the sharding group, this rank alone."""

    def __init__(self, comm: Communicator | None, timing: Timing) -> None:
        self.comm = comm
        self.timing = timing

    def size(self) -> int:
        return 1 if self.comm is None else self.comm.world_size


class _Gathered:
    """An all_gather through the communicator: ``wait()`` completes it and copies the rows
    into the caller's list (once), timing it as communication."""

    def __init__(self, handle: Handle, out: torch.Tensor, rows: list[torch.Tensor], timing: Timing) -> None:
        self.handle, self.out, self.rows, self.timing = handle, out, rows, timing
        self.done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            t0 = time.perf_counter()
            self.handle.wait()
            for row, got in zip(self.rows, self.out):
                row.copy_(got)
            self.done = True
            self.timing.comm_seconds += time.perf_counter() - t0
        return True

    def is_completed(self) -> bool:
        return self.done


class _Dist:
    """``torch.distributed`` as detonation's modules see it: ``get_world_size`` and
    ``all_gather`` on a :class:`_Group` go through thinwire; everything else is torch's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch_dist, name)

    def get_world_size(self, group: Any = None) -> int:
        return group.size() if isinstance(group, _Group) else torch_dist.get_world_size(group)

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                   async_op: bool = False) -> Any:
        if not isinstance(group, _Group):
            return torch_dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        comm = group.comm
        if comm is None or len(tensor_list) != comm.world_size:
            raise RuntimeError(f"peer-demo: detonation all_gathered {len(tensor_list)} tensors over "
                               f"{group.size()} ranks")
        t0 = time.perf_counter()
        out = torch.empty((comm.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        handle = comm.all_gather(tensor, out, async_op=True)
        group.timing.comm_seconds += time.perf_counter() - t0
        work = _Gathered(handle, out, tensor_list, group.timing)
        if not async_op:
            work.wait()
            return None
        return work


_DIST = _Dist()
_QUIET = threading.local()  # set on a thread while it builds a DeMo: its block-size line is dropped
_PATCH = threading.Lock()


def _print(*args: Any, **kwargs: Any) -> None:
    """``print`` for detonation's replicator module: silent while this thread builds a DeMo."""
    if not getattr(_QUIET, "on", False):
        builtins.print(*args, **kwargs)


def _import_demo() -> Any:
    """detonation's DeMo class, with its modules' ``dist`` routed (once, for good)."""
    try:
        import detonation.detonatiomixin as mixin
        import detonation.repl.demo_replicator as replicator
        from detonation.optim.demo import DeMo
    except ModuleNotFoundError as e:
        raise ImportError(MLTIMING if e.name == "mltiming" else INSTALL) from None
    with _PATCH:
        for module in (mixin, replicator):
            if getattr(module, "dist", None) not in (torch_dist, _DIST):
                raise ImportError(f"peer-demo supports detonation 0.5.x: {module.__name__} no longer uses "
                                  "torch.distributed as dist")
            module.dist = _DIST
        replicator.print = _print
    return DeMo


def _check_shapes(named: list[tuple[str, torch.Tensor]]) -> None:
    for name, p in named:
        require(p.dim() in (1, 2), f"peer-demo: detonation's DCT handles 1-D and 2-D parameters only; {name} has "
                f"shape {tuple(p.shape)}")


@METHODS.register
class PeerDeMo(Method, Reports):
    """detonation's DeMo optimizer (``detonation.optim.demo.DeMo``), its all_gathers through
    thinwire's communicator; the method itself only counts steps and reports."""

    flat_only = "detonation's optimizer averages over one flat group"

    name = "peer-demo"
    summary = ("detonation's DeMo optimizer (decoupled momentum: DCT blocks of the residual, top-k all_gather, "
               "sign-SGD step); replaces --optimizer")
    Config = PeerDeMoConfig
    elastic_unsafe = "detonation's optimizer averages over a torch.distributed group of fixed size"
    peer = True
    replaces_optimizer = True

    @classmethod
    def check_world(cls, config: Any, workers: int) -> None:
        """Refuse before any rank starts when detonation is not installed (any world runs)."""
        if not detonation_available():
            raise ValueError(MLTIMING if _found("detonation") else INSTALL)

    @classmethod
    def check_model(cls, config: Any, model: torch.nn.Module) -> None:
        _check_shapes([(n, p) for n, p in model.named_parameters() if p.requires_grad])

    @classmethod
    def make_optimizer(cls, config: Any, params: list[torch.nn.Parameter], lr: float, weight_decay: float,
                       comm: Communicator | None) -> torch.optim.Optimizer:
        """detonation's DeMo on ``params`` with learning rate ``lr``, its all_gathers through
        ``comm`` (default: the ``torch.distributed`` world). ``weight_decay`` (the task's) is
        not used: the ``weight_decay`` knob is DeMo's decoupled one."""
        from thinwire.algorithms.averaging import comm_or_world

        DeMo = _import_demo()
        params = list(params)
        _check_shapes([(f"parameter {i}", p) for i, p in enumerate(params) if p.requires_grad])
        require(lr * config.weight_decay < 1,
                f"peer-demo: lr * weight_decay must be < 1 (each step scales the parameters by 1 - lr*weight_decay), "
                f"got {lr} * {config.weight_decay}")
        timing = Timing()
        group = _Group(comm_or_world(comm), timing)
        _QUIET.on = True
        try:
            opt = DeMo(params, lr=lr, compression_decay=config.decay, compression_topk=config.topk,
                       compression_chunk=config.chunk, detonation_sign=config.sign,
                       detonation_weight_decay=config.weight_decay,
                       sharding_parallel_group=_Group(None, timing), replication_parallel_group=group)
        finally:
            _QUIET.on = False
        opt.weight_decay = config.weight_decay  # detonation 0.5.2 reads it but never sets it
        (rep,) = opt.replicators
        rep.replicate = _timed(rep.replicate, timing)
        return opt

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: Any = None, *, bucket_mb: float = 25.0,
                 overlap: bool = True, **knobs: Any) -> None:
        opt: Any = optimizer  # detonation's DeMo, untyped
        reps: Any = getattr(opt, "replicators", None)
        group = getattr(reps[0], "replication_parallel_group", None) if reps and len(reps) == 1 else None
        if not isinstance(group, _Group) or group.comm is None:
            raise ValueError("peer-demo is an optimizer: build it with PeerDeMo.make_optimizer(config, params, lr, "
                             "weight_decay, comm) and pass that one (the trainer does)")
        if comm is not None and comm is not group.comm:
            raise ValueError("peer-demo: pass the communicator its optimizer was built with (its bytes are metered "
                             "there)")
        super().__init__(model, optimizer, group.comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        cfg, rep = self.config, reps[0]
        built = PeerDeMoConfig(chunk=rep.compression_chunk, topk=rep.compression_topk, decay=rep.compression_decay,
                               sign=opt.detonation_sign, weight_decay=opt.detonation_weight_decay)
        if built != cfg:
            raise ValueError(f"peer-demo: the optimizer was built with {built}, the method with {cfg}")
        self.model: torch.nn.Module = model
        self.check_model(cfg, model)
        self.replicator = rep
        self._timing = group.timing
        self.step = 0
        self._params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]

    # -- the training loop -------------------------------------------------------------------
    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """Nothing to send (detonation sends inside ``optimizer.step()``); a parameter without
        a gradient gets zeros, so that every rank sends for every parameter. A ``GradScaler``
        that scales is refused."""
        if scaler is not None and scaler.is_enabled():
            raise ValueError("peer-demo cannot run with a GradScaler: a step it skips on one rank only leaves "
                             "detonation's all_gathers unmatched across the ranks")
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return True

    def after_step(self) -> None:
        """Count the step; detonation's per-step byte log is dropped (the meter has the bytes)."""
        self.step += 1
        self.replicator.data_transmitted.clear()
        self.replicator.data_received.clear()

    @property
    def timing(self) -> Timing:
        return self._timing

    # -- figures -----------------------------------------------------------------------------
    def payload_bytes_per_step(self) -> int:
        """What detonation hands to its all_gathers each step on more than one rank: per
        parameter, ``blocks · min(topk, block size)`` fp32 values and as many int32 positions."""
        shape = self.replicator.transform.shape_dict  # dimension -> block side
        total = 0
        for p in self._params:
            sides = [shape[n] for n in p.shape]
            blocks = p.numel() // math.prod(sides)
            total += blocks * min(self.config.topk, math.prod(sides)) * (4 + 4)
        return total

    def report(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"method": self.spec, "peer": f"detonation {version('detonation')} DeMo (detonation.optim.demo.DeMo)",
                "blocks": dict(self.replicator.transform.shape_dict),
                "payload_bytes_per_step": self.payload_bytes_per_step() if self.comm.world_size > 1 else 0}

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The step count: DeMo's residual and step live in ``optimizer.state_dict()``."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        extra = sorted(set(state) - {"step"})
        if extra:
            raise ValueError(f"{self.name} keeps only its step, got {', '.join(map(str, extra))}")
        self.step = int(state["step"])


def _timed(replicate: Callable[..., torch.Tensor], timing: Timing) -> Callable[..., torch.Tensor]:
    """detonation's ``replicate``, its seconds outside the all_gathers counted as codec time."""

    def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
        t0, before = time.perf_counter(), timing.comm_seconds
        try:
            return replicate(*args, **kwargs)
        finally:
            timing.codec_seconds += time.perf_counter() - t0 - (timing.comm_seconds - before)

    return timed

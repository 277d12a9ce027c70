"""PyTorch's own DDP communication as methods in thinwire's harness: the peers to beat.

``torch-ddp`` (DDP's all_reduce, as its default ``allreduce_hook``), ``torch-fp16`` and
``torch-bf16`` (the compress hooks), ``torch-powersgd:rank=R`` (``powerSGD_hook``) and
``torch-postlocalsgd:period=τ`` (``post_localSGD_hook`` with a ``PeriodicModelAverager``)
train the same model, data, seed and optimizer as thinwire's methods, through
``torch.nn.parallel.DistributedDataParallel``. Their bytes are counted by the same meter:
while one of PyTorch's hooks (or the averager) runs, ``torch.distributed.all_reduce`` on
the world group is routed through thinwire's communicator, which counts the bytes (and
delays them under ``--emulate-link``) and completes before it returns, so the hook's
future is already done. Time spent inside the hooks, outside the all_reduce, counts as
codec time; the all_reduce's as communication; the rest of the backward pass as compute.

Deliberate differences from a stock DDP script, so that the comparison is like for like:
``broadcast_buffers=False`` (thinwire's synchronous methods leave BatchNorm statistics
local too, and DDP's per-forward buffer broadcast would bypass the meter), and the
post-local-SGD hook does no intra-node all_reduce after its warm-up (every worker is taken
to be its own machine). Buckets follow ``--bucket-mb``. These methods need
``torch.distributed`` (``thinwire train`` starts it); a peer that PyTorch cannot run on this
backend is refused with PyTorch's reason (``torch-bf16`` on CPU/gloo: before any rank starts
for local runs, when DDP is built under torchrun). Checkpoints hold the hooks' own state:
PowerSGD's error feedback, warm-start factors, iteration and generator; post-local SGD's
iteration and the averager's step.
"""

from __future__ import annotations

import inspect
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from thinwire.algorithms.base import Loss, Method
from thinwire.algorithms.methods import METHODS
from thinwire.algorithms.reporting import Reports
from thinwire.comm.base import Communicator
from thinwire.knobs import knob, require
from thinwire.timing import Timing


@dataclass(frozen=True, kw_only=True)
class TorchPowerSGDConfig:
    rank: int = knob(1, "matrix_approximation_rank of PyTorch's PowerSGDState", ">= 1")
    start_iter: int = knob(10, "start_powerSGD_iter: plain all_reduce before it (PyTorch's default is 1,000; "
                           "ours is scaled to the bundled tasks)", ">= 2")
    min_compression_rate: float = knob(2.0, "compress a matrix only if it shrinks at least this much", ">= 1")

    def __post_init__(self) -> None:
        require(self.rank >= 1, f"rank must be >= 1, got {self.rank}")
        require(self.start_iter >= 2,
                f"start_iter must be >= 2 (PyTorch's error feedback needs it), got {self.start_iter}")
        require(self.min_compression_rate >= 1, f"min_compression_rate must be >= 1, got {self.min_compression_rate}")


@dataclass(frozen=True, kw_only=True)
class TorchPostLocalSGDConfig:
    period: int = knob(4, "steps between model averages (PeriodicModelAverager's period)", ">= 1")
    warmup: int = knob(0, "synchronous all_reduce steps first (start_localSGD_iter and the averager's warmup_steps)",
                       ">= 0")

    def __post_init__(self) -> None:
        require(self.period >= 1, f"period must be >= 1, got {self.period}")
        require(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")


class _Done:
    """The part of ``torch.distributed.Work`` that PyTorch's hooks use, already complete."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result([tensor])

    def get_future(self) -> torch.futures.Future:
        return self._future

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextmanager
def routed_all_reduce(comm: Communicator, timing: Timing) -> Iterator[None]:
    """While active, ``torch.distributed.all_reduce`` (SUM, world group) runs through ``comm``:
    metered, emulated where ``comm`` is, and complete on return."""
    original = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> _Done | None:
        if op != dist.ReduceOp.SUM or (group is not None and group is not dist.group.WORLD
                                       and dist.get_world_size(group) != comm.world_size):
            raise RuntimeError("thinwire meters PyTorch's hooks only for SUM all_reduce over the world group")
        t0 = time.perf_counter()
        dist.all_reduce = original  # the communicator's own all_reduce is torch.distributed's
        try:
            comm.all_reduce(tensor)
        finally:
            dist.all_reduce = all_reduce
        timing.comm_seconds += time.perf_counter() - t0
        return _Done(tensor) if async_op else None

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


@contextmanager
def _timed(comm: Communicator, timing: Timing) -> Iterator[None]:
    """Route the all_reduces through ``comm``; the time outside them is codec time."""
    t0, before = time.perf_counter(), timing.comm_seconds
    with routed_all_reduce(comm, timing):
        yield
    timing.codec_seconds += time.perf_counter() - t0 - (timing.comm_seconds - before)


def _wrap(hook: Callable, comm: Communicator, timing: Timing) -> Callable:
    def metered(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        with _timed(comm, timing):
            fut = hook(state, bucket)
            fut.wait()
        return fut

    # DDP checks a hook's annotations: the real classes, not this module's postponed strings
    metered.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                               "return": torch.futures.Future[torch.Tensor]}
    return metered


@METHODS.register
class TorchBuiltin(Method, Reports):
    """A model wrapped in DDP with one of PyTorch's communication hooks; the trainer runs
    forward and backward through the wrapper. ``hook`` names one of ``default_hooks`` for the
    subclasses that only pick one (fp16, bf16); PowerSGD and post-local SGD build their hook
    and its state in ``_hook``."""

    flat_only = "PyTorch's hooks average over one flat process group"
    elastic_unsafe = "PyTorch's DDP runs on a torch.distributed group of fixed size"

    name = "torch-ddp"
    summary = "PyTorch DDP, default all_reduce (allreduce_hook), fp32"
    averages_in_backward = True
    peer = True
    hook = "allreduce_hook"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: Any = None, *, bucket_mb: float = 25.0,
                 overlap: bool = True, **knobs: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(f"{self.name} runs PyTorch's DDP and needs torch.distributed (thinwire train starts it)")
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        self.model: torch.nn.Module = model
        self._timing = Timing()
        self.step = 0
        from torch.nn.parallel import DistributedDataParallel

        # BatchNorm statistics stay local, as under thinwire's methods
        local: dict[str, Any] = ({"forward_sync_buffers": False}
                                 if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                                 else {"broadcast_buffers": False})
        self.module = DistributedDataParallel(model, bucket_cap_mb=bucket_mb, **local)
        state, hook = self._hook()
        check = getattr(self.module, "_check_comm_hook", None)
        if check is not None:  # PyTorch's own verdict on its hook here (bf16 needs CUDA + NCCL)
            try:
                check(hook)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"{self.name} is unavailable here: {e}") from None
        self.module.register_comm_hook(state, _wrap(hook, self.comm, self._timing))
        self.hook_state = state

    def _hook(self) -> tuple[Any, Callable]:
        """The hook's state and the hook (DDP's ``register_comm_hook`` arguments)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return None, getattr(default_hooks, self.hook)

    def forward_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return self.module

    @property
    def timing(self) -> Timing:
        return self._timing

    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """Nothing: DDP averaged the gradients during the backward pass."""
        return True

    def after_step(self) -> None:
        self.step += 1

    def report(self) -> dict[str, Any]:
        return {"method": self.spec, "peer": "PyTorch DDP communication hook"}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


@METHODS.register
class TorchFP16(TorchBuiltin):
    name = "torch-fp16"
    summary = "PyTorch DDP with fp16_compress_hook (gradients cast to fp16 for the all_reduce)"
    hook = "fp16_compress_hook"


@METHODS.register
class TorchBF16(TorchBuiltin):
    name = "torch-bf16"
    summary = ("PyTorch DDP with bf16_compress_hook (gradients cast to bf16 for the all_reduce); PyTorch "
               "accepts it only with CUDA + NCCL 2.10+ (or XPU), so not on CPU/gloo")
    hook = "bf16_compress_hook"

    @classmethod
    def check_world(cls, config: Any, workers: int) -> None:
        """Refuse locally spawned runs up front: they use gloo, where PyTorch's DDP rejects
        this hook (under torchrun the rank checks the backend it got)."""
        if "RANK" not in os.environ:
            raise ValueError("torch-bf16 is unavailable on CPU/gloo: PyTorch's DDP accepts bf16_compress_hook only "
                             "with CUDA 11+ and NCCL 2.10+ (or XPU and XCCL); use bf16 (thinwire's cast codec) here")


@METHODS.register
class TorchPowerSGD(TorchBuiltin):
    name = "torch-powersgd"
    Config = TorchPowerSGDConfig
    skip_unsafe = ("PyTorch's hook folds a gradient into its error feedback inside the backward pass, before the "
                   "check, and would resend a NaN every later step")
    summary = "PyTorch DDP with powerSGD_hook (rank-r P/Q all_reduces, error feedback, warm start)"

    def _hook(self) -> tuple[Any, Callable]:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        cfg = self.config
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.rank,
                                 start_powerSGD_iter=cfg.start_iter, min_compression_rate=cfg.min_compression_rate,
                                 use_error_feedback=True, warm_start=True, random_seed=0)
        self._names = {id(p): name for name, p in self.model.named_parameters()}
        self._shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        self._layout: dict[int, list[str]] = {}  # bucket index -> its parameters, in the order last seen
        self._pieces: dict[str, dict[str, torch.Tensor]] | None = None  # per parameter, while buckets change

        def hook(st: ps.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            index = bucket.index()
            names = [self._names[id(p)] for p in bucket.parameters()]
            if self._layout.get(index) != names:
                self._relayout(index, names)
            future = ps.powerSGD_hook(st, bucket)
            if bucket.is_last():
                self._pieces = None  # every bucket has its layout for this iteration
            return future

        # DDP checks the annotations it finds against its own types: the real classes, not strings
        hook.__annotations__ = {"st": ps.PowerSGDState, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
        return state, hook

    def _relayout(self, index: int, names: list[str]) -> None:
        """DDP lays buckets out in parameter order on a fresh wrapper's first step and by
        gradient-ready order (and ``--bucket-mb``) after it rebuilds them, so a parameter can
        change place and bucket; PowerSGDState's per-bucket flat tensors (error feedback, P
        and Q) follow the layout they were made in. At the first change of an iteration every
        stored flat tensor is cut into per-parameter pieces; each bucket whose layout changed
        is then put together from the pieces of its parameters (a resumed run's first step,
        and the step after it). A bucket whose pieces are not all there starts afresh."""
        st = self.hook_state
        stores = (("error", st.error_dict), ("p", st.p_memory_dict), ("q", st.q_memory_dict))
        if self._pieces is None:
            self._pieces = {kind: {} for kind, _ in stores}
            for old_index, old_names in self._layout.items():
                for kind, store in stores:
                    flat = store.get(old_index)
                    segments = self._segments(old_names, kind)
                    if flat is None or sum(size for _, size in segments) != flat.numel():
                        continue
                    offset = 0
                    for name, size in segments:
                        self._pieces[kind][name] = flat[offset : offset + size]
                        offset += size
        for kind, store in stores:
            segments = self._segments(names, kind)
            parts = [self._pieces[kind].get(name) for name, _ in segments]
            found = [part for part in parts if part is not None]
            if segments and len(found) == len(parts):
                store[index] = torch.cat(found)
            else:
                store.pop(index, None)  # PowerSGD allocates afresh (zeros, or a new random Q)
        mine = set(names)
        for other, other_names in list(self._layout.items()):
            if other != index and mine.intersection(other_names):  # its state now lives in this bucket
                del self._layout[other]
                for _, store in stores:
                    store.pop(other, None)
        self._layout[index] = names

    def _segments(self, names: list[str], kind: str) -> list[tuple[str, int]]:
        """(parameter, length) of each piece of a bucket's flat error / P / Q tensor, in memory
        order: the error holds every gradient in bucket order; P and Q hold the compressed
        matrices grouped by shape (groups in order of first appearance), as powerSGD_hook
        allocates them."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

        if kind == "error":
            return [(name, math.prod(self._shapes[name])) for name in names]
        st = self.hook_state
        groups: dict[tuple[int, int], list[tuple[str, int]]] = {}
        for name in names:
            shape = self._shapes[name]
            rows = shape[0] if shape else 1
            cols = math.prod(shape) // rows if rows else 0
            rank = min(rows, cols, st.matrix_approximation_rank)
            if _should_compress(rows, cols, rank, st.min_compression_rate)[0]:
                groups.setdefault((rows, cols), []).append((name, (rows if kind == "p" else cols) * rank))
        return [piece for pieces in groups.values() for piece in pieces]

    def state_dict(self) -> dict:
        """The hook's own state (PowerSGDState): error feedback and warm-start factors per
        bucket, its iteration and its NumPy generator, as tensors and plain values."""
        st = self.hook_state
        name, keys, pos, has_gauss, cached = st.rng.get_state()
        return {
            "step": self.step, "iter": st.iter,
            "error_dict": dict(st.error_dict), "p_memory_dict": dict(st.p_memory_dict),
            "q_memory_dict": dict(st.q_memory_dict),
            "rng": {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached": float(cached)},
            "stats": [st.total_numel_before_compression, st.total_numel_after_compression, st.next_stats_report],
            "layout": {index: list(names) for index, names in self._layout.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        import numpy as np

        super().load_state_dict(state)
        st = self.hook_state
        st.iter = int(state["iter"])
        st.error_dict = dict(state["error_dict"])
        st.p_memory_dict = dict(state["p_memory_dict"])
        st.q_memory_dict = dict(state["q_memory_dict"])
        r = state["rng"]
        st.rng.set_state((r["name"], r["keys"].numpy().astype(np.uint32), r["pos"], r["has_gauss"], r["cached"]))
        st.total_numel_before_compression, st.total_numel_after_compression, st.next_stats_report = state["stats"]
        self._layout = {int(index): list(names) for index, names in state["layout"].items()}


@METHODS.register
class TorchPostLocalSGD(TorchBuiltin):
    name = "torch-postlocalsgd"
    Config = TorchPostLocalSGDConfig
    summary = "PyTorch post-local SGD: post_localSGD_hook + PeriodicModelAverager (parameters every period steps)"

    def _hook(self) -> tuple[Any, Callable]:
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pl
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        cfg = self.config
        self.averager = PeriodicModelAverager(period=cfg.period, warmup_steps=cfg.warmup)
        state = pl.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=cfg.warmup,
                                     post_local_gradient_allreduce=False)
        return state, pl.post_localSGD_hook

    def after_step(self) -> None:
        """Every ``period`` steps after the warm-up, average the parameters (metered)."""
        with _timed(self.comm, self._timing):
            self.averager.average_parameters(self.model.parameters())
        self.step += 1

    def state_dict(self) -> dict:
        return {"step": self.step, "iter": self.hook_state.iter, "averager_step": self.averager.step}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.hook_state.iter = int(state["iter"])
        self.averager.step = int(state["averager_step"])

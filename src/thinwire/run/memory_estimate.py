"""Whether a run's batch can fit this machine's memory, estimated before any rank starts.

``thinwire train --batch-size 100000000`` would otherwise start its ranks, and the first step
would grind through swap for minutes (or the kernel's out-of-memory killer would end a rank)
before anything said why. :func:`check_batch` refuses such a batch with one line.

The estimate for one rank is

    fixed + batch_size x per_sample

* ``per_sample`` = the bytes autograd keeps for backward per sample, plus
  :data:`BACKWARD_FACTOR` x the largest module output per sample, plus
  :data:`PIPELINE_COPIES` x the bytes of one sample of the batch (inputs and targets).
  The first two are measured, not modelled: the task's own model is built on the CPU and runs
  one forward (and the task's loss) on two tiny batches of the task's own training samples,
  while autograd's saved-tensor hooks record every tensor kept for backward (distinct
  storages, the parameters and the batch itself excepted) and forward hooks on every module
  record the largest output. The growth from the smaller batch to the larger one, per sample,
  is the figure, so what does not grow with the batch (a positional table) is not multiplied.
* ``fixed`` = :data:`BYTES_PER_WORKER` (the interpreter, torch) + the
  parameters with their gradients and the optimizer's state (Adam: two tensors per
  parameter, SGD: one) + the task's data set, which every rank holds (the tensors the task
  object holds).

What is ours and what is not: the kept tensors and the largest output are the model's own,
measured. The two factors are thinwire's round figures: :data:`BACKWARD_FACTOR` stands for
the gradients backward holds at once while it passes the largest layer (of its output and of
its input), :data:`PIPELINE_COPIES` for the batch as the task builds it plus the temporaries
of building it (index tensors, gathered copies; a task that augments makes more). Not
counted: a method's own state (error feedback holds a copy of the gradients), the evaluation
(its batches are the task's own fixed size), allocator slack. Against the growth of peak
resident memory over one real step (forward, backward, Adam's step) the per-sample part came
out at 0.96x (charlm, batch 500), 1.08x (synthetic, 50,000) and 1.17-1.24x (mnist1d,
20,000 and 60,000): close, so a batch is refused only when it cannot fit.

The memory compared against is what the OS reports available now (Linux ``MemAvailable``),
the figure that also bounds ``--workers``. Ranks counted: ``--workers`` for local spawns;
under torchrun the ranks on this machine (``LOCAL_WORLD_SIZE``), each rank checking before it
builds anything. A torchrun rank on a GPU (NCCL) is not checked: its activations live in the
GPU's memory, not in this one. A task or model that cannot be built or run here is not
checked either: the checks after this one report what is wrong with it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

BYTES_PER_WORKER = 500e6  # a rank's floor: the interpreter, torch and a small model
BACKWARD_FACTOR = 2.0  # the largest module output's gradients while backward runs (of its output and input)
PIPELINE_COPIES = 2.0  # the batch as built, plus the temporaries of building it
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "sgd": 1}  # state tensors per parameter (SGD: momentum)
PROBE_BATCHES = (2, 6)  # the two tiny batches whose difference gives the bytes per sample


@dataclass(frozen=True)
class Footprint:
    """What one sample and the model cost, measured once per task (:func:`footprint`)."""

    kept_bytes: float  # per sample: the tensors autograd keeps for backward
    output_bytes: float  # per sample: the largest module output
    sample_bytes: float  # per sample: the batch's inputs and targets
    parameter_bytes: int  # the model's parameters
    data_bytes: int  # the task's data set, as held by each rank


@dataclass(frozen=True)
class Estimate:
    """Bytes one rank needs for a batch: ``fixed + batch_size * per_sample``."""

    batch_size: int
    fixed: float
    per_sample: float

    @property
    def per_rank(self) -> float:
        return self.fixed + self.batch_size * self.per_sample

    def largest_batch(self, room: float) -> int:
        """The largest batch whose estimate fits ``room`` bytes (0 when not even one does)."""
        return max(0, int((room - self.fixed) // self.per_sample)) if self.per_sample > 0 else 0


_footprints: dict[tuple[Any, ...], Footprint | None] = {}
_footprints_lock = threading.Lock()


def footprint(task: str, seed: int = 0, data_dir: str | None = None,
              options: dict[str, Any] | None = None) -> Footprint | None:
    """The task's :class:`Footprint`, measured on the CPU (once per process for the same task,
    seed, data and options: ``thinwire compare`` resolves one config per method); None when
    the task or its model cannot be built or run here."""
    key = (task, seed, data_dir, repr(sorted((options or {}).items())))
    with _footprints_lock:
        if key not in _footprints:
            try:
                _footprints[key] = _measure(task, seed, data_dir, dict(options or {}))
            except Exception:  # noqa: BLE001  (the checks that build the task name what is wrong)
                _footprints[key] = None
        return _footprints[key]


def _measure(name: str, seed: int, data_dir: str | None, options: dict[str, Any]) -> Footprint:
    from thinwire.tasks import get as get_task

    task = get_task(name)(seed=seed, data_dir=data_dir, **options)
    model = task.build_model()
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    small, large = PROBE_BATCHES
    with torch.random.fork_rng(devices=[]):  # dropout draws: the caller's generator is left as it was
        kept_small, out_small, _ = _forward_bytes(task, model, small, params)
        kept_large, out_large, sample = _forward_bytes(task, model, large, params)
    return Footprint(
        kept_bytes=max(0.0, (kept_large - kept_small) / (large - small)),
        output_bytes=max(0.0, (out_large - out_small) / (large - small)),
        sample_bytes=sample / large,
        parameter_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        data_bytes=sum(v.numel() * v.element_size() for v in vars(task).values() if isinstance(v, torch.Tensor)),
    )


def _forward_bytes(task: Any, model: torch.nn.Module, batch: int, params: set[int]) -> tuple[int, int, int]:
    """A forward and the loss on ``batch`` of the task's own training samples: (bytes of the
    distinct storages kept for backward, the parameters and the batch excepted; bytes of the
    largest module output; bytes of the batch itself)."""
    from torch.utils._pytree import tree_flatten

    x, y = next(iter(task.train_batches(0, 1, batch)))
    skip = set(params) | {t.untyped_storage().data_ptr() for t in (x, y)}
    saved: dict[int, int] = {}
    largest = [0]

    def nbytes(t: Any) -> int:
        if not (isinstance(t, torch.Tensor) and t.layout == torch.strided):
            return 0
        storage = t.untyped_storage()
        return 0 if storage.data_ptr() in skip else storage.nbytes()

    def on_output(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        largest[0] = max([largest[0], *(nbytes(t) for t in tree_flatten(output)[0])])

    def pack(t: torch.Tensor) -> torch.Tensor:
        if nbytes(t):
            saved[t.untyped_storage().data_ptr()] = nbytes(t)
        return t

    hooks = [m.register_forward_hook(on_output) for m in model.modules()]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            task.loss(model(x), y)
    finally:
        for h in hooks:
            h.remove()
    return sum(saved.values()), largest[0], x.numel() * x.element_size() + y.numel() * y.element_size()


def estimate(cfg: Any, shape: Footprint) -> Estimate:
    """The bytes one rank of ``cfg`` (resolved: batch size and optimizer filled) needs."""
    slots = OPTIMIZER_SLOTS.get(str(cfg.optimizer), 2)
    fixed = BYTES_PER_WORKER + shape.parameter_bytes * (2 + slots) + shape.data_bytes
    per_sample = shape.kept_bytes + BACKWARD_FACTOR * shape.output_bytes + PIPELINE_COPIES * shape.sample_bytes
    return Estimate(batch_size=int(cfg.batch_size), fixed=fixed, per_sample=per_sample)


def local_ranks(cfg: Any, torchrun: bool) -> int | None:
    """The ranks of ``cfg`` on this machine whose memory is this machine's: ``--workers``, or
    torchrun's ``LOCAL_WORLD_SIZE``; None for a torchrun rank on a GPU (not checked)."""
    if not torchrun:
        return int(cfg.workers)
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:  # init_from_env picks NCCL and this GPU
        return None
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


def check_batch(cfg: Any, *, torchrun: bool, available: float | None) -> None:
    """Refuse (ValueError, one line naming the rule) a batch whose estimate, times the ranks on
    this machine, is more than the ``available`` memory. Nothing is refused when the
    available memory or the task's footprint is unknown, nor when the ranks do not fit even
    without a batch: that is the number of ranks, which ``--workers``' own bound (and
    ``--max-workers``, which replaces it) decides."""
    ranks = local_ranks(cfg, torchrun)
    if ranks is None or available is None:
        return
    shape = footprint(cfg.task, cfg.seed, cfg.data_dir, cfg.task_options)
    if shape is None:
        return
    need = estimate(cfg, shape)
    if ranks * need.per_rank <= available or ranks * need.fixed > available:
        return  # it fits; or what does not fit is the ranks themselves, which --workers' own bound decides
    fits = need.largest_batch(available / ranks)
    how = f"at most about {fits} per rank would fit" if fits else "not even a batch of 1 per rank would fit"
    together = f" ({ranks} ranks: {_size(ranks * need.per_rank)})" if ranks > 1 else ""
    raise ValueError(f"--batch-size {need.batch_size} needs about {_size(need.per_rank)} per rank{together} for "
                     f"{cfg.task}'s model, more than the {_size(available)} of memory this machine has available; "
                     f"{how}")


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"

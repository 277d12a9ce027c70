"""Hugging Face accelerate: thinwire's hook on the model ``Accelerator.prepare`` wrapped.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = thinwire.accelerate.register(accelerator, model, "powersgd:rank=2")   # the one line

With several processes (``accelerate launch`` or ``torchrun``; on the CPU with
``Accelerator(cpu=True)``, without which accelerate runs each process alone) ``prepare`` wraps
the model in PyTorch's DDP, and :func:`register` puts :func:`thinwire.ddp.register`'s hook on
it, with the accelerator's ``GradScaler`` under ``mixed_precision="fp16"``. Everything else is
accelerate's own: ``accelerator.backward(loss)``, ``accelerator.accumulate(model)`` (DDP's
``no_sync``: the hook runs on the step's last micro-batch), ``accelerator.save_state``.
thinwire's state (residuals, codec state: each process's own) is registered for
checkpointing, so ``accelerator.save_state``/``load_state`` carry it: every process's state
is gathered into the main process's file and each gets its own back
(:class:`~thinwire.integrations.ranks.EveryRank`); call :func:`register` before
``load_state``, and ``save_state`` on every process (the gathering is collective). Codecs
and policies only: a method with a schedule of its own attaches to a plain loop with
:func:`thinwire.attach`.
"""

from __future__ import annotations

import os
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from thinwire.integrations import ddp
from thinwire.integrations.ranks import EveryRank
from thinwire.policy import Policy


def register(accelerator: Any, model: Any, method: str | Policy = "identity", *,
             overlap: bool = True) -> ddp.HookState | None:
    """Register thinwire's DDP hook (``method``: a codec spec or policy) on a model
    ``accelerator.prepare`` returned, register its state for ``save_state``/``load_state``,
    and return it (``None`` in a run of one process,
    where accelerate does not wrap the model and nothing is communicated). Raises
    ``ValueError`` when the model is not DDP-wrapped (FSDP, DeepSpeed...) or the spec is not
    a codec or policy."""
    if accelerator.num_processes == 1:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:  # torchrun started several processes that accelerate runs as separate single ones
            raise ValueError(f"accelerate runs this process alone, but WORLD_SIZE={world}: on the CPU create "
                             "Accelerator(cpu=True) so that it joins the other processes (gloo)")
        return None
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"thinwire.accelerate.register needs the DDP-wrapped model accelerator.prepare returns; "
                         f"got {type(model).__name__} (distributed type {accelerator.distributed_type}): "
                         "thinwire's hook runs on DistributedDataParallel only")
    state = ddp.register(model, method, scaler=getattr(accelerator, "scaler", None), overlap=overlap)
    accelerator.register_for_checkpointing(EveryRank(state, model.process_group))
    return state


__all__ = ["register"]

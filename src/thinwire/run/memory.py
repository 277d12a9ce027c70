"""What one rank holds for its model, in bytes: the figures a run's summary reports under
``memory``.

* ``parameters``, ``gradients``, ``optimizer``: the tensors this rank holds (a sharded
  parameter's shard, FSDP2's local tensor), gradients counted as one per trainable parameter
  (they all exist when backward ends);
* ``method``: what the method keeps across steps: its state dict (residuals, snapshots,
  DiLoCo's copy ``θ`` and its outer optimizer's state), or its own figure of the buffers it
  keeps (``extra_memory_bytes``: DiLoCo's flat pseudo-gradient too) when that is larger;
* ``fsdp_unsharded``: between sharded groups, FSDP2's unsharded working set during a step,
  from its units: the root's parameters (the root keeps them gathered through the step),
  two other units' (the one computing and the one prefetched) and one unit's unsharded
  gradient, each the largest unit's;
* ``model_state_peak``: their sum, the figure a layout's memory is judged by;
* ``activations``: apart, the bytes one forward pass saved for backward (parameters not
  included), measured at this process's first step.
"""

from __future__ import annotations

from typing import Any

import torch

from thinwire.algorithms import reporting
from thinwire.comm.groups import is_sharded, local_part


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) state dict; tensors sharing storage count once; of a
    sharded (DTensor) one, the shard this rank holds."""
    seen: set[int] = set()

    def walk(o: Any) -> int:
        if isinstance(o, torch.Tensor):
            o = local_part(o)
            key = o.untyped_storage().data_ptr()
            if key in seen:
                return 0
            seen.add(key)
            return o.untyped_storage().nbytes()
        if isinstance(o, dict):
            return sum(walk(v) for v in o.values())
        if isinstance(o, (list, tuple)):
            return sum(walk(v) for v in o)
        return 0

    return walk(obj)


class SavedForBackward:
    """A context manager counting the bytes of the tensors autograd saves for backward inside
    it (each storage once; parameters, which the model holds anyway, left out): a forward
    pass's activations."""

    def __init__(self) -> None:
        self.bytes = 0
        self._seen: set[int] = set()
        self._hooks: Any = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and not is_sharded(t):
            key = t.untyped_storage().data_ptr()
            if key not in self._seen:
                self._seen.add(key)
                self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> SavedForBackward:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def fsdp_unsharded(model: torch.nn.Module) -> int:
    """FSDP2's unsharded working set during a step (see the module), 0 for a model it does
    not shard."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return 0
    inner = {id(p) for u in units if u is not model for p in u.parameters()}

    def unsharded(unit: torch.nn.Module, skip: set[int]) -> int:
        return sum(p.numel() * p.element_size() for p in unit.parameters() if id(p) not in skip)

    root = unsharded(model, inner) if isinstance(model, FSDPModule) else 0
    others = [unsharded(u, set()) for u in units if u is not model]
    largest = max(others, default=0)
    return root + 2 * largest + largest


def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer, method: Any, method_state: Any,
         activations: int | None) -> dict[str, int | None]:
    """This rank's figures (see the module); ``method_state``: the method's state dict."""
    params = list(model.parameters())
    parameters = sum(local_part(p.detach()).numel() * p.element_size() for p in params)
    gradients = sum(local_part(p.detach()).numel() * p.element_size() for p in params if p.requires_grad)
    opt = tensor_bytes(optimizer.state_dict()["state"])
    own = reporting.report(method).get("extra_memory_bytes")
    kept = max(tensor_bytes(method_state), int(own) if isinstance(own, (int, float)) else 0)
    working = fsdp_unsharded(model)
    return {"parameters": parameters, "gradients": gradients, "optimizer": opt, "method": kept,
            "fsdp_unsharded": working, "model_state_peak": parameters + gradients + opt + kept + working,
            "activations": activations}

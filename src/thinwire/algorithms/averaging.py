"""The state that model averaging keeps in agreement, as one flat fp32 vector.

Local SGD and DaSGD average *models*, not gradients: every trainable parameter, every
floating-point buffer (BatchNorm's running mean and variance; integer buffers such as
``num_batches_tracked`` are left alone) and, with ``average_momentum``, the optimizer's
per-parameter state tensors of the parameter's shape (SGD's momentum buffer, Adam's two
moments). Every rank lists them in the same order (module registration order), so the flat
vectors line up across ranks. A parameter sharded by FSDP2 (a DTensor) counts with the part
this rank holds (its local tensor): over sharded worker groups the flat vector is this rank's
shard of the model, which lines up with the same shard in the other groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from thinwire.algorithms.gradients import GradientReducer
from thinwire.codecs.base import Codec
from thinwire.codecs.identity import Identity, IdentityConfig
from thinwire.comm.base import Communicator
from thinwire.comm.groups import local_part
from thinwire.timing import Timing


def comm_or_world(comm: Communicator | None) -> Communicator:
    """``comm``, or the default ``torch.distributed`` process group as a communicator."""
    if comm is not None:
        return comm
    from thinwire.comm.torch_dist import TorchComm

    return TorchComm()


class GradientMean:
    """Synchronous fp32 (or ``codec``) gradient averaging (the warm-up steps of local SGD and DaSGD, and
    AB-training's phases), with DDP's gradient semantics (a ``None`` gradient stays
    ``None``; see :class:`~thinwire.algorithms.gradients.GradientReducer`). With ``overlap``,
    buckets are averaged while the backward pass goes on, in steps where :attr:`armed` is
    True: a method arms it for exactly the steps whose ``after_backward`` calls
    :meth:`reduce` (the warm-up), since a launched bucket must be reduced."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], comm: Communicator, bucket_mb: float,
                 overlap: bool = True, armed: bool = True, codec: Codec | None = None) -> None:
        self.named = list(named)
        # one per object: the aggregator sets its rank (``codec``: a cast instead, e.g. bf16 inside a node)
        chosen = codec if codec is not None else Identity(IdentityConfig())
        self.reducer = GradientReducer(self.named, lambda name, t: chosen, comm, bucket_mb=bucket_mb,
                                       overlap=overlap)
        self.armed = armed

    @property
    def armed(self) -> bool:
        """Whether the next backward pass launches buckets (only steps that reduce() may)."""
        return self.reducer.armed

    @armed.setter
    def armed(self, value: bool) -> None:
        self.reducer.armed = bool(value)

    @property
    def timing(self) -> Timing:
        return self.reducer.timing

    def reduce(self) -> None:
        """Replace every gradient with its mean over the ranks."""
        self.reducer.reduce()

    def state_dict(self) -> dict:
        return self.reducer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.reducer.load_state_dict(state)


class ModelState:
    """Gathers a model's averaged tensors into a flat fp32 vector and writes one back."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 average_momentum: bool = False) -> None:
        if average_momentum and optimizer is None:
            raise ValueError("average_momentum needs the optimizer")
        self.model = model
        self.optimizer = optimizer
        self.average_momentum = average_momentum
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model averaging needs at least one parameter with requires_grad=True")
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self._momentum: list[torch.Tensor] | None = None  # found at the first gather (optimizers create state lazily)

    def tensors(self) -> list[torch.Tensor]:
        """Parameters, float buffers, then (with ``average_momentum``) optimizer state tensors."""
        out = self.local_params() + [local_part(b) for b in self.buffers]
        if self.average_momentum:
            if self._momentum is None:
                self._momentum = self._find_momentum()
            out += self._momentum
        return out

    def local_params(self) -> list[torch.Tensor]:
        """The trainable parameters' data as this rank holds it (a shard's local tensor,
        writing through to it), in order."""
        return [local_part(p.detach()) for p in self.params]

    def _find_momentum(self) -> list[torch.Tensor]:
        assert self.optimizer is not None  # average_momentum needs it (checked when built)
        found: list[torch.Tensor] = []
        for p in self.params:
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                t = state[key]
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.shape == p.shape:
                    found.append(local_part(t))
        return found

    def numel(self) -> int:
        return sum(t.numel() for t in self.tensors())

    def gather(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensors, flattened into ``out`` (fp32, allocated when None)."""
        ts = self.tensors()
        n = sum(t.numel() for t in ts)
        if out is None or out.numel() != n:
            out = torch.empty(n, dtype=torch.float32, device=ts[0].device)
        off = 0
        for t in ts:
            out[off : off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()
        return out

    def scatter(self, flat: torch.Tensor) -> None:
        """Write ``flat`` back into the tensors (cast to each tensor's dtype)."""
        off = 0
        for t in self.tensors():
            t.copy_(flat[off : off + t.numel()].view(t.shape))
            off += t.numel()

    def add_(self, flat: torch.Tensor) -> None:
        """Add ``flat`` to the tensors in place."""
        off = 0
        for t in self.tensors():
            t.add_(flat[off : off + t.numel()].view(t.shape).to(t.dtype))
            off += t.numel()

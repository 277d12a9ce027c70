"""A DDP communication hook built on thinwire's codecs: an existing DDP script changes by one line.

    model = DistributedDataParallel(model)
    thinwire.ddp.register(model, "powersgd:rank=2")   # the one line

Every DDP bucket is averaged through the same aggregation path as :class:`SyncReducer`
(codec choice, error feedback keyed by parameter name, SUM or GATHER collective). The hook
runs its collectives synchronously and returns a completed future: with compressing codecs
the encode/decode work dominates on the CPU, and a synchronous hook keeps every rank's
collective order trivially identical. It therefore does not overlap communication with the
rest of the backward pass the way DDP's own asynchronous all_reduce does.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire.aggregate import Aggregator, Timing
from thinwire.codecs.base import Codec
from thinwire.codecs.registry import build_codec
from thinwire.comm.base import Communicator
from thinwire.feedback import ErrorFeedback
from thinwire.policy import Assignment, Policy, as_policy


@dataclass
class HookState:
    """What the hook keeps across calls: per-bucket aggregators keyed by parameter names.

    ``codec`` is the one codec of every parameter, or None when ``assignment`` (a policy
    applied to the model) gives each parameter its own."""

    codec: Codec | None
    comm: Communicator
    names: dict[int, str]  # id(parameter) -> qualified name
    assignment: Assignment | None = None
    feedback: ErrorFeedback = field(default_factory=ErrorFeedback)
    aggregators: dict[tuple[str, ...], Aggregator] = field(default_factory=dict)
    step: int = 0  # iterations completed; identical on all ranks

    def codec_for(self, name: str, tensor: torch.Tensor) -> Codec:
        return self.codec if self.assignment is None else self.assignment.codec_for(name)

    @property
    def codecs(self) -> list[Codec]:
        return [self.codec] if self.assignment is None else self.assignment.codecs

    def describe(self) -> str:
        return self.codec.describe() if self.assignment is None else self.assignment.policy.describe()

    def state_dict(self) -> dict:
        """Step, residuals by parameter name, and the codecs' state (for checkpoints)."""
        return {"step": self.step, "codec": self.describe(), "feedback": self.feedback.state_dict(),
                "codec_state": [c.state_dict() for c in self.codecs]}

    def load_state_dict(self, state: dict) -> None:
        if state["codec"] != self.describe():
            raise ValueError(f"checkpoint was saved with codec {state['codec']}, this hook has {self.describe()}")
        self.step = int(state["step"])
        self.feedback.load_state_dict(state["feedback"])
        for c, cs in zip(self.codecs, state["codec_state"]):
            c.load_state_dict(cs)

    @property
    def timing(self) -> Timing:
        total = Timing()
        for agg in self.aggregators.values():
            total.codec_seconds += agg.timing.codec_seconds
            total.comm_seconds += agg.timing.comm_seconds
        return total


# no `from __future__ import annotations` here: DDP checks that the hook's annotations are
# the real GradBucket / Future classes
def hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average one DDP bucket in place through ``state.codec``; returns the bucket's buffer."""
    names = tuple(state.names[id(p)] for p in bucket.parameters())
    grads = bucket.gradients()  # views into bucket.buffer(): writing them writes the buffer
    agg = state.aggregators.get(names)
    if agg is None:
        # DDP rebuilds its buckets after the first iteration; state is keyed by name, so the
        # new bucket's aggregator picks up residuals and warm starts where the old one left off.
        # Aggregators of superseded buckets (sharing a name with this one) are dropped.
        for old in [k for k in state.aggregators if set(k) & set(names)]:
            del state.aggregators[old]
        named = list(zip(names, grads))
        agg = state.aggregators[names] = Aggregator(named, state.codec_for, state.comm, feedback=state.feedback)
    agg.step = state.step
    agg.reduce_(dict(zip(names, grads)))
    if bucket.is_last():
        state.step += 1
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def register(
    model: DistributedDataParallel, method: "str | Codec | Policy" = "identity", comm: "Communicator | None" = None
) -> HookState:
    """Register thinwire's hook on a DDP model and return its state (for timing and checkpoints).

    ``method`` is a codec spec or codec, or a policy (a preset spec such as ``"hylo"``, or a
    :class:`~thinwire.policy.Policy`) applied to ``model.module``. ``comm`` defaults to the
    DDP model's process group.
    """
    policy = as_policy(method)
    if policy is not None:
        codec, assignment = None, policy.assign(model.module)
        codecs = assignment.codecs
    else:
        codec, assignment = (build_codec(method) if isinstance(method, str) else method), None
        codecs = [codec]
    for c in codecs:
        if c.loss_window():
            raise ValueError(f"{c.describe()} follows the training loss, which a DDP hook never sees; "
                             "use thinwire.SyncReducer and reduce(loss)")
    if comm is None:
        from thinwire.comm.torch_dist import TorchComm

        comm = TorchComm(model.process_group)
    names = {id(p): n for n, p in model.module.named_parameters()}
    state = HookState(codec, comm, names, assignment)
    model.register_comm_hook(state, hook)
    return state

"""A DDP communication hook built on thinwire's codecs: an existing DDP script changes by one line.

    model = DistributedDataParallel(model)
    thinwire.ddp.register(model, "powersgd:rank=2")   # the one line

Every DDP bucket is averaged through the same aggregation path as :class:`SyncReducer`
(codec choice, error feedback keyed by parameter name, SUM or GATHER collective).

**Overlap.** The hook returns at once with a future; the bucket is encoded, communicated
(every round of a multi-round codec such as PowerSGD) and decoded by one worker thread of
the hook's, while the backward pass goes on computing the next buckets, as DDP's own
asynchronous all_reduce does. Codecs without state whose one round is a sum (identity,
``bf16``, ``fp16``) go further, as PyTorch's own hooks do: the hook casts the bucket and
starts its all_reduce itself, and the worker only waits for it and casts the mean back into
the bucket, so the next bucket's collective starts while this one is still on the wire.
The worker takes buckets in the order DDP hands them over (bucket order, the same on every
rank), one at a time, and every collective is issued from one thread, so every rank issues
the same collectives in the same order, and the averages are bit-identical to the
synchronous path (``register(..., overlap=False)``: each bucket averaged inside the hook,
for debugging).
DDP waits for every bucket's future at the end of the backward pass, so gradients are
final when ``backward()`` returns. The last bucket's hook waits for the worker to finish
before it returns (every gradient is computed by then, so this costs no overlap): DDP issues
collectives of its own right after it (with ``find_unused_parameters=True``, the map of used
parameters), and they must follow the buckets' on every rank. On the CPU the overlap hides waiting on the network, and
codec work runs beside the backward pass's kernels where cores allow.

Gradient semantics are DDP's own: DDP decides which parameters are reduced (frozen ones,
and with ``find_unused_parameters=True`` unused ones, are handled by DDP itself). With
mixed precision, give the ``GradScaler`` to :func:`register`: the buckets of a step are
then held until the last one is ready (DDP waits for their futures only after the whole
backward pass), checked together with one 4-byte all_reduce, and either all averaged, in
unscaled units (residuals and codec state in the model's own units; plain casts such as
``fp16`` stay in the scaler's units, where loss scaling keeps small values) and scaled
back, or, when any rank holds an inf or NaN, all returned as NaN on every rank with no
residual, codec state or step changed, so every rank's ``scaler.step`` skips the step.
"""

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire.aggregate import Aggregator, pipelines
from thinwire.algorithms.gradients import check_and_unscale, is_plain, loss_scale, refuse_sparse
from thinwire.algorithms.methods import refuse_schedule
from thinwire.codecs.base import Codec
from thinwire.codecs.specs import build_codec
from thinwire.comm.background import Worker
from thinwire.comm.base import Communicator
from thinwire.comm.fingerprint import agree_on_parameters
from thinwire.feedback import ErrorFeedback
from thinwire.figures import figures
from thinwire.hierarchical import build_aggregator
from thinwire.policy import Assignment, Policy, as_policy
from thinwire.timing import Timing

# a bucket held until the step's last one (under a scaler): buffer, names, gradients, aggregator, future
_Pending = tuple[torch.Tensor, tuple[str, ...], list[torch.Tensor], Aggregator, torch.futures.Future]


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
    scaler: Any = None  # a torch.amp.GradScaler: buckets averaged in unscaled units, overflows agreed
    skipped: int = 0  # steps dropped on every rank for a non-finite gradient (under a scaler)
    pending: list[_Pending] = field(default_factory=list)  # under a scaler: this step's buckets, landed with the last
    overlap: bool = True  # average buckets on the worker thread while backward goes on (False: in the hook)
    worker: Worker | None = None

    @property
    def pipelines(self) -> bool:
        """Every codec of the hook launches from the backward pass and lands on the worker
        (:func:`thinwire.aggregate.pipelines`: identity and the casts); decided for the whole
        hook, so every rank issues every collective from the same thread, in bucket order.
        Never over nodes: a two-level bucket runs collectives inside the node both when it
        launches and when it lands, so both must stay on one thread."""
        return getattr(self.comm, "hierarchy", None) is None and all(pipelines(c) for c in self.codecs)

    def _single(self) -> Codec:
        """The one codec of every parameter (when there is no ``assignment``)."""
        assert self.codec is not None  # None only beside a policy's assignment
        return self.codec

    def codec_for(self, name: str, tensor: torch.Tensor) -> Codec:
        return self._single() if self.assignment is None else self.assignment.codec_for(name)

    @property
    def codecs(self) -> list[Codec]:
        return [self._single()] if self.assignment is None else self.assignment.codecs

    def describe(self) -> str:
        return self._single().describe() if self.assignment is None else self.assignment.policy.describe()

    def state_dict(self) -> dict:
        """Step, residuals by parameter name, and the codecs' state (for checkpoints)."""
        return {"step": self.step, "skipped": self.skipped, "codec": self.describe(),
                "feedback": self.feedback.state_dict(), "codec_state": [c.state_dict() for c in self.codecs]}

    def load_state_dict(self, state: dict) -> None:
        if state["codec"] != self.describe():
            raise ValueError(f"checkpoint was saved with codec {state['codec']}, this hook has {self.describe()}")
        self.step = int(state["step"])
        self.skipped = int(state.get("skipped", 0))
        self.feedback.load_state_dict(state["feedback"])
        for c, cs in zip(self.codecs, state["codec_state"]):
            c.load_state_dict(cs)

    @property
    def timing(self) -> Timing:
        return Timing.total(agg.timing for agg in self.aggregators.values())

    def scalars(self) -> dict[str, float]:
        """This rank's figures so far, ``{tag: number}`` for a logger: bytes and messages
        sent, codec and communication seconds, steps averaged and skipped, and the codecs'
        own numeric figures (see :func:`thinwire.figures.figures`)."""
        stats: dict[str, Any] = {"steps": self.step, "skipped_steps": self.skipped}
        for c in self.codecs:
            stats.update(c.stats())
        return figures(self.comm.meter, self.timing, stats)


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
        agg = state.aggregators[names] = build_aggregator(named, state.codec_for, state.comm, feedback=state.feedback)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    last, buffer = bucket.is_last(), bucket.buffer()
    if state.scaler is not None and state.scaler.is_enabled():
        # DDP waits for every bucket's future only once the whole backward has run, so each
        # bucket waits here until the last one is ready; the step is then decided at once
        state.pending.append((bucket.buffer(), names, grads, agg, fut))
        if bucket.is_last():
            _land_scaled(state)
        return fut

    tensors = dict(zip(names, grads))
    launched = None
    if state.overlap and state.pipelines:
        # identity and casts: encode and launch here, in backward, as DDP's own hooks do, and
        # land (wait, decode) on the worker, so the next bucket's collective starts while this
        # one is still on the wire
        agg.step = state.step
        launched = agg.launch(tensors)

    def average() -> torch.Tensor:
        agg.step = state.step  # the worker runs buckets in order: the step advances after the last
        agg.land(agg.launch(tensors) if launched is None else launched, tensors)
        if last:
            state.step += 1
        return buffer

    if not state.overlap:
        fut.set_result(average())
        return fut
    if state.worker is None:
        state.worker = Worker("thinwire-ddp-hook")
        weakref.finalize(state, state.worker.close)  # the thread ends with the hook's state
    state.worker.submit(average, fut)
    if last:
        # the backward pass has computed every gradient by now; DDP issues collectives of its own
        # right after this returns (the used-parameter map's all_reduce), which must follow every
        # bucket's on every rank: drain the worker first (it runs in order, so this is the last)
        fut.wait()
    return fut


def local_only(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP hook that sends nothing: each rank keeps its own gradients, for methods that
    communicate on a schedule of their own while DDP still wraps the model (the Lightning
    strategy's model averaging)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _land_scaled(state: HookState) -> None:
    """The whole step under a scaler: every bucket checked (and unscaled, but for plain
    casts) at once, one 4-byte all_reduce, then either every bucket NaN (every rank's scaler
    skips; no residual, codec state or step changes) or every bucket averaged and scaled
    back. Completes every pending future."""
    pending, state.pending = state.pending, []
    scale = loss_scale(state.scaler)
    assert scale is not None  # pending only under an enabled scaler
    plain = [[is_plain(state.codec_for(n, g), g.shape) for n, g in zip(names, grads)]
             for _, names, grads, _, _ in pending]
    found = check_and_unscale([g for _, _, grads, _, _ in pending for g in grads],
                              [1.0 if p else 1.0 / scale for flags in plain for p in flags])
    state.comm.all_reduce(found)  # every rank takes the same branch
    bad = bool(found.item())
    for (buffer, names, grads, agg, _), flags in zip(pending, plain):
        if bad:
            buffer.fill_(float("nan"))  # each rank's scaler.step sees it and skips the step
            continue
        agg.step = state.step
        agg.reduce_(dict(zip(names, grads)))
        back = [g for g, p in zip(grads, flags) if not p]
        if back and scale != 1.0:
            torch._foreach_mul_(back, scale)  # back to the scaler's units: scaler.step unscales
    if bad:
        state.skipped += 1
    else:
        state.step += 1
    for buffer, _, _, _, fut in pending:
        fut.set_result(buffer)


def _refuse_loss_window(codecs: "list[Codec]") -> None:
    for c in codecs:
        if c.loss_window():
            raise ValueError(f"{c.describe()} follows the training loss, which a DDP hook never sees; "
                             "use thinwire.SyncReducer and reduce(loss)")


def register(
    model: DistributedDataParallel, method: "str | Codec | Policy" = "identity", comm: "Communicator | None" = None,
    *, scaler: Any = None, overlap: bool = True,
) -> HookState:
    """Register thinwire's hook on a DDP model and return its state: keep it, it holds what a
    checkpoint needs (``state_dict()``/``load_state_dict()``: residuals and codec state by
    parameter name) and the seconds spent (``timing``); the bytes sent are on
    ``state.comm.meter``.

    ``method`` is a codec spec or codec, or a policy (a preset spec such as ``"hylo"``, or a
    :class:`~thinwire.policy.Policy`) applied to ``model.module``; methods with a schedule of
    their own (``dasgd``, ``ab``...) attach to a plain model with ``thinwire.attach``.
    ``comm`` defaults to the DDP model's process group. ``scaler``: the
    ``torch.amp.GradScaler`` of a mixed-precision loop (see the module's docstring).
    ``overlap`` (default True): average each bucket on the hook's worker thread while the
    backward pass goes on; False averages it inside the hook (the same result, no overlap).
    Under a scaler the step's buckets are decided together at the last one, as described
    above, whatever ``overlap`` says. The ranks must hold the same parameters in the same
    order (names, shapes, dtypes, ``requires_grad``): checked here, once, with a 40-byte
    all_gather the meter does not count; ranks that differ raise
    :class:`~thinwire.comm.fingerprint.ParameterMismatch` on every rank.
    """
    if isinstance(method, str):
        refuse_schedule(method, "a DDP communication hook")
    policy = as_policy(method)
    codec: Codec | None = None
    assignment: Assignment | None = None
    if policy is None:
        assert not isinstance(method, Policy)  # as_policy took every Policy
        codec = build_codec(method) if isinstance(method, str) else method
        _refuse_loss_window([codec])
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"thinwire.ddp.register needs a DistributedDataParallel model, got {type(model).__name__}; "
                         "for a plain model use thinwire.attach(model, optimizer, method)")
    refuse_sparse(model.module)
    if policy is not None:
        assignment = policy.assign(model.module)
        _refuse_loss_window(assignment.codecs)
    if comm is None:
        from thinwire.comm.torch_dist import TorchComm

        comm = TorchComm(model.process_group)
    named = list(model.module.named_parameters())
    # DDP checks shapes position by position; this also names layers swapped between ranks,
    # which the hook would average with each other (their residuals keyed by the wrong name)
    agree_on_parameters(named, comm)
    names = {id(p): n for n, p in named}
    state = HookState(codec, comm, names, assignment, scaler=scaler, overlap=overlap)
    model.register_comm_hook(state, hook)
    return state

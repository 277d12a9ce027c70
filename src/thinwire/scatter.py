"""A compressed reduce-scatter + all-gather: the mean of one flat tensor through a gathered codec
without every rank receiving every rank's payload.

An :class:`~thinwire.aggregate.Aggregator` averages a ``GATHER`` codec's payloads by
all_gathering them: each rank sends its payload to ``n − 1`` peers, so the bytes per rank grow
with the world (``(n − 1)·P`` against the ring all_reduce's ``2(n − 1)/n · 4N`` for fp32). Here
the tensor is cut into ``n`` equal chunks (the last padded with zeros) and

1. each rank encodes every chunk and sends chunk ``j`` to rank ``j`` (point to point, all
   pairs at once: a compressed reduce-scatter);
2. rank ``j`` decodes the ``n`` payloads of its chunk, averages them in fp32 and encodes the
   mean again;
3. the encoded means are all_gathered and every rank decodes the whole mean.

Each rank sends ``2(n − 1)`` chunk payloads of ``N/n`` values: ``2(n − 1)/n`` of its encoded
tensor, the ring all_reduce's volume at the codec's size. A 4-bit codec sends 8x fewer bytes
than fp32 on any ``n``, against ``16/n`` through all_gather. The price is a second rounding: the
mean is encoded once more (step 2), which the gather path never does.

Error feedback (the codec's ``ef``) is this rank's own: its residual is what its chunks' payloads
did not carry (step 1). The rounding of the mean (step 2) is not fed back.

Every rank builds the same chunks from the same numel and world size, and encodes fixed-size
payloads (``wire_spec``), so every rank issues the same collectives of the same sizes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import torch

from thinwire.codecs.base import Codec
from thinwire.comm.base import Communicator, Done, Handle
from thinwire.comm.meter import sent_bytes
from thinwire.feedback import ErrorFeedback
from thinwire.payload import Aggregation, Payload, as_bytes, from_bytes, spec_nbytes
from thinwire.timing import Timing


class ScatterMean:
    """The mean over ``comm``'s ranks of one flat tensor named ``name`` (``like``'s numel),
    through ``codec`` (a ``GATHER`` codec) by compressed reduce-scatter and all-gather.

    The same calls as an :class:`~thinwire.aggregate.Aggregator` of one flat tensor:
    :meth:`reduce_`, :meth:`start` (then ``wait``), ``step``, ``timing``, ``sent_bytes`` and
    state that resumes exactly."""

    def __init__(self, name: str, like: torch.Tensor, codec: Codec, comm: Communicator, *,
                 feedback: ErrorFeedback | None = None) -> None:
        if codec.aggregation is not Aggregation.GATHER:
            raise ValueError(f"scatter averaging needs a gathered codec; {codec.name} is summed on the wire "
                             "(its all_reduce is already a reduce-scatter + all-gather)")
        if codec.rounds != 1:
            raise ValueError(f"scatter averaging needs a one-round codec; {codec.name} has {codec.rounds}")
        if like.dim() != 1:
            raise ValueError(f"scatter averaging takes one flat tensor, got shape {tuple(like.shape)}")
        self.name, self.numel, self.codec, self.comm = name, like.numel(), codec, comm
        self.codecs = [codec]
        codec.rank = comm.rank
        self.feedback = feedback if feedback is not None else ErrorFeedback()
        self.timing = Timing()
        self.step = 0
        self.sent_bytes: dict[str, float] = {name: 0.0}
        n = comm.world_size
        self.chunk = math.ceil(self.numel / n)
        self._layout: list[tuple[int, tuple[int, ...], torch.dtype]] = []
        self.row_bytes = 0
        self._lay_out()
        self._buffers: dict[str, torch.Tensor] = {}

    def _lay_out(self) -> None:
        """Byte offsets of a chunk payload's wire tensors at the codec's current step (a wire size
        may follow a schedule, FFT's theta: the same on every rank at the same step)."""
        self._layout, off = [], 0
        for shape, dtype in self.codec.wire_spec(torch.Size([self.chunk]), torch.float32):
            self._layout.append((off, tuple(shape), dtype))
            off += spec_nbytes([(tuple(shape), dtype)])
        self.row_bytes = off

    # -- work ------------------------------------------------------------------------------
    def reduce_(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite ``tensors[name]`` with its mean over the ranks; advances the step."""
        self.start(tensors).wait()

    def start(self, tensors: Mapping[str, torch.Tensor]) -> ScatterReduction:
        """Encode the chunks and start the reduce-scatter; the mean lands in ``tensors`` at
        :meth:`ScatterReduction.wait` (which runs the all-gather)."""
        t0 = time.perf_counter()
        x = tensors[self.name]
        if x.numel() != self.numel or x.dim() != 1:
            raise ValueError(f"scatter averaging was built for a flat tensor of {self.numel} values, got "
                             f"shape {tuple(x.shape)}")
        self.codec.step = self.step
        self._lay_out()
        ef = self.codec.config.ef
        u = self.feedback.compensate(self.name, x) if ef else x
        n, c, rank = self.comm.world_size, self.chunk, self.comm.rank
        padded = self._buffer("padded", (n * c,), torch.float32, x.device)
        padded[: self.numel].copy_(u.reshape(-1))
        padded[self.numel :].zero_()
        send = self._buffer("send", (n, self.row_bytes), torch.uint8, x.device)
        own: list[Payload] = []
        for j in range(n):
            p = self.codec.encode(padded[j * c : (j + 1) * c], key=f"{self.name}/{j}")
            self._pack(p, send[j])
            own.append(p)
        if ef:  # this rank's residual: what its own chunk payloads did not carry
            sent = self._buffer("sent", (n * c,), torch.float32, x.device)
            for j, p in enumerate(own):
                self.codec.decode_to(p, sent[j * c : (j + 1) * c])
            self.feedback.update(self.name, u, sent[: self.numel].view_as(u))
        recv = self._buffer("recv", (n, self.row_bytes), torch.uint8, x.device)
        recv[rank].copy_(send[rank])
        peers = [j for j in range(n) if j != rank]
        self.sent_bytes[self.name] += len(peers) * sent_bytes("send", self.row_bytes, n)
        t1 = time.perf_counter()
        handle = self.comm.exchange({j: send[j] for j in peers}, {j: recv[j] for j in peers}, async_op=True)
        t2 = time.perf_counter()
        self.timing.codec_seconds += t1 - t0
        self.timing.comm_seconds += t2 - t1
        return ScatterReduction(self, handle, tensors, t1)

    def _land(self, handle: Handle, tensors: Mapping[str, torch.Tensor]) -> None:
        """Average this rank's chunk, encode the mean, all-gather the means, write them out."""
        t0 = time.perf_counter()
        handle.wait()
        t1 = time.perf_counter()
        n, c = self.comm.world_size, self.chunk
        recv = self._buffers["recv"]
        x = tensors[self.name]
        acc = self._buffer("acc", (c,), torch.float32, x.device)
        acc.zero_()
        self.codec.decode_sum([self._unpack(recv[i]) for i in range(n)], acc)
        acc.div_(n)
        mean = self.codec.encode(acc, key=f"{self.name}/mean")
        row = self._buffer("row", (self.row_bytes,), torch.uint8, x.device)
        self._pack(mean, row)
        gathered = self._buffer("gathered", (n, self.row_bytes), torch.uint8, x.device)
        self.sent_bytes[self.name] += sent_bytes("all_gather", self.row_bytes, n)
        t2 = time.perf_counter()
        self.comm.all_gather(row, gathered)
        t3 = time.perf_counter()
        out = self._buffer("out", (n * c,), torch.float32, x.device)
        for i in range(n):
            self.codec.decode_to(self._unpack(gathered[i]), out[i * c : (i + 1) * c])
        x.copy_(out[: self.numel].view_as(x))
        t4 = time.perf_counter()
        self.timing.comm_seconds += (t1 - t0) + (t3 - t2)
        self.timing.codec_seconds += (t2 - t1) + (t4 - t3)
        self.step += 1

    # -- bytes -----------------------------------------------------------------------------
    def _pack(self, p: Payload, row: torch.Tensor) -> None:
        for (off, _, _), t in zip(self._layout, p.tensors, strict=True):
            row[off : off + t.numel() * t.element_size()].copy_(as_bytes(t))

    def _unpack(self, row: torch.Tensor) -> Payload:
        return Payload(tuple(from_bytes(row, off, shape, dtype) for off, shape, dtype in self._layout),
                       torch.Size([self.chunk]), torch.float32)

    def _buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        b = self._buffers.get(key)
        if b is None or b.shape != shape or b.dtype != dtype or b.device != device:
            b = self._buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return b

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Step, bytes, this rank's residual and the codec's state."""
        return {"step": self.step, "sent_bytes": dict(self.sent_bytes), "feedback": self.feedback.state_dict(),
                "codecs": [self.codec.describe()], "codec_states": [self.codec.state_dict()], "scatter": True}

    def load_state_dict(self, state: dict) -> None:
        """Restore exactly; the state must be a scatter average's with the same codec."""
        if not state.get("scatter"):
            raise ValueError("checkpoint was saved with all_gather averaging (scatter=false); this run averages by "
                             "reduce-scatter (scatter=true): resume with the same setting")
        if list(state["codecs"]) != [self.codec.describe()]:
            raise ValueError(f"checkpoint was saved with codecs {state['codecs']}, this average has "
                             f"{[self.codec.describe()]}")
        self.step = int(state["step"])
        self.sent_bytes.update(state.get("sent_bytes", {}))
        self.feedback.load_state_dict(state["feedback"])
        self.codec.load_state_dict(state["codec_states"][0])


class ScatterReduction:
    """A :meth:`ScatterMean.start` in flight (the reduce-scatter): :meth:`wait` lands it, once."""

    def __init__(self, owner: ScatterMean, handle: Handle, tensors: Mapping[str, torch.Tensor],
                 started_at: float) -> None:
        self._owner, self._handle, self._tensors = owner, handle, tensors
        self.started_at = started_at
        self.done = False

    def is_completed(self) -> bool:
        """Whether the reduce-scatter has completed (the all-gather remains for :meth:`wait`)."""
        return self.done or self._handle.is_completed()

    def settle(self) -> None:
        """Wait for the reduce-scatter only (its seconds count as communication)."""
        t0 = time.perf_counter()
        self._handle.wait()
        self._handle = Done()  # waited once: gloo's point-to-point work must not be waited on again
        self._owner.timing.comm_seconds += time.perf_counter() - t0

    def wait(self) -> None:
        """Finish: average, all-gather and write the mean; a second call does nothing."""
        if self.done:
            return
        self._owner._land(self._handle, self._tensors)
        self.done = True

"""The join of codecs and communicators: average named tensors across ranks.

This module hands payloads to a communicator (as does :mod:`thinwire.scatter`, for one flat
tensor by reduce-scatter). It

* picks each tensor's codec (tensors the codec will not compress travel as fp32),
* groups tensors into buckets (one collective per bucket and round),
* applies error feedback (residuals keyed by parameter name),
* chooses the collective from the codec's aggregation kind: ``SUM`` payloads are divided by
  the world size in the wire dtype (as PyTorch's DDP hooks do, which keeps fp16 in range)
  and all_reduced; ``GATHER`` payloads are all_gathered as bytes, then every rank decodes
  every rank's payload, sums and divides by the world size,
* reuses its buffers from step to step.

Distributed invariant: every rank builds the same buckets from the same ordered list of
names and shapes and the same codec choices, so all ranks issue the same collectives, of
the same sizes, in the same order. Nothing here depends on tensor values except payload
contents, whose sizes are fixed by ``wire_spec``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from thinwire.buckets import Bucket, Flight, Slot, bucket_buffer
from thinwire.codecs.base import Codec
from thinwire.codecs.identity import Identity, IdentityConfig
from thinwire.comm.base import Communicator, Handle
from thinwire.comm.meter import sent_bytes
from thinwire.feedback import ErrorFeedback
from thinwire.payload import Aggregation, Payload, as_bytes, from_bytes, spec_nbytes
from thinwire.timing import Timing

CodecChooser = Callable[[str, torch.Tensor], Codec]


class Aggregator:
    """Averages a fixed set of named tensors over the ranks of ``comm``.

    ``named`` gives the tensors' names, shapes, dtypes and devices (typically the model's
    parameters); ``codec_for(name, tensor)`` picks the codec of each (the same choice on
    every rank). Call :meth:`reduce_` with tensors of those names and shapes (e.g. grads),
    or :meth:`start` and later :meth:`Reduction.wait` to let other work run while the
    collectives are in flight. ``feedback`` may be shared between aggregators over disjoint
    names (DDP buckets). ``as_given``: every tensor goes through the codec chosen for it,
    however small or one-dimensional (no fp32 fallback): for a flat vector such as a whole
    model's state, which :func:`thinwire.hierarchical.flat_aggregator` builds.

    Over a world whose ``comm.hierarchy`` is set (ranks grouped into nodes),
    :func:`thinwire.hierarchical.build_aggregator` gives a
    :class:`~thinwire.hierarchical.HierarchicalAggregator` instead: the same buckets, averaged
    uncompressed inside each node and through the codec between nodes.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        codec_for: CodecChooser,
        comm: Communicator,
        *,
        bucket_mb: float = 25.0,
        feedback: ErrorFeedback | None = None,
        as_given: bool = False,
    ) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if not named:
            raise ValueError("Aggregator needs at least one named tensor")
        if type(self) is Aggregator and getattr(comm, "hierarchy", None) is not None:
            raise ValueError("this communicator's ranks are grouped into nodes: build its aggregator with "
                             "thinwire.hierarchical.build_aggregator, which averages in two levels")
        self.comm = comm
        self.feedback = feedback if feedback is not None else ErrorFeedback()
        self.timing = Timing()
        self.step = 0
        # bytes this rank sent for each tensor, summed over steps and rounds (as the meter
        # counts them: the collective's algorithm factor applied to the tensor's payload bytes)
        self.sent_bytes: dict[str, float] = {name: 0.0 for name, _ in named}
        self._fallback = Identity(IdentityConfig())
        self.as_given = as_given
        self.buckets = self._plan(named, codec_for, int(bucket_mb * 2**20))
        # collectives go in the order the buckets fill up when tensors arrive in ``named``
        # order (a gradient reducer names them in the order backward computes them): a bucket
        # of the fp32 fallback that gathers every bias of the model comes last, not first
        position = {name: i for i, (name, _) in enumerate(named)}
        self.buckets.sort(key=lambda b: position[b.slots[-1].name])
        self.codecs = _unique(b.codec for b in self.buckets)
        for codec in self.codecs:
            codec.rank = comm.rank
            _check_pair(codec)

    # -- construction ----------------------------------------------------------------------
    def _plan(self, named: Sequence[tuple[str, torch.Tensor]], codec_for: CodecChooser, cap: int) -> list[Bucket]:
        """One open bucket per codec, filled in parameter order until ``cap`` bytes (fp32).

        Weights and biases usually alternate between a compressing codec and the fp32
        fallback; keeping a bucket open per codec (instead of cutting at every change)
        gives one collective per codec per round for a typical model, not one per tensor.
        """
        buckets: list[Bucket] = []
        open_: dict[int, Bucket] = {}  # id(codec) -> the bucket being filled
        for name, t in named:
            codec = codec_for(name, t)
            if not self.as_given and (not codec.compresses(t.shape) or codec.is_identity):
                codec = self._fallback  # plain fp32 shares one bucket, whichever codec chose it
            b = open_.get(id(codec))
            if b is None or 4 * (b.numel + t.numel()) > codec.bucket_cap(cap) and b.slots:
                b = open_[id(codec)] = Bucket(codec, codec.fusable and not codec.config.ef, [])
                buckets.append(b)
            b.slots.append(Slot(name, t.shape, t.numel(), b.numel))
        return buckets

    @staticmethod
    def _layout(b: Bucket) -> None:
        """Byte offsets of every wire tensor in one rank's row (GATHER buckets), at the codec's
        current step: a codec's wire size may follow a schedule (FFT's theta), the same on
        every rank at the same step."""
        b.layout = []
        off = 0
        for _, shape_in in _units(b):
            entries = []
            for shape, dtype in b.codec.wire_spec(shape_in, torch.float32):
                entries.append((off, shape, dtype))
                off += spec_nbytes([(shape, dtype)])
            b.layout.append(entries)
        b.row_bytes = off

    # -- questions ---------------------------------------------------------------------------
    def plan(self) -> list[dict]:
        """Per tensor: name, shape, codec spec and wire bytes (for reports)."""
        rows = []
        for b in self.buckets:
            if b.fused:  # one payload for the bucket: its bytes shared in proportion to size
                total = b.codec.nbytes(torch.Size([b.numel]), torch.float32)
                shares = [total * s.numel // b.numel for s in b.slots]
                shares[-1] += total - sum(shares)
            else:
                shares = [b.codec.nbytes(s.shape, torch.float32) for s in b.slots]
            for s, wire in zip(b.slots, shares):
                rows.append(dict(name=s.name, shape=list(s.shape), codec=b.codec.describe(), wire_bytes=wire,
                                 fp32_bytes=4 * s.numel, **({"bucket": b.key} if b.fused else {})))
        return rows

    # -- work ------------------------------------------------------------------------------
    def reduce_(self, tensors: Mapping[str, torch.Tensor], buckets: Sequence[int] | None = None) -> None:
        """Overwrite every tensor with its mean over all ranks (through its codec). Mutates
        the given tensors and the error-feedback residuals; advances the step counter.
        ``buckets``: indices into :attr:`buckets` to average (default: all; ``tensors`` then
        needs only their names).

        Every bucket's round-0 collective is launched before any is waited on, so encoding a
        bucket overlaps with the previous bucket's transfer; later rounds follow in bucket
        order. All ranks launch the same collectives in the same order.
        """
        self.land(self.launch(tensors, buckets), tensors)
        self.step += 1

    def start(self, tensors: Mapping[str, torch.Tensor]) -> Reduction:
        """Launch every bucket (as :meth:`launch`: round 0) and return at once; the means land
        in ``tensors`` at :meth:`Reduction.wait`, which runs any later rounds and advances the
        step counter. Until then ``tensors`` and the codecs belong to the reduction: touch
        neither. For one thread (start and wait on the same one): the launch's seconds are
        added to :attr:`timing` at once, the rest when it lands."""
        launched = self.launch(tensors)
        for _, f in launched:
            self.timing.codec_seconds += f.codec_seconds
            self.timing.comm_seconds += f.comm_seconds
            f.codec_seconds = f.comm_seconds = 0.0
        return Reduction(self, launched, tensors)

    def launch(self, tensors: Mapping[str, torch.Tensor], buckets: Sequence[int] | None = None, *,
               in_place: bool = True) -> list[tuple[Bucket, Flight]]:
        """Encode the chosen buckets' first round (with error feedback) and start their
        collectives; :meth:`land` finishes them. The step counter is read, not advanced.
        ``in_place``: ``tensors`` is also where :meth:`land` writes the means.

        With :attr:`pipelines`, the launched buckets may land on another thread while this
        one launches more (each bucket has one round and its codec no state)."""
        for codec in self.codecs:
            codec.step = self.step  # identical on all ranks: every rank calls reduce_ once per step
        chosen = self.buckets if buckets is None else [self.buckets[i] for i in buckets]
        return [(b, self._launch(b, tensors, in_place)) for b in chosen]

    def land(self, launched: list[tuple[Bucket, Flight]], tensors: Mapping[str, torch.Tensor]) -> None:
        """Every later round (in bucket order), then wait, decode and write the means into
        ``tensors`` (the buckets' names: the inputs, or tensors of their shapes)."""
        for r in range(1, max((b.codec.rounds for b, _ in launched), default=1)):
            for b, f in launched:
                if b.codec.rounds > r:
                    self._next_round(b, f, r)
        for b, f in launched:
            self._land(b, f, tensors)

    @property
    def pipelines(self) -> bool:
        """Whether every bucket has one SUM round through a codec that keeps no state
        (:attr:`~thinwire.codecs.base.Codec.concurrent`): then a bucket launched by one
        thread may land on another while the first launches the next, and no collective's
        order depends on which thread runs first."""
        return all(pipelines(b.codec) for b in self.buckets)

    def reduce_bucket(self, i: int, tensors: Mapping[str, torch.Tensor], out: Mapping[str, torch.Tensor]) -> None:
        """Average bucket ``i`` alone, every round of it, reading its tensors from ``tensors``
        (left as they are) and writing their means into ``out`` (same names and shapes).
        The step counter is not advanced: the caller owns it (``step`` is read). The same
        means, bit for bit, as :meth:`reduce_` gives: a bucket's result depends only on its
        own inputs, the codec's state and the step."""
        self.land(self.launch(tensors, [i], in_place=tensors is out), out)

    def _launch(self, b: Bucket, tensors: Mapping[str, torch.Tensor], in_place: bool = True) -> Flight:
        """Encode round 0 (with error feedback) and start its collective. ``in_place``: the
        tensors are also where the means go, so a fused bucket may work on them directly."""
        t0 = time.perf_counter()
        missing = [s.name for s in b.slots if s.name not in tensors]
        if missing:
            raise KeyError(f"reduce_ got no tensor named {missing[0]!r}; it averages the names it was built with")
        items = self._inputs(b, tensors, in_place)
        ef = b.codec.config.ef
        if ef and b.codec.own_feedback:  # compensated and updated by the codec, in its own domain
            flight = Flight(items, [b.codec.encode_feedback(x, self.feedback, key=k) for k, x in items])
        else:
            us = [(k, self.feedback.compensate(k, x) if ef else x) for k, x in items]
            flight = Flight(us, [b.codec.encode_into(u, self._wire_buffer(b, k, u.device), key=k) for k, u in us])
        in_comm = self._start(b, flight, 0)
        flight.codec_seconds += time.perf_counter() - t0 - in_comm
        return flight

    @staticmethod
    def _wire_buffer(b: Bucket, key: str,
                     device: torch.device) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor]:
        """Round 0's kept wire buffer of one unit of the bucket (:meth:`Codec.encode_into`):
        a bucket has one flight at a time, as its other kept buffers assume."""
        return lambda shape, dtype: bucket_buffer(b, f"wire:{key}", shape, dtype, device)

    def _start(self, b: Bucket, f: Flight, r: int) -> float:
        """Pack, start the collective, then (after the final round's encode) error feedback.

        Returns the seconds spent inside the communicator's call (counted as communication).
        """
        codec = b.codec
        self._account(b, f.payloads)
        if codec.aggregation is Aggregation.SUM:
            f.wire = self._pack_sum(b, r, f.payloads)
            f.wire.div_(self.comm.world_size)  # in the wire dtype, before the sum (as DDP's hooks)
            t0 = time.perf_counter()
            f.started_at = f.started_at or t0
            f.handle = self.comm.all_reduce(f.wire, async_op=True)
        else:
            device = f.us[0][1].device
            self._layout(b)
            send = bucket_buffer(b, "send", (b.row_bytes,), torch.uint8, device)
            for entries, p in zip(b.layout, f.payloads):
                for (off, _, _), t in zip(entries, p.tensors):
                    send[off : off + t.numel() * t.element_size()].copy_(as_bytes(t))
            f.wire = bucket_buffer(b, "recv", (self.comm.world_size, b.row_bytes), torch.uint8, device)
            t0 = time.perf_counter()
            f.started_at = f.started_at or t0
            f.handle = self.comm.all_gather(send, f.wire, async_op=True)
        in_comm = time.perf_counter() - t0
        if r == codec.rounds - 1 and codec.config.ef and not codec.own_feedback:  # else kept by encode_feedback
            # the wire tensors are packed already, so u (often the residual buffer) may be
            # overwritten; the residual comes from this rank's own payload
            for (k, u), p in zip(f.us, f.payloads):
                self.feedback.update_decoded(k, u, codec, p)
        f.comm_seconds += in_comm
        return in_comm

    def _account(self, b: Bucket, payloads: list[Payload]) -> None:
        """Add each tensor's share of this collective to ``sent_bytes`` (a fused payload's
        bytes shared in proportion to size, as in :meth:`plan`)."""
        op = "all_reduce" if b.codec.aggregation is Aggregation.SUM else "all_gather"
        n = self.comm.world_size
        if b.fused:
            total = sum(p.nbytes for p in payloads)
            shares = [total * s.numel // b.numel for s in b.slots]
            shares[-1] += total - sum(shares)
        else:
            shares = [p.nbytes for p in payloads]
        for s, nbytes in zip(b.slots, shares):
            self.sent_bytes[s.name] += sent_bytes(op, nbytes, n)

    def _wait(self, f: Flight) -> None:
        t0 = time.perf_counter()
        assert f.handle is not None  # set by _start with the collective
        f.handle.wait()
        f.comm_seconds += time.perf_counter() - t0

    def _next_round(self, b: Bucket, f: Flight, r: int) -> None:
        self._wait(f)
        t0 = time.perf_counter()
        assert f.wire is not None  # set by _start with the collective
        reduced = self._unpack_sum(f.wire, f.payloads)
        f.payloads = [b.codec.encode_next(p, key=k) for (k, _), p in zip(f.us, reduced)]
        in_comm = self._start(b, f, r)
        f.codec_seconds += time.perf_counter() - t0 - in_comm

    def _land(self, b: Bucket, f: Flight, tensors: Mapping[str, torch.Tensor]) -> None:
        """Wait for the last round, decode and write the means into ``tensors`` (the bucket's
        names; the inputs themselves, or tensors of their shapes)."""
        self._wait(f)
        t0 = time.perf_counter()
        codec = b.codec
        if codec.aggregation is Aggregation.SUM:
            assert f.wire is not None  # set by _start with the collective
            payloads = self._unpack_sum(f.wire, f.payloads)
            for (k, _), p in zip(f.us, payloads):
                codec.update(k, p)
            out = _adjacent(b, tensors) if b.fused else None
            if out is not None:
                codec.decode_to(payloads[0], out)  # straight into the flat buffer (a DDP bucket's)
            elif b.fused:
                self._write(b, tensors, [codec.decode(p) for p in payloads])
            else:
                for s, p in zip(b.slots, payloads):
                    _decode_into(codec, p, tensors[s.name])
        else:
            self._gathered_means(b, f, tensors)
        f.codec_seconds += time.perf_counter() - t0
        self.timing.codec_seconds += f.codec_seconds
        self.timing.comm_seconds += f.comm_seconds

    def _inputs(
        self, b: Bucket, tensors: Mapping[str, torch.Tensor], in_place: bool
    ) -> list[tuple[str, torch.Tensor]]:
        if not b.fused:
            return [(s.name, tensors[s.name]) for s in b.slots]
        flat = _adjacent(b, tensors) if in_place else None
        if flat is not None:
            return [(b.key, flat)]  # DDP's bucket gradients: already one flat buffer, no copy
        flat = bucket_buffer(b, "flat", (b.numel,), torch.float32, tensors[b.slots[0].name].device)
        for s in b.slots:
            flat[s.offset : s.offset + s.numel].copy_(tensors[s.name].reshape(-1))
        return [(b.key, flat)]

    def _pack_sum(self, b: Bucket, r: int, payloads: list[Payload]) -> torch.Tensor:
        wires = [t for p in payloads for t in p.tensors]
        if b.fused and len(wires) == 1:
            return wires[0]  # a buffer of our own (the fused flat input or a fresh cast)
        numel = sum(t.numel() for t in wires)
        buf = bucket_buffer(b, f"sum{r}", (numel,), wires[0].dtype, wires[0].device)
        off = 0
        for t in wires:
            buf[off : off + t.numel()].copy_(t.reshape(-1))
            off += t.numel()
        return buf

    @staticmethod
    def _unpack_sum(wire: torch.Tensor, payloads: list[Payload]) -> list[Payload]:
        out, off = [], 0
        for p in payloads:
            parts = []
            for t in p.tensors:
                parts.append(wire[off : off + t.numel()].view(t.shape))
                off += t.numel()
            out.append(p.with_tensors(tuple(parts)))
        return out

    def _gathered_means(self, b: Bucket, f: Flight, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every rank's payload decoded from the gathered bytes and summed into the output
        tensor (in place when it is contiguous fp32), then divided by n."""
        n = self.comm.world_size
        wire = f.wire
        assert wire is not None  # set by _start with the collective
        for (key, shape_in), entries, own in zip(_units(b), b.layout, f.payloads):
            out = None if b.fused else tensors[key]
            direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
            if direct and out is not None:
                acc = out
            else:
                acc = bucket_buffer(b, f"acc:{key}", tuple(shape_in), torch.float32, wire.device)
            payloads = [  # wire tensors only: meta is local to the rank that encoded
                Payload(tuple(from_bytes(wire[i], off, shape, dtype) for off, shape, dtype in entries),
                        shape_in, own.dtype)
                for i in range(n)
            ]
            b.codec.decode_sum(payloads, acc)
            acc.div_(n)
            if b.fused:
                self._write(b, tensors, [acc])
            elif not direct:
                assert out is not None  # not fused: the output tensor itself
                out.copy_(acc)

    @staticmethod
    def _write(b: Bucket, tensors: Mapping[str, torch.Tensor], results: list[torch.Tensor]) -> None:
        if b.fused:
            flat = results[0].reshape(-1)
            out = _adjacent(b, tensors)
            if out is not None:
                if out.data_ptr() != flat.data_ptr():
                    out.copy_(flat)  # one copy into the bucket's flat buffer
                return
            for s in b.slots:
                tensors[s.name].copy_(flat[s.offset : s.offset + s.numel].view(s.shape))
        else:
            for s, res in zip(b.slots, results):
                tensors[s.name].copy_(res)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Step, residuals (by parameter name) and every codec's state, in codec order."""
        return {
            "step": self.step,
            "sent_bytes": dict(self.sent_bytes),
            "feedback": self.feedback.state_dict(),
            "codecs": [c.describe() for c in self.codecs],
            "codec_states": [c.state_dict() for c in self.codecs],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore exactly; the codecs must be the ones the state was saved with."""
        if state.get("nodes") is not None and type(self) is Aggregator:
            count, per_node = state["nodes"]
            raise ValueError(f"checkpoint was saved with {count} node(s) x {per_node} rank(s); this run has no "
                             "nodes (flat): residuals are per shard, so resume with the same --group-size")
        saved, ours = list(state["codecs"]), [c.describe() for c in self.codecs]
        if saved != ours:
            raise ValueError(f"checkpoint was saved with codecs {saved}, this aggregator has {ours}")
        self.step = int(state["step"])
        self.sent_bytes.update(state.get("sent_bytes", {}))
        self.feedback.load_state_dict(state["feedback"])
        for c, cs in zip(self.codecs, state["codec_states"]):
            c.load_state_dict(cs)


class Reduction:
    """An :meth:`Aggregator.start` in flight: :meth:`wait` lands it (once)."""

    def __init__(self, agg: Aggregator, launched: list[tuple[Bucket, Flight]],
                 tensors: Mapping[str, torch.Tensor]) -> None:
        self._agg, self._launched, self._tensors = agg, launched, tensors
        self.done = False
        # when the first collective was started (after encoding): where communication begins
        self.started_at = min((f.started_at for _, f in launched), default=0.0)

    @property
    def payloads(self) -> list[Payload]:
        """This rank's round-0 payloads, bucket by bucket: what it sent."""
        return [p for _, f in self._launched for p in f.payloads]

    def is_completed(self) -> bool:
        """Whether every round-0 collective has completed (no side effects; landing, and a
        multi-round codec's later rounds, remain for :meth:`wait`)."""
        return self.done or all(f.handle is None or f.handle.is_completed() for _, f in self._launched)

    def settle(self) -> None:
        """Wait for the collectives only (their seconds count as communication)."""
        for _, f in self._launched:
            if f.handle is not None:
                self._agg._wait(f)

    def wait(self) -> None:
        """Wait for the collectives, decode the means into the tensors and advance the
        aggregator's step; a second call does nothing."""
        if self.done:
            return
        self._agg.land(self._launched, self._tensors)
        self._agg.step += 1
        self.done = True


def _units(b: Bucket) -> list[tuple[str, torch.Size]]:
    """(key, shape) of each payload of a bucket: one flat unit when fused, else its slots."""
    if b.fused:
        return [(b.key, torch.Size([b.numel]))]
    return [(s.name, s.shape) for s in b.slots]


def pipelines(codec: Codec) -> bool:
    """Whether buckets of ``codec`` may launch on one thread and land on another at the same
    time: one SUM round, no error feedback, and a codec that declares itself
    :attr:`~thinwire.codecs.base.Codec.concurrent` (identity and the casts)."""
    return (codec.concurrent and codec.rounds == 1 and codec.aggregation is Aggregation.SUM
            and not codec.config.ef)


def _decode_into(codec: Codec, payload: Payload, out: torch.Tensor) -> None:
    """``out = decode(payload)``, accumulating in place when ``out`` allows (no temporary)."""
    if out.dtype == torch.float32 and out.is_contiguous():
        out.zero_()
        codec.decode_add(payload, out)
    else:
        out.copy_(codec.decode(payload))


def _check_pair(codec: Codec) -> None:
    """Refuse a codec whose aggregation kind its wire format cannot support."""
    if codec.aggregation is Aggregation.SUM:
        for r in range(codec.rounds):
            for _, dtype in codec.wire_spec(torch.Size([4, 4]), torch.float32, r):
                if not dtype.is_floating_point:
                    raise ValueError(
                        f"codec {codec.name} declares SUM but sends {dtype}: only floating-point "
                        "payloads can be summed on the wire; declare GATHER"
                    )
    elif codec.aggregation is Aggregation.GATHER:
        if codec.rounds != 1:
            raise ValueError(f"codec {codec.name}: GATHER codecs must have one round, got {codec.rounds}")
    else:
        raise ValueError(f"codec {codec.name}: aggregation must be SUM or GATHER, got {codec.aggregation!r}")


def _adjacent(b: Bucket, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """A fused bucket's tensors as one flat fp32 view when they already lie back to back in
    one storage, in slot order (the gradients of a DDP bucket do); else None."""
    first = tensors[b.slots[0].name]
    storage, base = first.untyped_storage().data_ptr(), first.storage_offset()
    for s in b.slots:
        t = tensors[s.name]
        if (t.dtype != torch.float32 or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage
                or t.storage_offset() != base + s.offset):
            return None
    return torch.as_strided(first, (b.numel,), (1,), base)


def _unique(codecs: Iterable[Codec]) -> list[Codec]:
    seen: list[Codec] = []
    for c in codecs:
        if all(c is not s for s in seen):
            seen.append(c)
    return seen


class Watch:
    """Times each :class:`Reduction` from launch to completion on a helper thread that polls
    it (every 0.2 ms; ``is_completed`` has no side effects, unlike ``wait``): the communication
    seconds of averages run behind computation (DaSGD's, streaming DiLoCo's fragments).
    ``total`` sums them; one watch follows one reduction at a time."""

    POLL_S = 2e-4

    def __init__(self) -> None:
        self.total = 0.0
        self._thread: threading.Thread | None = None

    def start(self, handle: Handle, t_launch: float) -> None:
        self.join()
        if handle.is_completed():  # a one-rank world or an in-process communicator
            self.total += time.perf_counter() - t_launch
            return

        def run() -> None:
            while not handle.is_completed():
                time.sleep(self.POLL_S)
            self.total += time.perf_counter() - t_launch

        self._thread = threading.Thread(target=run, daemon=True, name="thinwire-watch")
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

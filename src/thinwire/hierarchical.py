"""Two-level averaging: uncompressed inside a node, through the codec between nodes.

An :class:`~thinwire.aggregate.Aggregator` built over a world communicator that carries a
:class:`~thinwire.comm.base.Hierarchy` is a :class:`HierarchicalAggregator`. It plans the
same buckets as a flat one (the same codec choices, fp32 fallback and order) and averages
each bucket in three stages:

1. **inside the node**, one fp32 ``reduce_scatter`` over ``intra`` of the bucket divided by
   the ranks per node ``L``: local rank ``l`` ends with the node's mean of its shard (in
   ``bf16`` when the hierarchy says so, ``--intra-dtype``: half the bytes, each gradient
   rounded to bf16 before the sum and the mean again for stage 3; the codec gets fp32);
2. **between nodes**, each local rank averages its shard through the bucket's codec over
   ``inter`` (an ordinary aggregator over the ranks with its local rank, one per node): the
   ``L`` shards cross the slow link in parallel, each ``1/L`` of the bucket. Error feedback
   stays per parameter: the residual of a parameter is that of its piece on this rank;
3. **inside the node**, one ``all_gather`` of the shards over ``intra``: every rank of a node
   ends with the same bits; every node with the same bits as the codec's flat average gives.

Shards: a codec that is :attr:`~thinwire.codecs.base.Codec.elementwise` splits every tensor
into ``L`` contiguous pieces (sizes differing by at most one element), so every local rank
carries ``1/L`` of every tensor. Other codecs (PowerSGD, ``fft``, ``dct``, ``kernels``: they
need a tensor's shape) get whole tensors, dealt largest first to the local rank with the
fewest elements so far (ties to the lowest), so each tensor is averaged once, by one rank.

With one node, stage 2 is skipped: nothing crosses a slow link, so nothing is compressed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from thinwire.aggregate import Aggregator, CodecChooser
from thinwire.buckets import Bucket, Flight, bucket_buffer
from thinwire.codecs.base import Codec
from thinwire.comm.base import Communicator
from thinwire.comm.meter import sent_bytes
from thinwire.comm.nodes import check_intra_dtype
from thinwire.feedback import ErrorFeedback


@dataclass(frozen=True)
class Piece:
    """The part of one tensor a local rank averages between nodes."""

    name: str
    start: int  # first element, in the flattened tensor
    numel: int
    shape: tuple[int, ...]  # what the codec sees: the tensor's shape when whole, else (numel,)
    offset: int  # first element inside the local rank's segment


def shard(slots: Sequence[tuple[str, torch.Size]], ranks: int, by_element: bool) -> list[list[Piece]]:
    """Each local rank's pieces of the tensors ``slots`` (name, shape), in slot order.

    ``by_element``: every tensor in ``ranks`` contiguous pieces (the first ``numel % ranks``
    one element longer; empty pieces left out); else whole tensors, largest first to the
    least loaded rank (ties: the lower rank)."""
    shards: list[list[Piece]] = [[] for _ in range(ranks)]
    used = [0] * ranks
    if by_element:
        for name, shape in slots:
            numel, start = _numel(shape), 0
            for r in range(ranks):
                n = numel // ranks + (r < numel % ranks)
                if n:
                    shards[r].append(Piece(name, start, n, (n,), used[r]))
                    used[r] += n
                start += n
        return shards
    order = sorted(range(len(slots)), key=lambda i: -_numel(slots[i][1]))  # stable: ties keep slot order
    owner = {}
    for i in order:
        r = min(range(ranks), key=lambda j: used[j])
        owner[i] = r
        used[r] += _numel(slots[i][1])
    used = [0] * ranks
    for i, (name, shape) in enumerate(slots):  # each rank's tensors in slot order
        r, n = owner[i], _numel(shape)
        shards[r].append(Piece(name, 0, n, tuple(shape), used[r]))
        used[r] += n
    return shards


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class _Stage:
    """One bucket's shards and this rank's aggregator between nodes."""

    shards: list[list[Piece]]  # by local rank
    segment: int  # elements per local rank in the intra-node buffers (the largest shard)
    inner: Aggregator | None  # None: this rank's shard is empty, or there is one node


@dataclass
class _Leg(Flight):
    """A bucket in flight: its node means (``mine``), the shard's flight between nodes."""

    stage: _Stage | None = None
    mine: torch.Tensor | None = None  # the node's means of this rank's shard, in the node's dtype
    means: torch.Tensor | None = None  # the same in fp32, what the codec averages between nodes
    inner_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    inner_launched: list = field(default_factory=list)


class _Handles:
    def __init__(self, handles: list) -> None:
        self.handles = handles

    def wait(self) -> None:
        for h in self.handles:
            h.wait()

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self.handles)


class HierarchicalAggregator(Aggregator):
    """An :class:`~thinwire.aggregate.Aggregator` over a world with nodes (see the module).

    Built by :func:`build_aggregator` when ``comm.hierarchy`` is set; the same API. Buckets
    are not pipelined across threads (:attr:`pipelines` is False): each bucket's stages run
    on the thread that lands it.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, torch.Tensor]],
        codec_for: CodecChooser,
        comm,
        *,
        bucket_mb: float = 25.0,
        feedback: ErrorFeedback | None = None,
        as_given: bool = False,
    ) -> None:
        hierarchy = comm.hierarchy
        super().__init__(named, codec_for, comm, bucket_mb=bucket_mb, feedback=feedback, as_given=as_given)
        self.hierarchy = hierarchy
        # the dtype of the node's collectives: the hierarchy's (--intra-dtype); model averages set fp32
        self.dtype: torch.dtype = hierarchy.dtype
        self.stages = [self._stage(b, bucket_mb) for b in self.buckets]
        for codec in self.codecs:
            codec.rank = hierarchy.inter.rank  # its peers between nodes average the same shard

    def _stage(self, b: Bucket, bucket_mb: float) -> _Stage:
        h = self.hierarchy
        shards = shard([(s.name, s.shape) for s in b.slots], h.layout.ranks_per_node, b.codec.elementwise)
        segment = max(max((p.offset + p.numel for p in pieces), default=0) for pieces in shards)
        mine = shards[h.local_rank]
        inner = None
        if mine and h.layout.count > 1:
            codec = b.codec
            inner = Aggregator([(p.name, torch.empty(p.shape, device="meta")) for p in mine],
                               lambda _n, _t: codec, h.inter, bucket_mb=bucket_mb, feedback=self.feedback,
                               as_given=True)  # the codec was chosen for the whole tensor
            inner.timing = self.timing
            inner.sent_bytes = self.sent_bytes  # its bytes count for the same parameters
        return _Stage(shards, max(segment, 1), inner)

    @property
    def pipelines(self) -> bool:
        return False

    # -- work ------------------------------------------------------------------------------
    def launch(self, tensors: Mapping[str, torch.Tensor], buckets: Sequence[int] | None = None, *,
               in_place: bool = True) -> list[tuple[Bucket, Flight]]:
        """Stage 1 of the chosen buckets (blocking), then stage 2's first round launched."""
        for codec in self.codecs:
            codec.step = self.step
        chosen = range(len(self.buckets)) if buckets is None else buckets
        return [(self.buckets[i], self._start_leg(self.buckets[i], self.stages[i], tensors)) for i in chosen]

    def _start_leg(self, b: Bucket, st: _Stage, tensors: Mapping[str, torch.Tensor]) -> _Leg:
        t0 = time.perf_counter()
        missing = [s.name for s in b.slots if s.name not in tensors]
        if missing:
            raise KeyError(f"reduce_ got no tensor named {missing[0]!r}; it averages the names it was built with")
        h = self.hierarchy
        ranks = h.layout.ranks_per_node
        device = tensors[b.slots[0].name].device
        send = bucket_buffer(b, "node:send", (ranks * st.segment,), self.dtype, device)
        for r, pieces in enumerate(st.shards):
            base = r * st.segment
            for p in pieces:
                src = tensors[p.name].detach().reshape(-1)[p.start : p.start + p.numel]
                dst = send[base + p.offset : base + p.offset + p.numel]
                # divided before the sum, as the flat path divides by the world size
                if src.dtype == torch.float32:  # and cast to the node's dtype, in one pass
                    torch.div(src, ranks, out=dst)
                else:  # a half-precision gradient is divided in the node's dtype, not its own
                    dst.copy_(src)
                    dst.div_(ranks)
            end = max((p.offset + p.numel for p in pieces), default=0)
            send[base + end : base + st.segment].zero_()  # padding: the same zeros on every rank
        mine = bucket_buffer(b, "node:mine", (st.segment,), self.dtype, device)
        t1 = time.perf_counter()
        h.intra.reduce_scatter(send, mine)
        t2 = time.perf_counter()
        leg = _Leg([], [], stage=st, mine=mine, codec_seconds=t1 - t0, comm_seconds=t2 - t1, started_at=t1)
        self._account_intra(b, st, ranks)
        if st.inner is not None:
            means = mine
            if self.dtype != torch.float32:  # the codec gets fp32
                means = bucket_buffer(b, "node:means", (st.segment,), torch.float32, device)
                means.copy_(mine)
                leg.codec_seconds += time.perf_counter() - t2
            leg.means = means
            leg.inner_tensors = {p.name: means[p.offset : p.offset + p.numel].view(p.shape)
                                 for p in st.shards[h.local_rank]}
            st.inner.step = self.step
            leg.inner_launched = st.inner.launch(leg.inner_tensors)
            leg.handle = _Handles([f.handle for _, f in leg.inner_launched if f.handle is not None])
            leg.started_at = min([t1] + [f.started_at for _, f in leg.inner_launched if f.started_at])
        return leg

    def land(self, launched: list[tuple[Bucket, Flight]], tensors: Mapping[str, torch.Tensor]) -> None:
        """Stage 2's later rounds and decode, then stage 3, writing the means into ``tensors``."""
        for b, leg in launched:
            assert isinstance(leg, _Leg) and leg.stage is not None and leg.mine is not None
            st = leg.stage
            if st.inner is not None:
                st.inner.land(leg.inner_launched, leg.inner_tensors)  # the means, into ``means``
                if leg.means is not None and leg.means is not leg.mine:
                    leg.mine.copy_(leg.means)
            t0 = time.perf_counter()
            ranks = self.hierarchy.layout.ranks_per_node
            gathered = bucket_buffer(b, "node:gathered", (ranks, st.segment), self.dtype, leg.mine.device)
            self.hierarchy.intra.all_gather(leg.mine, gathered)
            t1 = time.perf_counter()
            self._write_back(b, st, gathered, tensors)
            leg.comm_seconds += t1 - t0
            leg.codec_seconds += time.perf_counter() - t1
            self.timing.codec_seconds += leg.codec_seconds
            self.timing.comm_seconds += leg.comm_seconds
            leg.codec_seconds = leg.comm_seconds = 0.0

    def _wait(self, f: Flight) -> None:
        assert isinstance(f, _Leg)
        if f.stage is not None and f.stage.inner is not None:
            for _, inner in f.inner_launched:
                if inner.handle is not None:
                    f.stage.inner._wait(inner)

    @staticmethod
    def _write_back(b: Bucket, st: _Stage, gathered: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
        parts: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
        for r, pieces in enumerate(st.shards):
            for p in pieces:
                parts.setdefault(p.name, []).append((p, gathered[r, p.offset : p.offset + p.numel]))
        for s in b.slots:
            out = tensors[s.name]
            written = parts.get(s.name, [])
            if out.is_contiguous():
                flat = out.view(-1)
                for p, values in written:
                    flat[p.start : p.start + p.numel].copy_(values)
            elif written:
                out.copy_(torch.cat([values for _, values in written]).view(out.shape))

    def _account_intra(self, b: Bucket, st: _Stage, ranks: int) -> None:
        """The node stages' bytes (a reduce_scatter and an all_gather of the buckets'
        segments, in the node's dtype) shared among the bucket's tensors in proportion to size."""
        size = torch.finfo(self.dtype).bits // 8
        total = (sent_bytes("reduce_scatter", size * ranks * st.segment, ranks)
                 + sent_bytes("all_gather", size * st.segment, ranks))
        for s in b.slots:
            self.sent_bytes[s.name] += total * s.numel / b.numel

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["nodes"] = [self.hierarchy.layout.count, self.hierarchy.layout.ranks_per_node]
        state["intra_dtype"] = self.hierarchy.dtype_name
        return state

    def load_state_dict(self, state: dict) -> None:
        ours = [self.hierarchy.layout.count, self.hierarchy.layout.ranks_per_node]
        saved = state.get("nodes")
        if saved != ours:
            what = "no nodes (flat)" if saved is None else f"{saved[0]} node(s) x {saved[1]} rank(s)"
            raise ValueError(f"checkpoint was saved with {what}; this run has {ours[0]} node(s) x {ours[1]} "
                             "rank(s): residuals are per shard, so resume with the same --group-size")
        check_intra_dtype(state.get("intra_dtype"), self.hierarchy.dtype_name)
        super().load_state_dict(state)


def build_aggregator(named: Sequence[tuple[str, torch.Tensor]], codec_for: CodecChooser, comm: Communicator,
                     **options: Any) -> Aggregator:
    """The aggregator for ``comm``: a :class:`HierarchicalAggregator` over a world whose
    ``comm.hierarchy`` is set (ranks grouped into nodes), else a flat
    :class:`~thinwire.aggregate.Aggregator`; ``options`` are the aggregator's keywords.
    Over sharded groups (``hierarchy.sharded``: FSDP2 averaged inside the group already) the
    tensors are this rank's shards, averaged with the same shards in the other groups by a
    flat aggregator over ``hierarchy.inter``."""
    hierarchy = getattr(comm, "hierarchy", None)
    if hierarchy is not None and hierarchy.sharded:
        return Aggregator(named, codec_for, hierarchy.inter, **options)
    kind = HierarchicalAggregator if hierarchy is not None else Aggregator
    return kind(named, codec_for, comm, **options)


def flat_aggregator(name: str, like: torch.Tensor, codec: Codec, comm: Communicator, *,
                    feedback: ErrorFeedback | None = None) -> Aggregator:
    """An aggregator (:func:`build_aggregator`) of one flat tensor (``like``'s shape) through
    ``codec`` as it is, in one bucket: a model-averaging method's model state or delta."""
    return build_aggregator([(name, like)], lambda _name, _t: codec, comm, bucket_mb=max(1.0, 4 * like.numel() / 2**20),
                            feedback=feedback, as_given=True)

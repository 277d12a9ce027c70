"""SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, arXiv 2508.15706): DiLoCo whose outer
momentum is replaced by each worker's own error-feedback buffer, sent as its chunked top-k
at 2 bits.

    sparseloco = thinwire.SparseLoCo(model, inner_optimizer, period=15)
    for x, y in loader:
        inner_optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        sparseloco.after_backward()   # averages gradients during the warm-up steps only
        inner_optimizer.step()
        sparseloco.after_step()       # every `period` steps: the sparse outer step

Every rank keeps the outer parameters ``θ`` (identical on every rank) and its own
error-feedback buffer ``e_i`` (zero at the start). After every ``period``-th local step (H):

    Δ_i = θ − θ_i                        this rank's pseudo-gradient
    e_i ← β · e_i + Δ_i                  the buffer, decayed (β = ``beta``)
    Δ̂_i = Q(TopK(e_i))                   per chunk its ``k`` largest |e|, values quantized
    e_i ← e_i − Δ̂_i                      what was sent leaves the buffer
    Δ = (1/R) Σ_i Δ̂_i                    every rank decodes every rank's payload (all_gather)
    θ ← θ − α · Δ                        outer SGD, lr α = ``outer_lr``, no momentum
    θ_i ← θ                              every rank continues from θ

so every rank applies the same update and the ranks hold bit-identical models after each
sync. The decayed buffer stands in for DiLoCo's outer momentum (the paper's observation).

**Chunks.** Each parameter tensor is seen as a matrix (``shape[0] × rest``; vectors as
``1 × numel``) and tiled as the ``dct`` codec tiles it (:func:`thinwire.numerics.dct_basis.tiling`):
``chunk × chunk`` blocks (a side shorter than ``chunk`` rounds up to a power of two),
vectors in runs of ``chunk``, each side zero-padded to whole blocks. Per block the ``k``
entries of largest magnitude are kept (the whole block when it holds ``k`` or fewer; padding
is never chosen over a real entry, and never reaches the model).

**Values.** ``bits`` (2 by default) per kept value, from the paper's code's statistical
quantizer, per parameter tensor over its kept values ``v``: ``s = mean(v)``, ``c = v − s``,
``σ`` their unbiased standard deviation, ``L = 2^bits`` bins of width ``sigmas·σ / L``, code
``q = clamp(round(c / width + L/2), 0, L − 1)``, and a table of ``L`` levels, level ``b`` the
mean of the ``c`` coded ``b`` (0 for an empty bin); a value decodes as ``table[q] + s``. A
width of 0 (one value, or all equal) becomes 1. ``bits=32`` sends fp32 values unquantized.

**Shards.** Over sharded worker groups (FSDP2 inside a group) each rank tiles its own shard:
the local tensor of a row-sharded matrix (``rows/G × rest``) in the same ``chunk × chunk``
blocks, so a block never straddles two shards, and the ``k`` kept per block are picked within
the shard. A matrix whose shard's row count is not a multiple of ``chunk`` gets a padded last
row of blocks on each shard, where the whole matrix has one; its selection and byte count
therefore differ from an unsharded worker's (``wire_bytes`` counts the shard's).

**Wire** (one all_gather per sync, a fixed layout from the shapes alone), per rank: the
per-tensor statistics, ``(1 + 2^bits)`` fp32 each (none for ``bits=32``); the positions
inside their blocks, in the smallest integer type that holds a block's last index (uint8
for blocks of up to 256 entries, int16 up to 32,768, else int32), none for tensors whose
blocks travel whole; the codes, ``bits`` each, packed MSB first
(:mod:`thinwire.numerics.bitpack`). For an ``m × n`` matrix that tiles exactly into ``C``
blocks of ``chunk²`` entries that is ``C·k·(index bytes + bits/8)`` bytes plus 20 bytes of
statistics (2 bits); the meter counts ``(R − 1)`` times that per sync, as for any all_gather.
Float buffers (BatchNorm statistics) are averaged in fp32 at each sync, as DiLoCo does.

**Sources of the defaults.** ``bits`` 2 and the 1–3 % density are the paper's (abstract);
``chunk`` 64 (64 × 64 = 4,096-entry blocks), ``beta`` 0.95, ``outer_lr`` 1 and ``period`` 15
are those of the authors' public code (the CCLoco repository the paper's code link grew
from: ``chunk_size=64``, ``error_decay=0.95``, ``outer_learning_rate=1``, ``inner_steps=15``;
15 is also the smallest H of the paper's sweep, 15–250); ``k`` 64 (1.5625 % of a 4,096-entry
block) is the density the authors report for their Covenant-72B run with SparseLoCo, within
the paper's 1–3 %; ``sigmas`` 6 is the code's ``quantization_range``. Where the public code
differs from the paper's equations we follow the paper: the code adds ``α · Δ_i`` to the
buffer *and* steps ``θ`` by ``α`` times the aggregate (the same at α = 1, its setting); it
averages each position over the workers that sent it (a mean of the non-zero entries), the
paper divides the sum by R; it sends int64 positions (the authors' later runs pack them in
12 bits), we send the smallest integer type; it picks each block side as the largest
divisor of the tensor's side up to ``chunk``, we pad, as the ``dct`` codec does.

``finish()`` ends, as DiLoCo's family does (``final_sync``), with one more sparse outer step
over the steps since the last sync, after which every rank holds θ. State for an exact
resume: θ, the step counters and the error buffer (the aggregator's residual). Memory: θ,
the flat pseudo-gradient and the error buffer, three copies of the model in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch

from thinwire.algorithms.diloco import SYNC_HELP, SYNCS, DiLoCo, Fragment, check_sync
from thinwire.algorithms.methods import METHODS
from thinwire.codecs.base import Codec, in_range
from thinwire.codecs.dct import position_dtype
from thinwire.comm.base import Communicator
from thinwire.knobs import knob, require
from thinwire.numerics import dct_basis
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.payload import Aggregation, Payload, PayloadError, WireSpec

CHUNK_MAX = 1024  # a block of chunk² entries keeps its positions within int32
BITS = (1, 2, 3, 4, 5, 6, 7, 8, 32)


@dataclass(frozen=True, kw_only=True)
class SparseLoCoConfig:
    period: int = knob(15, "inner steps between outer steps (H); the authors' code's, the smallest of the paper's "
                       "sweep (15-250)", ">= 1")
    warmup: int = knob(0, "synchronous gradient-averaging steps before the first round", ">= 0")
    beta: float = knob(0.95, "decay of each rank's error-feedback buffer: e = beta e + pseudo-gradient (the "
                       "authors' code's error_decay)", "[0, 1)")
    chunk: int = knob(64, "block side: matrices in chunk x chunk blocks, vectors in runs of chunk (64: blocks of "
                      "4096, the authors' code's)", f"1..{CHUNK_MAX}")
    k: int = knob(64, "entries kept per block (all of a smaller block's); 64 of 4096 = 1.56% (the authors' "
                  "Covenant-72B run; the paper: 1-3%)", "1..chunk*chunk")
    bits: int = knob(2, "bits per kept value (the paper's 2), or 32: fp32 values, unquantized", "1..8 or 32")
    sigmas: float = knob(6.0, "the quantizer's range in standard deviations of a tensor's kept values (the code's "
                         "quantization_range)", "> 0")
    outer_lr: float = knob(1.0, "the outer SGD step on the mean sparse update (no momentum); the authors' code's 1",
                           "> 0")
    final_sync: bool = knob(True, "finish() ends with one more sparse outer step on the steps since the last sync, "
                            "so every rank holds the same model (false: each keeps its own)", "true|false")
    sync: str = knob("blocking", SYNC_HELP, "|".join(SYNCS))

    def __post_init__(self) -> None:
        require(self.period >= 1, f"period must be >= 1, got {self.period}")
        check_sync(self)
        require(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        require(0 <= self.beta < 1, f"beta must be in [0, 1), got {self.beta}")
        require(1 <= self.chunk <= CHUNK_MAX, f"chunk must be in 1..{CHUNK_MAX}, got {self.chunk}")
        require(1 <= self.k <= self.chunk**2,
                f"k must be in 1..{self.chunk**2} (a {self.chunk} x {self.chunk} block's entries), got {self.k}")
        require(self.bits in BITS, f"bits must be in 1..8 or 32, got {self.bits}")
        require(self.sigmas > 0, f"sigmas must be > 0, got {self.sigmas}")
        require(self.outer_lr > 0, f"outer_lr must be > 0, got {self.outer_lr}")

    # what DiLoCo's machinery reads and SparseLoCo fixes (not knobs): no outer momentum, no
    # codec of the user's choosing (the chunked top-k below), no averaging of the inner state
    @property
    def codec(self) -> str:
        return "identity"

    @property
    def average_momentum(self) -> bool:
        return False


@dataclass(frozen=True, kw_only=True)
class ChunkedTopKConfig:
    ef: bool = True  # the aggregator keeps the error buffer as its residual (decayed by SparseLoCo)
    chunk: int = 64
    k: int = 64
    bits: int = 2
    sigmas: float = 6.0


@dataclass(frozen=True)
class _Part:
    """One parameter tensor inside the flat pseudo-gradient: where it lies and how it is cut."""

    offset: int  # into the flat vector
    numel: int
    tiling: dct_basis.Tiling
    kept: int  # entries kept per block
    codes_at: int  # its first kept entry among the payload's kept entries
    positions: torch.dtype | None  # None: its blocks travel whole, no positions
    positions_at: int  # its first position in the positions tensor of its dtype

    @property
    def count(self) -> int:
        return self.tiling.chunks * self.kept


class ChunkedTopK(Codec):
    """The pseudo-gradient's wire format: per parameter tensor, the top ``k`` of every block,
    positions in the smallest integer type and values at ``bits`` bits (a GATHER codec of one
    flat vector laid out as ``shapes``). Not a registered codec: it is SparseLoCo's own."""

    name = "sparseloco-chunked-topk"
    summary = "per block of each tensor its top-k entries: positions + quantized values (all_gather)"
    Config = ChunkedTopKConfig
    aggregation = Aggregation.GATHER

    def __init__(self, config: ChunkedTopKConfig, shapes: list[tuple[int, ...]]) -> None:
        super().__init__(config)
        self.shapes = [tuple(s) for s in shapes]
        self.levels = 0 if config.bits == 32 else 1 << config.bits
        counts: dict[torch.dtype, int] = {}
        parts, offset, kept_total = [], 0, 0
        for shape in self.shapes:
            t = dct_basis.tiling(shape, config.chunk)
            kept = min(config.k, t.size)
            dtype = None if kept == t.size else position_dtype(t.size)
            at = 0
            if dtype is not None:
                at = counts.get(dtype, 0)
                counts[dtype] = at + t.chunks * kept
            part = _Part(offset, math.prod(shape), t, kept, kept_total, dtype, at)
            parts.append(part)
            offset += part.numel
            kept_total += part.count
        self.parts: list[_Part] = parts
        self._bases: dict[int, torch.Tensor] = {}  # per part: each block's first index in the tensor
        self.numel, self.kept = offset, kept_total
        # one positions tensor per integer type in use, widest first (aligned in the gathered row)
        self.position_counts = [(d, counts[d]) for d in (torch.int32, torch.int16, torch.uint8) if d in counts]

    # -- layout ---------------------------------------------------------------------------
    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        if math.prod(shape) != self.numel:
            raise ValueError(f"{self.name}: laid out for {self.numel} values, got a tensor of {math.prod(shape)}")
        spec: list[WireSpec] = []
        if self.levels:
            spec.append(((len(self.parts), 1 + self.levels), torch.float32))  # per tensor: shift, table
        spec += [((n,), d) for d, n in self.position_counts]
        if self.levels:
            spec.append(((packed_nbytes(self.kept, self.config.bits),), torch.uint8))
        else:
            spec.append(((self.kept,), torch.float32))
        return spec

    def check_fields(self, payload: Payload) -> None:
        """Positions inside their blocks and strictly ascending within each block (as sent)."""
        for p in self.parts:
            if p.positions is None or not p.count:
                continue
            pos = self._positions(payload, p)
            in_range(self.name, "positions", pos, 0, p.tiling.size - 1)
            if pos.shape[1] > 1 and not bool((pos[:, 1:] > pos[:, :-1]).all()):
                raise PayloadError(f"{self.name}: positions must ascend strictly within a block")

    # -- work -----------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        flat = x.detach().reshape(-1).float()
        positions = {d: torch.empty(n, dtype=d, device=flat.device) for d, n in self.position_counts}
        values = torch.empty(self.kept, dtype=torch.float32, device=flat.device)
        codes = torch.empty(self.kept, dtype=torch.uint8, device=flat.device)
        stats = torch.zeros(len(self.parts), 1 + self.levels, dtype=torch.float32, device=flat.device)
        for i, p in enumerate(self.parts):
            if not p.count:
                continue
            part = flat[p.offset : p.offset + p.numel]
            mags = _magnitudes(part, p.tiling)  # (C, S), padding -1
            if p.positions is None:  # every entry of every block
                pos = torch.arange(p.tiling.size, device=flat.device).expand(p.tiling.chunks, -1)
            else:
                pos = dct_basis.top_positions(mags, p.kept)  # (C, k)
                positions[p.positions][p.positions_at : p.positions_at + p.count] = pos.reshape(-1)
            index, real = self._places(i, pos)  # the kept entries' places in the tensor (real: not padding)
            if real is None:
                vals = part[index]
            else:
                vals = torch.where(real, part[index.clamp(max=p.numel - 1)], 0.0)  # padding sends 0
            span = slice(p.codes_at, p.codes_at + p.count)
            if self.levels:
                codes[span], stats[i] = self._quantize(vals.reshape(-1), None if real is None else real.reshape(-1))
            else:
                values[span] = vals.reshape(-1)
        wire = [stats] if self.levels else []
        wire += [positions[d] for d, _ in self.position_counts]
        wire.append(pack(codes, self.config.bits) if self.levels else values)
        return Payload(tuple(wire), x.shape, x.dtype)

    def _quantize(self, vals: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, [shift, table...]) of one tensor's kept values (statistics over the real ones,
        not the padding; ``real`` None: all are): the paper's code's statistical quantizer, its
        figures in fp64."""
        levels = self.levels
        v = (vals if real is None else vals[real]).double()
        stats = torch.zeros(1 + levels, dtype=torch.float64, device=vals.device)
        if not v.numel():
            return torch.zeros(vals.numel(), dtype=torch.uint8, device=vals.device), stats.float()
        shift = v.mean()
        c = v - shift
        std = (c.square().sum() / (c.numel() - 1)).sqrt() if c.numel() > 1 else c.new_zeros(())
        width = float(self.config.sigmas * std / levels)
        if not 0 < width < math.inf:
            width = 1.0
        code = ((vals.double() - shift) / width + levels // 2).round().clamp(0, levels - 1).long()  # (n,)
        mine = code if real is None else code[real]
        sums = torch.zeros(levels, dtype=torch.float64, device=vals.device).index_add_(0, mine, c)
        counts = torch.bincount(mine, minlength=levels).double()
        stats[0] = shift
        stats[1:] = torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)
        return code.to(torch.uint8), stats.float()

    def decode(self, payload: Payload) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=torch.float32, device=payload.tensors[-1].device)
        self._add(payload, out)
        return out.to(payload.dtype).view(payload.shape)

    def decode_add(self, payload: Payload, out: torch.Tensor) -> None:
        """``out += decode(payload)``, by an index_add of the kept entries (mutates ``out``)."""
        if out.dtype == torch.float32 and out.is_contiguous():
            self._add(payload, out.view(-1))
        else:
            out.add_(self.decode(payload))

    def decode_sub(self, payload: Payload, out: torch.Tensor) -> None:
        """``out -= decode(payload)``, by an index_add of the kept entries negated (the error
        buffer's update: the same bits as a subtraction, and no pass over the rest of ``out``)."""
        if out.dtype == torch.float32 and out.is_contiguous():
            self._add(payload, out.view(-1), negate=True)
        else:
            out.sub_(self.decode(payload))

    def decode_sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        """``out = sum of decode(p)``: every payload's kept entries added into zeros (the
        payloads are checked once, on entry)."""
        direct = out.dtype == torch.float32 and out.is_contiguous()
        acc = out.view(-1) if direct else torch.zeros(self.numel, dtype=torch.float32, device=out.device)
        acc.zero_()
        for p in payloads:
            self._add(p, acc)
        if not direct:
            out.copy_(acc.view(out.shape))

    def _add(self, payload: Payload, out: torch.Tensor, negate: bool = False) -> None:
        if self.levels:
            stats = payload.tensors[0].float()
            codes = unpack(payload.tensors[-1], self.kept, self.config.bits).long()
        for i, p in enumerate(self.parts):
            if not p.count:
                continue
            span = slice(p.codes_at, p.codes_at + p.count)
            if self.levels:
                vals = stats[i, 1:][codes[span]] + stats[i, 0]  # fp32: table[q] + shift
            else:
                vals = payload.tensors[-1][span].float()
            if negate:
                vals = vals.neg()  # exact: out + (−v) is out − v
            t = p.tiling
            if p.positions is None:
                pos = torch.arange(t.size, device=out.device).expand(t.chunks, -1)
            else:
                pos = self._positions(payload, p).long()
            index, real = self._places(i, pos)
            vals = vals.view(t.chunks, p.kept)
            if real is not None:
                index, vals = index[real], vals[real]
            out[p.offset : p.offset + p.numel].index_add_(0, index.reshape(-1), vals.reshape(-1))

    def _places(self, i: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For part ``i``'s (chunks, kept) positions inside their blocks: each entry's index
        in the tensor (row-major over its matrix view), and which entries are real, not
        padding (None when the blocks tile the tensor exactly: every entry is). Each block's
        first index is kept per part."""
        t = self.parts[i].tiling
        if not t.whole:
            index, real = _places(pos, t)
            return index, None if bool(real.all()) else real
        base = self._bases.get(i)
        if base is None or base.device != pos.device:
            q = t.grid[1]
            block = torch.arange(t.chunks, device=pos.device).unsqueeze(1)  # (chunks, 1)
            base = self._bases[i] = (block // q) * (t.b1 * t.cols) + (block % q) * t.b2
        return base + (pos // t.b2) * t.cols + pos % t.b2, None

    def _positions(self, payload: Payload, p: _Part) -> torch.Tensor:
        """Part ``p``'s (chunks, kept) positions from the payload's tensor of their dtype."""
        assert p.positions is not None  # only parts that send positions are asked
        which = [d for d, _ in self.position_counts].index(p.positions) + (1 if self.levels else 0)
        return payload.tensors[which][p.positions_at : p.positions_at + p.count].view(p.tiling.chunks, p.kept)


def _magnitudes(x: torch.Tensor, t: dct_basis.Tiling) -> torch.Tensor:
    """The magnitudes of the flat ``x`` (of ``t.shape``'s numel) cut into its (chunks, size)
    blocks, padding marked -1 (never chosen before a real entry): one copy of ``x`` (the cut)
    and the magnitude taken in place, or with padding the magnitude, the padded copy and the
    cut; the values themselves are read from ``x`` at the kept places only."""
    p, q = t.grid
    m = x.view(t.rows, t.cols)
    pad_r, pad_c = p * t.b1 - t.rows, q * t.b2 - t.cols
    if pad_r or pad_c:
        m = torch.nn.functional.pad(m.abs(), (0, pad_c, 0, pad_r), value=-1.0)
        return m.reshape(p, t.b1, q, t.b2).transpose(1, 2).reshape(t.chunks, t.size)
    cut = m.reshape(p, t.b1, q, t.b2).transpose(1, 2).reshape(t.chunks, t.size)
    if cut._is_view():  # blocks that are whole rows: the cut is x itself, not a copy, and x is not ours
        return cut.abs()
    return cut.abs_()


def _places(pos: torch.Tensor, t: dct_basis.Tiling) -> tuple[torch.Tensor, torch.Tensor]:
    """For (chunks, kept) positions inside their blocks: each entry's index in the tensor
    (row-major over its matrix view) and whether it is a real entry (not padding)."""
    q = t.grid[1]
    block = torch.arange(t.chunks, device=pos.device).unsqueeze(1)  # (chunks, 1)
    row = (block // q) * t.b1 + pos // t.b2
    col = (block % q) * t.b2 + pos % t.b2
    return row * t.cols + col, (row < t.rows) & (col < t.cols)


@METHODS.register
class SparseLoCo(DiLoCo):
    """DiLoCo's rounds with an error-feedback buffer per rank in place of outer momentum:
    every ``period`` inner steps the buffer's chunked top-k, quantized, is all_gathered and
    every rank steps θ by ``outer_lr`` times the mean."""

    name = "sparseloco"
    summary = ("SparseLoCo: every period inner steps, each rank's decayed error-feedback buffer sends its chunked "
               "top-k at 2 bits (all_gather); an outer SGD step on their mean, no momentum")
    Config = SparseLoCoConfig  # type: ignore[assignment]  # DiLoCo's machinery reads the fields the two share
    flat_only = "its chunks are blocks of whole parameter tensors, which a node's shards would cut apart"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: SparseLoCoConfig | None = None, *,
                 bucket_mb: float = 25.0, overlap: bool = True, **knobs: Any) -> None:
        super().__init__(model, optimizer, comm, cast(Any, config), bucket_mb=bucket_mb, overlap=overlap, **knobs)
        cfg = self.config
        self.wire = ChunkedTopK(ChunkedTopKConfig(chunk=cfg.chunk, k=cfg.k, bits=cfg.bits, sigmas=cfg.sigmas),
                                [tuple(t.shape) for t in self.state.local_params()])  # a shard's own rows
        self.codec = self.wire
        for f in self.fragments:  # one, the whole model (built before its aggregator is)
            f.codec = self.wire

    # eager: a rank's dense pseudo-gradient is no estimate of a mean of sparse messages (outer_lr
    # scales it several times); its own sparse message, which the mean holds at 1/R, is
    previews_own_message = True

    def _outer_from_config(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.config.outer_lr)  # θ ← θ − α Δ

    def _before_encode(self, f: Fragment) -> None:
        """Decay the error buffer (the aggregator's residual, ``e ← β e``); the encode that
        follows adds the pseudo-gradient to it, sends its top-k and keeps what was not sent."""
        if f.agg is not None:
            residual = f.agg.feedback.residuals.get("model")
            if residual is not None:
                residual.mul_(self.config.beta)

    def wire_bytes(self) -> int:
        """Bytes of one rank's payload per sync (the all_gather sends ``R − 1`` of them)."""
        return self.wire.nbytes(torch.Size([self.wire.numel]), torch.float32)

    def report(self) -> dict[str, Any]:
        report = super().report()
        numel = self.state.numel()
        report["extra_memory_bytes"] = 4 * (3 + self._copies) * numel  # θ, the pseudo-gradient, the error buffer
        report["payload_bytes_per_sync"] = self.wire_bytes()
        report["density"] = self.wire.kept / max(1, self.wire.numel)
        return report

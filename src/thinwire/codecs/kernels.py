"""Important-kernel selection for convolution gradients (Hylo's convolution branch).

A conv weight of shape ``(C_out, C_in, k...)`` is viewed as units: ``kernel`` (the default)
makes each ``k...`` slice a unit (``C_out * C_in`` units), ``filter`` each output channel
(``C_out`` units). Each unit is scored by the L1 norm (or L2) of ``u`` (the tensor plus the
error-feedback residual, which the aggregator adds); the ``k`` best units are sent whole and
the rest stays in the residual, so ``dense(sent) + r == u`` exactly.

``k = max(1, ceil(rate(numel) * units))`` with
``rate(numel) = clip(r_max * (t_conv / numel) ** beta, r_min, r_max)``: a layer of ``t_conv``
elements or fewer sends ``r_max`` of its units, bigger layers less, never under ``r_min``.
The thesis adapts the rate to the layer's size without publishing the rule; this formula,
its defaults (``r_max`` 0.25, ``r_min`` 0.01, ``beta`` 0.5, ``t_conv`` 16,384) and the L1
score are thinwire's choices.

Wire (GATHER, size fixed by shape and config): the units' positions as a bitmap (one bit
per unit) or ``k`` int32 indices, whichever is smaller (``positions`` forces one), then the
``k`` units' values in fp32, in ascending unit order. Ties in score keep the lowest units.

Tensors of fewer than three dimensions have one element per ``kernel`` unit (element-wise
top-k); under the default ``compresses`` rule the aggregator sends them as fp32 instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from thinwire.codecs.base import Codec, distinct, generator_for, in_range, zero_
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.specs import register
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.numerics.select import indices, top_mask
from thinwire.payload import Aggregation, Payload, PayloadError, WireSpec

_CHUNK = 1 << 16  # CPU values per scoring block: the block's |x| stays in cache
_COLUMNS = 16  # units of up to this many values are summed column by column
_SERIAL = 1 << 15  # below this many values torch scores in one serial call (no OpenMP region), cheaper


@dataclass(frozen=True, kw_only=True)
class KernelsConfig(CodecConfig):
    ef: bool = knob(True, "error feedback: what was not sent is added to the next step's tensor", "true|false")
    granularity: Literal["kernel", "filter"] = knob(
        "kernel", "unit of selection: kernel = each k x k slice, filter = each output channel", "kernel|filter"
    )
    score: Literal["l1", "l2"] = knob("l1", "how a unit's importance is measured: L1 or L2 norm of its values", "l1|l2")
    t_conv: int = knob(16384, "layer size (elements) at and below which r_max of the units is sent", ">= 1")
    r_max: float = knob(0.25, "largest share of units sent (small layers)", "(0, 1], >= r_min")
    r_min: float = knob(0.01, "smallest share of units sent (the biggest layers)", "(0, 1]")
    beta: float = knob(0.5, "how fast the share falls with size: r_max * (t_conv / numel) ^ beta", ">= 0")
    positions: Literal["auto", "bitmap", "index"] = knob(
        "auto", "how sent units are named: bitmap (1 bit per unit), index (int32 each), auto = the smaller",
        "auto|bitmap|index",
    )
    seed: int = knob(0, "seed of the selection's sample (which never changes the selected set)", "any integer")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.t_conv >= 1, f"t_conv must be >= 1, got {self.t_conv}")
        require(0 < self.r_max <= 1, f"r_max must be in (0, 1], got {self.r_max}")
        require(0 < self.r_min <= 1, f"r_min must be in (0, 1], got {self.r_min}")
        require(self.r_min <= self.r_max, f"r_min must be <= r_max, got r_min={self.r_min} > r_max={self.r_max}")
        require(self.beta >= 0, f"beta must be >= 0, got {self.beta}")


@register
class Kernels(Codec):
    """Sends the highest-scoring kernels (or filters) of a conv gradient whole."""

    name = "kernels"
    summary = ("conv gradients: send the top-scoring kernels whole (share falls with layer size) + positions "
               "(all_gather), EF on")
    Config = KernelsConfig
    aggregation = Aggregation.GATHER

    def __init__(self, config: KernelsConfig) -> None:
        super().__init__(config)
        self._block: np.ndarray | None = None  # CPU scoring buffer, reused

    def compresses(self, shape: torch.Size) -> bool:
        """Convolution weights: three or more dimensions and at least ``min_numel`` elements."""
        return len(shape) >= 3 and math.prod(shape) >= self.config.min_numel

    # -- layout, a pure function of shape and config ---------------------------------------
    def rate(self, numel: int) -> float:
        """Share of units sent for a layer of ``numel`` elements."""
        cfg = self.config
        if numel <= 0:
            return cfg.r_max
        return min(cfg.r_max, max(cfg.r_min, cfg.r_max * (cfg.t_conv / numel) ** cfg.beta))

    def units(self, shape: torch.Size) -> tuple[int, int]:
        """(units, elements per unit) of a tensor of this shape."""
        numel = math.prod(shape)
        if numel == 0:
            return 0, 1
        if len(shape) == 0:
            return 1, 1  # a 0-d tensor: one unit of one value
        lead = shape[0] if self.config.granularity == "filter" or len(shape) < 2 else shape[0] * shape[1]
        return lead, numel // lead

    def k(self, shape: torch.Size) -> int:
        """Units sent for a tensor of this shape (the 1e-12 absorbs float error in rate * units)."""
        count, _ = self.units(shape)
        if count == 0:
            return 0
        return min(count, max(1, math.ceil(self.rate(math.prod(shape)) * count * (1 - 1e-12))))

    def _bitmap(self, count: int, k: int) -> bool:
        if self.config.positions != "auto":
            return self.config.positions == "bitmap"
        return packed_nbytes(count, 1) < 4 * k

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        shape = torch.Size(shape)
        (count, size), k = self.units(shape), self.k(shape)
        pos = ((packed_nbytes(count, 1),), torch.uint8) if self._bitmap(count, k) else ((k,), torch.int32)
        return [pos, ((k * size,), torch.float32)]

    # -- work ------------------------------------------------------------------------------
    def check_fields(self, payload: Payload) -> None:
        """Positions: a bitmap marking exactly ``k`` units, or ``k`` unit indices within the
        layer, each sent once."""
        count, _ = self.units(payload.shape)
        k = self.k(payload.shape)
        if self._bitmap(count, k):
            chosen = _bits_set(payload.tensors[0], count)
            if chosen != k:
                raise PayloadError(f"{self.name}: the bitmap marks {chosen} units, the layout carries {k}")
        else:
            in_range(self.name, "unit indices", payload.tensors[0], 0, count - 1)
            distinct(self.name, "unit indices", payload.tensors[0])

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        (count, size), k = self.units(x.shape), self.k(x.shape)
        if count == 0:
            parts = [torch.zeros(s, dtype=d, device=x.device) for s, d in self.wire_spec(x.shape, x.dtype)]
            return Payload(tuple(parts), x.shape, x.dtype)
        rows = x.detach().reshape(count, size).float()  # (U, S) only read
        if rows.device.type == "cpu" and rows.numel() >= _SERIAL:
            score = torch.from_numpy(self._scores_numpy(rows.numpy()))  # (U,)
        elif self.config.score == "l1":  # (vector_norm's L1 over a dim measured 30x slower on the CPU)
            score = rows.abs().sum(1)  # (U,)
        else:
            score = torch.linalg.vector_norm(rows, 2, dim=1)  # (U,)
        mask = top_mask(score, k, generator_for(self.config.seed, self.step, key, x.device))  # (U,) k True
        idx = indices(mask)  # (k,) ascending
        values = rows.index_select(0, idx).reshape(-1)  # (k*S,)
        pos = pack(mask, 1) if self._bitmap(count, k) else idx.to(torch.int32)
        return Payload((pos, values), x.shape, x.dtype)

    def _scores_numpy(self, rows: np.ndarray) -> np.ndarray:
        """(U,) fp32 L1 (or L2) norm of each unit, in cache-sized blocks of units: ``|x|`` (or
        ``x^2``) of a block into a reused buffer, then its units summed, column by column when
        units are short (a 3x3 kernel: a reduction over 9 contiguous values is slow in NumPy).
        Torch's ``abs().sum(1)`` on 2 threads sharing cores took 8x longer on 2.4M values."""
        count, size = rows.shape
        score = np.empty(count, np.float32)
        per = max(1, _CHUNK // size)  # units per block
        if self._block is None or self._block.size < per * size:
            self._block = np.empty(per * size, np.float32)
        l1 = self.config.score == "l1"
        with np.errstate(over="ignore", invalid="ignore"):
            for lo in range(0, count, per):
                c = rows[lo : lo + per]
                b = self._block[: c.size].reshape(c.shape)
                (np.abs(c, out=b) if l1 else np.multiply(c, c, out=b))
                s = score[lo : lo + c.shape[0]]
                if size <= _COLUMNS:
                    np.copyto(s, b[:, 0])
                    for j in range(1, size):
                        np.add(s, b[:, j], out=s)
                else:
                    np.add.reduce(b, axis=1, out=s)
            if not l1:
                np.sqrt(score, out=score)
        return score

    def _positions(self, payload: Payload) -> torch.Tensor:
        """(k,) int64 ascending unit indices of a payload."""
        pos = payload.tensors[0]
        count, _ = self.units(payload.shape)
        if self._bitmap(count, self.k(payload.shape)):
            if pos.device.type == "cpu":
                return torch.from_numpy(np.flatnonzero(np.unpackbits(pos.detach().numpy(), count=count)))
            return indices(unpack(pos, count, 1).view(torch.bool))
        return pos.long()

    def decode(self, payload: Payload) -> torch.Tensor:
        count, size = self.units(payload.shape)
        out = torch.zeros(count, size, dtype=torch.float32, device=payload.tensors[1].device)
        if count:
            out.index_copy_(0, self._positions(payload), payload.tensors[1].view(-1, size))
        return out.view(payload.shape).to(payload.dtype)

    def decode_add(self, payload: Payload, out: torch.Tensor) -> None:
        self._add(payload, out)

    def decode_sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        """``out = sum of decode(p)``: zeros, then each payload's units added (the payloads
        are checked once, on entry)."""
        zero_(out)
        for p in payloads:
            self._add(p, out)

    def _add(self, payload: Payload, out: torch.Tensor) -> None:
        """``out += decode(payload)`` for a checked payload: the sent units added in place.
        On the CPU with several torch threads and a tensor big enough for an OpenMP region,
        a NumPy gather-add-scatter of whole rows (the positions are distinct): torch's
        ``index_add_`` of rows runs as a parallel ``scatter_add_``, which measured 3.4 ms
        against 1.0 ms on 262K 3x3 units on 2 shared cores (on 1 thread it is ~10% faster)."""
        count, size = self.units(payload.shape)
        if count == 0:
            return
        if not (out.dtype == torch.float32 and out.is_contiguous()):
            out.add_(self.decode(payload))
            return
        pos, values = self._positions(payload), payload.tensors[1].view(-1, size)
        if out.device.type == "cpu" and values.device.type == "cpu" and out.numel() >= _SERIAL \
                and torch.get_num_threads() > 1:
            o = out.detach().view(count, size).numpy()
            p = pos.numpy()
            o[p] += values.detach().numpy()
        else:
            out.view(count, size).index_add_(0, pos, values)


def _bits_set(bitmap: torch.Tensor, count: int) -> int:
    """How many of the first ``count`` bits (MSB first) of a uint8 bitmap are set."""
    if bitmap.device.type != "cpu":
        return int(unpack(bitmap, count, 1).sum().item())
    b = bitmap.detach().numpy()
    whole = count // 8
    total = int(np.bitwise_count(b[:whole]).sum(dtype=np.int64))
    if count % 8:
        total += int(np.bitwise_count(b[whole] & np.uint8((0xFF << (8 - count % 8)) & 0xFF)))
    return total

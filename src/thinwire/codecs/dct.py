"""Chunked DCT top-k: the strongest cosine coefficients of every chunk (DeMo's transform).

Per tensor (:mod:`thinwire.numerics.dct_basis`): an orthonormal DCT-II over ``chunk × chunk``
blocks of the tensor seen as a matrix (``shape[0] × rest``; 1-D tensors in chunks of
``chunk``), each side zero-padded to whole blocks; in every block the ``topk`` coefficients
of largest magnitude are kept (all of them when a block holds fewer). DeMo (Peng,
Quesnelle, Kingma, arXiv 2411.19870) compresses its momentum this way; the FFT method
(``fft``) is its ancestor: a whole-tensor spectrum, its strongest bins kept.

Wire (GATHER, fixed size: ``chunks × k`` coefficients), in this order:

* ``rangefloat`` values: the window exponent E_max (one int32); ``sign`` values: the scale
  (one fp32, the mean magnitude of the kept coefficients, which minimises the L2 error of
  ``±scale``); ``fp32`` and ``bf16``: nothing;
* positions: a ``(chunks, k)`` array of each kept coefficient's place in its block, in the
  smallest integer type that holds a block's index (uint8 up to 256 coefficients per block,
  int16 up to 32,768, else int32), ascending within a block;
* values: fp32, bf16, range floats of ``bits`` bits (``thinwire.numerics.range_format``: the
  FFT method's quantizer) or one sign bit each (1 = negative; zero is sent as +).

GATHER: every rank adds every rank's coefficients into one dense block matrix, then runs
one inverse transform (linearity: the inverse of the sum is the sum of the inverses), as
``fft`` sums spectra. With ``topk`` at a block's size and fp32 values the codec is lossless
up to fp32 rounding of the two transforms. The defaults (64, 32, bf16) are DeMo's chunk
and top-k with thinwire's value format (DeMo sends fp32 values and int64 positions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from thinwire.codecs.base import E_MAX_HIGH, E_MAX_LOW, Codec, Feedback, in_range, not_negative
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.rangefloat import resolve_layout
from thinwire.codecs.specs import register
from thinwire.numerics import dct_basis, range_format
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.payload import Aggregation, Payload, PayloadError, WireSpec

VALUES = ("fp32", "bf16", "rangefloat", "sign")
COEFFICIENTS = "#dct"  # suffix of a residual's key when it is kept as (chunks, size) coefficients
CHUNK_MAX = 1024


@dataclass(frozen=True, kw_only=True)
class DCTConfig(CodecConfig):
    chunk: int = knob(64, "block side: matrices in chunk x chunk blocks, vectors in chunks of chunk",
                      "2..1024, a power of two")
    topk: int = knob(32, "coefficients kept per block (all of a smaller block's); lower = more compression",
                     "1..chunk*chunk")
    values: Literal["fp32", "bf16", "rangefloat", "sign"] = knob(
        "bf16", "how kept coefficients travel: fp32, bf16, range floats of `bits`, or 1 sign bit + a per-tensor "
        "scale", "fp32|bf16|rangefloat|sign")
    bits: int = knob(8, "values=rangefloat: bits per coefficient", "3..8 or 16")
    exp_bits: int = knob(3, "values=rangefloat: exponent bits", "1..bits-1")
    man_bits: int | None = knob(None, "values=rangefloat: mantissa bits (default: the rest)", "bits-1-exp_bits")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.chunk >= 2, f"chunk must be >= 2, got {self.chunk}")
        require(self.chunk & (self.chunk - 1) == 0,
                f"chunk must be a power of two (blocks tile every tensor's padded sides), got {self.chunk}")
        require(self.chunk <= CHUNK_MAX, f"chunk must be <= {CHUNK_MAX}, got {self.chunk}")
        require(1 <= self.topk <= self.chunk**2,
                f"topk must be in 1..{self.chunk**2} (a {self.chunk} x {self.chunk} block's coefficients), "
                f"got {self.topk}")
        require(self.values in VALUES, f"values must be one of {', '.join(VALUES)}, got {self.values!r}")
        require(3 <= self.bits <= 8 or self.bits == 16, f"bits must be in 3..8 or 16, got {self.bits}")
        resolve_layout(self)


def position_dtype(size: int) -> torch.dtype:
    """The smallest integer type holding every index of a block of ``size`` coefficients."""
    return torch.uint8 if size <= 256 else torch.int16 if size <= 1 << 15 else torch.int32


@register
class DCT(Codec):
    """The top-k chunked-DCT coefficients of every block, with their positions; summed in the
    transform domain on decode."""

    name = "dct"
    summary = "keep the top-k coefficients of each chunk x chunk DCT-II block, bf16/fp32/range-float/1-bit (all_gather)"
    Config = DCTConfig
    aggregation = Aggregation.GATHER

    def __init__(self, config: DCTConfig) -> None:
        super().__init__(config)
        assert config.man_bits is not None  # filled by resolve_layout
        self.wire = range_format.Wire(config.bits, config.exp_bits, config.man_bits)
        self._work: dict[str, torch.Tensor] = {}  # scratch reused across tensors and steps

    def _scratch(self, role: str, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """(rows, cols) fp32 scratch for ``role``, grown when too small; valid until the next
        call for the same role (fresh large allocations cost several times a pass on the CPU)."""
        buf = self._work.get(role)
        if buf is None or buf.numel() < rows * cols or buf.device != device:
            buf = self._work[role] = torch.empty(rows * cols, dtype=torch.float32, device=device)
        return buf[: rows * cols].view(rows, cols)

    def tiling(self, shape: torch.Size | tuple[int, ...]) -> dct_basis.Tiling:
        return dct_basis.tiling(tuple(shape), self.config.chunk)

    def kept(self, t: dct_basis.Tiling) -> int:
        """Coefficients kept per block of this tiling."""
        return min(self.config.topk, t.size)

    # -- layout --------------------------------------------------------------------------
    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        t = self.tiling(shape)
        k, count = self.kept(t), t.chunks * self.kept(t)
        values = self.config.values
        spec: list[WireSpec] = []
        if values == "rangefloat":
            spec.append(((1,), torch.int32))
        elif values == "sign":
            spec.append(((1,), torch.float32))
        spec.append(((t.chunks, k), position_dtype(t.size)))
        if values == "fp32":
            spec.append(((count,), torch.float32))
        elif values == "bf16":
            spec.append(((count,), torch.bfloat16))
        elif values == "rangefloat":
            spec.append(self.wire.spec(count))
        else:
            spec.append(((packed_nbytes(count, 1),), torch.uint8))
        return spec

    def check_fields(self, payload: Payload) -> None:
        """Positions inside a block and ascending (so distinct) within it; E_max within fp32's
        exponents; a scale that is not negative."""
        *header, pos, _ = payload.tensors
        t = self.tiling(payload.shape)
        if header and self.config.values == "rangefloat":
            in_range(self.name, "the exponent E_max", header[0], E_MAX_LOW, E_MAX_HIGH)
        elif header:
            not_negative(self.name, "the scale", header[0])
        in_range(self.name, "positions", pos, 0, t.size - 1)
        if pos.shape[1] > 1 and not bool((pos[:, 1:] > pos[:, :-1]).all()):
            raise PayloadError(f"{self.name}: positions must ascend within each block (each sent once)")

    # -- work ----------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        t = self.tiling(x.shape)
        if t.chunks == 0 or t.size == 0:
            return Payload(tuple(torch.zeros(s, dtype=d, device=x.device) for s, d in self.wire_spec(x.shape, x.dtype)),
                           x.shape, x.dtype)
        return self._select(dct_basis.forward(x, t), t, x)

    def _select(self, coeffs: torch.Tensor, t: dct_basis.Tiling, x: torch.Tensor) -> Payload:
        """The payload of ``x`` (its shape, dtype, device) from its (chunks, size) coefficients
        (only read): every block's top ``k``, in the configured value format."""
        mags = self._scratch("mags", t.chunks, t.size, x.device)
        pos, vals = dct_basis.top_per_chunk(coeffs, self.kept(t), mags)
        if vals.data_ptr() == coeffs.data_ptr():  # every coefficient kept: the payload gets its own copy
            vals = vals.clone()
        flat = vals.reshape(-1)  # (chunks * k,)
        values = self.config.values
        wire_pos = pos.to(position_dtype(t.size)).contiguous()
        if values == "fp32":
            return Payload((wire_pos, flat.contiguous()), x.shape, x.dtype)
        if values == "bf16":
            return Payload((wire_pos, flat.to(torch.bfloat16)), x.shape, x.dtype)
        if values == "rangefloat":
            e_max, codes = self.wire.encode(flat.contiguous())
            return Payload((torch.tensor([e_max], dtype=torch.int32, device=x.device), wire_pos, codes),
                           x.shape, x.dtype)
        scale = flat.abs().mean().reshape(1)
        return Payload((scale, wire_pos, pack(flat < 0, 1)), x.shape, x.dtype)

    own_feedback = True

    def encode_feedback(self, x: torch.Tensor, feedback: Feedback, *, key: str = "") -> Payload:
        """Error feedback in the transform domain where the blocks tile ``x`` exactly. There
        the DCT is a rotation, so with ``R`` the residual's coefficients (kept under
        ``key + COEFFICIENTS``): ``R ← R + dct(x)``; send its top coefficients; ``R[kept] ←
        R[kept] − decoded values``. That is ``r ← u − idct(sent)`` of the tensor's domain, up
        to fp32 rounding, with one inverse transform fewer a step. A padded tensor keeps its
        residual in its own domain: there every step crops the padding's part of
        ``idct(sent)``, which the transform domain would keep."""
        t = self.tiling(x.shape)
        if not t.whole:
            u = feedback.compensate(key, x)
            payload = self.encode(u, key=key)
            feedback.update_decoded(key, u, self, payload)  # the payload shares no memory with u
            return payload
        coeffs = dct_basis.forward(x, t)  # a fresh (chunks, size) tensor
        ck = key + COEFFICIENTS
        r = feedback.residuals.get(ck)
        legacy = feedback.residuals.pop(key, None)  # kept in the tensor's domain (a state saved before)
        if legacy is not None and r is None:
            r = dct_basis.forward(legacy.to(x.device), t)
        if r is None:
            r = coeffs  # u = x: the first step
        else:
            if r.device != x.device:  # e.g. resumed from a checkpoint mapped to the CPU
                r = r.to(x.device)
            r.add_(coeffs)
        feedback.residuals[ck] = r
        payload = self._select(r, t, x)
        pos, sent = self.coefficients(payload)  # the values every rank decodes (fp32: the payload's own)
        r.scatter_add_(1, pos, sent.neg())  # R[kept] − sent, exactly (a + (−b) is a − b)
        return payload

    def coefficients(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions as int64, fp32 values), both (chunks, k): what the payload keeps."""
        t = self.tiling(payload.shape)
        *header, pos, wire = payload.tensors
        count = pos.numel()
        values = self.config.values
        if values in ("fp32", "bf16"):
            vals = wire.float()
        elif values == "rangefloat":
            vals = self.wire.decode(int(header[0].item()), wire, count)
        else:
            negative = unpack(wire, count, 1).to(torch.float32)  # 1 = negative
            vals = header[0] * (1 - 2 * negative)
        return pos.long(), vals.reshape(t.chunks, self.kept(t))

    def decode(self, payload: Payload) -> torch.Tensor:
        out = torch.empty(payload.shape, dtype=torch.float32, device=payload.tensors[-1].device)
        self._sum([payload], out)
        return out.to(payload.dtype)

    def decode_sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        """Every rank's coefficients added into one block matrix, then one inverse transform."""
        self._sum(payloads, out)

    def _sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        t = self.tiling(payloads[0].shape)
        if math.prod(t.shape) == 0:
            return
        dense = self._scratch("dense", t.chunks, t.size, out.device).zero_()
        for p in payloads:
            dct_basis.scatter_add(dense, *self.coefficients(p))
        dct_basis.inverse(dense, t, out)

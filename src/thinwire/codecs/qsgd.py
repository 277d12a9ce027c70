"""QSGD (Alistarh et al., NeurIPS 2017): stochastic rounding to s levels of |x| / ||x||_2.

Each value becomes ``norm * sign_i * l_i / s`` with ``l_i`` in ``{0..s}`` drawn so that
``E[l_i] = s |x_i| / norm``: unbiased, with ``E||x_hat - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2``
for a bucket of ``d`` values (the paper's Lemma 3.1).

Wire (GATHER): one fp32 norm per bucket, then one code per value. With
``L = ceil(log2(s+1))`` level bits and ``b = 1 + L <= 8`` a code is ``sign << L | level``
(sign 1 = negative), bit-packed MSB-first: ``4 * n_buckets + ceil(N * b / 8)`` bytes. For
``s > 127`` (``b > 8``) codes travel as int16 words holding ``±level``: ``4 * n_buckets + 2 * N``.

thinwire's own defaults (not the paper's): ``levels=127``, so sign + 7 bits fill exactly one
byte (4x smaller than fp32), and ``bucket=0``, one norm for the whole tensor as the per-tensor
form of the method. The paper's experiments bucket (e.g. d = 512), which cuts the variance
bound from ``sqrt(N)/s`` to ``sqrt(d)/s`` for 4 bytes per bucket: set ``bucket=512``.

Rounding noise is per rank: the generator is seeded with ``(seed + rank, step, key)``, so
ranks round independently and their errors partly cancel in the sum.

On the CPU (fp32, bf16 and fp16 inputs) both directions run in NumPy over cache-sized
chunks through reused buffers, with the torch path's fp32 operations in its order and the
same noise stream (drawn chunk by chunk), so the payloads are the same bits; the norms sum
exact fp64 squares (``einsum``: OpenBLAS's threaded ``ddot`` stalls when cores are shared).
Decoding looks every code up in a table of ``fp32(+-level) * fp32(norm / s)`` (the torch
path's product) straight into the output, the first payload written and the others added:
no dense temporary. A step on ResNet-18's gradients (11.2M floats: encode, then the sum of
2 payloads; 1 torch thread on 2 shared cores) went from 0.52-0.82 s to 0.21-0.28 s.
:func:`table_decode` is the same lookup for codes of 1, 2, 4 or 8 bits, shared with
:mod:`~thinwire.codecs.sign` and :mod:`~thinwire.codecs.terngrad`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from thinwire.codecs.base import Codec, generator_for, in_range, not_negative
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.specs import register
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.payload import Aggregation, Payload, WireSpec

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

MAX_LEVELS = 32767  # the largest level an int16 word holds
CHUNK = 1 << 16  # CPU values per pass: a chunk's temporaries stay in cache


@dataclass(frozen=True, kw_only=True)
class QSGDConfig(CodecConfig):
    levels: int = knob(127, "quantization levels s per sign; higher = more bits, less noise", f"1..{MAX_LEVELS}")
    bucket: int = knob(0, "values sharing one norm, 0 = whole tensor; lower = less noise, 4 bytes per bucket", ">= 0")
    seed: int = knob(0, "seed of the stochastic rounding (combined with the rank)", "any integer")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(1 <= self.levels <= MAX_LEVELS, f"levels must be in 1..{MAX_LEVELS}, got {self.levels}")
        require(self.bucket >= 0, f"bucket must be >= 0 (0 = whole tensor), got {self.bucket}")


class TableCodec(Codec):
    """A GATHER codec whose values decode through a table per payload (:func:`table_decode`):
    on the CPU, ``decode_add`` and ``decode_sum`` run chunk by chunk in NumPy without a dense
    temporary (the subclass gives ``_decode_numpy(payloads, out, add)``); elsewhere the
    dense defaults. :meth:`numpy_path` says which path a tensor takes (tests turn it off to
    compare with the torch path)."""

    elementwise = True

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._scratch = Scratch()  # CPU chunk buffers

    def numpy_path(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (an input, a wire tensor or an output) takes the NumPy path: on the CPU."""
        return t.device.type == "cpu"

    def decode_add(self, payload: Payload, out: torch.Tensor) -> None:
        """``out += decode(payload)``; on the CPU without a dense temporary."""
        if not (self.numpy_path(out) and cpu_fp32_out(payload, out)):
            return super().decode_add(payload, out)
        self._decode_numpy([payload], out.detach().view(-1).numpy(), add=True)

    def decode_sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        """``out = sum of decode(p)``: the first payload decodes straight into ``out``, the
        others add to it, chunk by chunk (on the CPU; the default elsewhere)."""
        if not (payloads and self.numpy_path(out) and all(cpu_fp32_out(p, out) for p in payloads)):
            return super().decode_sum(payloads, out)
        self._decode_numpy(payloads, out.detach().view(-1).numpy())

    def _decode_numpy(self, payloads: list[Payload], out: np.ndarray, add: bool = False) -> None:
        raise NotImplementedError


@register
class QSGD(TableCodec):
    """Norm-scaled stochastic rounding to ``levels`` levels plus a sign bit, bit-packed."""

    name = "qsgd"
    summary = "QSGD: ||x|| + stochastically rounded levels, sign + log2(s+1) bits per value (all_gather)"
    Config = QSGDConfig
    aggregation = Aggregation.GATHER

    def __init__(self, config: QSGDConfig) -> None:
        super().__init__(config)
        self._table: np.ndarray | None = None  # code -> signed level

    @property
    def level_bits(self) -> int:
        return self.config.levels.bit_length()  # == ceil(log2(s + 1))

    def _layout(self, n: int) -> tuple[int, int]:
        """(bucket size d, number of buckets) for N values."""
        d = self.config.bucket or max(n, 1)
        return d, -(-n // d)

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        n = math.prod(shape)
        bits = 1 + self.level_bits
        codes = ((packed_nbytes(n, bits),), torch.uint8) if bits <= 8 else ((n,), torch.int16)
        return [((self._layout(n)[1],), torch.float32), codes]

    def check_fields(self, payload: Payload) -> None:
        norms, codes = payload.tensors
        check_not_negative(self.name, "bucket norms", norms)
        s = self.config.levels
        if codes.dtype == torch.int16:
            in_range(self.name, "levels", codes, -s, s)
        elif s < (1 << self.level_bits) - 1:  # some codes name a level above s
            in_range(self.name, "levels", self._signed_levels(codes, math.prod(payload.shape)).abs(), 0, s)

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        g = generator_for(self.config.seed + self.rank, self.step, key, device=x.device)
        if self.numpy_path(x) and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return self._encode_numpy(x, g)
        n, s = x.numel(), self.config.levels
        d, nb = self._layout(n)
        rows = _padded(x.reshape(-1).float(), nb * d).view(nb, d)  # (nb, d) fp32, a new tensor
        norms = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float64).float()  # (nb,) no overflow of the squares
        y = rows.abs_().div_(torch.where(norms > 0, norms, 1)[:, None]).mul_(s)  # (nb, d) in [0, s]
        noise = torch.rand(y.shape, generator=g, device=x.device)  # (nb, d)
        level = y.add_(noise).floor_().clamp_(0, s).reshape(-1)[:n]  # (N,) P(up) = frac(y)
        neg = x.reshape(-1) < 0  # (N,)
        return Payload((norms, self._codes(level, neg)), x.shape, x.dtype)

    def decode(self, payload: Payload) -> torch.Tensor:
        norms, codes = payload.tensors
        n, s = math.prod(payload.shape), self.config.levels
        if self.numpy_path(codes):
            out = torch.empty(n, dtype=torch.float32)
            self._decode_numpy([payload], out.numpy())
            return out.to(payload.dtype).view(payload.shape)
        d, nb = self._layout(n)
        signed = self._signed_levels(codes, n)  # (N,) fp32
        scale = (norms / s)[:, None]  # (nb, 1)
        out = (_padded(signed, nb * d).view(nb, d) * scale).reshape(-1)[:n]  # (N,)
        return out.to(payload.dtype).view(payload.shape)

    # -- the CPU path: NumPy in cache-sized chunks, the same fp32 operations as the torch path
    def _encode_numpy(self, x: torch.Tensor, g: torch.Generator) -> Payload:
        """The torch path's payload, bit for bit (the noise is the same stream, drawn chunk by
        chunk), without its dozen full-size temporaries."""
        n, s, bits = x.numel(), self.config.levels, 1 + self.level_bits
        d, nb = self._layout(n)
        src = x.detach().reshape(-1).float().numpy()  # (N,) a view when x is contiguous fp32
        norms = _norms(src, d, nb, self._scratch)  # (nb,) fp32
        div = np.where(norms > 0, norms, np.float32(1))  # (nb,)
        s32 = np.float32(s)
        wide = bits > 8
        codes = np.empty(n, np.int16 if wide else np.uint8)  # (N,) the wire codes (8 bits: the packed bytes)
        sc = self._scratch
        y_buf, noise_buf = sc.get("y", np.float32), sc.get("noise", np.float32)
        neg_buf, sh_buf = sc.get("neg", np.bool_), sc.get("shift", np.uint8)
        noise_t = torch.from_numpy(noise_buf)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            for lo, hi, r0 in _chunks(n, d):
                m = hi - lo
                c, y, neg = src[lo:hi], y_buf[:m], neg_buf[:m]
                np.abs(c, out=y)
                _rowwise(np.divide, y, div, lo, r0, d)  # |x| / norm
                np.multiply(y, s32, out=y)  # in [0, s]
                noise_t[:m].uniform_(generator=g)  # the next m draws of the stream
                np.add(y, noise_buf[:m], out=y)
                np.floor(y, out=y)
                np.minimum(y, s32, out=y)  # the level (clamp(0, s): y + noise >= 0); P(up) = frac(s |x| / norm)
                np.less(c, 0, out=neg)
                part = codes[lo:hi]
                np.copyto(part, y, casting="unsafe")
                if wide:
                    np.negative(part, out=part, where=neg)  # +-level in an int16 word
                else:
                    sh = sh_buf[:m]
                    np.left_shift(neg.view(np.uint8), self.level_bits, out=sh)
                    np.bitwise_or(part, sh, out=part)  # sign << L | level
        wire = torch.from_numpy(codes)
        if not wide and bits < 8:
            wire = pack(wire, bits)
        return Payload((torch.from_numpy(norms), wire), x.shape, x.dtype)

    def _decode_numpy(self, payloads: list[Payload], out: np.ndarray, add: bool = False) -> None:
        """``out = sum of decode(p)`` (``+=`` with ``add``) for the flat fp32 ``out``: each code
        looks its value up in a table of ``fp32(+-level) * fp32(norm / s)``, the torch path's
        product, so the values are the same bits."""
        n, s = out.size, self.config.levels
        d, nb = self._layout(n)
        bits = 1 + self.level_bits
        prepared: list[tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] = []
        for p in payloads:
            norms, wire = p.tensors
            per_bucket = norms.detach().numpy() / np.float32(s)  # (nb,) fp32, as norms / s in torch
            wire = wire.detach()
            if bits < 8:
                wire = unpack(wire, n, bits)  # (N,) uint8 codes
            codes = wire.numpy()
            if bits > 8:
                prepared.append((codes, None, per_bucket))
            elif nb == 1:
                prepared.append((codes, (self._signed_table() * per_bucket[0]).astype(np.float32), None))
            else:
                prepared.append((codes, self._signed_table(), per_bucket))
        idx_buf, tmp_buf = self._scratch.get("idx", np.int64), self._scratch.get("values", np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            for lo, hi, r0 in _chunks(n, d):
                m = hi - lo
                for i, (codes, table, scale) in enumerate(prepared):
                    first = i == 0 and not add
                    dst = out[lo:hi] if first else tmp_buf[:m]
                    if table is None:  # int16 words: the signed level itself
                        np.copyto(dst, codes[lo:hi], casting="unsafe")
                    else:
                        idx = idx_buf[:m]
                        np.copyto(idx, codes[lo:hi], casting="unsafe")
                        np.take(table, idx, out=dst, mode="clip")  # (clip: no buffered bounds check)
                    if scale is not None:
                        _rowwise(np.multiply, dst, scale, lo, r0, d)
                    if not first:
                        np.add(out[lo:hi], dst, out=out[lo:hi])

    def _signed_table(self) -> np.ndarray:
        """(2^b,) fp32: the signed level each b-bit code names."""
        if self._table is None:
            level_bits = self.level_bits
            code = np.arange(1 << (1 + level_bits))
            level = (code & ((1 << level_bits) - 1)).astype(np.float32)
            self._table = np.where(code >> level_bits == 1, -level, level).astype(np.float32)
        return self._table

    def _codes(self, level: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        if 1 + self.level_bits > 8:
            return torch.where(neg, -level, level).to(torch.int16)  # (N,)
        code = level.to(torch.uint8) | (neg.to(torch.uint8) << self.level_bits)  # (N,)
        return pack(code, 1 + self.level_bits)

    def _signed_levels(self, codes: torch.Tensor, n: int) -> torch.Tensor:
        if 1 + self.level_bits > 8:
            return codes.float()
        code = unpack(codes, n, 1 + self.level_bits)  # (N,) uint8
        level = (code & ((1 << self.level_bits) - 1)).float()
        return torch.where(code >> self.level_bits == 1, -level, level)


class Scratch:
    """Chunk buffers reused across calls (one encode or decode at a time per codec)."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, role: str, dtype: DTypeLike, size: int = 0) -> np.ndarray:
        size = size or CHUNK
        buf = self._bufs.get(role)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._bufs[role] = np.empty(size, dtype)
        return buf


def table_decode(parts: list[tuple[np.ndarray, np.ndarray]], out: np.ndarray, scratch: Scratch,
                 add: bool = False) -> None:
    """``out = sum over parts of expand(table[byte])`` (``+=`` with ``add``) for the flat fp32
    ``out``: each ``(table, packed)`` part maps every byte of ``packed`` (uint8) to the ``m``
    fp32 values of its row of ``table`` ((256, m), m in 1, 2, 4, 8: codes of 8 / m bits,
    MSB first), the first byte to ``out[0:m]``. Chunk by chunk, each row read as one wide
    item (a 16-byte ``complex128`` for four values), so a lookup moves a whole row. Shared
    by the codecs that send fixed-width codes (QSGD's bytes, TernGrad's 2 bits, signSGD's 1)."""
    n = out.size
    if n == 0 or not parts:
        return
    m = parts[0][0].shape[1]
    wide, cols = {1: (np.float32, 1), 2: (np.float64, 1), 4: (np.complex128, 1), 8: (np.complex128, 2)}[m]
    rows = [np.ascontiguousarray(t).view(wide).reshape(256, cols) for t, _ in parts]
    whole, per = n // m, max(1, CHUNK // m)  # bytes whose m values all lie in out; bytes per pass
    idx_buf, tmp_buf = scratch.get("tidx", np.int64, per), scratch.get("trows", np.float32, per * m)
    for lo in range(0, whole, per):
        hi = min(whole, lo + per)
        dst = out[lo * m : hi * m]
        tmp = tmp_buf[: (hi - lo) * m]
        idx = idx_buf[: hi - lo]
        for i, (table, (_, packed)) in enumerate(zip(rows, parts, strict=True)):
            first = i == 0 and not add
            np.copyto(idx, packed[lo:hi], casting="unsafe")
            into = dst if first else tmp
            np.take(table, idx, axis=0, out=into.view(wide).reshape(hi - lo, cols), mode="clip")
            if not first:
                np.add(dst, tmp, out=dst)
    if n > whole * m:  # the last, partial byte
        dst = out[whole * m :]
        for i, (table, packed) in enumerate(parts):
            vals = table[int(packed[whole]), : n - whole * m]
            if i == 0 and not add:
                dst[:] = vals
            else:
                dst += vals


def check_not_negative(name: str, what: str, t: torch.Tensor) -> None:
    """:func:`~thinwire.codecs.base.not_negative` (a scale or norm of a payload), the common case,
    a CPU tensor with no negative value, answered by NumPy (a torch comparison and ``any`` cost
    ~15-20 us, paid on every decode of every tensor)."""
    if t.device.type == "cpu" and not bool((t.detach().numpy() < 0).any()):
        return
    not_negative(name, what, t)


def cpu_fp32_out(payload: Payload, out: torch.Tensor) -> bool:
    """Whether ``out`` takes the CPU path's values directly: contiguous fp32 on the CPU, for
    a payload of an fp32 tensor (a payload of another dtype rounds its decode to that dtype
    first) whose wire tensors are on the CPU."""
    return (out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
            and payload.dtype == torch.float32 and all(t.device.type == "cpu" for t in payload.tensors))


def _chunks(n: int, d: int) -> Iterator[tuple[int, int, int]]:
    """(lo, hi, r0) spans of ``range(n)`` of about ``CHUNK`` values: inside bucket ``r0`` when
    buckets are at least a chunk long, else whole buckets from bucket ``r0`` on (the last
    span may end inside one)."""
    if d >= CHUNK:
        for r0 in range(-(-n // d)):
            end = min(n, (r0 + 1) * d)
            for lo in range(r0 * d, end, CHUNK):
                yield lo, min(end, lo + CHUNK), r0
    else:
        step = CHUNK // d * d
        for lo in range(0, n, step):
            yield lo, min(n, lo + step), lo // d


def _rowwise(op: np.ufunc, y: np.ndarray, vec: np.ndarray, lo: int, r0: int, d: int) -> None:
    """``y = op(y, vec[bucket of each value])`` in place, for the span of :func:`_chunks`."""
    if d >= CHUNK or y.size <= d - lo % d:  # the span lies inside one bucket
        op(y, vec[r0], out=y)
        return
    full = y.size // d
    rows = y[: full * d].reshape(full, d)
    op(rows, vec[r0 : r0 + full, None], out=rows)
    if y.size > full * d:
        op(y[full * d :], vec[r0 + full], out=y[full * d :])


def _norms(src: np.ndarray, d: int, nb: int, scratch: Scratch) -> np.ndarray:
    """(nb,) fp32 L2 norms of the buckets of ``src``: exact fp64 squares summed in fp64 (no
    overflow), rounded once, as torch's ``vector_norm(dtype=float64).float()``. (``einsum``,
    not ``dot``: OpenBLAS runs a long ``ddot`` on threads that stall when cores are shared.)"""
    sq = np.zeros(nb, np.float64)
    wide = scratch.get("f64", np.float64)
    for lo, hi, r0 in _chunks(src.size, d):
        w = wide[: hi - lo]
        np.copyto(w, src[lo:hi])
        if d >= CHUNK or w.size <= d:
            sq[r0] += np.einsum("i,i->", w, w)
            continue
        full = w.size // d
        rows = w[: full * d].reshape(full, d)
        sq[r0 : r0 + full] += np.einsum("ij,ij->i", rows, rows)
        if w.size > full * d:
            tail = w[full * d :]
            sq[r0 + full] += np.einsum("i,i->", tail, tail)
    return np.sqrt(sq).astype(np.float32)


def _padded(flat: torch.Tensor, size: int) -> torch.Tensor:
    """``flat`` zero-padded to ``size`` (a new tensor either way, so it may be mutated)."""
    out = flat.new_zeros(size)
    out[: flat.numel()] = flat
    return out

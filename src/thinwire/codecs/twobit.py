"""Adaptive 2-bit threshold quantization (Hylo's fully-connected branch; MXNet's 2-bit layout).

Per tensor and step, with ``u`` the tensor (the aggregator adds the error-feedback residual
first): a threshold ``t = alpha * stat(|u|)`` (``stat`` = rms, the default, mean or max)
or, with ``threshold=``, a fixed ``t`` (MXNet's behaviour). Each value becomes a 2-bit code:
``u >= t`` -> ``0b11`` (decodes to ``+t``), ``u <= -t`` -> ``0b10`` (``-t``), otherwise
``0b00`` (0). What a code does not carry stays in the residual: ``r = u - decode``, so a
value sent as ``+t`` keeps ``u - t`` and a zero code keeps all of ``u`` (error feedback is
on by default; the method needs it).

Wire (GATHER): ``t`` as one fp32, then the codes four to a byte, the first value in the two
most significant bits, zero-padded to whole 32-bit words (16 values per word):
``4 + 4 * ceil(N / 16)`` bytes. The codes of MXNet's 2-bit compression have this layout.

Non-finite input: with the adaptive threshold, a NaN or infinite value makes ``t``
non-finite and the whole tensor is sent as zeros (all of it stays in the residual); with a
fixed threshold NaN compares false both ways and travels as 0, and +-inf as +-t. ``t = 0``
(an all-zero tensor) sends zeros only.

The default ``alpha = 1.0`` with ``stat = rms`` (``t = sqrt(mean(u^2))``) is thinwire's
choice: the thesis says the threshold adapts to the layer's gradient magnitude but not how
(a mean of ``|u|`` is the literal reading). A code moves a value by at most ``t`` per step, so a
value whose gradient stays above ``t`` piles up in the residual until ``t`` grows to match
it. When ``k`` of ``N`` values carry most of ``|u|`` (a classifier head), ``mean|u|``
reaches their size only once their residual holds about ``N / k`` steps of their gradient,
the rms after about ``sqrt(N / k)``; on Gaussian-like tensors the two send the same share of
``u``. Measured on a BatchNorm CNN (2 ranks, SGD momentum 0.9, lr 0.02, 300 steps, seeds
0-2) with every weight matrix 2-bit: 0.09-0.49 accuracy with the mean, 0.76-0.90 with the
rms, 0.97-0.98 uncompressed. The rms does not make a 2-bit classifier head safe under
momentum: keep the last layer in fp32 (Hylo sends only linear layers above ``t_fc`` as
2-bit).

On the CPU both directions run in NumPy, in cache-sized chunks through reused buffers, with
no torch op per tensor (each costs ~15 us on a shared core, and a model has dozens of
tensors): the threshold is computed in NumPy and Python floats (the torch path's arithmetic,
the same bits). Encoding: the codes of four values form one little-endian 32-bit word that a
single multiply folds into the byte (``(c0 | c1 << 8 | c2 << 16 | c3 << 24) *
(2^30 + 2^20 + 2^10 + 1)`` holds ``c0 << 6 | c1 << 4 | c2 << 2 | c3`` in its top byte, with no
carries). Decoding: every byte selects its four values from a 256-row table (``take`` of
16-byte rows, :func:`thinwire.codecs.qsgd.table_decode`), all payloads of a sum chunk by chunk.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

import numpy as np
import torch

from thinwire.codecs.base import Codec
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.qsgd import Scratch, check_not_negative, table_decode
from thinwire.codecs.specs import register
from thinwire.numerics.bitpack import pack, unpack
from thinwire.payload import Aggregation, Payload, WireSpec

if TYPE_CHECKING:
    from numpy.typing import DTypeLike

_CHUNK = 1 << 18  # CPU values per encoding pass (1 MB of fp32): the chunk and its codes stay in cache
_DECODE_BYTES = 1 << 18  # CPU packed bytes per decoding span handed to a thread (1M values)
_FOLD = np.uint32((1 << 30) + (1 << 20) + (1 << 10) + 1)  # four byte-wide codes -> one packed byte
T = TypeVar("T")
_LEVELS = (0.0, 0.0, -1.0, 1.0)  # code -> multiple of t (0b01 is never sent; it decodes to 0)
# byte -> the multiples of t of its four values, first value first
_BYTE_LEVELS = np.array([[_LEVELS[(b >> s) & 3] for s in (6, 4, 2, 0)] for b in range(256)], np.float32)


@dataclass(frozen=True, kw_only=True)
class TwoBitConfig(CodecConfig):
    ef: bool = knob(True, "error feedback: what was not sent is added to the next step's tensor", "true|false")
    alpha: float = knob(1.0, "threshold t = alpha * stat(|u|); higher = fewer, larger steps sent", "> 0")
    stat: Literal["mean", "rms", "max"] = knob(
        "rms", "the magnitude statistic the threshold scales: rms of u, mean |u|, or max |u|", "mean|rms|max"
    )
    threshold: float | None = knob(
        None, "a fixed threshold t instead of the adaptive one (MXNet's 2-bit compression)", "> 0, or none"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.alpha > 0, f"alpha must be > 0, got {self.alpha}")
        require(self.threshold is None or self.threshold > 0, f"threshold must be > 0, got {self.threshold}")


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _in_parts(fn: Callable[[int, int, int], T], n: int, chunk: int = _CHUNK) -> list[T]:
    """``fn(part, lo, hi)`` over contiguous spans of ``range(n)`` (whole chunks each), one per
    torch thread, on a shared pool (NumPy and torch release the GIL inside their loops);
    inline when torch runs one thread or ``n`` is a single chunk."""
    if n <= 0:
        return []  # nothing to do (fewer than four values leave no whole byte to decode)
    chunks = -(-n // chunk)
    parts = max(1, min(torch.get_num_threads(), chunks))
    per = -(-chunks // parts) * chunk
    spans = [(j, lo, min(n, lo + per)) for j, lo in enumerate(range(0, n, per))]
    if len(spans) == 1:
        return [fn(*spans[0])]
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="thinwire-twobit")
    return list(_pool.map(lambda span: fn(*span), spans))


def packed_words_nbytes(n: int) -> int:
    """Bytes of ``n`` 2-bit codes padded to whole 32-bit words: ``4 * ceil(n / 16)``."""
    return 4 * ((n + 15) // 16)


@register
class TwoBit(Codec):
    """Codes +t / -t / 0 against a per-tensor threshold, four values per byte."""

    name = "twobit"
    elementwise = True
    summary = "adaptive 2-bit: +t / -t / 0 with t = alpha * rms(u) (or fixed), t + packed codes (all_gather), EF on"
    Config = TwoBitConfig
    aggregation = Aggregation.GATHER

    def __init__(self, config: TwoBitConfig) -> None:
        super().__init__(config)
        self._scratch: dict[str, np.ndarray] = {}  # CPU encoding buffers, reused
        self._scratches: dict[int, Scratch] = {}  # CPU decoding buffers, one set per span

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        return [((1,), torch.float32), ((packed_words_nbytes(math.prod(shape)),), torch.uint8)]

    def check_fields(self, payload: Payload) -> None:
        check_not_negative(self.name, "the threshold", payload.tensors[0])  # code 0b01 decodes to 0

    def threshold(self, flat: torch.Tensor) -> torch.Tensor:
        """The threshold for the fp32 values ``flat`` as a (1,) fp32 tensor on their device."""
        if flat.device.type == "cpu":
            return torch.from_numpy(np.array([self._threshold_np(flat.detach().reshape(-1).numpy())], np.float32))
        cfg = self.config
        if cfg.threshold is not None:
            return torch.full((1,), cfg.threshold, dtype=torch.float32, device=flat.device)
        n = flat.numel()
        if n == 0:
            return flat.new_zeros(1)
        if cfg.stat == "max":
            lo, hi = torch.aminmax(flat)
            stat = torch.maximum(hi, -lo)
        elif cfg.stat == "rms":
            stat = torch.linalg.vector_norm(flat, 2, dtype=torch.float64).square().div(n).sqrt()
        else:
            stat = torch.linalg.vector_norm(flat, 1, dtype=torch.float64) / n
        return (cfg.alpha * stat).to(torch.float32).reshape(1)

    def _threshold_np(self, a: np.ndarray) -> np.float32:
        """:meth:`threshold` of the fp32 values ``a`` on the CPU, as an fp32 scalar, with no torch
        op (each costs ~15 us per tensor): the same arithmetic (fp64 statistic, alpha times it in
        fp64, rounded once; for ``max`` an fp32 product, as torch computes it), the same bits."""
        cfg = self.config
        if cfg.threshold is not None:
            return np.float32(cfg.threshold)
        n = a.size
        if n == 0:
            return np.float32(0)
        if cfg.stat == "max":
            hi, low = a.max(), -a.min()  # both NaN when a holds one
            return np.float32(cfg.alpha) * (low if hi < low else hi)  # torch.maximum's choice on ties (+-0)
        if cfg.stat == "rms":
            return np.float32(cfg.alpha * math.sqrt(self._sum_sq(a) / n))
        return np.float32(cfg.alpha * (self._l1(a) / n))

    def _l1(self, a: np.ndarray) -> float:
        """sum |x| of fp32 values in fp64 (a dot product with ones per chunk: torch's own L1 norm
        is several times slower on the CPU than a BLAS dot)."""

        def part(j: int, lo: int, hi: int) -> float:
            mag, ones = self._np(f"mag{j}", np.float32), self._np("ones", np.float32, fill=1.0)
            total = 0.0
            for i in range(lo, hi, _CHUNK):
                c = a[i : min(hi, i + _CHUNK)]
                m = mag[: c.size]
                np.abs(c, out=m)
                total += float(np.dot(m, ones[: c.size]))
            return total

        return sum(_in_parts(part, a.size))

    def _sum_sq(self, a: np.ndarray) -> float:
        """sum x^2 of fp32 values in fp64 (a BLAS dot of each chunk with itself, summed in fp64;
        torch's fp64 L2 norm measured 8x slower on the CPU). A chunk whose fp32 sum of squares
        could have overflowed or lost values below fp32's range is summed again in fp64."""

        def part(j: int, lo: int, hi: int) -> float:
            total = 0.0
            for i in range(lo, hi, _CHUNK):
                c = a[i : min(hi, i + _CHUNK)]
                with np.errstate(over="ignore", under="ignore"):
                    v = float(np.dot(c, c))
                if not 1e-20 < v < math.inf:  # squares of |x| > 1.8e19 or < 1e-19 leave fp32
                    d = c.astype(np.float64)
                    v = float(np.dot(d, d))
                total += v
            return total

        return sum(_in_parts(part, a.size))

    # -- work ----------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        flat = x.detach().reshape(-1).float()  # (N,) only read
        n = flat.numel()
        if flat.device.type == "cpu":  # NumPy throughout: no per-tensor torch op
            a = flat.numpy()
            t = self._threshold_np(a)
            packed = np.empty(packed_words_nbytes(n), np.uint8)  # (4*ceil(N/16),)
            if not (n and 0 < t < math.inf):  # t == 0 (all zeros), inf or NaN: every code stays 0
                packed.fill(0)
            else:
                packed[(n + 3) // 4 :] = 0  # the word padding
                self._encode_numpy(a, t, packed)
            return Payload((torch.from_numpy(np.array([t], np.float32)), torch.from_numpy(packed)), x.shape, x.dtype)
        threshold = self.threshold(flat)  # (1,)
        words = torch.zeros(packed_words_nbytes(n), dtype=torch.uint8, device=x.device)  # (4*ceil(N/16),)
        if n and 0 < float(threshold.item()) < math.inf:  # else (t == 0, inf or NaN) every code stays 0
            code = ((flat >= threshold) * 3 + (flat <= -threshold) * 2).to(torch.uint8)  # (N,) 0b11 / 0b10 / 0
            codes = pack(code, 2)
            words[: codes.numel()] = codes
        return Payload((threshold, words), x.shape, x.dtype)

    def _encode_numpy(self, a: np.ndarray, t: np.float32, out: np.ndarray) -> None:
        def part(j: int, lo: int, hi: int) -> None:
            ge, le = self._np(f"ge{j}", np.bool_, extra=3), self._np(f"le{j}", np.bool_, extra=3)  # room to pad
            word = self._np(f"word{j}", np.uint32, size=_CHUNK // 4 + 1)
            for i in range(lo, hi, _CHUNK):
                c = a[i : min(hi, i + _CHUNK)]
                n, padded = c.size, (c.size + 3) // 4 * 4
                g, lo_ = ge[:padded], le[:padded]
                g[n:] = lo_[n:] = False
                np.greater_equal(c, t, out=g[:n])
                np.less_equal(c, -t, out=lo_[:n])
                code = lo_.view(np.uint8)  # -> 2 * (g + l) + g: 0b11 where u >= t, 0b10 where u <= -t, else 0
                code += g.view(np.uint8)
                code += code
                code += g.view(np.uint8)
                w = word[: padded // 4]
                np.multiply(code.view("<u4"), _FOLD, out=w)  # each word's four codes -> its top byte
                np.right_shift(w, 24, out=w)
                out[i // 4 : i // 4 + w.size] = w  # chunks start on a multiple of 4 values: on a byte

        _in_parts(part, a.size)

    def decode(self, payload: Payload) -> torch.Tensor:
        t, packed = payload.tensors
        n = math.prod(payload.shape)
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
        self._decode_into([payload], out.view(-1))
        return out.to(payload.dtype).view(payload.shape)

    def decode_add(self, payload: Payload, out: torch.Tensor) -> None:
        if out.dtype == torch.float32 and out.is_contiguous():
            self._decode_into([payload], out.view(-1), add=True)
        else:
            out.add_(self.decode(payload))

    def decode_sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        """The first payload decodes straight into ``out``, the others add to it (on the CPU
        chunk by chunk, every payload's chunk in turn while the output's stays in cache)."""
        if not (out.dtype == torch.float32 and out.is_contiguous()) or not payloads:
            return super().decode_sum(payloads, out)
        self._decode_into(payloads, out.view(-1))

    def _decode_into(self, payloads: list[Payload], out: torch.Tensor, add: bool = False) -> None:
        """``out = sum of decode(p)`` (``+=`` with ``add``) for the flat fp32 ``out``."""
        n = out.numel()
        if n == 0:
            return
        if out.device.type == "cpu" and all(p.tensors[1].device.type == "cpu" for p in payloads):
            self._decode_cpu(payloads, out.detach().numpy(), add)
            return
        levels = torch.tensor(_LEVELS, dtype=torch.float32, device=out.device)
        for i, p in enumerate(payloads):
            t, packed = p.tensors
            code = unpack(packed, n, 2).long()  # (N,)
            values = torch.where(code >= 2, levels[code] * t, 0.0)  # (N,) 0 even if t is not finite
            out.add_(values) if add or i else out.copy_(values)

    def _decode_cpu(self, payloads: list[Payload], out: np.ndarray, add: bool) -> None:
        """Every packed byte looks up its four values, one 16-byte row of a 256-row table of
        ``level * t`` read as a complex128 (:func:`~thinwire.codecs.qsgd.table_decode`), in
        cache-sized chunks; NumPy only, so a small tensor costs a few microseconds, not a
        dozen torch ops. Spans of whole chunks go to the torch threads' shared pool."""
        parts = []
        for p in payloads:
            t = np.float32(p.tensors[0].detach().numpy()[0])
            # (a non-finite t only comes with all-zero codes, which decode to 0)
            table = _BYTE_LEVELS * t if math.isfinite(t) else np.zeros_like(_BYTE_LEVELS)
            parts.append((table, p.tensors[1].detach().numpy()))
        n = out.size

        def part(k: int, lo: int, hi: int) -> None:  # bytes [lo, hi): values [4 lo, 4 hi)
            scratch = self._scratches.get(k)
            if scratch is None:
                scratch = self._scratches[k] = Scratch()
            spans = [(table, packed[lo:hi]) for table, packed in parts]
            table_decode(spans, out[4 * lo : min(n, 4 * hi)], scratch, add)

        _in_parts(part, (n + 3) // 4, _DECODE_BYTES)

    def _np(self, role: str, dtype: DTypeLike, size: int = _CHUNK, extra: int = 0,
            fill: float | None = None) -> np.ndarray:
        buf = self._scratch.get(role)
        if buf is None or buf.size < size + extra or buf.dtype != dtype:
            buf = np.empty(size + extra, dtype)
            if fill is not None:  # filled before it is shared: parts on other threads may read it
                buf.fill(fill)
            self._scratch[role] = buf
        return buf

"""Range-based floats: n-bit codes whose exponent window is set by the data.

A code has 1 sign bit, ``e`` exponent bits and ``m`` mantissa bits (``n = 1 + e + m``),
laid out ``sign | exponent | mantissa`` from the most significant bit. The window's top
exponent is ``E_max = floor(log2(max |x|))``, sent beside the codes; exponent codes
``1 .. 2^e - 1`` stand for ``E_max - (2^e - 2) .. E_max`` and exponent code 0 is zero.
A value is ``(-1)^s (1 + mant / 2^m) 2^E``. Encoding rounds the mantissa to nearest
(ties to even), a carry bumps the exponent, values above the top code saturate to it, and
values below the window become zero. Inside the window the relative error is at most
``2^-(m+1)``. Non-finite inputs: ``±inf`` saturates to the top code of its sign and NaN
encodes as zero; the window is set by the finite values only. Negative zero encodes as
zero. (Wang et al., HPDC 2020 describe a range-based float for FFT coefficients;
the exact layout is not published, so this one is thinwire's.)

Encoding and decoding work on the fp32 bit patterns with integer ops whenever the window
lies inside fp32's normal range (every practical case); otherwise, and for other input
dtypes, a reference implementation of the definition runs. Both give the same codes. On the
CPU the integer ops run in NumPy, in cache-sized chunks through reused scratch (torch ops on
2 threads stall on OpenMP regions when ranks share cores, and NumPy's per-call cost is a
fraction of torch's), and byte codes decode through a table of their 256 values.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable

import numpy as np
import torch

from thinwire.numerics.bitpack import pack, pack_numpy, packed_nbytes, unpack

_F32_MIN_EXP = -126  # the smallest normal fp32 exponent
_F32_INF = 0x7F800000  # the bits of +inf; larger magnitudes are NaN
_CPU_CHUNK = 1 << 18
_NP_CHUNK = 1 << 16  # NumPy pass chunk: the int32 temporaries stay in L2, and per-call costs stay small


def _window_low(exp_bits: int, e_max: int) -> int:
    """The exponent of exponent code 1, the window's bottom."""
    return e_max - ((1 << exp_bits) - 2)


def exponent_max(x: torch.Tensor) -> int:
    """``floor(log2(max |x|))`` over the finite values, or 0 for an all-zero (or empty) tensor."""
    if x.numel() == 0:
        return 0
    if x.device.type == "cpu" and x.dtype == torch.float32:
        e_max = exponent_max_numpy(x.detach().reshape(-1).numpy())
        if e_max is not None:
            return e_max
    lo, hi = torch.aminmax(x.detach().float())  # one pass; NaN or inf falls to the slow path
    top = torch.maximum(-lo, hi)
    if not torch.isfinite(top):
        a = x.detach().float().abs()
        top = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).max()
    if top == 0:
        return 0
    return int(torch.frexp(top)[1].item()) - 1


def exponent_max_numpy(x: np.ndarray) -> int | None:
    """:func:`exponent_max` of a NumPy float array, or None when it holds NaN or inf (then
    :func:`exponent_max`'s slower rule for them applies). A result says that every value is
    finite: the codes need no NaN pass."""
    if x.size == 0:
        return 0
    lo, hi = float(x.min()), float(x.max())
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return None
    top = max(-lo, hi)
    return math.frexp(top)[1] - 1 if top else 0


def encode(
    x: torch.Tensor, exp_bits: int, man_bits: int, e_max: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Codes of ``1 + exp_bits + man_bits`` bits each, the shape of ``x``: a new int32 tensor,
    or written into ``out`` (any integer dtype wide enough, ``x.numel()`` elements) and returned."""
    flat = x.reshape(-1)  # (N,) only read
    if out is None:
        out = torch.empty(flat.numel(), dtype=torch.int32, device=x.device)
    elif out.numel() != flat.numel():
        raise ValueError(f"out holds {out.numel()} codes, need {flat.numel()}")
    if x.dtype != torch.float32 or _window_low(exp_bits, e_max) < _F32_MIN_EXP:
        out.view(-1).copy_(_encode_reference(flat, exp_bits, man_bits, e_max))
    elif x.device.type == "cpu" and out.is_contiguous():
        _encode_numpy(flat.detach().contiguous().numpy(), exp_bits, man_bits, e_max, out.view(-1).numpy())
    else:
        dst = out.view(-1)
        for s in range(0, flat.numel(), _chunk(flat)):
            dst[s : s + _chunk(flat)] = _encode_bits(flat[s : s + _chunk(flat)], exp_bits, man_bits, e_max)
    return out.view(x.shape)


def decode(
    codes: torch.Tensor, exp_bits: int, man_bits: int, e_max: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 values of the codes (any integer dtype holding non-negative codes), the shape of
    ``codes``: a new tensor, or written into ``out`` (``codes.numel()`` elements) and returned."""
    flat = codes.reshape(-1)
    if out is None:
        out = torch.empty(flat.numel(), dtype=torch.float32, device=codes.device)
    elif out.numel() != flat.numel():
        raise ValueError(f"out holds {out.numel()} values, need {flat.numel()}")
    if _window_low(exp_bits, e_max) < _F32_MIN_EXP:
        out.view(-1).copy_(_decode_reference(flat, exp_bits, man_bits, e_max))
    elif codes.device.type == "cpu" and out.is_contiguous() and not out.requires_grad and flat.dtype != torch.bool:
        _decode_numpy(flat.contiguous().numpy(), exp_bits, man_bits, e_max, out.view(-1).numpy())
    else:
        dst = out.view(-1)
        for s in range(0, flat.numel(), _chunk(flat)):
            dst[s : s + _chunk(flat)] = _decode_bits(flat[s : s + _chunk(flat)], exp_bits, man_bits, e_max)
    return out.view(codes.shape)


def _chunk(x: torch.Tensor) -> int:
    """Elements per pass: on the CPU small enough that the temporaries stay in cache."""
    return _CPU_CHUNK if x.device.type == "cpu" else max(x.numel(), 1)


def _encode_bits(x: torch.Tensor, exp_bits: int, man_bits: int, e_max: int) -> torch.Tensor:
    """:func:`encode` by integer arithmetic on the fp32 bit patterns (sign | 8 exponent | 23
    mantissa bits): the rounding add carries into the exponent by itself. Needs a window in
    fp32's normal range."""
    bits = x.contiguous().view(torch.int32)
    a = bits & 0x7FFFFFFF  # |x| as bits: a new tensor, worked on in place from here
    a.masked_fill_(a > _F32_INF, 0)  # NaN -> zero (inf stays, and saturates below)
    shift = 23 - man_bits
    if shift:
        lsb = (a >> shift) & 1
        a += (1 << (shift - 1)) - 1
        a += lsb  # round half to even
        a >>= shift  # biased exponent << man_bits | mantissa
    a -= (_window_low(exp_bits, e_max) + 126) << man_bits  # exponent code 1 = the window's bottom
    a.clamp_(max=(1 << (exp_bits + man_bits)) - 1)  # saturate at the top code
    under = a < (1 << man_bits)  # exponent code <= 0: below the window, or zero
    a |= (bits >> 31) & (1 << (exp_bits + man_bits))  # the sign (arithmetic shift: -1 if negative)
    return a.masked_fill_(under, 0)


def _decode_bits(codes: torch.Tensor, exp_bits: int, man_bits: int, e_max: int) -> torch.Tensor:
    """:func:`decode` by building fp32 bit patterns. Needs a window in fp32's normal range."""
    top = 1 << (exp_bits + man_bits)  # the sign bit of a code
    c = codes.to(torch.int32)
    if c.data_ptr() == codes.data_ptr():  # int32 codes: never write into the caller's tensor
        c = c.clone()
    sign = c & top
    c &= top - 1
    under = c < (1 << man_bits)  # exponent code 0: zero
    c += (_window_low(exp_bits, e_max) + 126) << man_bits
    c <<= 23 - man_bits
    c |= sign << (31 - exp_bits - man_bits)
    return c.masked_fill_(under, 0).view(torch.float32)


def encode_numpy(
    x: np.ndarray, exp_bits: int, man_bits: int, e_max: int, out: np.ndarray, *, finite: bool = False
) -> np.ndarray:
    """:func:`encode` for a 1-D fp32 NumPy array on the CPU: codes into ``out`` (any integer
    dtype wide enough, ``x.size`` elements), returned. ``finite``: the caller knows every
    value is finite (e.g. :func:`exponent_max_numpy` said so), which skips the NaN pass."""
    if _window_low(exp_bits, e_max) < _F32_MIN_EXP:
        out[:] = _encode_reference(torch.from_numpy(np.ascontiguousarray(x)), exp_bits, man_bits, e_max).numpy()
    else:
        _encode_numpy(x, exp_bits, man_bits, e_max, out, finite=finite)
    return out


def decode_numpy(codes: np.ndarray, exp_bits: int, man_bits: int, e_max: int, out: np.ndarray) -> np.ndarray:
    """:func:`decode` for 1-D NumPy arrays on the CPU (no torch call on the common path):
    ``out`` (fp32, ``codes.size`` elements) filled and returned."""
    if _window_low(exp_bits, e_max) < _F32_MIN_EXP:
        out[:] = _decode_reference(torch.from_numpy(np.ascontiguousarray(codes)), exp_bits, man_bits, e_max).numpy()
    else:
        _decode_numpy(codes, exp_bits, man_bits, e_max, out)
    return out


def decode_pairs_numpy(codes: np.ndarray, exp_bits: int, man_bits: int, e_max: int, out: np.ndarray) -> np.ndarray:
    """:func:`decode_numpy` of an even number of byte codes (uint8) into ``out`` viewed as
    complex64 (``codes.size // 2`` values: each pair of codes as real, imaginary), through a
    table of all 65,536 pairs: one lookup per pair instead of one per code."""
    if _window_low(exp_bits, e_max) < _F32_MIN_EXP:
        return decode_numpy(codes, exp_bits, man_bits, e_max, out.view(np.float32)).view(np.complex64)
    _take_chunked(_pair_table(exp_bits, man_bits, e_max), codes.view(np.uint16), out)
    return out


def _encode_numpy(
    x: np.ndarray, exp_bits: int, man_bits: int, e_max: int, out: np.ndarray, *, finite: bool = False
) -> None:
    """:func:`_encode_bits` in NumPy, chunk by chunk into ``out`` (any integer dtype): the
    same ops, with the exponent offset folded into the rounding add (``(a - o<<s) >> s ==
    (a >> s) - o``) and the NaN pass only where a chunk holds NaN (none with ``finite``)."""
    bits_all = x.view(np.int32)
    n = bits_all.size
    size = min(n, _NP_CHUNK)
    a_buf, t_buf, u_buf = np.empty(size, np.int32), np.empty(size, np.int32), np.empty(size, np.bool_)
    shift = 23 - man_bits
    offset = (_window_low(exp_bits, e_max) + 126) << man_bits  # exponent code 1 = the window's bottom
    add = ((1 << (shift - 1)) - 1 if shift else 0) - (offset << shift)  # fits int32: offset < 254 << man_bits
    top = (1 << (exp_bits + man_bits)) - 1
    sign = 1 << (exp_bits + man_bits)
    for s in range(0, n, _NP_CHUNK):
        bits = bits_all[s : s + _NP_CHUNK]
        k = bits.size
        a, t, u = a_buf[:k], t_buf[:k], u_buf[:k]
        np.bitwise_and(bits, 0x7FFFFFFF, out=a)  # |x| as bits
        if not finite and a.max() > _F32_INF:  # NaN -> zero (inf stays, and saturates below)
            np.greater(a, _F32_INF, out=u)
            np.copyto(a, 0, where=u)
        if shift:
            np.right_shift(a, shift, out=t)
            t &= 1
            a += add
            a += t  # round half to even
            a >>= shift  # (biased exponent << man_bits | mantissa) - offset
        else:
            a += add
        np.minimum(a, top, out=a)  # saturate at the top code
        np.less(a, 1 << man_bits, out=u)  # exponent code <= 0: below the window, or zero
        np.right_shift(bits, 31, out=t)  # -1 if negative (arithmetic shift)
        t &= sign
        a |= t
        np.copyto(a, 0, where=u)
        np.copyto(out[s : s + k], a, casting="unsafe")


def _decode_numpy(codes: np.ndarray, exp_bits: int, man_bits: int, e_max: int, out: np.ndarray) -> None:
    """:func:`_decode_bits` in NumPy into ``out`` (fp32): byte codes through a table of the
    256 values, wider codes by the bit ops chunk by chunk."""
    n = codes.size
    if codes.dtype == np.uint8:
        _take_chunked(_byte_table(exp_bits, man_bits, e_max), codes, out)
        return
    size = min(n, _NP_CHUNK)
    c_buf, s_buf, u_buf = np.empty(size, np.int32), np.empty(size, np.int32), np.empty(size, np.bool_)
    top = 1 << (exp_bits + man_bits)  # the sign bit of a code
    for s in range(0, n, _NP_CHUNK):
        k = min(_NP_CHUNK, n - s)
        c, sg, u = c_buf[:k], s_buf[:k], u_buf[:k]
        np.copyto(c, codes[s : s + k], casting="unsafe")
        np.bitwise_and(c, top, out=sg)
        c &= top - 1
        np.less(c, 1 << man_bits, out=u)  # exponent code 0: zero
        c += (_window_low(exp_bits, e_max) + 126) << man_bits
        c <<= 23 - man_bits
        sg <<= 31 - exp_bits - man_bits
        c |= sg
        np.copyto(c, 0, where=u)
        np.copyto(out[s : s + k], c.view(np.float32))


def _take_chunked(table: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = table[idx[i]]``, the small-int indices widened chunk by chunk (``np.take``
    widens them to intp first; a whole-array widening costs a pass of 8-byte writes)."""
    n = idx.size
    if n <= _NP_CHUNK:
        np.take(table, idx, out=out, mode="clip")  # (every index is in range: no bounds checks)
        return
    wide = np.empty(_NP_CHUNK, np.intp)
    for s in range(0, n, _NP_CHUNK):
        k = min(_NP_CHUNK, n - s)
        np.copyto(wide[:k], idx[s : s + k])
        np.take(table, wide[:k], out=out[s : s + k], mode="clip")


@functools.lru_cache(maxsize=64)
def _byte_table(exp_bits: int, man_bits: int, e_max: int) -> np.ndarray:
    """(256,) fp32: the value of every byte code (bits above the code's width ignored, as
    :func:`_decode_bits` does). Read-only: shared between calls."""
    table = np.empty(256, np.float32)
    _decode_numpy(np.arange(256, dtype=np.int32), exp_bits, man_bits, e_max, table)
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=16)
def _pair_table(exp_bits: int, man_bits: int, e_max: int) -> np.ndarray:
    """(65536,) complex64: the values of every pair of byte codes read as one native-endian
    uint16, the first code's value as the real part. Read-only: shared between calls."""
    bits = _byte_table(exp_bits, man_bits, e_max).view(np.uint32).astype(np.uint64)
    low, high = (bits, bits << 32) if np.little_endian else (bits << 32, bits)  # real part: the lower address
    first, second = (low[None, :], high[:, None]) if np.little_endian else (low[:, None], high[None, :])
    table = np.bitwise_or(first, second).reshape(-1).view(np.complex64)  # [code at the higher address, lower]
    table.flags.writeable = False
    return table


def decode_packed_numpy(packed: np.ndarray, count: int, bits: int, exp_bits: int, man_bits: int, e_max: int,
                        out: np.ndarray) -> np.ndarray:
    """fp32 values of ``count`` codes of ``bits`` (2 or 4) bit-packed MSB-first in the uint8
    ``packed``, into ``out`` (fp32, ``count`` elements), returned: one lookup per byte in a
    table of every byte's ``8 / bits`` values, with no unpacked codes in between."""
    per = 8 // bits
    table = _packed_table(bits, exp_bits, man_bits, e_max)  # (256, per) fp32
    full = count // per
    wide = {2: np.uint64, 4: np.complex128}[per]  # one element: a byte's values, copied as a whole
    _take_chunked(table.view(wide).reshape(-1), packed[:full], out[: full * per].view(wide))
    if full * per < count:
        out[full * per :] = table[packed[full], : count - full * per]
    return out


@functools.lru_cache(maxsize=64)
def _packed_table(bits: int, exp_bits: int, man_bits: int, e_max: int) -> np.ndarray:
    """(256, 8 / bits) fp32: the values of the codes in every byte, first code first. Built
    through :func:`decode`, so any window is right. Read-only: shared between calls."""
    values = decode(torch.arange(1 << bits, dtype=torch.int32), exp_bits, man_bits, e_max).numpy()
    byte = np.arange(256, dtype=np.int64)[:, None]
    shifts = np.arange(8 - bits, -1, -bits, dtype=np.int64)[None, :]  # (per,): the first code in the top bits
    table = np.ascontiguousarray(values[(byte >> shifts) & ((1 << bits) - 1)])
    table.flags.writeable = False
    return table


def _encode_reference(x: torch.Tensor, exp_bits: int, man_bits: int, e_max: int) -> torch.Tensor:
    """The format by its definition (frexp and float arithmetic): any dtype and window."""
    a = x.float().abs()
    finite = torch.isfinite(a)
    frac, k = torch.frexp(torch.where(finite, a, torch.zeros_like(a)))  # a = frac * 2^k, frac in [0.5, 1)
    e = torch.where(finite, k - 1, torch.full_like(k, e_max + 1))  # floor(log2 a); inf saturates
    scale = 1 << man_bits
    q = torch.round((2 * frac - 1) * scale).to(torch.int32)  # mantissa, ties to even
    carry = q == scale
    q = torch.where(carry, torch.zeros_like(q), q)
    e = e + carry.to(e.dtype)
    e_min = e_max - ((1 << exp_bits) - 2)
    over = e > e_max
    q = torch.where(over, torch.full_like(q, scale - 1), q)  # saturate at the top code
    e = torch.where(over, torch.full_like(e, e_max), e)
    expcode = (e - e_min + 1).to(torch.int32)
    sign = (x < 0).to(torch.int32)
    code = (sign << (exp_bits + man_bits)) | (expcode << man_bits) | q
    zero = (e < e_min) | (a == 0) | torch.isnan(a)  # below the window, zero or NaN: exponent code 0
    return torch.where(zero, torch.zeros_like(code), code)


def _decode_reference(codes: torch.Tensor, exp_bits: int, man_bits: int, e_max: int) -> torch.Tensor:
    """The format by its definition: any window."""
    c = codes.to(torch.int32)
    q = c & ((1 << man_bits) - 1)
    expcode = (c >> man_bits) & ((1 << exp_bits) - 1)
    sign = (c >> (exp_bits + man_bits)) & 1
    e_min = e_max - ((1 << exp_bits) - 2)
    mag = torch.ldexp(1 + q.float() / (1 << man_bits), (expcode - 1 + e_min).float())
    mag = torch.where(expcode == 0, torch.zeros_like(mag), mag)
    return torch.where(sign == 1, -mag, mag)


class Wire:
    """How a codec sends real values as range floats: ``bits`` per value, bit-packed MSB-first
    (3..8), as int16 words shifted by 2^15 (16), or as plain fp32 (32: no window, E_max 0),
    beside the window's ``E_max``. The one layout the ``rangefloat``, ``fft`` and ``dct``
    codecs share: :meth:`spec` says the wire tensor of ``count`` values, :meth:`encode` gives
    ``(E_max, wire)``, :meth:`decode` the fp32 values back."""

    def __init__(self, bits: int, exp_bits: int, man_bits: int) -> None:
        if not (3 <= bits <= 8 or bits in (16, 32)):
            raise ValueError(f"bits must be in 3..8, 16 or 32, got {bits}")
        self.bits, self.exp_bits, self.man_bits = bits, exp_bits, man_bits
        self._local = threading.local()

    def spec(self, count: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The wire tensor's shape and dtype for ``count`` values."""
        if self.bits == 32:
            return (count,), torch.float32
        if self.bits == 16:
            return (count,), torch.int16
        return (packed_nbytes(count, self.bits),), torch.uint8

    def encode(self, values: torch.Tensor, out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """(E_max, wire tensor) of the 1-D fp32 ``values`` (only read; with 32 bits the wire
        is ``values`` itself). ``out``: a tensor of :meth:`spec`'s shape and dtype for the wire
        (with 3..8 bits), filled and returned instead of a new one."""
        if self.bits == 32:
            return 0, values
        if out is not None and (self.bits == 16 or (tuple(out.shape), out.dtype) != self.spec(values.numel())
                                or out.device != values.device or not out.is_contiguous()):
            raise ValueError(f"out must be the contiguous wire tensor of {values.numel()} values: "
                             f"{self.spec(values.numel())}, got {tuple(out.shape)} {out.dtype}")
        if values.device.type == "cpu" and values.dtype == torch.float32:
            # byte codes in kept room (a quarter of int32's memory, no pages faulted in), and
            # the extremes read once: they give the window and say that no NaN pass is needed
            flat = values.detach().reshape(-1).contiguous().numpy()
            low, high = (float(flat.min()), float(flat.max())) if flat.size else (0.0, 0.0)
            return self.encode_numpy(flat, low, high, scratch=self._scratch(flat.size), out=out)
        e_max = exponent_max(values)
        if self.bits == 8:  # one code per byte: the packed layout is the codes themselves
            if out is None:
                out = torch.empty(values.numel(), dtype=torch.uint8, device=values.device)
            return e_max, encode(values, self.exp_bits, self.man_bits, e_max, out=out)
        codes = encode(values, self.exp_bits, self.man_bits, e_max)  # int32
        if self.bits == 16:
            return e_max, (codes - (1 << 15)).to(torch.int16)
        packed = pack(codes, self.bits)
        if out is None:
            return e_max, packed
        out.copy_(packed)
        return e_max, out

    def _scratch(self, n: int) -> np.ndarray | None:
        """This thread's kept room for ``n`` codes (grown, never shrunk; none for 8 bits): a
        codec may encode on a background thread while the training thread encodes another
        tensor."""
        if self.bits == 8:
            return None
        wide = np.int32 if self.bits == 16 else np.uint8
        room = getattr(self._local, "codes", None)
        if room is None or room.size < n or room.dtype != wide:
            room = self._local.codes = np.empty(n, wide)
        return room[:n]

    def encode_numpy(self, values: np.ndarray, low: float, high: float,
                     split: Callable[[Callable[[int, int], object], int], list] | None = None,
                     scratch: np.ndarray | None = None, out: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """:meth:`encode` of 1-D fp32 NumPy ``values`` whose extremes are ``low`` and ``high``
        (new wire arrays, the same bytes; ``values`` is only read, except with 32 bits, where
        it is the wire itself). ``split(fn, n)`` may run ``fn(a, b)`` over parts of the values
        on several threads; ``scratch``: room for the codes (uint8 for 3..7 bits, int32 for
        16; none is needed with 8, whose codes are the wire); ``out``: the wire tensor to fill
        (3..8 bits; CPU)."""
        if self.bits == 32:
            return 0, torch.from_numpy(values)
        finite = math.isfinite(low) and math.isfinite(high)
        if finite:
            top = max(-low, high)
            e_max = math.frexp(top)[1] - 1 if top else 0
        else:  # NaN or inf among the values: the window of the finite ones
            e_max = exponent_max(torch.from_numpy(values))
        n = values.size
        wide = np.int32 if self.bits == 16 else np.uint8  # every code of 8 bits or fewer fits a byte
        if self.bits == 8:
            codes = out.numpy() if out is not None else np.empty(n, np.uint8)
        elif scratch is not None and scratch.size >= n and scratch.dtype == wide:
            codes = scratch[:n]
        else:
            codes = np.empty(n, wide)
        run = split or (lambda fn, size: [fn(0, size)])
        run(lambda a, b: encode_numpy(values[a:b], self.exp_bits, self.man_bits, e_max, codes[a:b], finite=finite),
            n)
        if self.bits == 8:
            return e_max, torch.from_numpy(codes) if out is None else out
        if self.bits == 16:
            return e_max, torch.from_numpy(np.subtract(codes, 1 << 15, dtype=np.int32).astype(np.int16))
        if 8 % self.bits == 0:  # whole codes per byte: strided NumPy passes
            wire = out if out is not None else torch.empty(packed_nbytes(n, self.bits), dtype=torch.uint8)
            pack_numpy(codes, self.bits, wire.numpy())
            return e_max, wire
        packed = pack(torch.from_numpy(codes), self.bits)
        if out is None:
            return e_max, packed
        out.copy_(packed)
        return e_max, out

    def codes(self, wire: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` codes of a wire tensor (int32, or the bytes themselves with 8 bits)."""
        if self.bits == 16:
            return wire.to(torch.int32) + (1 << 15)
        return wire[:count] if self.bits == 8 else unpack(wire, count, self.bits)

    def decode(self, e_max: int, wire: torch.Tensor, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """(count,) fp32 values of a wire tensor, written into ``out`` when given."""
        if self.bits == 32:
            return wire.float()
        if (self.bits == 4 and wire.device.type == "cpu" and wire.dtype == torch.uint8
                and (out is None or (out.device.type == "cpu" and out.dtype == torch.float32
                                     and out.is_contiguous() and not out.requires_grad))):
            if wire.numel() < packed_nbytes(count, self.bits):
                raise ValueError(f"need {packed_nbytes(count, self.bits)} bytes for {count} codes of {self.bits} "
                                 f"bits, got {wire.numel()}")
            if out is None:
                out = torch.empty(count, dtype=torch.float32)
            elif out.numel() != count:
                raise ValueError(f"out holds {out.numel()} values, need {count}")
            decode_packed_numpy(wire.contiguous().numpy(), count, self.bits, self.exp_bits, self.man_bits, e_max,
                                out.view(-1).numpy())
            return out
        return decode(self.codes(wire, count), self.exp_bits, self.man_bits, e_max, out=out)

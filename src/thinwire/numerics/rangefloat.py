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
dtypes, a reference implementation of the definition runs. Both give the same codes.
"""

from __future__ import annotations

import torch

_F32_MIN_EXP = -126  # the smallest normal fp32 exponent
_F32_INF = 0x7F800000  # the bits of +inf; larger magnitudes are NaN
_CPU_CHUNK = 1 << 18


def _window_low(exp_bits: int, e_max: int) -> int:
    """The exponent of exponent code 1, the window's bottom."""
    return e_max - ((1 << exp_bits) - 2)


def exponent_max(x: torch.Tensor) -> int:
    """``floor(log2(max |x|))`` over the finite values, or 0 for an all-zero (or empty) tensor."""
    if x.numel() == 0:
        return 0
    lo, hi = torch.aminmax(x.detach().float())  # one pass; NaN or inf falls to the slow path
    top = torch.maximum(-lo, hi)
    if not torch.isfinite(top):
        a = x.detach().float().abs()
        top = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).max()
    if top == 0:
        return 0
    return int(torch.frexp(top)[1].item()) - 1


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

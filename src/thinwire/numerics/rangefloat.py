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
"""

from __future__ import annotations

import torch


def exponent_max(x: torch.Tensor) -> int:
    """``floor(log2(max |x|))``, or 0 for an all-zero (or empty) tensor."""
    if x.numel() == 0:
        return 0
    a = x.float().abs()
    top = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).max()
    if top == 0:
        return 0
    return int(torch.frexp(top)[1].item()) - 1


def encode(x: torch.Tensor, exp_bits: int, man_bits: int, e_max: int) -> torch.Tensor:
    """int32 codes (same shape as ``x``) of ``1 + exp_bits + man_bits`` bits each."""
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


def decode(codes: torch.Tensor, exp_bits: int, man_bits: int, e_max: int) -> torch.Tensor:
    """fp32 values of the codes (any integer dtype holding non-negative codes)."""
    c = codes.to(torch.int32)
    q = c & ((1 << man_bits) - 1)
    expcode = (c >> man_bits) & ((1 << exp_bits) - 1)
    sign = (c >> (exp_bits + man_bits)) & 1
    e_min = e_max - ((1 << exp_bits) - 2)
    mag = torch.ldexp(1 + q.float() / (1 << man_bits), (expcode - 1 + e_min).float())
    mag = torch.where(expcode == 0, torch.zeros_like(mag), mag)
    return torch.where(sign == 1, -mag, mag)

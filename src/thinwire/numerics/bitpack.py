"""k-bit unsigned codes <-> bytes, MSB-first, with vectorised torch ops.

Layout: the codes form one big-endian bit stream. Code ``i`` occupies stream bits
``[i*bits, (i+1)*bits)``, most significant bit first, and stream bit ``b`` is bit
``7 - b % 8`` of byte ``b // 8``. So with ``bits=2`` the codes ``[3, 0, 1, 2]`` pack to the
single byte ``0b11_00_01_10``. The last byte is zero-padded. Every ``bits`` in 1..8 is
supported; 1, 2, 4 and 8 (codes never straddle a byte) take a faster path, and 1 bit on
the CPU numpy's ``packbits``/``unpackbits``, whose layout this is.

Both ends of a collective compute the same layout from ``(n, bits)`` alone, so the packed
size is known before packing (:func:`packed_nbytes`) and no length crosses the wire.
"""

from __future__ import annotations

import numpy as np
import torch


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes holding ``n`` codes of ``bits`` bits each: ``ceil(n * bits / 8)``."""
    _check_bits(bits)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return (n * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes (any integer dtype, values in ``[0, 2**bits)``, any shape) into uint8.

    Returns a new 1-D uint8 tensor of ``packed_nbytes(codes.numel(), bits)`` bytes on the
    codes' device. Codes outside the range corrupt their neighbours (not checked: speed).
    """
    _check_bits(bits)
    flat = codes.reshape(-1).to(torch.uint8)  # (n,)
    if bits == 1 and flat.device.type == "cpu":  # numpy's packbits has this very layout
        return torch.from_numpy(np.packbits(flat.numpy()))
    if 8 % bits:
        return _pack_divisor(_to_bits(flat, bits), 1)
    return _pack_divisor(flat, bits)


def unpack(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes as a new 1-D uint8 tensor."""
    if packed.numel() < packed_nbytes(n, bits):
        raise ValueError(f"need {packed_nbytes(n, bits)} bytes for {n} codes of {bits} bits, got {packed.numel()}")
    if bits == 1 and packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.reshape(-1).to(torch.uint8).numpy(), count=n))
    if 8 % bits:
        stream = _unpack_divisor(packed, n * bits, 1)  # (n*bits,) of 0/1
        return _from_bits(stream, bits)
    return _unpack_divisor(packed, n, bits)


def pack_numpy(codes: np.ndarray, bits: int, out: np.ndarray) -> np.ndarray:
    """:func:`pack` of 1-D uint8 NumPy codes whose width divides 8 (1, 2, 4, 8) into ``out``
    (uint8, ``packed_nbytes(codes.size, bits)`` bytes), returned: strided passes with no
    temporary as large as the codes."""
    _check_bits(bits)
    if 8 % bits:
        raise ValueError(f"pack_numpy takes widths that divide 8 (1, 2, 4, 8), got {bits}")
    n, per = codes.size, 8 // bits
    if out.size != packed_nbytes(n, bits):
        raise ValueError(f"out holds {out.size} bytes, need {packed_nbytes(n, bits)}")
    if per == 1:
        np.copyto(out, codes)
        return out
    full = n // per  # bytes whose every code is present
    body = out[:full]
    np.left_shift(codes[0 : full * per : per], 8 - bits, out=body)
    for j in range(1, per):
        shifted = codes[j : full * per : per] << np.uint8(8 - bits * (j + 1))
        body |= shifted
    if full * per < n:  # the last byte: the remaining codes, zero padded
        tail = 0
        for j, c in enumerate(codes[full * per :].tolist()):
            tail |= c << (8 - bits * (j + 1))
        out[full] = tail
    return out


def _pack_divisor(flat: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes whose width divides 8: ``8 // bits`` codes per byte."""
    per = 8 // bits
    pad = -flat.numel() % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    cols = flat.view(-1, per)  # (nbytes, per): one row per output byte
    out = cols[:, 0] << (8 - bits)  # a new tensor; the first code goes in the top bits
    for j in range(1, per):
        out |= cols[:, j] << (8 - bits * (j + 1))
    return out


def _unpack_divisor(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(8 - bits, -1, -bits, dtype=torch.uint8, device=packed.device)  # (per,)
    mask = (1 << bits) - 1
    nbytes = (n + per - 1) // per
    codes = (packed[:nbytes, None].to(torch.uint8) >> shifts) & mask  # (nbytes, per)
    return codes.reshape(-1)[:n]


def _to_bits(flat: torch.Tensor, bits: int) -> torch.Tensor:
    """(n,) codes -> (n*bits,) stream of 0/1, MSB of each code first."""
    shifts = torch.arange(bits - 1, -1, -1, dtype=torch.uint8, device=flat.device)  # (bits,)
    return ((flat[:, None] >> shifts) & 1).reshape(-1)  # (n*bits,)


def _from_bits(stream: torch.Tensor, bits: int) -> torch.Tensor:
    """(n*bits,) stream of 0/1 -> (n,) codes."""
    rows = stream.view(-1, bits)  # (n, bits)
    out = rows[:, 0].clone()
    for j in range(1, bits):
        out <<= 1
        out |= rows[:, j]
    return out


def _check_bits(bits: int) -> None:
    if not (isinstance(bits, int) and 1 <= bits <= 8):
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")

"""The chunked orthonormal DCT-II of the ``dct`` codec and of DeMo, and per-chunk top-k.

A tensor is seen as a matrix, ``shape[0] × (numel / shape[0])`` when it has two or more
dimensions, ``1 × numel`` otherwise, and tiled in blocks of ``b1 × b2`` (1-D tensors: chunks
of ``b2``). A block side is ``min(chunk, the next power of two >= that side of the
matrix)``, so that a small tensor is not padded to a whole chunk; each side is zero-padded
up to a multiple of its block side, identically on every rank (the padding is transformed
with the rest; only kept coefficients travel). Every block ``B`` becomes ``D1 B D2ᵀ`` with
the orthonormal DCT-II basis ``D[k, n] = s_k cos(pi (2n + 1) k / 2b)`` (``s_0 = sqrt(1/b)``,
``s_k = sqrt(2/b)``): ``D`` is orthogonal, so the inverse is ``D1ᵀ C D2`` and Parseval holds
block by block (``||C|| = ||B||``). DeMo (Peng et al., arXiv 2411.19870) transforms
``chunk × chunk`` blocks of matrices and chunks of vectors the same way; its code picks each
side's largest divisor up to ``chunk`` instead of padding, which leaves a prime-sized side
untransformed: thinwire pads.

The transforms are matrix products (two per block: a batched ``matmul``), in the tensor's
device and fp32, with bases built once per size in fp64 and rounded. Coefficients come out
as ``(chunks, b1 * b2)``: one row per block, its ``b1 × b2`` coefficients row-major.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tiling:
    """How one tensor shape is cut into blocks (a pure function of shape and chunk)."""

    shape: tuple[int, ...]
    rows: int  # the matrix view: rows x cols (1 x numel for tensors of fewer than 2 dimensions)
    cols: int
    b1: int  # block rows (1 for 1-D tensors)
    b2: int  # block columns

    @property
    def grid(self) -> tuple[int, int]:
        """Blocks down and across the padded matrix."""
        return -(-self.rows // self.b1), -(-self.cols // self.b2)

    @property
    def chunks(self) -> int:
        """Blocks in all: rows of the coefficient matrix."""
        p, q = self.grid
        return p * q

    @property
    def size(self) -> int:
        """Coefficients per block."""
        return self.b1 * self.b2

    @property
    def whole(self) -> bool:
        """The blocks tile the matrix with no padding: the transform is then a rotation of the
        tensor itself (its inverse gives back every value, and nothing is cropped)."""
        p, q = self.grid
        return p * self.b1 == self.rows and q * self.b2 == self.cols and self.chunks > 0


def _side(n: int, chunk: int) -> int:
    return min(chunk, 1 << max(0, n - 1).bit_length())


@functools.lru_cache(maxsize=4096)
def tiling(shape: tuple[int, ...], chunk: int) -> Tiling:
    """The blocks of a tensor of ``shape`` with at most ``chunk`` per side (a power of two >= 2)."""
    numel = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 and numel else 1
    cols = numel // rows if rows else 0
    return Tiling(tuple(shape), rows, cols, _side(rows, chunk) if rows > 1 else 1, _side(cols, chunk))


_bases: dict[tuple[int, torch.device], torch.Tensor] = {}


def basis(b: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The (b, b) fp32 orthonormal DCT-II matrix ``D`` (``X = D x``), cached per device."""
    key = (b, torch.device(device))
    d = _bases.get(key)
    if d is None:
        k = torch.arange(b, dtype=torch.float64).unsqueeze(1)
        n = torch.arange(b, dtype=torch.float64).unsqueeze(0)
        m = torch.cos(math.pi * (2 * n + 1) * k / (2 * b)) * math.sqrt(2 / b)
        m[0] /= math.sqrt(2)
        d = _bases[key] = m.float().to(key[1])
    return d


def forward(x: torch.Tensor, t: Tiling) -> torch.Tensor:
    """(chunks, size) fp32 DCT coefficients of ``x`` (of shape ``t.shape``; only read)."""
    p, q = t.grid
    m = x.detach().reshape(t.rows, t.cols).float()
    pad_r, pad_c = p * t.b1 - t.rows, q * t.b2 - t.cols
    if pad_r or pad_c:
        m = torch.nn.functional.pad(m, (0, pad_c, 0, pad_r))
    blocks = m.reshape(p, t.b1, q, t.b2).transpose(1, 2)  # (p, q, b1, b2)
    out = blocks @ basis(t.b2, x.device).T  # each block's rows
    if t.b1 > 1:
        out = basis(t.b1, x.device) @ out  # and columns
    return out.reshape(t.chunks, t.size)


def inverse(coeffs: torch.Tensor, t: Tiling, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor of shape ``t.shape`` (fp32) whose coefficients are the (chunks, size)
    ``coeffs``, the padding cropped: a new tensor, or written into ``out`` (``t``'s numel)."""
    p, q = t.grid
    blocks = coeffs.reshape(p, q, t.b1, t.b2) @ basis(t.b2, coeffs.device)
    if t.b1 > 1:
        blocks = basis(t.b1, coeffs.device).T @ blocks
    m = blocks.transpose(1, 2)  # (p, b1, q, b2): the blocks back in place
    whole = p * t.b1 == t.rows and q * t.b2 == t.cols
    if out is not None and whole and out.is_contiguous():
        out.view(p, t.b1, q, t.b2).copy_(m)  # one pass from the blocks into place
        return out
    m = m.reshape(p * t.b1, q * t.b2)
    if not whole:
        m = m[: t.rows, : t.cols]
    if out is not None:
        out.view(t.rows, t.cols).copy_(m)
        return out
    return m.reshape(t.shape)


def top_per_chunk(coeffs: torch.Tensor, k: int,
                  work: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, values): the ``k`` largest-magnitude coefficients of every row of the
    (chunks, size) ``coeffs``, positions ascending within a row (int64, (chunks, k)), values
    at them ((chunks, k), the coefficients' dtype). Ties keep ``torch.topk``'s choice.
    ``work``: scratch of ``coeffs``' shape and dtype for the magnitudes (else a new tensor)."""
    if k >= coeffs.shape[1]:
        pos = torch.arange(coeffs.shape[1], device=coeffs.device).expand(coeffs.shape[0], -1)
        return pos, coeffs
    mags = torch.abs(coeffs, out=work) if work is not None else coeffs.abs()
    pos = top_positions(mags, k)
    return pos, coeffs.gather(1, pos)


def top_positions(mags: torch.Tensor, k: int) -> torch.Tensor:
    """The positions (int64, (chunks, k), ascending within a row) of the ``k`` largest of
    every row of the (chunks, size) magnitudes ``mags``: values >= 0, padding at one
    negative value. ``torch.topk``'s choice, ties included. On the CPU fp32 magnitudes are
    ranked by their int32 bit patterns, which order as the floats do where the sign bit is
    clear (and put the padding below them all): ``torch.topk`` runs the same comparisons
    there without its NaN test, about a quarter faster (a NaN still ranks above every
    number)."""
    if mags.device.type == "cpu" and mags.dtype == torch.float32:
        mags = mags.view(torch.int32)
    return torch.topk(mags, k, dim=1, sorted=False).indices.sort(dim=1).values


def scatter_add(dense: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
    """``dense[c, pos[c, j]] += values[c, j]`` for the (chunks, size) ``dense`` (positions of
    a row distinct)."""
    dense.scatter_add_(1, pos.long(), values.to(dense.dtype))

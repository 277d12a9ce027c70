"""Scaled sign (EF-signSGD, Karimireddy et al., ICML 2019): ``(||u||_1 / N) * sign(u)``.

Wire (GATHER): one fp32 scale, then one sign bit per value packed MSB-first (bit 1 =
negative; zero is sent as +): ``4 + ceil(N / 8)`` bytes, 32x smaller than fp32. The scale
makes the compressor a contraction, which is what error feedback (default on) needs.

On the CPU both directions run in NumPy over cache-sized chunks (torch ops on threads stall
when ranks share cores, and each costs a full-size temporary): encoding sums ``|u|`` (fp32
within a chunk, fp64 across chunks, divided by N in fp64 and rounded once) and packs the
signs with ``packbits``; decoding maps every byte to its eight values ``+-scale`` through a
256-row table, one 32-byte row per lookup. The signs are the torch path's bits; the scale is
within 1e-6 of the exact mean (the torch path's fp32 norm, which other devices still use,
measured up to 1.4e-5 off on a transformer's gradients), so it may differ in its last bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from thinwire.codecs.config import CodecConfig, knob
from thinwire.codecs.qsgd import CHUNK, TableCodec, check_not_negative, table_decode
from thinwire.codecs.specs import register
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.payload import Aggregation, Payload, WireSpec

# byte -> its eight sign bits, first value first (1 = negative)
_BYTE_BITS = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1)  # (256, 8)
_BYTE_SIGNS = (1 - 2 * _BYTE_BITS.astype(np.float32)).astype(np.float32)  # (256, 8) +-1


@dataclass(frozen=True, kw_only=True)
class SignConfig(CodecConfig):
    ef: bool = knob(True, "error feedback: what was not sent is added to the next step's tensor", "true|false")


@register
class SignSGD(TableCodec):
    """One bit per value plus the mean magnitude; deterministic."""

    name = "signsgd"
    summary = "EF-signSGD: 1 sign bit per value + fp32 scale ||x||_1/N (all_gather), EF on"
    Config = SignConfig
    aggregation = Aggregation.GATHER

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        return [((1,), torch.float32), ((packed_nbytes(math.prod(shape), 1),), torch.uint8)]

    def check_fields(self, payload: Payload) -> None:
        check_not_negative(self.name, "the scale", payload.tensors[0])

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        flat = x.detach().reshape(-1).float()  # (N,) only read
        if self.numpy_path(flat):
            return Payload(self._encode_numpy(flat.numpy()), x.shape, x.dtype)
        scale = torch.linalg.vector_norm(flat, 1).div(max(1, flat.numel())).reshape(1)  # (1,)
        bits = pack(flat < 0, 1)  # (ceil(N/8),)
        return Payload((scale, bits), x.shape, x.dtype)

    def _encode_numpy(self, src: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        n = src.size
        bits = np.empty(packed_nbytes(n, 1), np.uint8)
        mag, neg = self._scratch.get("mag", np.float32), self._scratch.get("neg", np.bool_)
        total = 0.0
        for lo in range(0, n, CHUNK):  # CHUNK is a multiple of 8: every chunk starts on a byte
            c = src[lo : lo + CHUNK]
            m = mag[: c.size]
            np.abs(c, out=m)
            total += float(np.add.reduce(m))
            bits[lo // 8 : (lo + c.size + 7) // 8] = np.packbits(np.less(c, 0, out=neg[: c.size]))
        scale = np.array([total / max(1, n)], np.float32)  # (1,) NaN or inf if u holds one
        return torch.from_numpy(scale), torch.from_numpy(bits)

    def decode(self, payload: Payload) -> torch.Tensor:
        scale, bits = payload.tensors
        n = math.prod(payload.shape)
        if self.numpy_path(bits):
            out = torch.empty(n, dtype=torch.float32)
            self._decode_numpy([payload], out.numpy())
            return out.to(payload.dtype).view(payload.shape)
        neg = unpack(bits, n, 1)  # (N,) 0/1
        out = (1 - 2 * neg.float()) * scale  # (N,) +-scale
        return out.to(payload.dtype).view(payload.shape)

    def _decode_numpy(self, payloads: list[Payload], out: np.ndarray, add: bool = False) -> None:
        """Each byte -> its eight values, ``+-1 * scale`` in fp32 (the torch path's product)."""
        parts = [(_BYTE_SIGNS * p.tensors[0].detach().numpy()[0], p.tensors[1].detach().numpy()) for p in payloads]
        table_decode(parts, out, self._scratch, add)


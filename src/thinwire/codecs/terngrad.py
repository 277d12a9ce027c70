"""TernGrad (Wen et al., NeurIPS 2017): unbiased stochastic ternary values ``{-s, 0, +s}``.

``s = max |x|`` per tensor; ``b_i ~ Bernoulli(|x_i| / s)``; value ``s * sign(x_i) * b_i``, so
``E[value] = x_i``. Wire (GATHER): one fp32 ``s``, then 2-bit codes packed MSB-first
(0 = zero, 1 = +s, 2 = -s): ``4 + ceil(N / 4)`` bytes, 16x smaller than fp32.

Not included (thinwire's choice, the defaults being the plain per-layer method): the paper's
gradient clipping to 2.5 sigma and its scaler sharing across workers (a max over ranks needs
a collective, which a codec may not issue). Rounding noise is per rank: the generator is
seeded with ``(seed + rank, step, key)``.

On the CPU both directions run in NumPy over cache-sized chunks, with the same fp32
operations and the same noise stream (drawn chunk by chunk) as the torch path, so the
payloads are the same bits: the codes of four values, one per byte of a little-endian 32-bit
word, fold into one packed byte with a single multiply (as in :mod:`thinwire.codecs.twobit`);
decoding maps every byte to its four values through a 256-row table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from thinwire.codecs.base import generator_for
from thinwire.codecs.config import CodecConfig, knob
from thinwire.codecs.qsgd import CHUNK, TableCodec, check_not_negative, table_decode
from thinwire.codecs.specs import register
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.payload import Aggregation, Payload, WireSpec

_FOLD = np.uint32((1 << 30) + (1 << 20) + (1 << 10) + 1)  # four byte-wide 2-bit codes -> one packed byte
_LEVELS = np.array([0.0, 1.0, -1.0, 0.0], np.float32)  # code -> sign
# byte -> the signs of its four values, first value first
_BYTE_LEVELS = np.array([[_LEVELS[(b >> s) & 3] for s in (6, 4, 2, 0)] for b in range(256)], np.float32)


@dataclass(frozen=True, kw_only=True)
class TernGradConfig(CodecConfig):
    seed: int = knob(0, "seed of the stochastic ternarization (combined with the rank)", "any integer")


@register
class TernGrad(TableCodec):
    """Per-tensor max scale and stochastic ternary codes, 2 bits per value."""

    name = "terngrad"
    summary = "TernGrad: max|x| + unbiased stochastic {-1, 0, +1}, 2 bits per value (all_gather)"
    Config = TernGradConfig
    aggregation = Aggregation.GATHER

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        return [((1,), torch.float32), ((packed_nbytes(math.prod(shape), 2),), torch.uint8)]

    def check_fields(self, payload: Payload) -> None:
        check_not_negative(self.name, "the scale max|x|", payload.tensors[0])  # code 3 decodes to 0

    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        flat = x.detach().reshape(-1).float()  # (N,) only read
        g = generator_for(self.config.seed + self.rank, self.step, key, device=x.device)
        if self.numpy_path(flat):
            return Payload(self._encode_numpy(flat.numpy(), g), x.shape, x.dtype)
        mag = flat.abs()  # (N,) a new tensor
        s = mag.max() if flat.numel() else mag.new_zeros(())
        keep = torch.rand(mag.shape, generator=g, device=x.device) < mag.div_(torch.where(s > 0, s, 1))  # (N,)
        code = keep.to(torch.uint8) << (flat < 0).to(torch.uint8)  # (N,) 0, 1 (+) or 2 (-)
        return Payload((s.reshape(1), pack(code, 2)), x.shape, x.dtype)

    def _encode_numpy(self, src: np.ndarray, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        n = src.size
        sc = self._scratch
        mag, noise, keep, neg = sc.get("mag", np.float32), sc.get("noise", np.float32), sc.get("keep", np.bool_), \
            sc.get("neg", np.bool_)
        code = sc.get("code", np.uint8, CHUNK + 3)  # room to pad the last chunk to whole words
        word = sc.get("word", np.uint32, CHUNK // 4 + 1)
        noise_t = torch.from_numpy(noise)
        s = np.float32(0)
        for lo in range(0, n, CHUNK):  # pass 1: s = max |x| (NaN if x holds one)
            c = src[lo : lo + CHUNK]
            s = np.maximum(s, np.abs(c, out=mag[: c.size]).max())
        div = s if s > 0 else np.float32(1)
        packed = np.empty(packed_nbytes(n, 2), np.uint8)
        with np.errstate(invalid="ignore"):
            for lo in range(0, n, CHUNK):  # pass 2: the codes; CHUNK is a multiple of 4
                c = src[lo : lo + CHUNK]
                m, w = c.size, (c.size + 3) // 4
                y = mag[:m]
                np.abs(c, out=y)
                np.divide(y, div, out=y)  # P(keep) = |x| / s
                noise_t[:m].uniform_(generator=g)  # the next m draws of the stream
                k, ng, cd = keep[:m], neg[:m], code[: 4 * w]
                np.less(noise[:m], y, out=k)
                np.less(c, 0, out=ng)
                np.left_shift(k.view(np.uint8), ng.view(np.uint8), out=cd[:m])  # 0, 1 (+) or 2 (-)
                cd[m:] = 0
                ws = word[:w]
                np.multiply(cd.view("<u4"), _FOLD, out=ws)  # each word's four codes -> its top byte
                np.right_shift(ws, 24, out=ws)
                packed[lo // 4 : lo // 4 + w] = ws
        return torch.from_numpy(np.array([s], np.float32)), torch.from_numpy(packed)

    def decode(self, payload: Payload) -> torch.Tensor:
        s, packed = payload.tensors
        n = math.prod(payload.shape)
        if self.numpy_path(packed):
            out = torch.empty(n, dtype=torch.float32)
            self._decode_numpy([payload], out.numpy())
            return out.to(payload.dtype).view(payload.shape)
        code = unpack(packed, n, 2)  # (N,)
        table = torch.tensor([0.0, 1.0, -1.0, 0.0], device=s.device)  # code -> sign
        out = table[code.long()] * s  # (N,)
        return out.to(payload.dtype).view(payload.shape)

    def _decode_numpy(self, payloads: list[Payload], out: np.ndarray, add: bool = False) -> None:
        """Each byte -> its four values, ``sign * s`` in fp32 (the torch path's product)."""
        parts = [(_BYTE_LEVELS * p.tensors[0].detach().numpy()[0], p.tensors[1].detach().numpy()) for p in payloads]
        table_decode(parts, out, self._scratch, add)


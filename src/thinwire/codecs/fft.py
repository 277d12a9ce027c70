"""FFT sparsification with range-based floats (Wang et al., HPDC 2020, arXiv 1811.08596).

Per tensor: ``X = rfft(u)`` over the flattened tensor, zero-padded to a fast (5-smooth)
length ``L`` (the padding is never sent); keep the ``K = ceil((1 - theta) B)`` of the
``B = L//2 + 1`` bins with the largest Parseval-weighted energy ``w_k |X_k|^2`` (``w = 1``
for DC and, when ``L`` is even, Nyquist; 2 otherwise), which minimises the L2 error of the
reconstruction; send their positions and their real and imaginary parts as range-based
floats. GATHER: every rank sums the decoded *spectra* and runs one ``irfft``.

Wire: the window exponent (int32; 0 when ``bits = 32``), positions as a ``B``-bit bitmap
or ``K`` int32 indices, whichever is smaller (a pure function of shape and config), then
``2K`` values: range-float codes (``bits`` 3..8 bit-packed, 16 as int16 words) or fp32
(``bits = 32``).

theta follows a schedule, a pure function of the step (identical on every rank, so every
rank sends the same payload size at the same step): ``constant``; ``linear`` and
``cosine`` from ``theta`` down to ``theta_min`` over ``horizon`` steps, then ``theta_min``;
``step`` divides theta by ``factor`` every ``every`` steps, down to ``theta_min``. The
paper's convergence guarantee needs a diminishing theta, so the default schedule is
``cosine``. Defaults (``theta`` 0.9 -> 0.5 over 1,000 steps, 8 bits = 1 + 3 + 4, error
feedback off) are thinwire's own choices: the paper does not publish its values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from thinwire.codecs.base import Codec
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.rangefloat import resolve_layout
from thinwire.codecs.registry import register
from thinwire.codecs.topk import TopK, TopKConfig
from thinwire.numerics import rangefloat
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.payload import Aggregation, Payload, WireSpec


@dataclass(frozen=True, kw_only=True)
class FFTConfig(CodecConfig):
    theta: float = knob(0.9, "drop ratio: share of frequency bins not sent; higher = more compression", "[0, 1)")
    bits: int = knob(8, "bits per kept real or imaginary part: range float, or 32 = plain fp32", "3..8, 16 or 32")
    exp_bits: int = knob(3, "range-float exponent bits (window of 2^exp_bits - 1 octaves)", "1..bits-2")
    man_bits: int | None = knob(
        None, "range-float mantissa bits; exp_bits + man_bits + 1 must equal bits (default: the rest)",
        "bits-1-exp_bits",
    )
    positions: Literal["auto", "bitmap", "index"] = knob(
        "auto", "how kept bins are named: bitmap (B bits), index (K int32), auto = the smaller", "auto|bitmap|index"
    )
    schedule: Literal["constant", "linear", "cosine", "step"] = knob(
        "cosine", "how theta falls over the run (a diminishing theta is what convergence needs)",
        "constant|linear|cosine|step",
    )
    theta_min: float = knob(
        0.5, "the floor theta falls to (capped at theta); lower = more accuracy, less compression", "[0, 1)"
    )
    horizon: int = knob(1000, "linear/cosine: steps over which theta falls to theta_min", ">= 1")
    every: int = knob(500, "step schedule: steps between divisions of theta", ">= 1")
    factor: float = knob(2.0, "step schedule: theta is divided by this every `every` steps", "> 1")
    seed: int = knob(0, "seed of the bin-selection sample (which never changes the kept set)", "any integer")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.theta < 1, f"theta must be in [0, 1), got {self.theta}")
        require(0 <= self.theta_min < 1, f"theta_min must be in [0, 1), got {self.theta_min}")
        require(self.horizon >= 1, f"horizon must be >= 1, got {self.horizon}")
        require(self.every >= 1, f"every must be >= 1, got {self.every}")
        require(self.factor > 1, f"factor must be > 1, got {self.factor}")
        require(3 <= self.bits <= 8 or self.bits in (16, 32), f"bits must be in 3..8, 16 or 32, got {self.bits}")
        if self.bits != 32:  # 32 = plain fp32 parts: no range-float layout
            resolve_layout(self)


def theta_at(cfg: FFTConfig, step: int) -> float:
    """The drop ratio at ``step``: a pure function of (step, config)."""
    hi, lo = cfg.theta, min(cfg.theta_min, cfg.theta)
    if cfg.schedule == "constant":
        return hi
    if cfg.schedule == "step":
        return max(lo, hi / cfg.factor ** (step // cfg.every))
    frac = min(step, cfg.horizon) / cfg.horizon
    if cfg.schedule == "linear":
        return hi + (lo - hi) * frac
    return lo + (hi - lo) * (1 + math.cos(math.pi * frac)) / 2


@functools.lru_cache(maxsize=1024)
def fast_length(n: int) -> int:
    """The smallest 5-smooth integer >= n (FFT time depends on the length's prime factors).
    Cached: every encode, decode and layout of a tensor asks for the same length."""
    if n <= 0:
        return 0
    m = n
    while not _smooth(m):  # ends before 2n: a power of two lies in [n, 2n)
        m += 1
    return m


def _smooth(m: int) -> bool:
    for p in (2, 3, 5):
        while m % p == 0:
            m //= p
    return m == 1


@register
class FFT(Codec):
    """Top-energy rfft bins of the tensor, quantized as range floats; spectra summed on decode."""

    name = "fft"
    summary = "keep the strongest rfft bins (1 - theta of them) as range floats + positions (all_gather)"
    Config = FFTConfig
    aggregation = Aggregation.GATHER

    # -- layout, a pure function of shape and config -----------------------------------------
    def _sizes(self, n: int) -> tuple[int, int, int]:
        """(L padded length, B bins, K kept bins) at the current step."""
        length = fast_length(n)
        bins = length // 2 + 1 if length else 0
        return length, bins, self._selector().k(bins) if bins else 0

    def _selector(self) -> TopK:
        """Top-k selection of this step's (1 - theta) share of bins: the top-k codec's exact or
        sampled-threshold path (the sampled path keeps exactly the top-k set, much faster).
        One selector, re-configured when theta moves, so its scan buffers are kept."""
        keep = 1 - theta_at(self.config, self.step)
        if self._sel.config.ratio != keep:
            self._sel.config = TopKConfig(ratio=keep, ef=False, seed=self.config.seed)
        self._sel.step = self.step
        return self._sel

    def _bitmap(self, bins: int, kept: int) -> bool:
        if self.config.positions != "auto":
            return self.config.positions == "bitmap"
        return packed_nbytes(bins, 1) < 4 * kept

    def _value_spec(self, count: int) -> WireSpec:
        bits = self.config.bits
        if bits == 32:
            return ((count,), torch.float32)
        if bits == 16:
            return ((count,), torch.int16)
        return ((packed_nbytes(count, bits),), torch.uint8)

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        _, bins, kept = self._sizes(math.prod(shape))
        pos = ((packed_nbytes(bins, 1),), torch.uint8) if self._bitmap(bins, kept) else ((kept,), torch.int32)
        return [((1,), torch.int32), pos, self._value_spec(2 * kept)]

    def __init__(self, config: FFTConfig) -> None:
        super().__init__(config)
        self._sel = TopK(TopKConfig(ratio=1 - config.theta, ef=False, seed=config.seed))

    def stats(self) -> dict[str, float]:
        return {"theta": theta_at(self.config, self.step)}

    # -- work ----------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        flat = x.reshape(-1).float()  # (N,) only read
        length, bins, kept = self._sizes(flat.numel())
        dev = x.device
        if bins == 0:
            parts = [torch.zeros(s, dtype=d, device=dev) for s, d in self.wire_spec(x.shape, x.dtype)]
            return Payload(tuple(parts), x.shape, x.dtype)
        spec = torch.fft.rfft(flat, n=length)  # (B,) complex
        energy = spec.real.square() + spec.imag.square()  # (B,)
        energy[1 : bins - (1 if length % 2 == 0 else 0)] *= 2  # Parseval weights
        idx = self._selector().encode(energy, key=key).tensors[1].long().sort().values  # (K,) ascending
        parts = torch.view_as_real(spec[idx]).reshape(-1)  # (2K,) re, im, re, im, ...
        e_max, values = self._quantize(parts)
        if self._bitmap(bins, kept):
            mask = torch.zeros(bins, dtype=torch.bool, device=dev)
            mask[idx] = True
            pos = pack(mask, 1)
        else:
            pos = idx.to(torch.int32)
        header = torch.tensor([e_max], dtype=torch.int32, device=dev)
        return Payload((header, pos, values), x.shape, x.dtype)

    def _quantize(self, parts: torch.Tensor) -> tuple[int, torch.Tensor]:
        cfg = self.config
        if cfg.bits == 32:
            return 0, parts
        e_max = rangefloat.exponent_max(parts)
        codes = rangefloat.encode(parts, cfg.exp_bits, cfg.man_bits, e_max)  # (2K,)
        return e_max, (codes - (1 << 15)).to(torch.int16) if cfg.bits == 16 else pack(codes, cfg.bits)

    def _dequantize(self, e_max: int, values: torch.Tensor, count: int) -> torch.Tensor:
        cfg = self.config
        if cfg.bits == 32:
            return values.float()
        codes = values.to(torch.int32) + (1 << 15) if cfg.bits == 16 else unpack(values, count, cfg.bits)
        return rangefloat.decode(codes, cfg.exp_bits, cfg.man_bits, e_max)

    def spectrum_add(self, payload: Payload, spec: torch.Tensor) -> None:
        """``spec += the payload's sparse spectrum`` (complex, ``B`` bins). Pure in the payload."""
        header, pos, values = payload.tensors
        _, bins, kept = self._sizes(math.prod(payload.shape))
        if kept == 0:
            return
        idx = unpack(pos, bins, 1).nonzero().squeeze(1) if self._bitmap(bins, kept) else pos.long()  # (K,)
        parts = self._dequantize(int(header[0].item()), values, 2 * kept).view(kept, 2)  # (K, 2)
        spec.index_add_(0, idx, torch.view_as_complex(parts.contiguous()))

    def _inverse(self, spec: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        n = math.prod(shape)
        if n == 0:
            return torch.zeros(shape, device=spec.device)
        length, _, _ = self._sizes(n)
        return torch.fft.irfft(spec, n=length)[:n].view(shape)  # (N,) cropped: padding never sent

    def _zero_spectrum(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        _, bins, _ = self._sizes(math.prod(shape))
        return torch.zeros(bins, dtype=torch.complex64, device=device)

    def decode(self, payload: Payload) -> torch.Tensor:
        spec = self._zero_spectrum(payload.shape, payload.tensors[0].device)
        self.spectrum_add(payload, spec)
        return self._inverse(spec, payload.shape).to(payload.dtype)

    def decode_sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        """Sum the spectra of every rank's payload, then one inverse FFT (linearity)."""
        spec = self._zero_spectrum(payloads[0].shape, out.device)
        for p in payloads:
            self.spectrum_add(p, spec)
        out.copy_(self._inverse(spec, payloads[0].shape))

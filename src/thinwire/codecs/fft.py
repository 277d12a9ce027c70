"""FFT sparsification with range-based floats (Wang et al., HPDC 2020, arXiv 1811.08596).

Per tensor: ``X = rfft(u)`` over the flattened tensor, zero-padded to a fast (5-smooth)
length ``L`` (the padding is never sent); keep the ``K = ceil((1 - theta) B)`` of the
``B = L//2 + 1`` bins with the largest Parseval-weighted energy ``w_k |X_k|^2`` (``w = 1``
for DC and, when ``L`` is even, Nyquist; 2 otherwise), which minimises the L2 error of the
reconstruction; send their positions and their real and imaginary parts as range-based
floats. GATHER: every rank sums the decoded *spectra* and runs one ``irfft``. With ``bucket_mb > 0``
the tensors fft compresses are concatenated into flat buckets of up to that size, each sent
as one signal (one FFT, one selection across the bucket's tensors); the default, one FFT
per tensor, is thinwire's choice (the paper does not say how it groups gradients).

Wire: the window exponent (int32; 0 when ``bits = 32``), positions as a ``B``-bit bitmap
or ``K`` int32 indices, whichever is smaller (a pure function of shape and config), then
``2K`` values: range-float codes (``bits`` 3..8 bit-packed, 16 as int16 words) or fp32
(``bits = 32``).

theta follows a schedule, identical on every rank (so every rank sends the same payload
size at the same step): ``constant``; ``linear`` and ``cosine`` from ``theta`` down to
``theta_min`` over ``horizon`` steps, then ``theta_min``; ``step`` divides theta by
``factor`` every ``every`` steps, down to ``theta_min``; ``recover`` reacts to the training
loss agreed across ranks: at the end of every window of ``every`` steps, unless the
window's mean loss beats the best earlier window's by ``tolerance`` (relative), theta is
divided by ``factor`` (down to ``theta_min``) from the next step on; it never rises. The
first four are pure functions of (step, config); ``recover`` of (step, config, agreed
window losses), and its state travels in the checkpoint. The paper's convergence guarantee
needs a diminishing theta, so the default schedule is ``cosine``. Defaults (``theta`` 0.9
-> 0.5 over 1,000 steps, 8 bits = 1 + 3 + 4, error feedback off, and ``recover``'s rule
and tolerance) are thinwire's own choices: the paper does not publish its values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch

from thinwire.codecs.base import E_MAX_HIGH, E_MAX_LOW, Codec, distinct, generator_for, in_range
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.rangefloat import resolve_layout
from thinwire.codecs.registry import register
from thinwire.numerics import rangefloat
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.numerics.select import indices, top_mask
from thinwire.payload import Aggregation, Payload, PayloadError, WireSpec


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
    schedule: Literal["constant", "linear", "cosine", "step", "recover"] = knob(
        "cosine", "how theta falls over the run (a diminishing theta is what convergence needs); "
        "recover: when the loss stalls", "constant|linear|cosine|step|recover",
    )
    theta_min: float = knob(
        0.5, "the floor theta falls to (capped at theta); lower = more accuracy, less compression", "[0, 1)"
    )
    horizon: int = knob(1000, "linear/cosine: steps over which theta falls to theta_min", ">= 1")
    every: int = knob(500, "step: steps between divisions of theta; recover: steps per loss window", ">= 1")
    factor: float = knob(2.0, "step, recover: theta is divided by this at each fall", "> 1")
    tolerance: float = knob(
        0.01, "recover: a window's mean loss must beat the best earlier one by this share, or theta falls", "[0, 1)"
    )
    seed: int = knob(0, "seed of the bin-selection sample (which never changes the kept set)", "any integer")
    bucket_mb: float = knob(
        0.0, "fuse the tensors fft compresses into flat buckets of up to this many MB (fp32), one FFT "
        "each; 0 = one FFT per tensor", ">= 0; > 0 needs ef=false",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.theta < 1, f"theta must be in [0, 1), got {self.theta}")
        require(0 <= self.theta_min < 1, f"theta_min must be in [0, 1), got {self.theta_min}")
        require(self.horizon >= 1, f"horizon must be >= 1, got {self.horizon}")
        require(self.every >= 1, f"every must be >= 1, got {self.every}")
        require(self.factor > 1, f"factor must be > 1, got {self.factor}")
        require(0 <= self.tolerance < 1, f"tolerance must be in [0, 1), got {self.tolerance}")
        require(self.bucket_mb >= 0, f"bucket_mb must be >= 0, got {self.bucket_mb}")
        require(not (self.bucket_mb > 0 and self.ef), "bucket_mb > 0 needs ef=false (residuals are kept per tensor)")
        require(3 <= self.bits <= 8 or self.bits in (16, 32), f"bits must be in 3..8, 16 or 32, got {self.bits}")
        if self.bits != 32:  # 32 = plain fp32 parts: no range-float layout
            resolve_layout(self)


def theta_at(cfg: FFTConfig, step: int) -> float:
    """The drop ratio at ``step``: a pure function of (step, config). For ``recover``, which
    also follows the loss, the starting theta (see :meth:`FFT.theta`)."""
    hi, lo = cfg.theta, min(cfg.theta_min, cfg.theta)
    if cfg.schedule in ("constant", "recover"):
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
        keep = 1 - self.theta()
        return length, bins, min(bins, max(1, math.ceil(keep * bins * (1 - 1e-12)))) if bins else 0

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

    def check_fields(self, payload: Payload) -> None:
        """E_max within fp32's exponents; positions: a bitmap marking exactly ``K`` bins, or
        ``K`` bin indices within the spectrum, each sent once."""
        header, pos, _ = payload.tensors
        in_range(self.name, "the exponent E_max", header, E_MAX_LOW, E_MAX_HIGH)
        _, bins, kept = self._sizes(math.prod(payload.shape))
        if self._bitmap(bins, kept):
            chosen = int(unpack(pos, bins, 1).sum().item())
            if chosen != kept:
                raise PayloadError(f"{self.name}: the bitmap marks {chosen} frequency bins, the layout carries {kept}")
        else:
            in_range(self.name, "bin indices", pos, 0, bins - 1)
            distinct(self.name, "bin indices", pos)

    def __init__(self, config: FFTConfig) -> None:
        super().__init__(config)
        self._work: dict[str, torch.Tensor] = {}  # scratch reused across tensors and steps
        self._theta = config.theta  # recover: the current theta ...
        self._best_loss: float | None = None  # ... and the best window mean loss so far
        self._theta_used: float | None = None  # by the last encode, for stats()

    @property
    def fusable(self) -> bool:  # type: ignore[override]
        return self.config.bucket_mb > 0

    def bucket_cap(self, cap: int) -> int:
        return min(cap, int(self.config.bucket_mb * 2**20)) if self.fusable else cap

    def theta(self) -> float:
        """The drop ratio of the current step."""
        return self._theta if self.config.schedule == "recover" else theta_at(self.config, self.step)

    def loss_window(self) -> int:
        return self.config.every if self.config.schedule == "recover" else 0

    def observe_loss(self, mean_loss: float) -> None:
        """recover: unless ``mean_loss`` beats the best earlier window by ``tolerance``
        (relative to its size), theta falls by ``factor``, not below ``theta_min``. A
        non-finite loss counts as a rise."""
        cfg, best = self.config, self._best_loss
        if not math.isfinite(mean_loss):
            stalled = True
        else:
            stalled = best is not None and not mean_loss < best - cfg.tolerance * abs(best)
            self._best_loss = mean_loss if best is None else min(best, mean_loss)
        if stalled:
            self._theta = max(min(cfg.theta_min, cfg.theta), self._theta / cfg.factor)

    def state_dict(self) -> dict:
        if self.config.schedule != "recover":
            return {}
        return {"theta": self._theta, "best_loss": self._best_loss}

    def load_state_dict(self, state: dict) -> None:
        if self.config.schedule != "recover":
            return super().load_state_dict(state)
        self._theta, self._best_loss = float(state["theta"]), state["best_loss"]

    def _buffer(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """(numel,) scratch for ``role``, grown when too small; valid until the next call for
        the same role. Fresh large allocations cost several times a copy on the CPU."""
        buf = self._work.get(role)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._work[role] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def stats(self) -> dict[str, float]:
        """The theta the last encode used (``recover`` may have lowered it for the next step)."""
        return {"theta": self._theta_used if self._theta_used is not None else self.theta()}

    # -- work ----------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        flat = x.reshape(-1).float()  # (N,) only read
        length, bins, kept = self._sizes(flat.numel())
        self._theta_used = self.theta()
        dev = x.device
        if bins == 0:
            parts = [torch.zeros(s, dtype=d, device=dev) for s, d in self.wire_spec(x.shape, x.dtype)]
            return Payload(tuple(parts), x.shape, x.dtype)
        spec = torch.fft.rfft(flat, n=length, out=self._buffer("spec", bins, torch.complex64, dev))  # (B,)
        pairs = torch.view_as_real(spec)  # (B, 2) re, im
        energy = torch.mul(pairs[:, 0], pairs[:, 0], out=self._buffer("energy", bins, torch.float32, dev))
        energy.addcmul_(pairs[:, 1], pairs[:, 1])  # (B,) |X_k|^2
        # Parseval: every bin counts twice in ||u||^2 except DC and (L even) Nyquist, which
        # count once; halving those two ranks bins exactly as the weighted energy does.
        energy[0] *= 0.5
        if length % 2 == 0:
            energy[bins - 1] *= 0.5
        mask = top_mask(energy, kept, generator_for(self.config.seed, self.step, key, dev))  # (B,) K True
        idx = indices(mask)  # (K,) ascending
        e_max, values = self._quantize(torch.view_as_real(spec[idx]).reshape(-1))  # (2K,) re, im, re, im, ...
        pos = pack(mask, 1) if self._bitmap(bins, kept) else idx.to(torch.int32)
        header = torch.tensor([e_max], dtype=torch.int32, device=dev)
        return Payload((header, pos, values), x.shape, x.dtype)

    def _quantize(self, parts: torch.Tensor) -> tuple[int, torch.Tensor]:
        cfg = self.config
        if cfg.bits == 32:
            return 0, parts
        e_max = rangefloat.exponent_max(parts)
        if cfg.bits == 8:  # one code per byte: the packed layout is the codes themselves
            out = torch.empty(parts.numel(), dtype=torch.uint8, device=parts.device)
            return e_max, rangefloat.encode(parts, cfg.exp_bits, cfg.man_bits, e_max, out=out)
        codes = rangefloat.encode(parts, cfg.exp_bits, cfg.man_bits, e_max)  # (2K,) int32
        return e_max, (codes - (1 << 15)).to(torch.int16) if cfg.bits == 16 else pack(codes, cfg.bits)

    def _dequantize(self, e_max: int, values: torch.Tensor, count: int) -> torch.Tensor:
        """(count,) fp32 parts in scratch (valid until the next call)."""
        cfg = self.config
        if cfg.bits == 32:
            return values.float()
        if cfg.bits == 16:
            codes = values.to(torch.int32) + (1 << 15)
        else:
            codes = values[:count] if cfg.bits == 8 else unpack(values, count, cfg.bits)
        out = self._buffer("parts", count, torch.float32, values.device)
        return rangefloat.decode(codes, cfg.exp_bits, cfg.man_bits, e_max, out=out)

    def spectrum_add(self, payload: Payload, spec: torch.Tensor) -> None:
        """``spec += the payload's sparse spectrum`` (complex, ``B`` bins). Pure in the payload."""
        header, pos, values = payload.tensors
        _, bins, kept = self._sizes(math.prod(payload.shape))
        if kept == 0:
            return
        idx = indices(unpack(pos, bins, 1).view(torch.bool)) if self._bitmap(bins, kept) else pos.long()  # (K,)
        parts = self._dequantize(int(header[0].item()), values, 2 * kept).view(kept, 2)  # (K, 2)
        spec.index_add_(0, idx, torch.view_as_complex(parts))

    def _spectrum(self, payloads: list[Payload], device: torch.device) -> torch.Tensor:
        """The sum of the payloads' sparse spectra, in scratch."""
        _, bins, _ = self._sizes(math.prod(payloads[0].shape))
        spec = self._buffer("sum", bins, torch.complex64, device).zero_()
        for p in payloads:
            self.spectrum_add(p, spec)
        return spec

    def decode(self, payload: Payload) -> torch.Tensor:
        n = math.prod(payload.shape)
        if n == 0:
            return torch.zeros(payload.shape, dtype=payload.dtype, device=payload.tensors[0].device)
        spec = self._spectrum([payload], payload.tensors[0].device)
        out = torch.fft.irfft(spec, n=fast_length(n))[:n]  # (N,) cropped: padding never sent
        return out.view(payload.shape).to(payload.dtype)

    def decode_sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        """Sum the spectra of every rank's payload, then one inverse FFT (linearity)."""
        n, length = out.numel(), fast_length(out.numel())
        if n == 0:
            return
        spec = self._spectrum(payloads, out.device)
        if length == n and out.is_contiguous() and out.dtype == torch.float32:
            torch.fft.irfft(spec, n=length, out=out.view(-1))
        else:
            out.copy_(torch.fft.irfft(spec, n=length, out=self._buffer("time", length, torch.float32, out.device))[:n].view(out.shape))

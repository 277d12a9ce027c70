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

Cost (CPU): everything around the two transforms runs in NumPy (and torch's ``index_add_``,
a serial loop), the same bytes as the torch path other devices take. Torch ops on 2
threads stall on OpenMP regions when ranks share cores (a scheduler tick per op) and cost
several times NumPy's per call on a model's many small tensors; the FFTs' ``out=``
variants transform into a new tensor and copy it over, so the FFTs return new tensors.
Large spectra go through in cache-sized chunks: the selection computes energies as it scans (no energy array), the
kept bins are gathered chunk by chunk from the mask, the decoder turns each chunk's bitmap
bytes into positions and adds every payload's values into the chunk while it is in cache
(8-bit codes through a table of all 65,536 code pairs), and each pass splits across as many
threads as torch uses (NumPy lets go of the GIL inside its loops). Layouts are cached per
(size, theta), since decoding checks one per payload. ``benchmarks/bench_fft.py`` measures
the codec against its two transforms alone (25M floats, and ResNet-18's 62 gradients).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from thinwire.codecs.base import E_MAX_HIGH, E_MAX_LOW, Codec, distinct, generator_for, in_range
from thinwire.codecs.config import CodecConfig, knob, require
from thinwire.codecs.rangefloat import resolve_layout
from thinwire.codecs.specs import register
from thinwire.numerics import parallel, range_format
from thinwire.numerics.bitpack import pack, packed_nbytes, unpack
from thinwire.numerics.select import SAMPLED_MIN, indices, sampled_scan, top_mask, top_mask_numpy
from thinwire.payload import Aggregation, Payload, PayloadError, WireSpec


@dataclass(frozen=True, kw_only=True)
class FFTConfig(CodecConfig):
    theta: float = knob(0.9, "drop ratio: share of frequency bins not sent; higher = more compression", "[0, 1)")
    bits: int = knob(8, "bits per kept real or imaginary part: range float, or 32 = plain fp32", "3..8, 16 or 32")
    exp_bits: int = knob(3, "range-float exponent bits (window of 2^exp_bits - 1 octaves)", "1..bits-1")
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


_CHUNK = 1 << 16  # CPU passes over the spectrum: bins per chunk (a multiple of 8: whole bitmap bytes)
_PAIR_TABLE_MIN = 1 << 15  # kept bins from which 8-bit values decode through the table of code pairs
_SPLIT_MIN = 1 << 18  # bins (or values) from which a CPU pass is split across torch's thread count
_HAS_BITCOUNT = hasattr(np, "bitwise_count")  # NumPy >= 2.0
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)  # bits set per byte


@dataclass(frozen=True)
class _Plan:
    """The layout of one tensor size at one theta (a pure function of both)."""

    length: int  # L, the 5-smooth padded length
    bins: int  # B = L // 2 + 1
    kept: int  # K
    bitmap: bool  # positions as a B-bit bitmap (else K int32 indices)
    spec: tuple[WireSpec, ...]


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
    def _plan(self, n: int) -> _Plan:
        """The layout for ``n`` elements at the current theta; cached (decoding checks it
        for every payload, so it must cost next to nothing)."""
        theta = self.theta()
        plan = self._plans.get((n, theta))
        if plan is None:
            if len(self._plans) >= 4096:  # a schedule visits many thetas: keep the cache bounded
                self._plans.clear()
            length = fast_length(n)
            bins = length // 2 + 1 if length else 0
            kept = min(bins, max(1, math.ceil((1 - theta) * bins * (1 - 1e-12)))) if bins else 0
            bitmap = self._bitmap(bins, kept)
            pos = ((packed_nbytes(bins, 1),), torch.uint8) if bitmap else ((kept,), torch.int32)
            spec = (((1,), torch.int32), pos, self.wire.spec(2 * kept))
            plan = self._plans[(n, theta)] = _Plan(length, bins, kept, bitmap, spec)
        return plan

    def _bitmap(self, bins: int, kept: int) -> bool:
        if self.config.positions != "auto":
            return self.config.positions == "bitmap"
        return packed_nbytes(bins, 1) < 4 * kept

    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        return list(self._plan(math.prod(shape)).spec)

    def check_fields(self, payload: Payload) -> None:
        """E_max within fp32's exponents; positions: a bitmap marking exactly ``K`` bins, or
        ``K`` bin indices within the spectrum, each sent once."""
        header, pos, _ = payload.tensors
        if header.device.type != "cpu" or not E_MAX_LOW <= header.item() <= E_MAX_HIGH:
            in_range(self.name, "the exponent E_max", header, E_MAX_LOW, E_MAX_HIGH)
        plan = self._plan(math.prod(payload.shape))
        if plan.bitmap:
            chosen = _bitmap_count(pos, plan.bins)
            if chosen != plan.kept:
                raise PayloadError(f"{self.name}: the bitmap marks {chosen} frequency bins, "
                                   f"the layout carries {plan.kept}")
        else:
            in_range(self.name, "bin indices", pos, 0, plan.bins - 1)
            distinct(self.name, "bin indices", pos)

    def __init__(self, config: FFTConfig) -> None:
        super().__init__(config)
        self._work: dict[str, torch.Tensor] = {}  # scratch reused across tensors and steps
        self._np_work: dict[str, np.ndarray] = {}  # the same, for the CPU path
        self._plans: dict[tuple[int, float], _Plan] = {}  # (numel, theta) -> layout
        self._theta = config.theta  # recover: the current theta ...
        self._best_loss: float | None = None  # ... and the best window mean loss so far
        self._theta_used: float | None = None  # by the last encode, for stats()
        self._theta_at: tuple[int | None, float] = (None, config.theta)  # (step, theta_at(step))
        self.wire = range_format.Wire(config.bits, config.exp_bits, config.man_bits or 0)  # the kept parts' format

    @property
    def fusable(self) -> bool:  # type: ignore[override]
        return self.config.bucket_mb > 0

    def bucket_cap(self, cap: int) -> int:
        return min(cap, int(self.config.bucket_mb * 2**20)) if self.fusable else cap

    def theta(self) -> float:
        """The drop ratio of the current step."""
        if self.config.schedule == "recover":
            return self._theta
        if self._theta_at[0] != self.step:  # every encode and check asks: once per step
            self._theta_at = (self.step, theta_at(self.config, self.step))
        return self._theta_at[1]

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

    def _scratch(self, role: str, numel: int, dtype: type) -> np.ndarray:
        """:meth:`_buffer` for the CPU path, as a NumPy array (slicing one costs a tenth of
        slicing a tensor, which counts on the many small tensors of a model)."""
        buf = self._np_work.get(role)
        if buf is None or buf.size < numel or buf.dtype != dtype:
            buf = self._np_work[role] = np.empty(numel, dtype)
        return buf[:numel]

    def stats(self) -> dict[str, float]:
        """The theta the last encode used (``recover`` may have lowered it for the next step)."""
        return {"theta": self._theta_used if self._theta_used is not None else self.theta()}

    # -- work ----------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        flat = x.detach().reshape(-1)  # (N,) only read
        if flat.dtype != torch.float32:
            flat = flat.float()
        plan = self._plan(flat.numel())
        self._theta_used = self.theta()
        dev = x.device
        if plan.bins == 0:
            parts = [torch.zeros(s, dtype=d, device=dev) for s, d in plan.spec]
            return Payload(tuple(parts), x.shape, x.dtype)
        # (B,) a new tensor: torch's out= variants of the FFTs transform into a new tensor
        # and copy it over (one more pass, and on the CPU one more OpenMP region)
        spec = torch.fft.rfft(flat, n=plan.length)
        if dev.type == "cpu":
            return Payload(self._encode_cpu(spec.numpy(), plan, key), x.shape, x.dtype)
        pos, kept = self._select(spec, plan, key)
        e_max, values = self.wire.encode(torch.view_as_real(kept).reshape(-1))  # (2K,) re, im, re, im, ...
        header = torch.tensor([e_max], dtype=torch.int32, device=dev)
        return Payload((header, pos, values), x.shape, x.dtype)

    def _select(self, spec: torch.Tensor, plan: _Plan, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions on the wire, the K kept bins in ascending order) by torch ops."""
        dev, bins = spec.device, plan.bins
        pairs = torch.view_as_real(spec)  # (B, 2) re, im
        energy = torch.mul(pairs[:, 0], pairs[:, 0], out=self._buffer("energy", bins, torch.float32, dev))
        energy.addcmul_(pairs[:, 1], pairs[:, 1])  # (B,) |X_k|^2
        # Parseval: every bin counts twice in ||u||^2 except DC and (L even) Nyquist, which
        # count once; halving those two ranks bins exactly as the weighted energy does.
        energy[0] *= 0.5
        if plan.length % 2 == 0:
            energy[bins - 1] *= 0.5
        mask = top_mask(energy, plan.kept, generator_for(self.config.seed, self.step, key, dev))  # (B,) K True
        idx = indices(mask)  # (K,) ascending
        return (pack(mask, 1) if plan.bitmap else idx.to(torch.int32)), spec[idx]

    def _encode_cpu(self, spec: np.ndarray, plan: _Plan, key: str) -> tuple[torch.Tensor, ...]:
        """The wire tensors, as :meth:`_select` and the wire format's encode make them (the same
        bytes), by NumPy passes over cache-sized chunks through reused scratch (see the module
        notes). Large spectra never store their energies: the sampled selection scans them
        chunk by chunk as they are made."""
        cfg, bins, kept = self.config, plan.bins, plan.kept
        mask = self._scratch("mask", bins, np.bool_)
        if bins <= min(_CHUNK, SAMPLED_MIN):  # small: the same steps in few calls (per-call costs rule)
            return self._encode_small(spec, plan, mask)
        found = None
        if bins >= SAMPLED_MIN and 0 < kept < bins:
            gen = generator_for(cfg.seed, self.step, key)
            energy = _Energy(spec, plan.length)
            found = sampled_scan(bins, kept, gen, energy.at, energy.scorer, mask, _CHUNK, _split)
        if found is None:  # small, or the sample misjudged: the exact path over stored energies
            scores = self._scratch("energy", bins, np.float32)
            of = _Energy(spec, plan.length).scorer()
            for a in range(0, bins, _CHUNK):
                scores[a : a + _CHUNK] = of(a, min(bins, a + _CHUNK))
            top_mask_numpy(scores, kept, out=mask, sampled=False)
        # the kept bins in ascending order: the payload's own array when sent as fp32 parts
        vals = np.empty(kept, np.complex64) if cfg.bits == 32 else self._scratch("vals", kept, np.complex64)
        if plan.bitmap:
            pos = np.packbits(mask)

            def gather(a0: int, a1: int) -> list[tuple[float, float]]:  # no (K,) index array: chunk by chunk
                done, extremes = int(np.count_nonzero(mask[:a0])) if a0 else 0, []
                for a in range(a0, a1, _CHUNK):
                    at = mask[a : min(a1, a + _CHUNK)].nonzero()[0]
                    if at.size:
                        v = vals[done : done + at.size]
                        np.take(spec[a : a + _CHUNK], at, out=v, mode="clip")
                        extremes.append(_extremes(v.view(np.float32)))
                        done += at.size
                return extremes

            extremes = [e for part in _split(gather, bins) for e in part]
        else:
            idx = mask.nonzero()[0]
            pos = idx.astype(np.int32)
            np.take(spec, idx, out=vals, mode="clip")
            extremes = [_extremes(vals.view(np.float32))]
        low, high = min(e[0] for e in extremes), max(e[1] for e in extremes)
        if any(math.isnan(e[0]) or math.isnan(e[1]) for e in extremes):
            low = high = math.nan
        e_max, values = self._quantize_np(vals.view(np.float32), low, high)
        return torch.from_numpy(np.array([e_max], np.int32)), torch.from_numpy(pos), values

    def _encode_small(self, spec: np.ndarray, plan: _Plan, mask: np.ndarray) -> tuple[torch.Tensor, ...]:
        """:meth:`_encode_cpu` for a spectrum of one chunk: exact selection, no split."""
        with np.errstate(over="ignore", invalid="ignore"):  # huge or non-finite bins: inf or NaN, as torch gives
            sq = np.square(spec.view(np.float32))
            energy = np.add(sq[0::2], sq[1::2])  # as _Energy makes them
        energy[0] *= 0.5
        if plan.length % 2 == 0:
            energy[-1] *= 0.5
        top_mask_numpy(energy, plan.kept, out=mask, sampled=False)
        vals = spec[mask]  # (K,) ascending, a new array
        pos = np.packbits(mask) if plan.bitmap else mask.nonzero()[0].astype(np.int32)
        parts = vals.view(np.float32)
        e_max, values = self._quantize_np(parts, *_extremes(parts))
        return torch.from_numpy(np.array([e_max], np.int32)), torch.from_numpy(pos), values

    def _quantize_np(self, parts: np.ndarray, low: float, high: float) -> tuple[int, torch.Tensor]:
        """:meth:`Wire.encode_numpy <thinwire.numerics.range_format.Wire.encode_numpy>` of the
        kept parts, split across threads."""
        bits = self.config.bits
        scratch = None if bits in (8, 32) else self._scratch("codes", parts.size, np.int32 if bits == 16 else np.uint8)
        return self.wire.encode_numpy(parts, low, high, _split, scratch)

    def _dequantize(self, e_max: int, values: torch.Tensor, count: int) -> torch.Tensor:
        """(count,) fp32 parts in scratch (valid until the next call)."""
        out = None if self.config.bits == 32 else self._buffer("parts", count, torch.float32, values.device)
        return self.wire.decode(e_max, values, count, out)

    def spectrum_add(self, payload: Payload, spec: torch.Tensor) -> None:
        """``spec += the payload's sparse spectrum`` (complex, ``B`` bins). Pure in the payload."""
        header, pos, values = payload.tensors
        plan = self._plan(math.prod(payload.shape))
        kept = plan.kept
        if kept == 0:
            return
        idx = indices(unpack(pos, plan.bins, 1).view(torch.bool)) if plan.bitmap else pos.long()  # (K,)
        parts = self._dequantize(int(header[0].item()), values, 2 * kept).view(kept, 2)  # (K, 2)
        spec.index_add_(0, idx, torch.view_as_complex(parts))

    def _spectrum(self, payloads: list[Payload], device: torch.device) -> torch.Tensor:
        """The sum of the payloads' sparse spectra, in scratch."""
        plan = self._plan(math.prod(payloads[0].shape))
        if device.type == "cpu" and all(p.tensors[2].device.type == "cpu" for p in payloads):
            total = self._scratch("sum", plan.bins, np.complex64)
            with np.errstate(over="ignore", invalid="ignore"):  # sums past fp32's range: inf, as torch gives
                self._spectrum_cpu(payloads, plan, total)
            return torch.from_numpy(total)
        spec = self._buffer("sum", plan.bins, torch.complex64, device)
        spec.zero_()
        for p in payloads:
            self.spectrum_add(p, spec)
        return spec

    def _spectrum_cpu(self, payloads: list[Payload], plan: _Plan, out: np.ndarray) -> None:
        """``out`` = the sum of the payloads' spectra, by NumPy. With bitmaps, one pass over the
        bins, chunk by chunk (zero the chunk, then per payload: its bitmap bytes to bin
        positions, its next values decoded, added in), so that all of it stays in cache, split
        across threads for large spectra; bit-packed widths other than 8 decode a whole
        payload first, one payload at a time."""
        bits, kept = self.config.bits, plan.kept
        fused = bits in (8, 16, 32)  # values decode chunk by chunk
        for g, group in enumerate([payloads] if fused else [[p] for p in payloads]):
            # (positions, values: codes or decoded parts, E_max) per payload
            sources: list[tuple[np.ndarray, np.ndarray, int]] = []
            for p in group:
                header, positions, wire = p.tensors
                e_max = int(header.item())  # an int32 tensor: already an int
                vals = wire.numpy() if fused else self._dequantize(e_max, wire, 2 * kept).numpy()
                sources.append((positions.numpy(), vals, e_max))
            if not plan.bitmap:
                if g == 0:
                    out.fill(0)
                work = self._scratch("chunk", 2 * kept, np.float32)
                for pos, vals, e_max in sources:  # indices distinct (checked), in any order
                    _add_at(out, pos, self._parts(vals, e_max, 0, kept, fused, work))
                continue

            if plan.bins <= _CHUNK:  # one chunk: the steps of add() below, in few calls
                work = self._scratch("chunk", 2 * kept, np.float32)
                for j, (pos, vals, e_max) in enumerate(sources):
                    at = np.unpackbits(pos, count=plan.bins).view(np.bool_).nonzero()[0]
                    v = self._parts(vals, e_max, 0, at.size, fused, work)
                    if g == 0 and j == 0:
                        out.fill(0)
                        out[at] = v
                    else:
                        _add_at(out, at, v)
                continue

            def add(a0: int, a1: int, sources: list[tuple[np.ndarray, np.ndarray, int]] = sources,
                    first: bool = g == 0) -> None:
                work = np.empty(2 * min(a1 - a0, _CHUNK), np.float32)  # decoded values, this part's own
                done = [_bitmap_count(pos, a0) if a0 else 0 for pos, _, _ in sources]  # values before a0
                for a in range(a0, a1, _CHUNK):
                    chunk = out[a : min(a1, a + _CHUNK)]
                    if first:
                        chunk.fill(0)
                    for j, (pos, vals, e_max) in enumerate(sources):
                        bits_set = np.unpackbits(pos[a // 8 : (a + chunk.size + 7) // 8], count=chunk.size)
                        at = bits_set.view(np.bool_).nonzero()[0]  # (bool: NumPy's fast nonzero)
                        if at.size:
                            v = self._parts(vals, e_max, done[j], at.size, fused, work)
                            if first and j == 0:
                                chunk[at] = v
                            else:
                                _add_at(chunk, at, v)
                            done[j] += at.size

            _split(add, plan.bins)

    def _parts(self, vals: np.ndarray, e_max: int, first: int, count: int, codes: bool, work: np.ndarray) -> np.ndarray:
        """(count,) complex64: the kept bins ``first .. first + count`` of a payload, from its
        wire values (``codes``; decoded into ``work``, fp32 scratch) or from parts decoded
        already. Many 8-bit codes decode through a table of all 65,536 code pairs (one lookup
        per bin), built once per E_max and kept."""
        cfg = self.config
        part = vals[2 * first : 2 * (first + count)]
        if not codes or cfg.bits == 32:
            return part.view(np.complex64)
        out = work[: 2 * count]
        if cfg.bits == 8 and vals.size >= 2 * _PAIR_TABLE_MIN:
            return range_format.decode_pairs_numpy(part, cfg.exp_bits, cfg.man_bits, e_max, out.view(np.complex64))
        if cfg.bits == 16:
            part = part.astype(np.int32)
            part += 1 << 15
        return range_format.decode_numpy(part, cfg.exp_bits, cfg.man_bits, e_max, out).view(np.complex64)

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
        res = torch.fft.irfft(spec, n=length)  # (L,) a new tensor (see encode)
        if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous() and not out.requires_grad:
            dst, src = out.numpy().reshape(-1), res.numpy()  # NumPy copies: torch's copy_ is an OpenMP region
            _split(lambda a, b: np.copyto(dst[a:b], src[a:b]), n)
        else:
            out.copy_(res[:n].view(out.shape))


class _Energy:
    """Parseval-weighted energies ``w_k |X_k|^2`` of a complex64 spectrum, made on demand:
    each square rounded to fp32, then their sum (DC and, for an even length, Nyquist halved,
    which ranks bins exactly as the weights 1 and 2 do)."""

    def __init__(self, spec: np.ndarray, length: int) -> None:
        self.spec, self.parts = spec, spec.view(np.float32)
        self.last = spec.size - 1 if length % 2 == 0 else -1  # the Nyquist bin, when there is one

    def scorer(self) -> Callable[[int, int], np.ndarray]:
        """``of(a, b)``: the energies of bins [a, b) (at most a chunk) in scratch of its own,
        valid until its next call (one per thread)."""
        tmp = np.empty(3 * min(self.spec.size, _CHUNK), np.float32)
        room = tmp.size // 3

        def of(a: int, b: int) -> np.ndarray:
            sq, e = tmp[: 2 * (b - a)], tmp[2 * room : 2 * room + b - a]
            with np.errstate(over="ignore", invalid="ignore"):  # huge or non-finite bins: inf or NaN, as torch
                np.square(self.parts[2 * a : 2 * b], out=sq)  # contiguous: one vector pass
                np.add(sq[0::2], sq[1::2], out=e)
            if a == 0:
                e[0] *= 0.5
            if a <= self.last < b:
                e[self.last - a] *= 0.5
            return e

        return of

    def at(self, pos: np.ndarray) -> np.ndarray:
        """(m,) energies of the bins at ``pos`` (a new array)."""
        with np.errstate(over="ignore", invalid="ignore"):
            sq = np.square(np.take(self.spec, pos).view(np.float32))
            e = sq[0::2] + sq[1::2]
        e[pos == 0] *= 0.5
        e[pos == self.last] *= 0.5
        return e


def _add_at(out: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:
    """``out[at] += values`` for distinct ``at`` (int32 or int64): torch's ``index_add_``, a
    serial loop on the CPU, runs 2-3 times faster than NumPy's buffered fancy add."""
    torch.from_numpy(out).index_add_(0, torch.from_numpy(at), torch.from_numpy(values))


def _extremes(a: np.ndarray) -> tuple[float, float]:
    """(min, max) of a non-empty fp32 array (NaN if it holds NaN)."""
    return float(np.minimum.reduce(a)), float(np.maximum.reduce(a))


def _split(fn: Callable[[int, int], object], n: int) -> list:
    """``fn(a, b)`` over parts of ``[0, n)`` in whole chunks, on threads for large passes."""
    return parallel.split(fn, n, _CHUNK, _SPLIT_MIN)


def _bitmap_count(pos: torch.Tensor | np.ndarray, bins: int) -> int:
    """Bits set among the first ``bins`` of a bitmap (the padding bits of its last byte,
    never read, are not counted)."""
    if isinstance(pos, torch.Tensor):
        if pos.device.type != "cpu":
            return int(unpack(pos, bins, 1).sum().item())
        pos = pos.numpy()
    b = pos[: (bins + 7) // 8]
    if b.size <= 1024:  # small: one Python integer (the padding bits are its lowest)
        return (int.from_bytes(b.tobytes(), "big") >> (8 * b.size - bins)).bit_count()
    full, rest = divmod(bins, 8)
    count = int(np.bitwise_count(b[:full]).sum()) if _HAS_BITCOUNT else int(_POPCOUNT[b[:full]].sum())
    if rest:
        count += int(b[full] >> (8 - rest)).bit_count()
    return count

"""The codec protocol: what every compression method answers and does.

A codec turns one tensor into a fixed-size :class:`~thinwire.payload.Payload` and back.
It never communicates (it must not import ``torch.distributed``); ``thinwire.aggregate``
moves payloads across ranks with the collective its ``aggregation`` names.

Contract (tested for every registered codec):

* ``wire_spec(shape, dtype)`` depends only on shape, dtype and config, so payload sizes are
  known before encoding and ``nbytes`` is exact.
* ``decode`` is pure; cross-step state changes only in ``update``.
* ``SUM`` codecs are linear in the payload.
* Randomness comes from a generator owned by the codec, seeded from (seed, step, key).
* Multi-round codecs (PowerSGD: a P round then a Q round) set ``rounds > 1``; the caller
  reduces round ``i`` and passes the reduced payload to ``encode_next`` for round ``i+1``.
* Every ``decode``, ``decode_add``, ``decode_sub`` and ``decode_sum`` first runs :meth:`Codec.check` on its
  payloads (wrapped in by ``__init_subclass__``, so a new codec gets it too): the declared
  tensor is real floating point with no negative dimension, the tensor count, shapes and
  dtypes match ``wire_spec``, then the codec's own header fields (``check_fields``: counts,
  exponents, indices in range and each sent once). A malformed payload raises
  :class:`~thinwire.payload.PayloadError` instead of reading out of bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from thinwire.payload import Aggregation, Payload, PayloadError, WireSpec, spec_nbytes


class Feedback(Protocol):
    """What :meth:`Codec.encode_feedback` uses of error feedback (``thinwire.feedback.ErrorFeedback``)."""

    residuals: dict[str, torch.Tensor]

    def compensate(self, key: str, x: torch.Tensor) -> torch.Tensor: ...

    def update_decoded(self, key: str, u: torch.Tensor, codec: Codec, payload: Payload) -> None: ...


class Codec:
    """Base class for codecs. Subclasses set ``name``, ``aggregation`` and the config type."""

    name: ClassVar[str]
    Config: ClassVar[type]  # the frozen config dataclass parsed from the spec
    summary: ClassVar[str] = ""  # one line for `thinwire methods`
    aggregation: ClassVar[Aggregation]
    rounds: ClassVar[int] = 1
    # True when many tensors may be fused into one flat buffer and encoded once: codecs that
    # work element-wise on any flat view (identity, casts), or that choose to treat a bucket
    # as one signal (fft with bucket_mb > 0). Fusion needs ef off (residuals are per tensor).
    fusable: bool = False
    # True when encode and decode keep no state and share no scratch buffers, so one thread
    # may encode a bucket while another decodes an earlier one (identity and the casts): the
    # DDP hook and the gradient reducer then launch such buckets from the backward pass itself
    # and land them on their worker thread (thinwire.aggregate.pipelines)
    concurrent: bool = False
    # True when a piece of a tensor (a flat slice of it) may be encoded on its own as well as
    # the whole: then a hierarchical average splits every tensor between a node's ranks by
    # element; else (codecs that need a tensor's shape: low-rank, transforms, kernels, and
    # any codec that does not say) whole tensors are dealt out between them, balanced by size
    elementwise: bool = False

    @property
    def is_identity(self) -> bool:
        """Whether this codec sends every value as it is, in fp32, keeping no state (the
        uncompressed baseline: callers may take the plain fp32 path instead)."""
        return False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # every decoding entry point checks first
        for name in ("decode", "decode_add", "decode_sub", "decode_sum", "decode_to"):
            if name in cls.__dict__ and not getattr(cls.__dict__[name], "_checks", False):
                setattr(cls, name, _checked(cls.__dict__[name], many=name == "decode_sum"))

    def __init__(self, config: Any) -> None:
        self.config = config
        self.step = 0  # set by the caller before each step's encode; identical on all ranks
        self.rank = 0  # set by the caller at bind time; for per-rank independent randomness

    def compresses(self, shape: torch.Size) -> bool:
        """Whether a tensor of this shape is worth compressing (else it travels as fp32).

        Default rule: tensors with ndim >= 2 and at least ``config.min_numel`` elements.
        """
        return len(shape) >= 2 and math.prod(shape) >= self.config.min_numel

    def bucket_cap(self, cap: int) -> int:
        """fp32 bytes per bucket of this codec's tensors, given the caller's cap."""
        return cap

    # -- questions answered without working ---------------------------------------------
    def wire_spec(self, shape: torch.Size, dtype: torch.dtype, round: int = 0) -> list[WireSpec]:
        """Shapes and dtypes of the wire tensors for a tensor of this shape (one round)."""
        raise NotImplementedError

    def nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int:
        """Bytes this rank contributes to the wire for one tensor, all rounds together."""
        shape = torch.Size(shape)
        return sum(spec_nbytes(self.wire_spec(shape, dtype, r)) for r in range(self.rounds))

    def ratio(self, shape: torch.Size, dtype: torch.dtype = torch.float32) -> float:
        """fp32 bytes / wire bytes for one tensor."""
        return 4 * math.prod(shape) / max(1, self.nbytes(torch.Size(shape), dtype))

    # -- work ----------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, *, key: str = "") -> Payload:
        """Encode ``x`` (round 0). Does not modify ``x``."""
        raise NotImplementedError

    def encode_into(self, x: torch.Tensor, buffer: Callable[[tuple[int, ...], torch.dtype], torch.Tensor], *,
                    key: str = "") -> Payload:
        """:meth:`encode`, free to write its wire tensors into kept buffers: ``buffer(shape,
        dtype)`` returns one, the same memory on every call for its caller (an aggregator's
        bucket), which owns the payload until the next call. Codecs whose wire is a fresh
        tensor as large as the input (the casts) override it: a fresh large allocation
        faults its pages in every step, several copies' time. Default: :meth:`encode`."""
        return self.encode(x, key=key)

    #: :meth:`encode_feedback` keeps error feedback itself (in the codec's own domain); the
    #: aggregator then leaves its compensate/update steps to it
    own_feedback: ClassVar[bool] = False

    def encode_feedback(self, x: torch.Tensor, feedback: Feedback, *, key: str = "") -> Payload:
        """:meth:`encode` with error feedback (``config.ef``), for codecs with
        :attr:`own_feedback`: adds the residual kept under ``key`` (or a key of the codec's
        own) to ``x``, encodes, and leaves in ``feedback`` what this payload did not send.
        The payload's tensors share no memory with ``x`` or the residual."""
        raise NotImplementedError(f"{self.name} keeps no error feedback of its own")

    def encode_next(self, reduced: Payload, *, key: str = "") -> Payload:
        """Round ``i+1`` from the reduced payload of round ``i`` (multi-round codecs only)."""
        raise NotImplementedError(f"{self.name} has a single round")

    def decode(self, payload: Payload) -> torch.Tensor:
        """Reconstruct a dense tensor of ``payload.shape`` and ``payload.dtype``. Pure."""
        raise NotImplementedError

    def check(self, payload: Payload) -> None:
        """Raise :class:`PayloadError` unless ``payload`` has exactly the wire layout this
        codec declares for its shape and dtype (in any of its rounds) and header fields in
        range (:meth:`check_fields`). The declared tensor (``payload.dtype``, ``payload.shape``)
        must be a gradient: real floating point, no negative dimension."""
        if not (isinstance(payload.dtype, torch.dtype) and payload.dtype.is_floating_point):
            raise PayloadError(f"{self.name}: the payload declares dtype {_dtype(payload.dtype)}; "
                               "gradients are real floating point")
        shape = torch.Size(payload.shape)
        if any(d < 0 for d in shape):
            raise PayloadError(f"{self.name}: the payload declares shape {list(shape)}, with a negative dimension")
        got = [(tuple(t.shape), t.dtype) for t in payload.tensors]
        layouts = [[(tuple(s), d) for s, d in self.wire_spec(shape, payload.dtype, r)] for r in range(self.rounds)]
        if got not in layouts:
            raise PayloadError(f"{self.name}: payload for a {list(shape)} {payload.dtype} tensor has wire tensors "
                               f"{_layout(got)}, expected {' or '.join(_layout(layout) for layout in layouts)}")
        self.check_fields(payload)

    def check_fields(self, payload: Payload) -> None:
        """The codec's header fields against their allowed ranges (its layout already
        matches); none by default."""

    def stats(self) -> dict[str, float]:
        """Figures of the current step worth logging (e.g. FFT's theta); none by default."""
        return {}

    def decode_add(self, payload: Payload, out: torch.Tensor) -> None:
        """``out += decode(payload)`` (mutates ``out``). GATHER codecs may override with a
        cheaper sparse accumulation; the default decodes densely."""
        out.add_(self.decode(payload))

    def decode_sub(self, payload: Payload, out: torch.Tensor) -> None:
        """``out -= decode(payload)`` (mutates ``out``): error feedback's residual update. The
        default negates ``out`` around :meth:`decode_add` (negation is exact: the same bits as
        a subtraction), with no dense temporary where ``decode_add`` needs none; a sparse codec
        may subtract its kept entries alone."""
        out.neg_()
        self.decode_add(payload, out)
        out.neg_()

    def decode_to(self, payload: Payload, out: torch.Tensor) -> None:
        """``out[...] = decode(payload)`` (mutates ``out``, of the payload's numel). Codecs whose
        decode is a cast override it to cast straight into ``out``, with no temporary."""
        res = self.decode(payload).reshape(out.shape)
        if res.data_ptr() != out.data_ptr():
            out.copy_(res)

    def decode_sum(self, payloads: list[Payload], out: torch.Tensor) -> None:
        """``out = sum of decode(p)`` over the gathered payloads (overwrites ``out``, fp32).

        The default accumulates with ``decode_add``; a codec whose decode ends in a linear
        map may sum before it (FFT: sum the spectra, then one inverse transform)."""
        out.zero_()
        for p in payloads:
            self.decode_add(p, out)

    def update(self, key: str, reduced: Payload) -> None:
        """Cross-step state update, called once per step after the final round."""

    def loss_window(self) -> int:
        """Steps per window of training loss this codec's schedule reacts to (FFT's
        ``recover``); 0, the default, when it ignores the loss."""
        return 0

    def observe_loss(self, mean_loss: float) -> None:
        """The mean training loss of the window that just ended, agreed across ranks (the
        same value on every rank). The caller calls it every ``loss_window()`` steps."""

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only: per-tensor state keyed by tensor key (parameter
        name), a codec's own state (e.g. a loss-driven theta) under names of its own."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"codec {self.name} holds no state, got keys {sorted(state)}")

    def describe(self) -> str:
        """The spec string that rebuilds this codec, e.g. ``topk:ratio=0.01``."""
        show = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
        knobs = ",".join(f"{k}={show(v)}" for k, v in asdict(self.config).items())
        return f"{self.name}:{knobs}" if knobs else self.name

    def __repr__(self) -> str:
        return f"<{self.describe()}>"


def _dtype(dtype: object) -> str:
    return str(dtype).replace("torch.", "")


def _layout(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> str:
    return "[" + ", ".join(f"{list(s)} {_dtype(d)}" for s, d in specs) + "]"


def _checked(fn: Callable[..., Any], many: bool) -> Callable[..., Any]:
    """``fn`` (a decoding method) preceded by ``self.check`` of its payload(s)."""

    def decode(self: Codec, payload: Any, *args: Any, **kwargs: Any) -> Any:
        for p in (payload if many else (payload,)):
            self.check(p)
        return fn(self, payload, *args, **kwargs)

    decode.__name__, decode.__qualname__, decode.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    decode._checks = True  # type: ignore[attr-defined]
    return decode


E_MAX_LOW, E_MAX_HIGH = -150, 127  # floor(log2 |x|) of a nonzero fp32 value lies in [-149, 127]


def in_range(name: str, what: str, t: torch.Tensor, low: float, high: float) -> None:
    """Raise :class:`PayloadError` unless every value of ``t`` lies in [low, high]."""
    if t.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(t.detach().reshape(-1))).tolist()  # one read back from the device
    if not (low <= lo and hi <= high):
        raise PayloadError(f"{name}: {what} must lie in [{low:g}, {high:g}], got values in [{lo:g}, {hi:g}]")


def not_negative(name: str, what: str, t: torch.Tensor) -> None:
    """Raise :class:`PayloadError` when ``t`` (a scale or norm) holds a negative value; NaN and
    inf pass (a codec carries non-finite input that way; the trainer stops it before encoding)."""
    if t.numel() and bool((t < 0).any()):
        raise PayloadError(f"{name}: {what} must not be negative, got {t.min().item():g}")


def distinct(name: str, what: str, t: torch.Tensor) -> None:
    """Raise :class:`PayloadError` when the 1-D ``t`` (indices that may each name a position
    once) holds a value more than once. Indices that already ascend strictly pass in one
    comparison pass; others are sorted once. On the CPU this runs in NumPy (torch ops on
    cores shared by several ranks wait on OpenMP regions)."""
    if t.numel() < 2:
        return
    flat = t.detach().reshape(-1)
    a = flat.numpy() if flat.device.type == "cpu" else flat
    if bool((a[1:] > a[:-1]).all()):
        return
    s = np.sort(a) if isinstance(a, np.ndarray) else a.sort().values
    repeated = s[1:][s[1:] == s[:-1]]
    if len(repeated):
        v = repeated[0]
        raise PayloadError(f"{name}: {what} must be distinct, index {int(v)} appears {int((a == v).sum())} times")


def zero_(out: torch.Tensor) -> None:
    """``out.zero_()``; a contiguous fp32 CPU tensor as a memset, with no OpenMP region (they
    stall on shared cores)."""
    if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
        out.detach().numpy().fill(0)
    else:
        out.zero_()


def generator_for(seed: int, step: int, key: str, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from (seed, step, key): identical on every rank that asks the same."""
    h = 1469598103934665603
    for ch in key.encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 64)
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step * 7_919 + h) % (1 << 63))
    return g

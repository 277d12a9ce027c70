"""Low-rank layers for AB-training: a Linear or Conv weight held either in full (``W``) or as
a product of two factors ``A·B``, only one of which trains at a time.

    layer = Factorized(nn.Linear(640, 256))   # mode "full": the layer as it was
    rank = layer.factorize(cutoff=0.15)       # A = U S^1/2, B = S^1/2 V^T of the tall view
    layer.set_mode("a")                       # forward uses A·B; only A requires grad

The weight is viewed as a matrix ``(out, -1)`` and transposed when it is wide, so the
factored matrix ``M`` is tall (``m >= n``): ``M = U S V^T``, ``A = U S^1/2`` (``m x r``),
``B = S^1/2 V^T`` (``r x n``). The rank keeps the singular values ``σ_k > cutoff · σ_1``
(at least one), or is given. :func:`factorize_model` swaps a model's Linear and Conv
layers for :class:`Factorized` wrappers in place; the wrapper adopts the layer's own
``weight`` and ``bias`` parameters (same objects, same names, so an optimizer built
before the swap still holds them) and adds ``a`` and ``b``. The mode travels in the
state dict (``_extra_state``), and loading a state dict resizes ``a`` and ``b`` to the
saved rank. :func:`unfactorize_model` swaps the original layer objects back (holding the
wrappers' ``weight`` and ``bias``, ``W = A·B`` where a factored mode was on), so the
model's state dict is the original class's again; such a plain state also loads into the
wrappers (mode ``full``, no factors).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

MODES = ("full", "a", "b")
PLAIN_MISSING = ("a", "b", "_extra_state")  # the keys a wrapper saves that a plain layer's state lacks


class Factorized(nn.Module):
    """A Linear or Conv layer whose weight is ``W`` (mode ``full``) or ``A·B`` (``a``, ``b``)."""

    _layer: nn.Linear | _ConvNd  # set past Module.__setattr__: not registered as a submodule
    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, layer: nn.Linear | _ConvNd) -> None:
        super().__init__()
        if not _supported(layer):
            raise TypeError(f"Factorized wraps nn.Linear or a (non-transposed) Conv layer, got {type(layer).__name__}")
        object.__setattr__(self, "_layer", layer)  # its config (stride, padding, ...), not a submodule
        # The layer's registered Parameters (its class annotates them as plain tensors).
        self.weight = cast(nn.Parameter, layer.weight)
        self.bias = cast("nn.Parameter | None", layer.bias)
        w = layer.weight
        self.rows, self.cols = w.shape[0], w[0].numel()  # the (out, -1) view
        self.transposed = self.rows < self.cols  # factor the tall view
        self.a = nn.Parameter(w.new_empty(0), requires_grad=False)
        self.b = nn.Parameter(w.new_empty(0), requires_grad=False)
        self.mode = "full"

    @property
    def kind(self) -> str:
        return type(self._layer).__name__

    @property
    def shape(self) -> tuple[int, int]:
        """``(m, n)`` of the tall matrix that is factored (``m >= n``)."""
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)

    @property
    def rank(self) -> int:
        return self.a.shape[1] if self.a.dim() == 2 else 0

    def extra_repr(self) -> str:
        return f"{self.kind} {tuple(self.weight.shape)}, mode={self.mode}, rank={self.rank}"

    # -- the matrix and its factors ---------------------------------------------------------
    def tall(self, w: torch.Tensor | None = None) -> torch.Tensor:
        """``w`` (default: the full weight) as the tall ``m x n`` matrix."""
        w2 = (self.weight if w is None else w).detach().reshape(self.rows, self.cols)
        return w2.T if self.transposed else w2

    def product(self) -> torch.Tensor:
        """``A·B`` in the weight's shape (differentiable in the factors)."""
        m = self.a @ self.b
        return (m.T if self.transposed else m).reshape(self.weight.shape)

    def factorize(self, cutoff: float | None = None, rank: int | None = None) -> int:
        """Set ``A = U S^1/2``, ``B = S^1/2 V^T`` from the SVD of the full weight's tall view,
        keeping ``rank`` singular values, or those above ``cutoff · σ_1`` (default: all).
        Returns the rank kept."""
        u, s, vh = torch.linalg.svd(self.tall(), full_matrices=False)
        if rank is not None:
            r = rank
        elif cutoff is not None:
            r = rank_for(s, cutoff)
        else:
            r = s.numel()
        r = max(1, min(int(r), s.numel()))
        root = s[:r].sqrt()
        self.set_factors(u[:, :r] * root, root[:, None] * vh[:r])
        return r

    def singular_values(self) -> torch.Tensor:
        return torch.linalg.svdvals(self.tall())

    def set_factors(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Replace ``A`` (``m x r``) and ``B`` (``r x n``); their gradients are dropped."""
        m, n = self.shape
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != m or b.shape[1] != n or a.shape[1] != b.shape[0]:
            raise ValueError(f"factors of a {m} x {n} matrix must be {m} x r and r x {n}, "
                             f"got {tuple(a.shape)} and {tuple(b.shape)}")
        self.a.data = a.detach().to(self.weight.dtype).contiguous()
        self.b.data = b.detach().to(self.weight.dtype).contiguous()
        self.a.grad = self.b.grad = None

    def set_mode(self, mode: str, keep_weight: bool = False) -> None:
        """``full`` trains W (copied from ``A·B`` when leaving a factored mode, unless
        ``keep_weight``); ``a`` / ``b`` run on ``A·B`` and train only that factor."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode != "full" and self.rank == 0:
            raise ValueError("factorize the layer before switching it to a factored mode")
        if mode == "full" and self.mode != "full" and not keep_weight:
            with torch.no_grad():
                self.weight.copy_(self.product())
        self.mode = mode
        self._flags()

    def _flags(self) -> None:
        self.weight.requires_grad_(self.mode == "full")
        self.a.requires_grad_(self.mode == "a")
        self.b.requires_grad_(self.mode == "b")

    def trained(self) -> list[nn.Parameter]:
        """The parameters this mode trains (the bias always)."""
        main = {"full": self.weight, "a": self.a, "b": self.b}[self.mode]
        return [main] + ([self.bias] if self.bias is not None else [])

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.mode == "full" else self.product()
        if isinstance(self._layer, nn.Linear):
            return F.linear(x, w, self.bias)
        return self._layer._conv_forward(x, w, self.bias)

    # -- back to the original layer --------------------------------------------------------------
    def unwrap(self) -> nn.Linear | _ConvNd:
        """The original layer object, ready to take this wrapper's place: it gets the wrapper's
        ``weight`` and ``bias`` Parameters (the same objects, so an optimizer holding them
        steps the layer) and its train/eval mode. Mutates this wrapper first when a factored
        mode is on: back to ``full`` with ``W = A·B``."""
        if self.mode != "full":
            self.set_mode("full")
        layer = self._layer
        layer.weight = self.weight
        layer.bias = self.bias
        layer.train(self.training)
        return layer

    # -- state ---------------------------------------------------------------------------------
    def get_extra_state(self) -> dict:
        return {"mode": self.mode}

    def set_extra_state(self, state: dict) -> None:
        mode = state.get("mode") if isinstance(state, dict) else None
        if mode not in MODES:
            raise ValueError(f"Factorized state: mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._flags()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        if prefix + "weight" in state_dict and not any(prefix + k in state_dict for k in PLAIN_MISSING):
            state_dict = {**state_dict, **self._as_full(prefix)}  # a plain layer's state (an exported model)
        for name in ("a", "b"):  # the saved rank decides the factors' shapes
            saved = state_dict.get(prefix + name)
            if isinstance(saved, torch.Tensor) and saved.shape != getattr(self, name).shape:
                getattr(self, name).data = torch.empty_like(saved, dtype=self.weight.dtype, device=self.weight.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _as_full(self, prefix: str) -> dict:
        """What a plain layer's state lacks, filled in: no factors, mode ``full``. So the state
        of the original layer (e.g. a model given back by :func:`unfactorize_model`) loads
        into the wrapper as the layer it was."""
        empty = self.weight.new_empty(0)
        return {prefix + "a": empty, prefix + "b": empty, prefix + "_extra_state": {"mode": "full"}}


def _supported(m: nn.Module) -> bool:
    if isinstance(m, _ConvNd) and m.transposed:  # ConvTranspose: another forward, left alone
        return False
    if isinstance(m, NonDynamicallyQuantizableLinear):  # MultiheadAttention reads out_proj.weight itself
        return False
    return isinstance(m, (nn.Linear, _ConvNd)) and m.weight is not None and m.weight.dim() >= 2


def rank_for(singular_values: torch.Tensor, cutoff: float) -> int:
    """How many singular values exceed ``cutoff · σ_1`` (at least one)."""
    s = singular_values
    return max(1, int((s > cutoff * s[0]).sum().item())) if s.numel() else 0


def factorizable(model: nn.Module) -> list[str]:
    """Names of the Linear and Conv layers in registration order (not ConvTranspose, not
    MultiheadAttention's output projection, whose weight the attention reads directly)."""
    return [n for n, m in model.named_modules() if n and (isinstance(m, Factorized) or _supported(m))]


def resolve_exclude(model: nn.Module, exclude: Iterable[str]) -> list[str]:
    """The layer names ``exclude`` means: module names, ``first`` / ``last`` for the first and
    last factorisable layer. Raises ``ValueError`` for a name that matches no such layer."""
    names = factorizable(model)
    out = []
    for item in exclude:
        if item in ("first", "last"):
            if names:
                out.append(names[0] if item == "first" else names[-1])
        elif item in names:
            out.append(item)
        else:
            shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
            raise ValueError(f"exclude: {item!r} matches no Linear or Conv layer of the model (layers: {shown})")
    return sorted(set(out), key=names.index)


def factorize_model(model: nn.Module, exclude: Iterable[str] = ("first", "last")) -> dict[str, Factorized]:
    """Swap every Linear and Conv layer of ``model`` not in ``exclude`` for a
    :class:`Factorized` wrapper (in place, mode ``full``); returns them by module name."""
    skip = set(resolve_exclude(model, exclude))
    out: dict[str, Factorized] = {}
    for name in factorizable(model):
        if name in skip:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = getattr(parent, child)
        wrapped = layer if isinstance(layer, Factorized) else Factorized(layer)
        setattr(parent, child, wrapped)
        out[name] = wrapped
    return out


def unfactorize_model(model: nn.Module, names: Iterable[str] | None = None) -> dict[str, nn.Module]:
    """Swap :class:`Factorized` wrappers of ``model`` (all, or those at ``names``) back for
    their original layer objects, in place (see :meth:`Factorized.unwrap`: same weight and
    bias Parameters, ``W = A·B`` where a factored mode was on); returns them by module name.
    Raises ``ValueError`` for a name that holds no wrapper."""
    wanted = [n for n, m in model.named_modules() if isinstance(m, Factorized)] if names is None else list(names)
    out: dict[str, nn.Module] = {}
    for name in wanted:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        wrapped = getattr(parent, child, None)
        if not isinstance(wrapped, Factorized):
            raise ValueError(f"unfactorize_model: {name!r} is not a Factorized layer of the model "
                             f"(it is {type(wrapped).__name__})")
        out[name] = wrapped.unwrap()
        setattr(parent, child, out[name])
    return out

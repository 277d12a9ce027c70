"""Per-parameter codec choice: ordered rules, the first that matches wins; Hylo is a preset.

A rule names a codec spec and conditions on the parameter: the type of the module that owns
it (``module``), a regular expression searched in its qualified name (``name``), its size
(``min_numel``, ``max_numel``, inclusive) and its number of dimensions (``ndim``). A rule
with no condition is a catch-all; a policy ends with exactly one, so every parameter gets a
codec. Each rule's codec is built once and shared by the parameters it matches (one bucket,
so one collective, per codec group and step).

    policy = thinwire.Policy([
        {"module": "conv", "min_numel": 16385, "codec": "kernels"},
        {"module": "linear", "ndim": 2, "min_numel": 65537, "codec": "twobit:alpha=1.5"},
        {"codec": "identity"},
    ])
    reducer = thinwire.SyncReducer(model, policy)

The same rules in a TOML file (``thinwire train --policy FILE``, :meth:`Policy.from_toml`)::

    [[rule]]
    module = "conv"
    min_numel = 16385
    codec = "kernels"

    [[rule]]
    codec = "identity"

Module types: ``conv`` (any ``torch.nn`` convolution), ``linear``, ``embedding``, ``norm``
(batch, layer, group and instance norms), any ``torch.nn`` class name (``Conv2d``,
``MultiheadAttention``, ...), or in Python a module class itself; a list matches any of them.
The choice depends only on names, shapes and module types, so every rank makes the same one.

Presets are policies by name with knobs, used like a method: ``hylo`` (see :class:`HyloConfig`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from thinwire.codecs.base import Codec
from thinwire.codecs.specs import CODECS, build_codec, build_config, parse_spec
from thinwire.knobs import describe_config, knob, read_user_file, require
from thinwire.registry import Registry

RULE_KEYS = ("codec", "module", "name", "min_numel", "max_numel", "ndim")
MODULE_GROUPS: dict[str, tuple[type, ...]] = {
    "conv": (nn.modules.conv._ConvNd,),
    "linear": (nn.Linear,),
    "embedding": (nn.Embedding, nn.EmbeddingBag),
    "norm": (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
    + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
}


@dataclass(frozen=True)
class ParamInfo:
    """What a rule sees of a parameter."""

    name: str
    shape: torch.Size
    module: nn.Module | None  # the module that owns it directly; None when only names are known

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Rule:
    """One rule: a codec spec and the conditions a parameter must meet (all of them)."""

    codec: str
    module: tuple[str | type, ...] = ()  # any of these module types; empty: any module
    name: str | None = None  # regular expression, searched in the qualified parameter name
    min_numel: int | None = None
    max_numel: int | None = None
    ndim: tuple[int, ...] = ()  # any of these; empty: any
    where: str = field(default="", compare=False)  # "rule 2" or "file.toml:7: rule 2", for errors

    def __post_init__(self) -> None:
        fix = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen: normalise once)
        if isinstance(self.module, (str, type)):
            fix("module", (self.module,))
        if isinstance(self.ndim, int):
            fix("ndim", (self.ndim,))
        fix("module", tuple(self.module))
        fix("ndim", tuple(self.ndim))
        at = f"{self.where}: " if self.where else ""
        require(isinstance(self.codec, str) and bool(self.codec.strip()),
                f"{at}codec must be a codec spec, got {self.codec!r}")
        try:
            build_codec(self.codec)
        except ValueError as e:
            raise ValueError(f"{at}{e}") from None
        for m in self.module:
            _module_types(m, at)
        if self.name is not None:
            require(isinstance(self.name, str), f"{at}name must be a regular expression string, got {self.name!r}")
            try:
                re.compile(self.name)
            except re.error as e:
                raise ValueError(f"{at}name {self.name!r} is not a valid regular expression: {e}") from None
        for key in ("min_numel", "max_numel"):
            v = getattr(self, key)
            require(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
                    f"{at}{key} must be an integer >= 0, got {v!r}")
        require(self.min_numel is None or self.max_numel is None or self.min_numel <= self.max_numel,
                f"{at}min_numel must be <= max_numel, got {self.min_numel} > {self.max_numel}")
        for d in self.ndim:
            require(isinstance(d, int) and not isinstance(d, bool) and d >= 0,
                    f"{at}ndim must be integers >= 0, got {d!r}")

    @property
    def catch_all(self) -> bool:
        return not (self.module or self.name is not None or self.min_numel is not None
                    or self.max_numel is not None or self.ndim)

    def matches(self, p: ParamInfo) -> bool:
        if self.module:
            if p.module is None:
                raise ValueError(f"{self.where or 'a rule'} matches by module type: build the policy's "
                                 "assignment from the model (an nn.Module), not from named parameters")
            if not any(isinstance(p.module, _module_types(m)) for m in self.module):
                return False
        if self.name is not None and re.search(self.name, p.name) is None:
            return False
        if self.min_numel is not None and p.numel < self.min_numel:
            return False
        if self.max_numel is not None and p.numel > self.max_numel:
            return False
        return not self.ndim or len(p.shape) in self.ndim

    def to_dict(self) -> dict[str, Any]:
        """The rule as plain values (module classes by name), conditions left out when unset."""
        d: dict[str, Any] = {"codec": self.codec}
        if self.module:
            d["module"] = [m if isinstance(m, str) else m.__name__ for m in self.module]
        for key in ("name", "min_numel", "max_numel"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.ndim:
            d["ndim"] = list(self.ndim)
        return d


def _module_types(spec: str | type, at: str = "") -> tuple[type, ...]:
    if isinstance(spec, type):
        require(issubclass(spec, nn.Module), f"{at}module type {spec.__name__} is not an nn.Module")
        return (spec,)
    group = MODULE_GROUPS.get(spec)
    if group is not None:
        return group
    cls = getattr(nn, spec, None) if isinstance(spec, str) and spec.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, nn.Module):
        return (cls,)
    raise ValueError(f"{at}unknown module type {spec!r}; use {', '.join(MODULE_GROUPS)} or a torch.nn class name "
                     "such as Conv2d")


class Policy:
    """Ordered rules; the first whose conditions a parameter meets gives its codec.

    ``rules`` are :class:`Rule` objects or mappings with the keys ``codec`` (required),
    ``module``, ``name``, ``min_numel``, ``max_numel`` and ``ndim``. The last rule must be the
    only catch-all. Raises ``ValueError`` naming the rule (and file and line, from TOML).
    """

    def __init__(self, rules: Sequence[Rule | Mapping[str, Any]], *, spec: str | None = None) -> None:
        built = []
        for i, r in enumerate(rules, 1):
            if isinstance(r, Rule):
                built.append(r if r.where else dataclasses.replace(r, where=f"rule {i}"))
            elif isinstance(r, Mapping):
                built.append(_rule_from_mapping(r, f"rule {i}"))
            else:
                raise ValueError(f"rule {i}: expected a Rule or a mapping, got {type(r).__name__}")
        require(bool(built), "a policy needs at least one rule, and the last must be a catch-all (codec only)")
        for r in built[:-1]:
            require(not r.catch_all, f"{r.where}: a catch-all rule (no conditions) must be the last rule; "
                    "the rules after it could never match")
        last = built[-1]
        require(last.catch_all, f"{last.where}: the last rule must be a catch-all (a codec and no conditions), "
                "so that every parameter gets a codec")
        self.rules: tuple[Rule, ...] = tuple(built)
        self.spec = spec  # the preset spec that built it, if any

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_toml(cls, path: str | Path) -> Policy:
        """Rules from a TOML file: an array of ``[[rule]]`` tables."""
        return cls.from_toml_text(read_user_file(path, "policy file"), str(path))

    @classmethod
    def from_toml_text(cls, text: str, source: str = "<policy>") -> Policy:
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            import tomli as tomllib

        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{source}: not valid TOML: {e}") from None
        extra = sorted(set(doc) - {"rule"})
        if extra:
            raise ValueError(f"{source}: unknown top-level key {extra[0]!r}; a policy file holds [[rule]] tables only")
        rules = doc.get("rule")
        if not isinstance(rules, list) or not rules:
            raise ValueError(f"{source}: no [[rule]] tables; a policy needs at least one rule, the last a catch-all")
        lines: list[int | None] = [
            i for i, line in enumerate(text.splitlines(), 1) if re.match(r"\s*\[\[\s*rule\s*\]\]", line)
        ]
        if len(lines) != len(rules):
            lines = [None] * len(rules)  # rules not written as [[rule]] headers: no line numbers
        built = []
        for i, (r, line) in enumerate(zip(rules, lines), 1):
            where = f"{source}:{line}: rule {i}" if line else f"{source}: rule {i}"
            if not isinstance(r, dict):
                raise ValueError(f"{where}: a rule must be a table")
            built.append(_rule_from_mapping(r, where))
        return cls(built)

    @classmethod
    def preset(cls, spec: str) -> Policy:
        """A named preset with knobs, e.g. ``"hylo:t_fc=100000,alpha=1.5"``."""
        name, knobs = parse_spec(spec)
        entry = PRESETS.entry(name)
        cfg = build_config(entry.Config, knobs, name)
        return cls(entry.value(cfg), spec=describe_config(name, cfg))

    # -- questions -----------------------------------------------------------------------------
    def describe(self) -> str:
        """The preset spec, or ``policy`` followed by the rules' codecs in order."""
        return self.spec or "policy[" + "; ".join(r.codec for r in self.rules) + "]"

    def to_dicts(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.rules]

    def rule_for(self, p: ParamInfo) -> int:
        """Index of the first rule that matches ``p``."""
        return next(i for i, r in enumerate(self.rules) if r.matches(p))

    def assign(self, model: nn.Module | Iterable[tuple[str, torch.Tensor]]) -> Assignment:
        """Each parameter's rule and codec. Give the model when a rule matches by module type."""
        return Assignment(self, params_of(model))

    def __repr__(self) -> str:
        return f"<Policy {self.describe()}>"


def _rule_from_mapping(r: Mapping[str, Any], where: str) -> Rule:
    unknown = sorted(set(r) - set(RULE_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; rule keys: {', '.join(RULE_KEYS)}")
    if "codec" not in r:
        raise ValueError(f"{where}: a rule needs a codec (a codec spec such as \"twobit:alpha=1.5\")")
    kw = dict(r)
    for key in ("module", "ndim"):
        if isinstance(kw.get(key), list):
            kw[key] = tuple(kw[key])
    return Rule(**kw, where=where)


def params_of(model: nn.Module | Iterable[tuple[str, torch.Tensor]]) -> list[ParamInfo]:
    """The trainable parameters in ``named_parameters()`` order, each with its owning module."""
    if isinstance(model, nn.Module):
        owner: dict[int, nn.Module] = {}
        for _, m in model.named_modules():
            for p in m.parameters(recurse=False):
                owner.setdefault(id(p), m)
        return [ParamInfo(n, p.shape, owner.get(id(p))) for n, p in model.named_parameters() if p.requires_grad]
    return [ParamInfo(n, p.shape, None) for n, p in model]


class Assignment:
    """A policy applied to a model's parameters: one codec per rule, shared by its parameters."""

    def __init__(self, policy: Policy, params: Sequence[ParamInfo]) -> None:
        self.policy = policy
        self.codecs: list[Codec] = [build_codec(r.codec) for r in policy.rules]
        self.rule_of: dict[str, int] = {p.name: policy.rule_for(p) for p in params}

    def codec_for(self, name: str, tensor: torch.Tensor | None = None) -> Codec:
        """The codec of parameter ``name`` (an aggregator's chooser)."""
        try:
            return self.codecs[self.rule_of[name]]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not in the model this policy was assigned to") from None

    def table(self) -> list[dict[str, Any]]:
        """Per parameter: name, the rule that matched (1-based) and its codec spec."""
        return [{"name": n, "rule": i + 1, "codec": self.policy.rules[i].codec} for n, i in self.rule_of.items()]


# -- presets -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class HyloConfig:
    """Hylo (Peng 2021): conv weights above ``t_conv`` elements -> ``kernels``, linear weights
    above ``t_fc`` -> ``twobit``, everything else fp32. The thresholds' defaults are
    thinwire's choice (the thesis does not publish them), as is the 2-bit threshold's
    statistic, the rms of ``u`` (see :mod:`thinwire.codecs.twobit` for why not the mean);
    the other knobs pass through to the two codecs. Lowering ``t_fc`` until a small last
    layer (a classifier head) is sent as 2-bit makes training fragile: its few large
    gradients wait in the residual, and with SGD momentum 0.9 a BatchNorm CNN with every
    layer compressed (``t_conv=0,t_fc=0``) measured 0.28-0.38 accuracy over three seeds,
    0.88-0.95 with its 640-weight head in fp32 (``t_fc=1000``), 0.97-0.98 uncompressed."""

    t_conv: int = knob(16384, "conv weights with more elements than this are sent as top kernels", ">= 0")
    t_fc: int = knob(65536, "linear weights with more elements than this are sent as 2-bit codes", ">= 0")
    ef: bool = knob(True, "error feedback in both compressed branches", "true|false")
    granularity: Literal["kernel", "filter"] = knob("kernel", "kernels: unit of selection (kernel or filter)",
                                                    "kernel|filter")
    score: Literal["l1", "l2"] = knob("l1", "kernels: unit importance (L1 or L2 norm)", "l1|l2")
    r_max: float = knob(0.25, "kernels: largest share of units sent", "(0, 1], >= r_min")
    r_min: float = knob(0.01, "kernels: smallest share of units sent", "(0, 1]")
    beta: float = knob(0.5, "kernels: rate = clip(r_max * (t_conv / numel)^beta, r_min, r_max)", ">= 0")
    alpha: float = knob(1.0, "twobit: threshold t = alpha * stat(|u|)", "> 0")
    stat: Literal["mean", "rms", "max"] = knob("rms", "twobit: rms | mean | max of |u|", "mean|rms|max")
    threshold: float | None = knob(None, "twobit: a fixed threshold instead of the adaptive one", "> 0, or none")

    def __post_init__(self) -> None:
        require(self.t_conv >= 0, f"t_conv must be >= 0, got {self.t_conv}")
        require(self.t_fc >= 0, f"t_fc must be >= 0, got {self.t_fc}")
        for spec in _hylo_specs(self):
            build_codec(spec)  # the sub-codecs validate their own knobs


# policy presets by name: each builds its rules from its config (this module's functions)
PRESETS: Registry[Callable[[Any], list[Rule]]] = Registry(
    "policy preset", builtins=("thinwire.policy",), taken=lambda name: "a codec" if name in CODECS else None)


def _hylo_specs(cfg: HyloConfig) -> tuple[str, str]:
    ef = str(cfg.ef).lower()
    kernels = (f"kernels:ef={ef},min_numel=0,granularity={cfg.granularity},score={cfg.score},"
               f"t_conv={max(1, cfg.t_conv)},r_max={cfg.r_max},r_min={cfg.r_min},beta={cfg.beta}")
    twobit = f"twobit:ef={ef},min_numel=0,alpha={cfg.alpha},stat={cfg.stat}"
    if cfg.threshold is not None:
        twobit += f",threshold={cfg.threshold}"
    return kernels, twobit


@PRESETS.register(name="hylo", Config=HyloConfig,
                  summary="Hylo: top kernels for conv weights > t_conv, adaptive 2-bit for linear weights > t_fc, "
                          "fp32 for the rest")
def _hylo_rules(cfg: HyloConfig) -> list[Rule]:
    kernels, twobit = _hylo_specs(cfg)
    return [
        Rule(kernels, module=("conv",), ndim=(3, 4, 5), min_numel=cfg.t_conv + 1, where="hylo rule 1 (conv)"),
        Rule(twobit, module=("linear",), ndim=(2,), min_numel=cfg.t_fc + 1, where="hylo rule 2 (linear)"),
        Rule("identity", where="hylo rule 3 (the rest)"),
    ]


def as_policy(method: Any) -> Policy | None:
    """``method`` as a policy when it is one (a :class:`Policy` or a preset spec), else None."""
    if isinstance(method, Policy):
        return method
    if isinstance(method, str) and parse_spec(method)[0] in PRESETS:
        return Policy.preset(method)
    return None

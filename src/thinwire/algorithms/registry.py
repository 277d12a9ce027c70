"""Method specs: a training method's name with knobs, a policy preset, or any codec spec.

``build_method("topk:ratio=0.01", model, optimizer, comm)`` gives a
:class:`~thinwire.algorithms.sync.SyncReducer` over that codec; a policy preset
(``"hylo"``) a :class:`~thinwire.algorithms.sync.SyncReducer` with a codec per parameter;
a method of :data:`METHODS` (``"dasgd:period=4"``) that method. A name belongs to one
registry: a name that two of them answer to is refused (:func:`kind_of`).

The built-in methods are the classes in :data:`BUILTIN`, imported and registered on the
first lookup (name, ``Config`` and summary are read from the class), in that order. A
method of a user's own module registers with ``METHODS.register(cls)`` (or as a class
decorator) and is listed after the built-in ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from thinwire.codecs.base import Codec
from thinwire.codecs.registry import CODECS, build_codec, build_config, parse_spec
from thinwire.comm.base import Communicator
from thinwire.knobs import describe_config
from thinwire.policy import PRESETS, Policy
from thinwire.registry import Entry, Registry

if TYPE_CHECKING:
    from thinwire.algorithms.base import Method

# the built-in methods ("module:class"), in listing order
BUILTIN = (
    "thinwire.algorithms.local_sgd:LocalSGD",
    "thinwire.algorithms.dasgd:DaSGD",
    "thinwire.algorithms.diloco:DiLoCo",
    "thinwire.algorithms.streaming_diloco:StreamingDiLoCo",
    "thinwire.algorithms.sparseloco:SparseLoCo",
    "thinwire.algorithms.demo:DeMoMethod",
    "thinwire.algorithms.gossip:DPSGD",
    "thinwire.algorithms.powergossip:PowerGossip",
    "thinwire.algorithms.ab:ABTraining",
    "thinwire.integrations.torch_builtins:TorchBuiltin",
    "thinwire.integrations.torch_builtins:TorchFP16",
    "thinwire.integrations.torch_builtins:TorchBF16",
    "thinwire.integrations.torch_builtins:TorchPowerSGD",
    "thinwire.integrations.torch_builtins:TorchPostLocalSGD",
    "thinwire.integrations.torchft_diloco:TorchFTDiLoCo",
    "thinwire.integrations.detonation_demo:PeerDeMo",
)


def _load_builtin() -> None:
    for path in BUILTIN:
        module, _, name = path.partition(":")
        METHODS.register(getattr(importlib.import_module(module), name))


def _taken(name: str) -> str | None:
    """What else a method's name would shadow (methods resolve first)."""
    return "a codec" if name in CODECS else "a policy preset" if name in PRESETS else None


METHODS: Registry[type[Method]] = Registry("method", load=_load_builtin, package="thinwire", taken=_taken)


def method_names() -> list[str]:
    """Every name a spec may start with: codecs, policy presets, then methods."""
    return [*CODECS, *PRESETS, *METHODS]


def kind_of(spec: str) -> str:
    """``"method"`` (a method of :data:`METHODS`), ``"preset"`` or ``"codec"``; an unknown
    name, or one that two registries answer to (a user's codec named like a method), raises
    ``ValueError`` naming the problem."""
    name, _ = parse_spec(spec)
    kinds = [kind for kind, registry in (("method", METHODS), ("preset", PRESETS), ("codec", CODECS))
             if name in registry]
    if not kinds:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(method_names())}")
    if len(kinds) > 1:
        raise ValueError(f"{name!r} names both a {kinds[0]} and a {kinds[1]}: register one of them under "
                         "another name")
    return kinds[0]


def is_gradient_codec(spec: str) -> bool:
    """Whether ``spec`` runs as a :class:`~thinwire.algorithms.sync.SyncReducer` (a codec or
    a policy preset), not as a method with a schedule of its own."""
    return kind_of(spec) != "method"


def method_config(spec: str) -> tuple[type[Method], Any]:
    """The class and the validated config of a method spec of :data:`METHODS`."""
    name, knobs = parse_spec(spec)
    entry = METHODS.entry(name)
    return entry.value, build_config(entry.Config, knobs, name)


def resolve_method(spec: str) -> str:
    """Validate a method spec and return it with every default filled in.

    Raises ``ValueError`` naming the problem (unknown method or knob, value out of range).
    """
    kind = kind_of(spec)
    if kind == "method":
        cls, config = method_config(spec)
        return describe_config(cls.name, config)
    if kind == "preset":
        return Policy.preset(spec).describe()
    return build_codec(spec).describe()


def check_world(spec: str | Policy | Codec, workers: int) -> None:
    """Raise ``ValueError`` when a resolved method cannot run on ``workers`` ranks (a
    topology that does not fit, for instance); a codec or policy runs on any world."""
    if isinstance(spec, str) and kind_of(spec) == "method":
        cls, config = method_config(spec)
        cls.check_world(config, workers)


def skip_unsafe(spec: str) -> str | None:
    """Why a step dropped after backward (``--on-nonfinite skip``) would leave the method of
    ``spec`` unclean, or None when it would not (:attr:`Method.skip_unsafe`)."""
    return METHODS[parse_spec(spec)[0]].skip_unsafe if kind_of(spec) == "method" else None


def flat_only(spec: str | Policy | Codec) -> str | None:
    """Why the method of a resolved spec cannot average in two levels (:attr:`Method.flat_only`),
    or None when it can (codecs and policies always can)."""
    if isinstance(spec, str) and kind_of(spec) == "method":
        return METHODS[parse_spec(spec)[0]].flat_only
    return None


def own_optimizer(spec: str | Policy | Codec) -> bool:
    """Whether a resolved spec names a method that is an optimizer itself (DeMo), built in
    place of the run's Adam or SGD (:attr:`Method.replaces_optimizer`)."""
    try:
        return isinstance(spec, str) and kind_of(spec) == "method" and method_config(spec)[0].replaces_optimizer
    except ValueError:
        return False  # not a method spec (a policy's label): no method of its own


def own_compute(spec: str | Policy | Codec) -> bool:
    """Whether a resolved spec's steps compute something other than the task's plain forward,
    backward and optimizer step (:attr:`Method.own_compute`; a method that is its own optimizer
    always does): its compute figure is its own, not the one methods of a race share."""
    try:
        if not (isinstance(spec, str) and kind_of(spec) == "method"):
            return False
        cls = method_config(spec)[0]
    except ValueError:
        return False
    return bool(cls.own_compute or cls.replaces_optimizer)


def optimizer_method_help(name: str) -> str:
    """The one way to attach a method that is an optimizer itself (DeMo), for the errors that
    meet a loop doing otherwise."""
    return (f"{name} is an optimizer itself: build it in place of yours and attach that one, "
            f"opt = thinwire.method_optimizer('{name}', model.parameters(), lr); "
            f"thinwire.attach(model, opt, '{name}')")


def method_optimizer(spec: str | Policy | Codec, params: Any, lr: float, *, weight_decay: float = 0.0,
                     comm: Communicator | None = None) -> torch.optim.Optimizer | None:
    """The optimizer of a method that is one (``demo``, ``peer-demo``), built on ``params`` in
    place of yours; None for every other spec (train with your own optimizer). ``comm``: the
    default ``torch.distributed`` group when None."""
    if not own_optimizer(spec):
        return None
    assert isinstance(spec, str)  # own_optimizer holds for method specs only
    cls, config = method_config(spec)
    return cls.make_optimizer(config, list(params), lr, weight_decay, comm)


def check_model(spec: str | Policy | Codec, model: torch.nn.Module) -> None:
    """Raise ``ValueError`` when a resolved method cannot run on ``model`` (AB-training's
    excluded layer names, for instance); a codec or policy runs on any model."""
    if isinstance(spec, str) and kind_of(spec) == "method":
        cls, config = method_config(spec)
        cls.check_model(config, model)


def build_method(spec: str | Policy | Codec, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 comm: Communicator | None, *, bucket_mb: float = 25.0, overlap: bool = True,
                 find_unused_parameters: bool = False) -> Method:
    """The :class:`~thinwire.algorithms.base.Method` a spec (or a policy) names, built on
    ``model``. ``overlap``: methods that average gradients do so while the backward pass
    goes on (False: at ``after_backward``). ``find_unused_parameters`` applies to gradient
    codecs and policies (see :class:`~thinwire.algorithms.sync.SyncReducer`)."""
    from thinwire.algorithms.sync import SyncReducer

    if isinstance(spec, str) and kind_of(spec) == "method":
        if find_unused_parameters:
            raise ValueError(f"find_unused_parameters applies to gradient codecs and policies, not to "
                             f"{parse_spec(spec)[0]}: its averaging assumes every rank's gradients cover the "
                             "same parameters")
        cls, config = method_config(spec)
        return cls(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap)
    return SyncReducer(model, spec, comm, bucket_mb=bucket_mb, overlap=overlap,
                       find_unused_parameters=find_unused_parameters)


def refuse_schedule(spec: str, where: str) -> None:
    """Raise naming the right API when ``spec`` names a method with its own schedule
    (``dasgd``, ``ab``, ``torch-ddp``, ...) where only a gradient codec or policy fits."""
    try:
        name, _ = parse_spec(spec)
    except ValueError:
        return  # malformed: the codec parser says why
    if name in METHODS:
        raise ValueError(f"{name!r} is a training method with its own schedule, not a gradient codec, so {where} "
                         f"cannot run it; attach it to your loop with thinwire.attach(model, optimizer, {spec!r})")


def markdown_table(names: Collection[str] | None = None) -> str:
    """Every spec name (or those of ``names``) with its kind, summary and knobs (defaults), as
    a markdown table: the index in docs/methods.md (``thinwire methods --markdown`` prints it;
    a test keeps the page in step)."""
    from thinwire.codecs.registry import knob_table

    rows = ["| name | kind | what it does | knobs (default) |", "|---|---|---|---|"]
    kinds: list[tuple[Entry[Any], str]] = [(e, f"codec ({e.value.aggregation.value})") for e in CODECS.entries()]
    kinds += [(e, "policy preset") for e in PRESETS.entries()]
    kinds += [(e, "PyTorch peer" if e.value.peer else "method") for e in METHODS.entries()]
    for e, kind in kinds:
        if names is not None and e.name not in names:
            continue
        knobs = ", ".join(f"`{name}` ({default})" for name, default, _, _ in knob_table(e.Config)) or "—"
        rows.append(f"| `{e.name}` | {kind} | {e.summary.replace('|', chr(92) + '|')} | {knobs} |")
    return "\n".join(rows) + "\n"


def elastic_refusal(spec: str | Policy | Codec) -> str | None:
    """Why the method of a resolved spec cannot run elastic (:meth:`Method.check_elastic`),
    or None when it can (codecs and policies always can: each step averages over the workers
    present)."""
    if isinstance(spec, str) and kind_of(spec) == "method":
        cls, config = method_config(spec)
        return cls.check_elastic(config)
    return None

"""Method specs: a training method's name with knobs, a policy preset, or any codec spec.

:data:`METHODS` holds the training methods by name; a spec's name may also be a policy
preset (``"hylo"``, :data:`thinwire.policy.PRESETS`) or a codec (``"topk:ratio=0.01"``,
:data:`thinwire.codecs.specs.CODECS`). A name belongs to one registry: a name that two of
them answer to is refused (:func:`kind_of`). The functions here resolve and check specs;
:mod:`thinwire.algorithms.build` builds the method a spec names.

The built-in methods are the classes decorated with ``@METHODS.register`` in the modules of
:mod:`thinwire.algorithms` and :mod:`thinwire.peers`, imported on the first lookup. A method
of a user's own module registers the same way and is listed after the built-in ones.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch

from thinwire.codecs.base import Codec
from thinwire.codecs.specs import CODECS, build_codec, build_config, parse_spec
from thinwire.knobs import describe_config
from thinwire.policy import PRESETS, Policy
from thinwire.registry import Entry, Registry

if TYPE_CHECKING:
    from thinwire.algorithms.base import Method

# listing order of the built-in methods, by module (`thinwire methods`, docs/methods.md): the
# methods first, then the peers that run another project's code
_LISTING = ("local_sgd", "dasgd", "diloco", "streaming_diloco", "sparseloco", "demo", "gossip", "powergossip", "ab",
            "torch_builtins", "torchft_diloco", "detonation_demo")


def _listing(entry: Entry[type[Method]]) -> int:
    module = entry.value.__module__.rpartition(".")[2]
    return _LISTING.index(module) if module in _LISTING else len(_LISTING)


def _taken(name: str) -> str | None:
    """What else in the package answers to a method's name (a codec or a preset)."""
    return "a codec" if name in CODECS else "a policy preset" if name in PRESETS else None


METHODS: Registry[type[Method]] = Registry("method", builtins=("thinwire.algorithms", "thinwire.peers"),
                                            taken=_taken, order=_listing)


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


def sharded_refusal(spec: str | Policy | Codec) -> str | None:
    """Why the method of a resolved spec cannot run between groups of sharded ranks
    (:attr:`Method.sharded_unsafe`), or None: codecs and policies can."""
    if isinstance(spec, str) and kind_of(spec) == "method":
        return method_config(spec)[0].sharded_unsafe
    return None


def flat_only(spec: str | Policy | Codec) -> str | None:
    """Why the method of a resolved spec cannot average in two levels (:attr:`Method.flat_only`),
    or None when it can (codecs and policies always can)."""
    if isinstance(spec, str) and kind_of(spec) == "method":
        return method_config(spec)[0].flat_only
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


def check_model(spec: str | Policy | Codec, model: torch.nn.Module) -> None:
    """Raise ``ValueError`` when a resolved method cannot run on ``model`` (AB-training's
    excluded layer names, for instance); a codec or policy runs on any model."""
    if isinstance(spec, str) and kind_of(spec) == "method":
        cls, config = method_config(spec)
        cls.check_model(config, model)


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
    from thinwire.codecs.specs import knob_table

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

"""Method specs: an algorithm name with knobs, a policy preset, or any codec spec.

``build_method("topk:ratio=0.01", model, comm)`` gives a :class:`SyncReducer` over that
codec; a policy preset (``"hylo"``) a :class:`SyncReducer` with a codec per parameter.
Algorithms with their own schedule (local SGD, gossip, ...) register here under
their own names and take precedence over codec names.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from thinwire.codecs.registry import available as available_codecs
from thinwire.codecs.registry import build_codec, parse_spec
from thinwire.comm.base import Communicator
from thinwire.knobs import describe_config

# name -> (validate(spec) -> resolved spec string, build(spec, model, optimizer, comm) -> method)
_ALGORITHMS: dict[str, tuple[Callable[[str], str], Callable[..., Any]]] = {}


def register_algorithm(name: str, validate: Callable[[str], str], build: Callable[..., Any]) -> None:
    if name in _ALGORITHMS or name in available_codecs() or name in algorithms():
        raise ValueError(f"method {name!r} registered twice")
    _ALGORITHMS[name] = (validate, build)


def algorithms() -> dict[str, type]:
    """Built-in algorithms with their own schedule, by name: name -> class (``Config``-typed
    knobs, built as ``cls(model, optimizer, comm, config, bucket_mb=...)``)."""
    from thinwire.algorithms.ab import ABConfig, ABTraining
    from thinwire.algorithms.dasgd import DaSGD, DaSGDConfig
    from thinwire.algorithms.gossip import DPSGD, DPSGDConfig
    from thinwire.algorithms.local_sgd import LocalSGD, LocalSGDConfig
    from thinwire.algorithms.powergossip import PowerGossip, PowerGossipConfig

    from thinwire.integrations.torch_builtins import BUILTINS

    return {"localsgd": (LocalSGD, LocalSGDConfig), "dasgd": (DaSGD, DaSGDConfig), "dpsgd": (DPSGD, DPSGDConfig),
            "powergossip": (PowerGossip, PowerGossipConfig), "ab": (ABTraining, ABConfig),
            **{name: (cls, cls.config_cls) for name, cls in BUILTINS.items()}}


def check_world(spec: str, workers: int) -> None:
    """Raise ``ValueError`` when a resolved method cannot run on ``workers`` ranks (a
    topology that does not fit, for instance)."""
    name, _ = parse_spec(spec)
    if name in algorithms():
        cls, config = _config_of(spec)
        if hasattr(cls, "check_world"):
            cls.check_world(config, workers)


def check_model(spec: str, model: torch.nn.Module) -> None:
    """Raise ``ValueError`` when a resolved method cannot run on ``model`` (AB-training's
    excluded layer names, for instance)."""
    name, _ = parse_spec(spec)
    if name in algorithms():
        cls, config = _config_of(spec)
        if hasattr(cls, "check_model"):
            cls.check_model(config, model)


def _config_of(spec: str):
    from thinwire.codecs.registry import build_config

    name, knobs = parse_spec(spec)
    cls, config_cls = algorithms()[name]
    return cls, build_config(config_cls, knobs, name)


def method_names() -> list[str]:
    from thinwire.policy import PRESETS

    return list(available_codecs()) + list(PRESETS) + list(algorithms()) + list(_ALGORITHMS)


def resolve_method(spec: str) -> str:
    """Validate a method spec and return it with every default filled in.

    Raises ``ValueError`` naming the problem (unknown method or knob, value out of range).
    """
    from thinwire.policy import PRESETS, Policy

    name, _ = parse_spec(spec)
    if name in _ALGORITHMS:
        return _ALGORITHMS[name][0](spec)
    if name in algorithms():
        cls, config = _config_of(spec)
        return describe_config(cls.name, config)
    if name in PRESETS:
        return Policy.preset(spec).describe()
    if name not in available_codecs():
        raise ValueError(f"unknown method {name!r}; available: {', '.join(method_names())}")
    return build_codec(spec).describe()


def build_method(spec: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, comm: Communicator, *,
                 overlap: bool = True, **kw: Any):
    """The object the trainer drives: ``after_backward(loss=...)`` (this rank's loss of the
    step), ``after_step()``, ``timing``,
    ``state_dict()``; see :class:`thinwire.algorithms.sync.SyncReducer`. ``overlap``: built-in
    methods that average gradients do so while the backward pass goes on (False: at
    ``after_backward``)."""
    name, _ = parse_spec(spec)
    if name in _ALGORITHMS:
        return _ALGORITHMS[name][1](spec, model, optimizer, comm, **kw)
    if name in algorithms():
        cls, config = _config_of(spec)
        return cls(model, optimizer, comm, config, overlap=overlap, **kw)
    from thinwire.algorithms.sync import SyncReducer

    return SyncReducer(model, spec, comm, overlap=overlap, **kw)



def refuse_schedule(spec: str, where: str) -> None:
    """Raise naming the right API when ``spec`` names a method with its own schedule
    (``dasgd``, ``ab``, ``torch-ddp``, ...) where only a gradient codec or policy fits."""
    try:
        name, _ = parse_spec(spec)
    except ValueError:
        return  # malformed: the codec parser says why
    if name in algorithms() or name in _ALGORITHMS:
        raise ValueError(f"{name!r} is a training method with its own schedule, not a gradient codec, so {where} "
                         f"cannot run it; attach it to your loop with thinwire.attach(model, optimizer, {spec!r})")

"""Build the :class:`~thinwire.algorithms.base.Method` a spec names, and the optimizer of a method
that is one (DeMo)."""

from __future__ import annotations

from typing import Any

import torch

from thinwire.algorithms.base import Method
from thinwire.algorithms.methods import kind_of, method_config, own_optimizer
from thinwire.algorithms.sync import SyncReducer
from thinwire.codecs.base import Codec
from thinwire.codecs.specs import parse_spec
from thinwire.comm.base import Communicator
from thinwire.policy import Policy


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


def build_method(spec: str | Policy | Codec, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 comm: Communicator | None, *, bucket_mb: float = 25.0, overlap: bool = True,
                 find_unused_parameters: bool = False) -> Method:
    """The :class:`~thinwire.algorithms.base.Method` a spec (or a policy) names, built on
    ``model``. ``overlap``: methods that average gradients do so while the backward pass
    goes on (False: at ``after_backward``). ``find_unused_parameters`` applies to gradient
    codecs and policies (see :class:`~thinwire.algorithms.sync.SyncReducer`)."""
    if isinstance(spec, str) and kind_of(spec) == "method":
        if find_unused_parameters:
            raise ValueError(f"find_unused_parameters applies to gradient codecs and policies, not to "
                             f"{parse_spec(spec)[0]}: its averaging assumes every rank's gradients cover the "
                             "same parameters")
        cls, config = method_config(spec)
        return cls(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap)
    return SyncReducer(model, spec, comm, bucket_mb=bucket_mb, overlap=overlap,
                       find_unused_parameters=find_unused_parameters)

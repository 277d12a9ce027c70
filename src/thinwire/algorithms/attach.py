"""One entry point for any method in a user's own loop: ``thinwire.attach``.

    run = thinwire.attach(model, optimizer, "dasgd:period=4")   # any spec `thinwire methods` lists
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(run.model(x), y)     # run.model: your model (PyTorch's DDP wrapper for torch-*)
        loss.backward()
        run.after_backward(loss)            # gradients averaged (synchronous methods, warm-ups)
        optimizer.step()
        run.after_step()                    # models averaged, mixed or synced (their own schedule)
    run.finish()                            # e.g. AB-training's last sync

Codecs and policies give a :class:`~thinwire.algorithms.sync.SyncReducer`, algorithms
(``localsgd``, ``dasgd``, ``dpsgd``, ``powergossip``, ``ab``) and PyTorch's own DDP hooks
(``torch-*``) their own objects; :class:`Attached` gives them all the same calls.
"""

from __future__ import annotations

from typing import Any

import torch

from thinwire.algorithms import reporting
from thinwire.algorithms.averaging import comm_or_world
from thinwire.algorithms.base import Method
from thinwire.algorithms.build import build_method, optimizer_method_help
from thinwire.algorithms.methods import is_gradient_codec, own_optimizer, resolve_method
from thinwire.codecs.base import Codec
from thinwire.comm.base import Communicator
from thinwire.comm.groups import worker_groups
from thinwire.figures import figures
from thinwire.policy import Policy
from thinwire.timing import Timing


class Attached:
    """A method attached to a training loop: the calls every method answers alike.

    ``method`` is the object doing the work (``SyncReducer``, ``DaSGD``, ...), ``spec`` its
    resolved spec with every default filled in, ``model`` the module to run forward and
    backward through (the user's model, or PyTorch's DDP wrapper around it for ``torch-*``).
    """

    def __init__(self, method: Method, model: torch.nn.Module) -> None:
        self.method = method
        self.model = method.forward_module(model)
        self.spec = method.spec
        self.comm = method.comm
        self.finished = False

    def after_backward(self, loss: float | torch.Tensor | None = None, *, scaler: Any = None) -> bool:
        """Call after ``loss.backward()`` (with a ``GradScaler``: after
        ``scaler.scale(loss).backward()``, passing ``scaler``, before ``scaler.step``).
        Returns False when a scaler overflow made every rank skip the step.

        ``scaler`` matters to methods that average gradients through codecs (codec specs and
        policies), which then work in unscaled units and agree on overflows; the others
        average gradients only with plain fp32 sums (warm-ups, AB-training's groups), which
        carry an overflow to every rank of the sum as DDP's all_reduce does, or not at all
        (gossip), so each rank's scaler decides for itself."""
        self._check_open()
        loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        return self.method.after_backward(loss, scaler=scaler) is not False  # None: a method that does not say

    def after_step(self) -> None:
        """Call after ``optimizer.step()`` (``scaler.step(optimizer)``), every step."""
        self._check_open()
        self.method.after_step()

    def finish(self) -> None:
        """Call once after the last step: methods that end with work of their own do it
        (AB-training syncs every rank and gives back plain layers); the others have none.
        The DiLoCo family (``diloco``, ``streaming-diloco``) ends with one more outer step, so
        every rank holds the same model (``final_sync=false`` skips it). Model averaging and
        gossip (``localsgd``, ``dasgd``, ``dpsgd``, ``powergossip``) leave each rank with its
        own model, apart by the steps since the last average."""
        self._check_open()
        self.method.finish()
        self.finished = True

    def _check_open(self) -> None:
        if self.finished:
            raise RuntimeError(f"{self.spec} was finished: attach a new method to train further")

    @property
    def timing(self) -> Timing:
        """Seconds in codecs and in communication so far (this rank's host clock)."""
        return self.method.timing

    @property
    def bytes_sent(self) -> float:
        """Bytes this rank sent so far, as the byte meter counts them."""
        return self.comm.meter.bytes_sent

    def scalars(self) -> dict[str, float]:
        """This rank's figures so far, ``{tag: number}`` for a logger (``thinwire/bytes_sent``,
        ``thinwire/messages``, ``thinwire/codec_seconds``, ``thinwire/comm_seconds``, and the
        method's own numeric ones such as DaSGD's ``thinwire/delay``): one call logs them,
        ``for tag, v in run.scalars().items(): writer.add_scalar(tag, v, step)``."""
        return figures(self.comm.meter, self.timing, reporting.stats(self.method))

    def state_dict(self) -> dict[str, Any]:
        """The method's state (residuals, snapshots, schedules...) for a checkpoint, beside
        the model's and the optimizer's."""
        return self.method.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore after the model and the optimizer (AB-training's factors live in the model)."""
        self.method.load_state_dict(state)

    def __repr__(self) -> str:
        return f"<thinwire.Attached {self.spec}>"


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    method: Any = "identity",
    comm: Communicator | None = None,
    *,
    bucket_mb: float = 25.0,
    find_unused_parameters: bool = False,
    overlap: bool = True,
    mesh: Any = None,
) -> Attached:
    """Attach any method (a spec ``thinwire methods`` lists, a built codec or a
    :class:`~thinwire.policy.Policy`) to ``model`` and ``optimizer``.

    Build it on every rank with the same arguments, after the model is on its device and
    before the first step. ``comm`` defaults to the default ``torch.distributed`` process
    group. ``find_unused_parameters`` applies to gradient averaging through codecs (see
    :class:`~thinwire.algorithms.sync.SyncReducer`); an invalid spec raises ``ValueError``
    naming the problem. Methods with a schedule (``localsgd``, ``dasgd``, ``ab``, ...) need
    the ``optimizer``; AB-training and the ``torch-*`` methods change or wrap ``model``
    (forward through :attr:`Attached.model`). ``overlap`` (default True): gradients are
    averaged while the backward pass goes on (see :class:`~thinwire.algorithms.sync.SyncReducer`
    for what a loop must then not do); False averages them in ``after_backward``.

    ``mesh``: a 2-D ``DeviceMesh`` of worker groups, dimension 0 across the groups (the slow
    link), dimension 1 inside a group (the fast one), ``G`` consecutive ranks per group. The
    method then runs between the groups (:mod:`thinwire.comm.groups`): with ``model`` wrapped
    by FSDP2's ``fully_shard(..., mesh=mesh["<dimension 1>"])``, each rank averages its shard with the same
    shard in the other groups; with a plain ``model``, thinwire keeps each group's replicas in
    step itself (an fp32 gradient mean inside the group every step) and each rank carries
    ``1/G`` of every average across; with ``model`` wrapped in ``DistributedDataParallel`` over
    ``mesh.get_group(1)``, DDP keeps them in step and each rank averages the whole model over
    dimension 0 (after DDP's mean has landed: ``overlap`` does not apply). ``comm`` is then the
    world (default: every process).
    """
    spec: str | Policy | Codec
    if isinstance(method, str):
        spec = resolve_method(method)
        if find_unused_parameters and not is_gradient_codec(spec):
            raise ValueError(f"find_unused_parameters applies to gradient codecs and policies, not to "
                             f"{spec.split(':')[0]}: its averaging assumes every rank's gradients cover the same "
                             "parameters")
        if optimizer is None and own_optimizer(spec):
            raise ValueError(optimizer_method_help(spec.split(":")[0]))
        if optimizer is None and not is_gradient_codec(spec):
            raise ValueError(f"{spec} keeps its own schedule around the optimizer's steps: pass the optimizer, "
                             f"thinwire.attach(model, optimizer, {method!r})")
    else:  # a built codec or a Policy
        spec = method
    if mesh is not None:
        if own_optimizer(spec):
            raise ValueError(f"{str(spec).split(':')[0]} cannot run between worker groups: its optimizer averages over "
                             "the communicator it was built with")
        comm = worker_groups(model, mesh, comm)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            overlap = False  # backward's gradient hooks fire before DDP's mean lands in .grad
    elif not own_optimizer(spec):  # an optimizer that is the method (DeMo) brings the communicator it was built with
        comm = comm_or_world(comm)
    built = build_method(spec, model, optimizer, comm, bucket_mb=bucket_mb, overlap=overlap,
                         find_unused_parameters=find_unused_parameters)
    return Attached(built, model)

"""The contract of a training method: what the trainer, the CLI and ``thinwire.attach`` call.

A method is built on every rank with the same arguments, after the model is on its device
and before the first step, and is then driven by two calls around the optimizer's step::

    loss.backward()
    method.after_backward(loss)   # gradients averaged (or nothing: averaging on a schedule)
    optimizer.step()
    method.after_step()           # models averaged, mixed or synced on the method's schedule
    ...
    method.finish()               # once, after the last step

Everything else has a documented default here, so a method states only what it does
differently. The figures the harness reads beyond the training calls (the records' and the
summary's, the cost model's) are an optional protocol of their own,
:class:`~thinwire.algorithms.reporting.Reports`: a method that implements only the training
calls is complete. Every rank must issue the same collectives in the same order: a method keeps
its schedule in counters that every rank advances alike.

:class:`Method` is the base; :class:`PeriodicAveraging` (local SGD, DaSGD: a synchronous
warm-up, then local steps and model averages every ``period`` steps) and :class:`Gossip`
(D-PSGD, PowerGossip: neighbours on a graph, no all_reduce) hold what their families share.
Methods are registered by name in :data:`thinwire.algorithms.methods.METHODS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, overload

import torch

from thinwire.aggregate import Aggregator
from thinwire.algorithms.averaging import GradientMean, ModelState, comm_or_world
from thinwire.algorithms.reporting import Reports
from thinwire.codecs.base import Codec
from thinwire.codecs.identity import Identity, IdentityConfig
from thinwire.comm.base import Communicator
from thinwire.comm.fingerprint import agree_on_parameters
from thinwire.comm.groups import is_sharded
from thinwire.comm.nodes import check_intra_dtype
from thinwire.hierarchical import HierarchicalAggregator, flat_aggregator
from thinwire.knobs import describe_config
from thinwire.registry import NoKnobs
from thinwire.scatter import ScatterMean
from thinwire.timing import Timing
from thinwire.topology import Topology, build_topology

Loss = float | torch.Tensor | None


class Method(ABC):
    """A training method: averaging, mixing or syncing around a user's optimizer steps.

    Class attributes: ``name`` (its spec name), ``summary`` (one line for ``thinwire
    methods``), ``Config`` (the frozen dataclass of its knobs, parsed from the spec),
    ``replaces_optimizer`` (the method is an optimizer, DeMo's: the trainer builds it with
    :meth:`make_optimizer` instead of its own, and refuses an ``--optimizer``),
    ``decentralized`` (the ranks' models differ between averages for good: the trainer
    evaluates their mean), ``averages_in_backward`` (the averaging runs inside
    ``loss.backward()`` and blocks it, as PyTorch's DDP does: its seconds there are not
    compute), ``peer`` (PyTorch's own implementation, listed apart as a peer to compare
    against), ``skip_unsafe`` (why a step dropped on every rank after its backward pass,
    for a non-finite gradient, would leave the method's state unclean; None: it would not),
    ``flat_only`` (why the method cannot average in two levels, uncompressed inside a node
    and compressed between nodes (``--group-size``); None: it can), ``sharded_unsafe``
    (why it cannot run between groups whose ranks hold FSDP2 shards of the model, averaging
    each rank's shard with the same shard in the other groups (:mod:`thinwire.comm.groups`);
    None: it can; refused by default, as a method reads whole tensors unless it says
    otherwise), ``elastic_unsafe``
    (why it cannot run elastic, with workers leaving and joining (:mod:`thinwire.elastic`);
    None: it can; :meth:`check_elastic` may refuse a config of a method that otherwise can).

    The constructor takes the model, the optimizer (None where the method has no schedule
    of its own), the communicator (default: the default ``torch.distributed`` group) and a
    config, or the config's knobs as keywords; ``bucket_mb`` and ``overlap`` apply to the
    methods that average gradients. It checks, before the method sends anything, that every
    rank holds the same parameters in the same order (``parameters``: the ``(name,
    parameter)`` pairs to check, default the model's ``named_parameters()``), and raises
    :class:`~thinwire.comm.fingerprint.ParameterMismatch` on every rank when they do not.
    """

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    Config: ClassVar[type] = NoKnobs
    decentralized: ClassVar[bool] = False
    averages_in_backward: ClassVar[bool] = False
    peer: ClassVar[bool] = False
    skip_unsafe: ClassVar[str | None] = None
    replaces_optimizer: ClassVar[bool] = False
    flat_only: ClassVar[str | None] = None
    sharded_unsafe: ClassVar[str | None] = "it reads whole parameter tensors, not a rank's shard of them"
    elastic_unsafe: ClassVar[str | None] = "its rules for a quorum that changes between steps are not written"
    # True where a step's computation is not the task's plain forward, backward and optimizer
    # step (AB-training's factorized layers, DeMo's own optimizer): ``compare`` and ``cost``
    # then keep this method's own compute figure instead of the one its race shares
    own_compute: ClassVar[bool] = False

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: Any = None, *, bucket_mb: float = 25.0,
                 overlap: bool = True, parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                 **knobs: Any) -> None:
        if config is not None and knobs:
            raise TypeError(f"{self.name}: pass a config or its knobs, not both (got {', '.join(knobs)})")
        self.config = config if config is not None else self.Config(**knobs)
        self.model: torch.nn.Module | None = model
        self.optimizer = optimizer
        self.comm = comm_or_world(comm)
        hierarchy = self.comm.hierarchy
        sharded = (hierarchy is not None and hierarchy.sharded) or (
            model is not None and any(is_sharded(p) for p in model.parameters()))
        if sharded and self.sharded_unsafe is not None:
            raise ValueError(f"{self.name} cannot run between groups of sharded ranks: {self.sharded_unsafe}")
        if self.flat_only is not None and hierarchy is not None and not hierarchy.sharded:
            raise ValueError(f"{self.name} cannot average in two levels: {self.flat_only}; give it a communicator "
                             "without nodes")
        self.warned: list[str] = []  # what the method warned of (:meth:`warn`): a run's summary lists them
        if parameters is None and model is not None:
            parameters = model.named_parameters()
        if parameters is not None:  # before anything of the method's own goes on the wire
            agree_on_parameters(parameters, self.comm)
        self.bucket_mb = bucket_mb
        self.overlap = overlap

    # -- checks before any rank starts ---------------------------------------------------
    @classmethod  # noqa: B027
    def check_world(cls, config: Any, workers: int) -> None:
        """Raise ``ValueError`` when the method cannot run on ``workers`` ranks (a topology
        that does not fit, groups that do not divide the world). Default: any world."""

    @classmethod
    def check_elastic(cls, config: Any) -> str | None:
        """Why the method with ``config`` cannot run elastic (default: :attr:`elastic_unsafe`)."""
        return cls.elastic_unsafe

    @classmethod  # noqa: B027
    def check_model(cls, config: Any, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` when the method cannot run on ``model``. Default: any model."""

    @classmethod
    def make_optimizer(cls, config: Any, params: list[torch.nn.Parameter], lr: float, weight_decay: float,
                       comm: Communicator | None) -> torch.optim.Optimizer:
        """The optimizer a method that *is* one (``replaces_optimizer``: DeMo) trains with, in
        place of the trainer's Adam or SGD, built on ``params`` with the run's ``lr`` and the
        task's ``weight_decay``; the method is then built with it. Only such methods implement it."""
        raise NotImplementedError(f"{cls.name} trains with the run's optimizer")

    # -- the training loop -----------------------------------------------------------------
    def forward_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module to run forward and backward through: ``model`` itself, or a wrapper
        around it (PyTorch's DDP for its peers)."""
        return model

    @abstractmethod
    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """Called after ``loss.backward()`` with this rank's loss of the step (detached) and
        the ``GradScaler`` if there is one. Returns False when every rank skips the step (a
        scaler's overflow); methods that do not read the scaler return True and leave the
        decision to each rank's scaler."""

    @abstractmethod
    def after_step(self) -> None:
        """Called after ``optimizer.step()``, every step: the method's schedule advances."""

    def warn(self, message: str) -> None:
        """Warn the user (``warnings.warn``) and keep the message in :attr:`warned`, which
        ``thinwire train`` writes into ``summary.json`` under ``warnings``."""
        import warnings

        self.warned.append(message)
        warnings.warn(message, stacklevel=3)

    def communicates_next(self) -> bool:
        """Whether the next step (``after_backward`` through ``after_step``) issues a collective.
        An elastic worker asks for a quorum, votes and keeps a copy to undo the step only on
        steps that do; on the others it trains alone. Default: every step does."""
        return True

    def elastic_join(self) -> None:  # noqa: B027
        """Called on a worker that joined a running elastic job, right after it took a present
        worker's state (model, optimizer, this method's state): where the model it should
        start from is not that worker's (DiLoCo: the global model, not the peer's weights
        within the round), set it here. Default: nothing."""

    def finish(self) -> torch.nn.Module | None:
        """Called once after the last step: work the method ends with (AB-training's final
        sync, which gives the model back with plain layers and returns it). Default: none."""
        return None

    @property
    @abstractmethod
    def timing(self) -> Timing:
        """Seconds in codecs and in communication so far (this rank's host clock)."""

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs beside the model and the optimizer. Default: none."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` gave, after the model and the optimizer (strict:
        a state this method does not keep raises ``ValueError``)."""
        if state:
            raise ValueError(f"{self.name} keeps no state, got {', '.join(map(str, state))}")

    # -- figures -----------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        """The method's spec with every knob filled in."""
        return describe_config(self.name, self.config)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"


class PeriodicAveraging(Method, Reports):
    """Model averaging on a schedule: ``config.warmup`` synchronous steps (fp32 gradient
    averaging, overlapped with backward), then local steps with an average of the model
    state (:class:`~thinwire.algorithms.averaging.ModelState`) on the subclass's schedule.

    ``config`` has ``period``, ``warmup`` and ``average_momentum``. A subclass implements
    :meth:`after_local_step`, called after every step past the warm-up with the count of
    local steps, averages through :meth:`averager` and adds its own other seconds (gathering,
    merging) to ``self._timing``.

    Over a world with nodes (``comm.hierarchy``, ``--group-size``) the local steps are
    local to a node, not to a rank: every step's gradients are averaged inside the node in
    fp32 (plain DDP there, :attr:`node`), so a node's ranks keep one model, and the averages
    on the schedule go uncompressed inside each node and through the codec between nodes
    (the layout of HSDP with DiLoCo between nodes). Over sharded groups (FSDP2 inside a group,
    ``hierarchy.sharded``) FSDP keeps the group's ranks in step, and every average is of this
    rank's shards (:class:`~thinwire.algorithms.averaging.ModelState`'s local tensors) with the
    same shards in the other groups.
    """

    elastic_unsafe: ClassVar[str | None] = None  # its averages run within one step: any quorum can take them
    sharded_unsafe: ClassVar[str | None] = None  # it averages each rank's shard, element by element

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: Any = None, *, bucket_mb: float = 25.0,
                 overlap: bool = True, **knobs: Any) -> None:
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        self.model: torch.nn.Module = model
        self.state = ModelState(model, optimizer, self.config.average_momentum)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.warmup = GradientMean(trainable, self.comm, bucket_mb, overlap=overlap, armed=self.config.warmup > 0)
        hierarchy = self.comm.hierarchy
        # with nodes: the local steps' gradient mean inside the node (every step past the warm-up)
        self.node = None
        if hierarchy is not None and not hierarchy.sharded:  # sharded: FSDP averages inside the group
            from thinwire.codecs.specs import build_codec

            cast = None if hierarchy.dtype == torch.float32 else build_codec(hierarchy.dtype_name)  # --intra-dtype
            self.node = GradientMean(trainable, hierarchy.intra, bucket_mb, overlap=overlap,
                                     armed=self.config.warmup == 0, codec=cast)
        self.step = 0  # optimizer steps completed; identical on every rank
        self._timing = Timing()
        self.aggregators: list[Aggregator | ScatterMean] = []  # what the averages go through (see averager())

    @overload
    def averager(self, like: torch.Tensor, codec: Codec | None = None) -> Aggregator: ...

    @overload
    def averager(self, like: torch.Tensor, codec: Codec | None = None, *, scatter: bool,
                 comm: Communicator | None = None) -> Aggregator | ScatterMean: ...

    def averager(self, like: torch.Tensor, codec: Codec | None = None, *, scatter: bool = False,
                 comm: Communicator | None = None) -> Aggregator | ScatterMean:
        """An :class:`~thinwire.aggregate.Aggregator` of one flat tensor shaped as ``like``
        (the model state, or a delta of it) through ``codec`` (default: fp32, ``identity``),
        whose seconds count in :attr:`timing`. Build it once and reuse it. Over nodes its
        stages inside a node stay fp32 whatever ``--intra-dtype`` says: it averages weights
        (or their deltas), which bf16 would round at every sync. ``scatter``: a
        :class:`~thinwire.scatter.ScatterMean` instead (a gathered codec's compressed
        reduce-scatter + all-gather, over all ranks, nodes or not). ``comm``: another
        communicator over the same ranks (a background sync's twin, with worker groups of its own)."""
        if scatter:
            assert codec is not None  # the config refuses scatter without a gathered codec
            over = comm or self.comm
            hierarchy = over.hierarchy
            across = hierarchy.inter if hierarchy is not None and hierarchy.sharded else over
            mean = ScatterMean("model", like, codec, across)
            self.aggregators.append(mean)
            return mean
        agg = flat_aggregator("model", like, codec if codec is not None else Identity(IdentityConfig()),
                              comm or self.comm)
        if isinstance(agg, HierarchicalAggregator):
            agg.dtype = torch.float32
        self.aggregators.append(agg)
        return agg

    @property
    def timing(self) -> Timing:
        node = [self.node.timing] if self.node is not None else []
        return Timing.total([self._timing, self.warmup.timing, *node, *(a.timing for a in self.aggregators)])

    @property
    def warming_up(self) -> bool:
        """Whether the next step is a synchronous warm-up step."""
        return self.step < self.config.warmup

    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """During the warm-up, replace every gradient with its mean over the ranks; after it,
        with nodes, with its mean over the node's ranks."""
        if self.warming_up:
            self.warmup.reduce()
        else:
            self.node_mean()
        return True

    def node_mean(self) -> None:
        """With nodes, replace every gradient with its mean inside the node (a local step)."""
        if self.node is not None:
            self.node.reduce()

    def after_step(self) -> None:
        """Count the step; past the warm-up, run the subclass's schedule."""
        self.step += 1
        self.warmup.armed = self.warming_up  # the warm-up's gradients overlap backward
        if self.node is not None:
            self.node.armed = not self.warming_up
        local = self.step - self.config.warmup
        if local > 0:
            self.after_local_step(local)

    @abstractmethod
    def after_local_step(self, local: int) -> None:
        """The schedule after local step ``local`` (1, 2, ... after the warm-up)."""

    def communicates_next(self) -> bool:
        """A warm-up step averages gradients; a local step communicates where
        :meth:`averages_after` says its schedule averages (and, with nodes, every local step
        averages inside the node)."""
        local = self.step + 1 - self.config.warmup
        return local <= 0 or self.node is not None or self.averages_after(local)

    def averages_after(self, local: int) -> bool:
        """Whether the schedule issues a collective after local step ``local``. Default: yes
        (a subclass that knows its schedule says when)."""
        return True

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "sync": self.warmup.state_dict()}
        if self.node is not None:
            state["node"] = self.node.state_dict()
            state["intra_dtype"] = self._intra_dtype()
        return state

    def _intra_dtype(self) -> str:
        return self.comm.hierarchy.dtype_name if self.comm.hierarchy is not None else "fp32"

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.warmup.load_state_dict(state["sync"])
        self.warmup.armed = self.warming_up
        if self.node is not None:
            if "node" not in state:
                raise ValueError("checkpoint was saved without nodes (flat); this run has --group-size: resume "
                                 "with the same --group-size")
            check_intra_dtype(state.get("intra_dtype"), self._intra_dtype())
            self.node.load_state_dict(state["node"])
            self.node.armed = not self.warming_up


class Gossip(Method, Reports):
    """Decentralized training on a graph (``config.topology``): each rank mixes its model
    with its neighbours' through point-to-point exchanges, with no all_reduce. The ranks'
    models differ, so the trainer evaluates their mean (:attr:`decentralized`). Mixing
    happens in :meth:`after_backward`, before the optimizer applies the gradient computed
    at the old model (the D-PSGD order); :meth:`after_step` does nothing."""

    flat_only = "it exchanges with its graph neighbours by rank, not through a node's groups"
    sharded_unsafe = "it exchanges whole models with its graph neighbours by rank"
    elastic_unsafe = "its graph of neighbours is fixed by rank and is not rebuilt when workers leave or join"

    decentralized = True

    @classmethod
    def check_world(cls, config: Any, workers: int) -> None:
        """Raise ``ValueError`` unless the topology fits ``workers`` (e.g. no torus of a prime)."""
        build_topology(config.topology, workers)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: Any = None, *, bucket_mb: float = 25.0,
                 overlap: bool = True, **knobs: Any) -> None:
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        self.model: torch.nn.Module = model
        self.topology: Topology = build_topology(self.config.topology, self.comm.world_size)
        self.neighbours: Sequence[int] = self.topology.neighbours(self.comm.rank)
        self.step = 0
        self._timing = Timing()

    @property
    def timing(self) -> Timing:
        return self._timing

    def after_step(self) -> None:
        """Nothing: the mix happened before the optimizer step (D-PSGD order)."""

    def report(self) -> dict[str, Any]:
        return {"method": self.spec, "topology": self.topology.describe(), "neighbours": list(self.neighbours)}

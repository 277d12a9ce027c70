"""PyTorch Lightning: any thinwire codec, policy or model-averaging method from a ``Trainer``.

    import thinwire.lightning
    trainer = lightning.pytorch.Trainer(strategy=thinwire.lightning.strategy("powersgd:rank=2"), ...)

:func:`strategy` gives a :class:`ThinwireStrategy`, Lightning's own ``DDPStrategy`` (same
launchers, samplers, ``no_sync`` under gradient accumulation, checkpoints) with thinwire's
communication in place of DDP's all_reduce:

* **Codecs and policies** (``powersgd:rank=2``, ``topk:ratio=0.01``, ``hylo``...): DDP's
  buckets are averaged by :func:`thinwire.ddp.register`'s hook, overlapped with the backward
  pass as DDP's own all_reduce is; on every device (Lightning registers its own
  ``ddp_comm_hook`` on CUDA only). Under ``precision="16-mixed"`` the hook gets Lightning's
  ``GradScaler``: buckets are averaged in unscaled units and an overflow skips the step on
  every rank.
* **Methods with a schedule** that keep the user's model and optimizer: ``localsgd``,
  ``dasgd``, ``diloco``, ``streaming-diloco``, ``dpsgd``, ``powergossip``. DDP still wraps
  the model (Lightning's loops expect it) but its hook sends nothing; the method is attached
  with :func:`thinwire.attach` to the LightningModule and its one optimizer, its
  ``after_backward`` runs when the optimizer's closure (forward and backward of the step's
  last micro-batch) has returned, before gradient clipping and ``optimizer.step``, and its
  ``after_step`` after the step. Manual optimization: ``after_backward`` follows every
  ``manual_backward``.
* **Refused**, each with its reason: ``ab`` (it replaces the model's layers, which Lightning
  built the optimizer on), ``demo`` and the ``peer-*``/``torch-*`` peers (an optimizer of their
  own, or PyTorch's hooks: Lightning's ``DDPStrategy(ddp_comm_hook=...)`` runs those).

**Checkpoints.** ``trainer.save_checkpoint`` (and ``ModelCheckpoint``) store every rank's
thinwire state (residuals, codec state, snapshots, outer optimizer, schedule) under the
checkpoint's ``"thinwire"`` key, gathered to rank 0, which writes the file; ``fit(ckpt_path=...)``
gives each rank its own back. A checkpoint of another method or world size is refused by
name; one without thinwire state (saved with another strategy, or while interrupted by an
exception or a signal, when the ranks cannot gather) loads with a warning and thinwire starts
afresh. ``validate``/``test``/``predict`` read no thinwire state. A strategy of a
model-averaging method runs one ``fit`` (it attaches to that fit's optimizer); a codec's
runs any number.

The model-averaging methods keep DDP from broadcasting rank 0's buffers at every forward
(``broadcast_buffers=False`` unless given): each rank keeps its own, as in a plain loop.

At the end of ``fit`` the model-averaging methods leave each rank with its own model, apart
by the steps since the last average, as :func:`thinwire.attach` does: choose ``max_steps``
a multiple of the period for one model. :meth:`ThinwireStrategy.scalars` gives the figures
a logger takes (``self.log_dict(self.trainer.strategy.scalars())``).
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("thinwire.lightning needs PyTorch Lightning: pip install 'thinwire[lightning]'") from e

from thinwire.algorithms.attach import Attached, attach
from thinwire.algorithms.methods import kind_of, method_config, resolve_method
from thinwire.integrations import ddp
from thinwire.integrations.ranks import gather_states
from thinwire.policy import Policy

_REFUSED = {
    "ab": "it replaces the model's layers with low-rank factors, and Lightning built the optimizer on the old ones",
}


def _kind(method: str | Policy) -> str:
    """``"gradient"`` (a codec or policy: the DDP hook) or ``"schedule"`` (thinwire.attach);
    raises ``ValueError`` for a method Lightning cannot run, saying why."""
    if isinstance(method, Policy) or kind_of(method) != "method":
        return "gradient"
    cls, _ = method_config(method)
    name = cls.name
    if name in _REFUSED:
        raise ValueError(f"thinwire.lightning cannot run {name!r}: {_REFUSED[name]}; use thinwire.attach in a "
                         "plain loop")
    if cls.replaces_optimizer:
        raise ValueError(f"thinwire.lightning cannot run {name!r}: it is an optimizer of its own; return it from "
                         "configure_optimizers in a plain DDP run, or use thinwire.attach in a plain loop")
    if cls.peer:
        raise ValueError(f"thinwire.lightning does not run the peer {name!r}: for PyTorch's own hooks pass "
                         "DDPStrategy(ddp_comm_hook=...) to the Trainer")
    return "schedule"


class ThinwireStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` communicating through thinwire (see the module's docstring).

    ``method``: a spec ``thinwire methods`` lists, or a :class:`~thinwire.policy.Policy`;
    ``overlap``: average while the backward pass goes on (codecs; the warm-ups of the
    schedule methods), ``bucket_mb``: the schedule methods' own buckets. Other keyword
    arguments go to ``DDPStrategy`` (and DDP): ``find_unused_parameters``, ``timeout``,
    ``process_group_backend``, ``start_method``...
    """

    strategy_name = "thinwire"

    def __init__(self, method: str | Policy = "identity", *, overlap: bool = True, bucket_mb: float = 25.0,
                 **kwargs: Any) -> None:
        for taken in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(taken) is not None:
                raise ValueError(f"thinwire.lightning.strategy runs the communication itself: {taken} is "
                                 "DDPStrategy's own, pass it to DDPStrategy instead")
        self.kind = _kind(method)
        self.method: str | Policy = method
        self.spec = method.describe() if isinstance(method, Policy) else resolve_method(method)
        self.overlap = overlap
        self.bucket_mb = bucket_mb
        self.hook_state: ddp.HookState | None = None
        self.attached: Attached | None = None
        self._pending: dict[str, Any] | None = None  # a checkpoint's thinwire state, applied once built
        if self.kind == "schedule":  # DDP sends nothing for these: not rank 0's buffers at every forward either
            kwargs.setdefault("broadcast_buffers", False)
        super().__init__(**kwargs)

    def __repr__(self) -> str:
        return f"<thinwire.lightning.ThinwireStrategy {self.spec}>"

    # --- building --------------------------------------------------------------------------

    def _scaler(self) -> Any:
        return getattr(self.precision_plugin, "scaler", None)

    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        if self.kind == "gradient":
            self.hook_state = ddp.register(self.model, self.method, scaler=self._scaler(), overlap=self.overlap)
        else:
            self.model.register_comm_hook(None, ddp.local_only)

    def setup(self, trainer: Any) -> None:
        fitting = self._fitting(trainer)
        if fitting and self.attached is not None:
            raise RuntimeError(f"this strategy already ran a fit of {self.spec}, attached to that fit's optimizer: "
                               "give the next Trainer a new thinwire.lightning.strategy(...)")
        super().setup(trainer)  # fitting: DDP wraps the model and, for codecs, a new hook state is registered
        if fitting and self.kind == "schedule":
            if len(self.optimizers) != 1:
                raise ValueError(f"{self.spec} averages one optimizer's model; configure_optimizers returned "
                                 f"{len(self.optimizers)}")
            assert self.lightning_module is not None
            self.attached = attach(self.lightning_module, self.optimizers[0], self.method, bucket_mb=self.bucket_mb,
                                   overlap=self.overlap)
        if fitting and self._pending is not None:
            self._load(self._pending)
            self._pending = None

    def teardown(self) -> None:
        super().teardown()
        self._pending = None  # a checkpoint's state belongs to the fit it was loaded for

    @staticmethod
    def _fitting(trainer: Any) -> bool:
        from lightning.pytorch.trainer.states import TrainerFn

        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    def _trainer(self) -> Any:
        return getattr(self.lightning_module, "_trainer", None)

    def _built(self) -> bool:
        return self.hook_state is not None or self.attached is not None

    # --- the schedule methods' calls -------------------------------------------------------

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self.attached is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        attached = self.attached
        automatic = self.lightning_module is not None and self.lightning_module.automatic_optimization

        def closure_then_average() -> Any:
            loss = closure()
            if automatic and loss is not None:  # None: training_step skipped the batch, no backward ran
                attached.after_backward(loss, scaler=self._scaler())
            return loss

        out = super().optimizer_step(optimizer, closure_then_average, model, **kwargs)
        attached.after_step()
        return out

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        lm = self.lightning_module
        if self.attached is not None and lm is not None and not lm.automatic_optimization:
            self.attached.after_backward(closure_loss, scaler=self._scaler())

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.attached is not None and not self.attached.finished:
            self.attached.finish()

    # --- figures -----------------------------------------------------------------------------

    def scalars(self) -> dict[str, float]:
        """This rank's figures so far (``thinwire/bytes_sent``, ``thinwire/messages``,
        ``thinwire/codec_seconds``, ``thinwire/comm_seconds``, and the method's own such as
        DaSGD's phase), for ``self.log_dict(...)`` or a ``SummaryWriter``; empty before ``fit``
        has built the method."""
        if self.hook_state is not None:
            return self.hook_state.scalars()
        if self.attached is not None:
            return self.attached.scalars()
        return {}

    # --- checkpoints ---------------------------------------------------------------------------

    def thinwire_state_dict(self) -> dict[str, Any]:
        if self.hook_state is not None:
            return self.hook_state.state_dict()
        assert self.attached is not None
        return self.attached.state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        from lightning.pytorch.trainer.states import TrainerStatus

        trainer = self._trainer()
        if self._built() and trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED:
            # an exception's or a signal's checkpoint: the ranks need not all be here to gather
            rank_zero_warn(f"{filepath}: saved while interrupted, without {self.spec}'s state (residuals, codec "
                           "state): a resume from it starts thinwire afresh")
        elif self._built():  # every rank is here (trainer.save_checkpoint is collective): gathered to rank 0
            checkpoint["thinwire"] = {"spec": self.spec, "world_size": self.world_size,
                                      "ranks": gather_states(self.thinwire_state_dict())}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        if not self._fitting(self._trainer()):
            return checkpoint  # validate, test, predict: no thinwire state needed, none touched
        saved = checkpoint.get("thinwire")
        if saved is None:
            rank_zero_warn(f"{checkpoint_path} holds no thinwire state (saved with another strategy): {self.spec} "
                           "starts without residuals or codec state")
        elif self._built() and isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self._load(saved)  # inside this fit (a tuner restoring its checkpoint)
        else:
            self._pending = saved  # before setup: applied once this fit has built the method
        return checkpoint

    def _load(self, saved: dict[str, Any]) -> None:
        if saved["spec"] != self.spec:
            raise ValueError(f"the checkpoint's thinwire state is for {saved['spec']}, this strategy runs {self.spec}")
        if saved["world_size"] != self.world_size:
            raise ValueError(f"the checkpoint's thinwire state is for {saved['world_size']} ranks, this run has "
                             f"{self.world_size}")
        state = saved["ranks"][self.global_rank]
        if self.hook_state is not None:
            self.hook_state.load_state_dict(state)
        else:
            assert self.attached is not None
            self.attached.load_state_dict(state)


def strategy(method: str | Policy = "identity", **kwargs: Any) -> ThinwireStrategy:
    """A Lightning strategy averaging through ``method`` (see :class:`ThinwireStrategy`):
    ``Trainer(strategy=thinwire.lightning.strategy("powersgd:rank=2"), devices=..., ...)``.
    An invalid or unsupported spec raises ``ValueError`` naming the problem."""
    return ThinwireStrategy(method, **kwargs)


__all__ = ["ThinwireStrategy", "strategy"]

"""Compressed gradient averaging for any training loop, overlapped with the backward pass.

    reducer = thinwire.SyncReducer(model, "topk:ratio=0.01")
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()           # buckets are averaged while backward goes on
        reducer.reduce(loss)      # every rank's .grad now holds the compressed mean
        optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from thinwire.aggregate import CodecChooser
from thinwire.algorithms.base import Loss, Method
from thinwire.algorithms.gradients import GradientReducer, refuse_sparse
from thinwire.algorithms.methods import refuse_schedule
from thinwire.algorithms.reporting import Reports
from thinwire.codecs.base import Codec
from thinwire.codecs.specs import build_codec
from thinwire.comm.base import Communicator
from thinwire.policy import Assignment, Policy, as_policy
from thinwire.registry import NoKnobs
from thinwire.timing import Timing


class SyncReducer(Method, Reports):
    """Averages the gradients of ``model`` over all ranks through one codec or a policy.

    ``method`` is a codec spec (``"powersgd:rank=2"``), a built codec, a policy preset spec
    (``"hylo:t_fc=100000"``) or a :class:`~thinwire.policy.Policy` (a codec per parameter;
    give the model itself when a rule matches by module type); methods with their own
    schedule (``dasgd``, ``ab``, ...) attach with :func:`thinwire.attach` instead. ``comm``
    defaults to the default ``torch.distributed`` process group. Parameters are taken in
    ``named_parameters()`` order, which must be identical on all ranks to keep the
    collectives in lockstep: the reducer checks it when built and raises
    :class:`~thinwire.comm.fingerprint.ParameterMismatch` on every rank when it is not.

    Gradient semantics are DDP's (:class:`~thinwire.algorithms.gradients.GradientReducer`):
    a ``None`` gradient stays ``None`` and costs nothing, ``requires_grad`` is read every
    step, ``find_unused_parameters=True`` is needed when ranks may disagree about which
    parameters got a gradient, sparse gradients are refused, and ``reduce(scaler=...)``
    works in unscaled units and skips a scaler's overflow step on every rank.

    **Overlap** (``overlap=True``, the default). The parameters are bucketed from the last
    one backwards (the order in which backward computes gradients, as DDP buckets them). A
    hook on every parameter (``register_post_accumulate_grad_hook``) counts its gradient;
    once every gradient of the next bucket has arrived, that bucket is averaged (encoded,
    communicated in every round, decoded) on a background thread while the backward pass
    goes on, buckets strictly in bucket order on every rank. ``reduce()`` waits for them,
    writes their means into ``.grad`` and averages the rest (buckets not complete: a
    parameter that got no gradient, one frozen since the last step). The result is the
    same, bit for bit, as ``overlap=False``, which averages everything in ``reduce()``: both
    split the step into the same buckets. The local gradients stay untouched until
    ``reduce()`` (a check for non-finite values after ``backward()`` sees this rank's own).

    The reducer learns from the steps before: the first step averages everything in
    ``reduce()``; with gradient accumulation (several backward passes per ``reduce()``) a
    bucket goes when its gradients have arrived as often as the most backward passes seen
    per step so far, so shorter windows simply go later. Steps with a ``GradScaler`` and
    ``find_unused_parameters=True`` are decided whole at ``reduce()`` (no overlap). What a
    user must not do with overlap on: change a gradient between ``backward()`` and
    ``reduce()`` (the value at the end of backward is what is sent; DDP has the same
    rule), run more backward passes before one ``reduce()`` than ever before (raises
    ``RuntimeError`` naming the parameter: the step's average would be wrong), skip
    ``reduce()`` after a backward pass (a launched bucket's collective is already out),
    start passing a scaler after steps without one, or keep two overlapping reducers on
    one model. ``overlap=False`` lifts all of these. Overlap keeps one gradient-sized buffer
    (the launched buckets' means wait there until ``reduce()``) and one thread per reducer.
    """

    name = "sync"  # a codec's or a policy's own spec names it (``spec``), not a registry entry
    summary = "synchronous gradient averaging through a codec or a policy"
    elastic_unsafe = None  # each step's average is over the workers present, its divisor their count
    sharded_unsafe = None  # a shard's gradient goes through the codec as a tensor of its own (its local shape)


    def __init__(
        self,
        model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
        method: str | Codec | Policy = "identity",
        comm: Communicator | None = None,
        *,
        bucket_mb: float = 25.0,
        find_unused_parameters: bool = False,
        overlap: bool = True,
    ) -> None:
        if isinstance(model, torch.nn.Module):
            refuse_sparse(model)
            named = list(model.named_parameters())
        else:
            named = model = list(model)
        if not any(p.requires_grad for _, p in named):
            raise ValueError("SyncReducer needs at least one parameter with requires_grad=True")
        if isinstance(method, str):
            refuse_schedule(method, "SyncReducer")
        self.policy = as_policy(method)
        chooser: CodecChooser
        if self.policy is not None:
            self.assignment: Assignment | None = self.policy.assign(model)
            chooser = self._policy_chooser
            self.method = self.policy.describe()
        else:
            self.assignment = None
            assert not isinstance(method, Policy)  # as_policy took every Policy
            codec = build_codec(method) if isinstance(method, str) else method
            chooser = lambda name, t: codec  # noqa: E731
            self.method = codec.describe()
        # the communicator last: a bad spec is named whether or not torch.distributed is up
        super().__init__(model if isinstance(model, torch.nn.Module) else None, None, comm, NoKnobs(),
                         bucket_mb=bucket_mb, overlap=overlap, parameters=named)
        self.reducer = GradientReducer(named, chooser, self.comm, bucket_mb=bucket_mb,
                                       find_unused_parameters=find_unused_parameters, overlap=overlap)
        self.params = [(n, p) for n, p in named if p.requires_grad]  # trainable when built
        self.aggregator = self.reducer.aggregator
        self.codecs = self.aggregator.codecs  # the codecs in use, the fp32 fallback included
        windows = sorted({c.loss_window() for c in self.codecs} - {0})
        if len(windows) > 1:
            raise ValueError(f"codecs of one reducer must share one loss window, got windows of {windows} steps")
        self._window = windows[0] if windows else 0
        self._loss_sum = 0.0  # this rank's training loss summed over the current window

    def _policy_chooser(self, name: str, tensor: torch.Tensor) -> Codec:
        assert self.assignment is not None  # the chooser of a reducer built from a policy
        if name not in self.assignment.rule_of:
            raise ValueError(f"parameter {name!r} was frozen when the reducer was built, so the policy gave it "
                             "no codec; build the reducer after unfreezing it")
        return self.assignment.codec_for(name)

    @property
    def timing(self) -> Timing:
        return self.reducer.timing

    @property
    def step(self) -> int:
        return self.reducer.step

    @property
    def skipped(self) -> int:
        """Steps skipped on every rank for a scaler's overflow."""
        return self.reducer.skipped

    def reduce(self, loss: float | torch.Tensor | None = None, *, scaler: Any = None) -> bool:
        """Replace every parameter's ``.grad`` with the mean over ranks (in place); False when
        the step was skipped for ``scaler``'s overflow.

        Call it after ``backward()`` and before ``optimizer.step()`` (with a
        ``torch.amp.GradScaler``: before ``scaler.unscale_``/``scaler.step``, passing the
        scaler). ``loss``, this rank's training loss of the step, is required by codecs whose
        schedule follows the loss (``fft:schedule=recover``): at the end of each of their
        windows the ranks agree on the window's mean loss with one 8-byte all_reduce
        (counted by the meter) and the codec sees it.
        """
        window = self._window
        if window and loss is None:
            raise ValueError(f"{self.method} follows the training loss: call reduce(loss=...) every step")
        if not self.reducer.reduce(scaler):
            return False  # nothing reduced: the loss window waits too
        if window:
            assert loss is not None  # refused above
            self._loss_sum += float(loss)
            if self.step % window == 0:
                self._agree_loss(window)
        return True

    def _agree_loss(self, window: int) -> None:
        device = self.params[0][1].device
        total = torch.tensor([self._loss_sum], dtype=torch.float64, device=device)  # (1,)
        self.comm.all_reduce(total)  # identical on every rank, so is the codec's reaction
        mean = total.item() / (window * self.comm.world_size)
        for codec in self.codecs:
            if codec.loss_window():
                codec.observe_loss(mean)
        self._loss_sum = 0.0

    # -- the Method interface (see algorithms/base.py) ---------------------------------------
    @property
    def spec(self) -> str:
        """The codec's or the policy's spec with every knob filled in."""
        return self.method

    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """:meth:`reduce`."""
        return self.reduce(loss, scaler=scaler)

    def after_step(self) -> None:
        """Nothing to do after the optimizer step: the gradients were already averaged."""

    def stats(self) -> dict:
        """The codecs' figures for the last step (logged in metrics.jsonl); a name two codecs
        share is logged once per codec as ``name@codec``."""
        out: dict = {}
        seen: dict[str, int] = {}
        every = [c.stats() for c in self.codecs]
        for s in every:
            for k in s:
                seen[k] = seen.get(k, 0) + 1
        for c, s in zip(self.codecs, every):
            for k, v in s.items():
                out[k if seen[k] == 1 else f"{k}@{c.name}"] = v
        return out

    def overlap_report(self) -> dict[str, Any]:
        """How much of the averaging ran beside the backward pass, over the run so far:
        ``steps`` that launched buckets in backward, ``window_seconds`` (from the first
        launch to ``reduce()``: the backward time communication could hide behind),
        ``blocked_seconds`` (``reduce()`` waiting for launched buckets), ``early_share``
        (the share of averaged elements launched in backward), ``reduces`` (steps averaged) and
        ``leads``: per launch position, in launch order, (mean seconds from the launch to
        ``reduce()``, share of the averaged elements), the cost model's queue of buckets."""
        f = self.reducer.overlap_figures
        elements = f["elements"]
        return {"enabled": self.reducer.overlap, "steps": f["steps"], "window_seconds": f["window_seconds"],
                "blocked_seconds": f["blocked_seconds"],
                "early_share": f["early_elements"] / elements if elements else 0.0, "reduces": f["reduces"],
                "leads": [[seconds / max(n, 1), count / elements if elements else 0.0]
                          for seconds, count, n in zip(f["lead_seconds"], f["lead_elements"], f["lead_steps"])]}

    def summary_fields(self) -> dict[str, Any]:
        return {"overlap": self.overlap_report()}

    def report(self) -> dict:
        """Extra figures for summary.json: the method, each tensor's codec and per-step wire
        bytes, and the policy's rules when there is one."""
        out = {"codec": self.method, "layers": self.plan()}
        if self.policy is not None:
            out["policy"] = self.policy.to_dicts()
        return out

    def per_parameter(self) -> list[dict]:
        """Per parameter, in ``named_parameters()`` order: name, shape, codec spec and the bytes
        this rank sent for it so far (all steps, as the byte meter counts them)."""
        sent = self.reducer.sent_bytes
        plan = {r["name"]: r for r in self.plan()}
        return [{"name": name, "shape": plan[name]["shape"], "codec": plan[name]["codec"], "bytes_sent": sent[name]}
                for name, _ in self.params]  # in parameter order

    def plan(self) -> list[dict]:
        return self.reducer.plan()

    def elastic_join(self) -> None:
        """A worker that joined a running elastic job starts with no error-feedback residual:
        the one it took is a present worker's own unsent error, which would be sent twice."""
        self.reducer.clear_feedback()

    def state_dict(self) -> dict:
        return {**self.reducer.state_dict(), "loss_sum": self._loss_sum}

    def load_state_dict(self, state: dict) -> None:
        self.reducer.load_state_dict(state)
        self._loss_sum = float(state.get("loss_sum", 0.0))

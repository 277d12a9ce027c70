"""AB-training (Coquelin et al., arXiv 2405.01067): weights factored into low-rank ``A·B``,
trained by independent groups of workers, reconciled periodically.

    ab = thinwire.ABTraining(model, optimizer)   # swaps layers for Factorized; groups: half the world
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        ab.after_backward()   # gradient mean over the world (full-rank phases) or the group
        optimizer.step()
        ab.after_step()       # phase changes: factorise, sync, re-factorise
    ab.finish()               # a final sync if inside a group phase, then the plain model comes back

Every Linear and Conv layer except the excluded ones (default: the first and the last)
becomes a :class:`~thinwire.nn.Factorized` wrapper until ``finish()``, which swaps the
original layer objects back (see :meth:`ABTraining.finish`). With ``t`` the steps completed:

* ``t < warmup``: full-rank synchronous training (fp32 gradient mean over all ranks).
* ``t == warmup``: factorise without truncation (rank ``min(m, n)``), start a group phase.
* group phase: the ranks form contiguous groups of ``group_size``; the first half of the
  groups train ``A`` (``B`` frozen), the second half ``B`` (``sync=only-b``: every group
  trains ``B``). Each step averages the trained factor's gradient and those of every
  unfactored parameter (biases, norms, excluded layers) within the group only.
* ``t % cycle == 0`` (after the warm-up): sync over all ranks (``sync`` mode below), back to
  the full-rank ``W``, then ``full_steps`` synchronous full-rank steps.
* ``t % cycle == full_steps``: re-factorise with truncation: keep the singular values above
  ``cutoff · σ_1``, the largest rank over the ranks wins (all_gather, MAX), so shapes agree.
  Then the next group phase.

Sync modes: ``full`` averages the products ``A·B``; ``with-stale`` averages ``A`` and ``B``
separately (the frozen copies too) and multiplies; ``only-learned`` takes ``A`` from the
A-groups and ``B`` from the B-groups (one all_reduce, each rank contributing its trained
factor); ``only-b`` averages ``B`` (``A`` is never trained, so it agrees already). Unfactored
parameters, their optimizer state (momentum, Adam moments: the groups averaged their
gradients apart) and floating-point buffers are averaged over all ranks at every sync, so
the full-rank steps after it run identically on every rank.

At each phase change (factorisation, sync, re-factorisation) the learning rate restarts
at 1e-5 and ramps linearly back to the optimizer's over ``rebound`` steps (capped at the
optimizer's own). The factors join the optimizer as a new parameter group: create a
learning-rate scheduler after ``ABTraining`` so that it covers them, and step it after
``after_step()``. At a re-factorisation the optimizer's
per-parameter state of ``A`` and ``B`` (momentum, Adam moments) is sliced to the new rank
(zero-padded if the rank grew); ``reset_optimizer`` clears it instead. ``A = U S^1/2``,
``B = S^1/2 V^T``; under ``only-b`` ``A = U`` and ``B = S V^T``, as the reference code does
(its frozen ``A`` is then an orthonormal basis).

Use Adam or AdamW (the paper's choice): with ``B`` fixed, a step on ``A`` moves ``W`` by
``-lr grad_W B^T B``, scaled by the singular values, and plain SGD at a high learning rate
can diverge (measured: the small VGG at SGD lr 0.1 fell to chance accuracy).

Default knobs (ours, scaled to the bundled 600-800-step tasks; the paper's runs use
thousands of steps): warm-up 100, cycle 100, 10 full-rank steps, cutoff 0.15 (docs/methods.md's `ab` section),
rebound 20 steps, groups of half the world.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.algorithms.averaging import GradientMean
from thinwire.algorithms.base import Loss, Method
from thinwire.algorithms.methods import METHODS
from thinwire.algorithms.reporting import Reports
from thinwire.comm.base import Communicator
from thinwire.knobs import knob, require
from thinwire.nn.factorized import Factorized, factorize_model, rank_for, resolve_exclude, unfactorize_model
from thinwire.timing import Timing

SYNC_MODES = ("full", "with-stale", "only-learned", "only-b")
PHASES = ("warmup", "group", "sync", "full")
REBOUND_FROM = 1e-5  # the learning rate each phase change restarts from


@dataclass(frozen=True, kw_only=True)
class ABConfig:
    group_size: int = knob(0, "ranks per group (contiguous blocks); 0 = half the world (one A and one B group)",
                           ">= 0, divides the world")
    sync: str = knob("full", "how the groups' factors are reconciled at each sync", "|".join(SYNC_MODES))
    warmup: int = knob(100, "full-rank synchronous steps before the first factorisation", ">= 0")
    cycle: int = knob(100, "steps between syncs (S)", "> full_steps")
    full_steps: int = knob(10, "full-rank synchronous steps after each sync (D)", ">= 0")
    cutoff: float = knob(0.15, "keep singular values above cutoff * the largest", "(0, 1)")
    rebound: int = knob(20, "steps of the LR ramp from 1e-5 after each phase change; 0 = off", ">= 0")
    exclude: str = knob("first;last", "layers kept full rank: module names separated by ';', first / last "
                        "for the first and last Linear/Conv layer, or none", "NAME;...|none")
    reset_optimizer: bool = knob(False, "clear the factors' optimizer state at each re-factorisation "
                                 "(default: slice it to the new rank)", "true|false")

    def __post_init__(self) -> None:
        require(self.group_size >= 0, f"group_size must be >= 0, got {self.group_size}")
        require(self.sync in SYNC_MODES, f"sync must be one of {', '.join(SYNC_MODES)}, got {self.sync!r}")
        require(self.warmup >= 0, f"warmup must be >= 0, got {self.warmup}")
        require(self.full_steps >= 0, f"full_steps must be >= 0, got {self.full_steps}")
        require(self.cycle > self.full_steps, f"cycle must be > full_steps, got cycle={self.cycle}, "
                f"full_steps={self.full_steps}")
        require(0 < self.cutoff < 1, f"cutoff must be in (0, 1), got {self.cutoff}")
        require(self.rebound >= 0, f"rebound must be >= 0, got {self.rebound}")

    def excluded(self) -> list[str]:
        items = [s.strip() for s in self.exclude.split(";") if s.strip()]
        return [] if items == ["none"] else items


def groups_of(config: ABConfig, workers: int) -> list[list[int]]:
    """Contiguous blocks of ``group_size`` ranks; raises ``ValueError`` when they do not give
    at least one A and one B group (one B group under ``only-b``)."""
    if config.group_size == 0:
        require(workers % 2 == 0, f"group_size 0 (half the world) needs an even number of workers, got {workers}")
    size = config.group_size or workers // 2
    require(workers % size == 0, f"group_size {size} must divide the {workers} workers")
    count = workers // size
    require(count >= 2 or config.sync == "only-b",
            f"sync={config.sync} needs at least one A group and one B group: group_size {size} on "
            f"{workers} workers gives {count} group (group_size 0, the default, makes two halves)")
    return [list(range(g * size, (g + 1) * size)) for g in range(count)]


@METHODS.register
class ABTraining(Method, Reports):
    """Factored weights trained in groups (A or B), synchronised every ``cycle`` steps."""

    flat_only = "its groups of ranks train factors on their own; they are not nodes"
    own_compute = True  # factorized layers: another forward and backward than the task's

    name = "ab"
    summary = "AB-training: low-rank A·B factors trained in independent groups, synchronised every cycle"

    Config = ABConfig
    elastic_unsafe = "its groups of ranks and their phases are fixed by rank at the start"

    @classmethod
    def check_world(cls, config: ABConfig, workers: int) -> None:
        groups_of(config, workers)

    @classmethod
    def check_model(cls, config: ABConfig, model: torch.nn.Module) -> None:
        """Raise ``ValueError`` when ``exclude`` names no layer or leaves nothing to factorise."""
        from thinwire.nn.factorized import factorizable

        names = factorizable(model)
        left = [n for n in names if n not in set(resolve_exclude(model, config.excluded()))]
        require(bool(left), f"ab: no Linear or Conv layer left to factorise (layers: {', '.join(names) or 'none'}; "
                f"exclude={config.exclude})")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: ABConfig | None = None, *,
                 bucket_mb: float = 25.0, overlap: bool = True, **knobs: Any) -> None:
        if config is None:  # the knobs are checked first, then the optimizer
            config, knobs = ABConfig(**knobs), {}
        if optimizer is None:
            raise ValueError("ab needs the optimizer (it adds the factors and slices their state)")
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        cfg, comm = self.config, self.comm
        self.optimizer: torch.optim.Optimizer = optimizer
        self.model: torch.nn.Module = model
        self.check_model(cfg, model)
        self.groups = groups_of(cfg, comm.world_size)
        self.group = next(i for i, g in enumerate(self.groups) if comm.rank in g)
        self.role = "b" if cfg.sync == "only-b" or self.group >= len(self.groups) // 2 else "a"
        self.group_comm: Communicator | None = None
        for g in self.groups:  # every rank creates every group, in the same order
            sub = comm.subgroup(g)
            if sub is not None:
                self.group_comm = sub
        self.layers: dict[str, Factorized] = factorize_model(model, cfg.excluded())
        factors = [p for layer in self.layers.values() for p in (layer.a, layer.b)]
        hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        optimizer.add_param_group({**hyper, "params": factors})
        self._load_hook = optimizer.register_load_state_dict_pre_hook(self._with_factor_group)
        weights = {id(layer.weight) for layer in self.layers.values()}
        skip = {id(p) for p in factors}
        self.full_named = [(n, p) for n, p in model.named_parameters() if id(p) not in skip]
        self.others = [(n, p) for n, p in self.full_named if id(p) not in weights]  # never factored
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.full_params = sum(p.numel() for _, p in self.full_named)
        # the warm-up's gradient mean overlaps backward; later phases drop gradients after
        # backward (frozen factors), so they average at after_backward, synchronously
        self._full_mean: GradientMean | None = GradientMean(self.full_named, comm, bucket_mb, overlap=overlap,
                                                            armed=cfg.warmup > 0)  # None after finish()
        self._full_sent = 0.0  # bytes the full-model gradient mean had sent at the last after_backward
        self._group_mean: GradientMean | None = None
        self.step = 0
        self.exported = False  # finish() gave the original layers back: nothing steps any more
        self.phase = "warmup"
        self.phase_started = 0  # step of the last phase change (the LR ramp counts from it)
        self.ranks: dict[str, int] = {}
        self.factorisations = 0
        self.syncs = 0
        self.bytes_by_phase = dict.fromkeys(PHASES, 0.0)
        self.steps_by_phase = dict.fromkeys(("warmup", "group", "full"), 0)
        self._saved_lr: list[float] | None = None
        self._timing = Timing()
        if cfg.warmup == 0:
            self._factorise(truncate=False)

    @property
    def timing(self) -> Timing:
        return self._timing

    # -- the trainer's interface --------------------------------------------------------------
    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """Average the gradients this phase trains (all ranks, or the group) and set the
        learning rate of the step (the ramp after a phase change)."""
        self._require_live("after_backward()")
        self._ramp_lr()
        for layer in self.layers.values():  # frozen tensors keep no gradient, so the optimizer skips them
            keep = {id(p) for p in layer.trained()}
            for p in (layer.weight, layer.a, layer.b):
                if id(p) not in keep:
                    p.grad = None
        self.steps_by_phase[self.phase] += 1
        if self.phase == "group":
            if self._group_mean is not None:
                self._metered("group", self._group_mean.reduce)
        else:
            assert self._full_mean is not None  # dropped by finish() only
            t0 = time.perf_counter()
            self._full_mean.reduce()
            self._timing.comm_seconds += time.perf_counter() - t0
            # the warm-up's buckets go during backward, before this call: count the mean's own bytes
            sent = sum(self._full_mean.reducer.sent_bytes.values())
            self.bytes_by_phase[self.phase] += sent - self._full_sent
            self._full_sent = sent
        return True

    def after_step(self) -> None:
        """Restore the learning rate; at a phase boundary factorise, sync or re-factorise."""
        self._require_live("after_step()")
        if self._saved_lr is not None:
            for group, lr in zip(self.optimizer.param_groups, self._saved_lr):
                group["lr"] = lr
            self._saved_lr = None
        self.step += 1
        t, cfg = self.step, self.config
        if t == cfg.warmup:
            self._factorise(truncate=False)
            return
        if t > cfg.warmup and t % cfg.cycle == 0 and self.phase == "group":
            self.sync()
        if self.phase == "full" and t % cfg.cycle == cfg.full_steps:
            self._factorise(truncate=True)

    def finish(self) -> torch.nn.Module:
        """End of training; returns the model, mutated in place into a plain one.

        1. One model on every rank: a run inside a group phase syncs (``sync`` mode, then
           ``W = A·B``); one that ends on the very step that factorised goes back to its
           full-rank ``W`` (identical on every rank, untouched by the factorisation).
        2. Export: every ``Factorized`` wrapper is swapped for the user's original layer
           object (same class and hyper-parameters) holding the same ``weight`` and ``bias``
           Parameter objects, now ``W``; ``model.state_dict()`` loads with ``strict=True``
           into a fresh instance of the model's class. The optimizer's factor group is
           emptied (kept, so learning-rate schedulers still match its groups) and the
           factors' state dropped: it holds exactly the model's parameters and can go on
           stepping them. The wrappers stay in ``self.layers`` with their last factors,
           which move into :meth:`state_dict`; ranks, compression and the report keep their
           figures.

        Afterwards the method steps no more: ``after_backward``, ``after_step``, ``sync``
        and ``load_state_dict`` raise ``RuntimeError``. A second call returns the model."""
        if self.exported:
            return self.model
        self._final_sync()
        self._export()
        return self.model

    def _final_sync(self) -> None:
        """Step 1 of :meth:`finish`: mutates the layers' modes (all ``full``) and the phase."""
        if self.phase != "group":
            return
        if self.step == self.phase_started:
            for layer in self.layers.values():
                layer.set_mode("full", keep_weight=True)
            self._enter("full")
            return
        self.sync()

    def _export(self) -> None:
        """Step 2 of :meth:`finish`: mutates the model (original layers back in) and the
        optimizer (the factors' group emptied, their state removed)."""
        unfactorize_model(self.model, list(self.layers))
        factors = {id(p): p for layer in self.layers.values() for p in (layer.a, layer.b)}
        for p in factors.values():
            self.optimizer.state.pop(p, None)
        for group in self.optimizer.param_groups:  # emptied, not removed: schedulers keep one entry per group
            keep = [id(p) not in factors for p in group["params"]]
            for key in ("params", "param_names"):
                if key in group and len(group[key]) == len(keep):
                    group[key] = [x for x, k in zip(group[key], keep) if k]
        self._load_hook.remove()  # the optimizer no longer holds this method alive
        self._full_mean = self._group_mean = None
        self.exported = True

    def _with_factor_group(self, optimizer: torch.optim.Optimizer, state: dict) -> dict | None:
        """Optimizer load pre-hook: in a state saved after :meth:`finish` the factors' group
        is empty; it gets this optimizer's count of parameter ids back (ids no saved state
        uses, so the factors start without state). Mutates only the optimizer's own shallow
        copy of ``state``."""
        groups = state["param_groups"]
        at = self._factor_group_index()
        if at is None or len(groups) != len(optimizer.param_groups) or groups[at]["params"]:
            return None
        start = max((i for g in groups for i in g["params"]), default=-1) + 1
        count = len(optimizer.param_groups[at]["params"])
        refilled = {k: v for k, v in groups[at].items() if k != "param_names"}
        refilled["params"] = list(range(start, start + count))
        state["param_groups"] = [*groups[:at], refilled, *groups[at + 1:]]
        return state

    def _factor_group_index(self) -> int | None:
        first = next((layer.a for layer in self.layers.values()), None)
        return next((i for i, g in enumerate(self.optimizer.param_groups)
                     if any(p is first for p in g["params"])), None)

    def _require_live(self, call: str) -> None:
        if self.exported:
            raise RuntimeError(f"ab: {call} after finish(): the model was exported to its plain layers and the "
                               "method steps no more (a new ABTraining on the model trains it again)")

    # -- phases --------------------------------------------------------------------------------
    def _factorise(self, truncate: bool) -> None:
        """SVD of every factored layer's full weight; agreed ranks; the group phase begins."""
        t0 = time.perf_counter()
        cfg = self.config
        svds = {name: torch.linalg.svd(layer.tall(), full_matrices=False) for name, layer in self.layers.items()}
        if truncate:
            device = next(iter(self.layers.values())).weight.device  # NCCL gathers device tensors only
            local = torch.tensor([rank_for(s, cfg.cutoff) for _, s, _ in svds.values()], dtype=torch.int64,
                                 device=device)
            every = torch.empty((self.comm.world_size, local.numel()), dtype=torch.int64, device=device)
            t_comm = time.perf_counter()
            self._metered("full", lambda: self.comm.all_gather(local, every))
            t0 += time.perf_counter() - t_comm  # counted as communication, not codec time
            ranks = every.max(0).values.tolist()
        else:
            ranks = [s.numel() for _, s, _ in svds.values()]
        for (name, layer), r in zip(self.layers.items(), ranks):
            u, s, vh = svds[name]
            old = (layer.a.shape, layer.b.shape)
            if cfg.sync == "only-b":
                layer.set_factors(u[:, :r], s[:r, None] * vh[:r])
            else:
                root = s[:r].sqrt()
                layer.set_factors(u[:, :r] * root, root[:, None] * vh[:r])
            self._refit_state(layer, old)
            layer.set_mode(self.role)
            self.ranks[name] = r
        self._group_mean = self._build_group_mean()
        self.factorisations += 1
        self._enter("group")
        self._timing.codec_seconds += time.perf_counter() - t0

    def _build_group_mean(self) -> GradientMean | None:
        """Gradient mean within the group over the trained factors and the unfactored
        parameters (None for groups of one rank: nothing to send)."""
        if len(self.groups[0]) == 1:
            return None
        named = [(f"{n}.{self.role}", layer.trained()[0]) for n, layer in self.layers.items()] + self.others
        assert self.group_comm is not None  # this rank's group, of more than one rank
        return GradientMean(named, self.group_comm, self.bucket_mb, overlap=False)

    def _refit_state(self, layer: Factorized, old: tuple[torch.Size, torch.Size]) -> None:
        """The optimizer state of ``A`` and ``B`` at the new rank: sliced (zero-padded if it
        grew), or cleared with ``reset_optimizer``."""
        for p, was, dim in ((layer.a, old[0], 1), (layer.b, old[1], 0)):
            state = self.optimizer.state.get(p)
            if not state:
                continue
            if self.config.reset_optimizer:
                self.optimizer.state.pop(p)
                continue
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and value.shape == was and value.dim() == 2:
                    fitted = torch.zeros_like(p)
                    r = min(value.shape[dim], p.shape[dim])
                    fitted.narrow(dim, 0, r).copy_(value.narrow(dim, 0, r))
                    state[key] = fitted

    def sync(self) -> None:
        """Reconcile all ranks (``sync`` mode), then train the full-rank ``W = A·B``."""
        self._require_live("sync()")
        t0 = time.perf_counter()
        comm, n, mode = self.comm, self.comm.world_size, self.config.sync
        layers = list(self.layers.values())
        with torch.no_grad():
            parts: list[torch.Tensor] = []
            if mode == "full":
                parts = [layer.product() for layer in layers]
            elif mode == "with-stale":
                parts = [t for layer in layers for t in (layer.a, layer.b)]
            elif mode == "only-learned":  # each rank contributes only the factor it trained
                parts = [(layer.a if self.role == "a" else torch.zeros_like(layer.a)) for layer in layers]
                parts += [(layer.b if self.role == "b" else torch.zeros_like(layer.b)) for layer in layers]
            else:  # only-b
                parts = [layer.b for layer in layers]
            rest = [p.detach() for _, p in self.others] + self.buffers + self._others_state()
            flat = torch.cat([t.detach().reshape(-1).float() for t in parts + rest])
            t1 = time.perf_counter()
            self._metered("sync", lambda: comm.all_reduce(flat))
            t2 = time.perf_counter()
            flat.div_(n)
            a_ranks = sum(len(g) for g in self.groups[: len(self.groups) // 2])
            scale = {"a": n / a_ranks if a_ranks else 0.0, "b": n / (n - a_ranks)}  # only-learned: mean of the trainers
            off = 0
            views = []
            for t in parts + rest:
                views.append(flat[off : off + t.numel()].view(t.shape))
                off += t.numel()
            mine, rest_views = views[: len(parts)], views[len(parts) :]
            for t, v in zip(rest, rest_views):
                t.copy_(v)
            for i, layer in enumerate(layers):
                if mode == "full":
                    layer.set_mode("full")
                    layer.weight.copy_(mine[i])
                    continue
                if mode == "with-stale":
                    layer.a.copy_(mine[2 * i])
                    layer.b.copy_(mine[2 * i + 1])
                elif mode == "only-learned":
                    layer.a.copy_(mine[i] * scale["a"])
                    layer.b.copy_(mine[len(layers) + i] * scale["b"])
                else:
                    layer.b.copy_(mine[i])
                layer.set_mode("full")
            for layer in layers:
                layer.a.grad = layer.b.grad = None
        self.syncs += 1
        self._enter("full")
        self._timing.codec_seconds += (t1 - t0) + (time.perf_counter() - t2)
        self._timing.comm_seconds += t2 - t1

    def _others_state(self) -> list[torch.Tensor]:
        """The optimizer's state tensors of the unfactored parameters (momentum, Adam
        moments): the groups averaged those parameters' gradients apart, so a sync averages
        this state too and the full-rank steps after it run identically on every rank."""
        out = []
        for _, p in self.others:
            for value in self.optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.is_floating_point():
                    out.append(value)
        return out

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.phase_started = self.step
        if self._full_mean is not None:
            self._full_mean.armed = False  # only the warm-up overlaps, and it never comes back

    def _ramp_lr(self) -> None:
        """Scale the step's learning rate: 1e-5 at a phase change, linear back over ``rebound``."""
        r, k = self.config.rebound, self.step - self.phase_started
        if r == 0 or self.factorisations == 0 or k >= r:
            return
        self._saved_lr = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = min(g["lr"], REBOUND_FROM + (g["lr"] - REBOUND_FROM) * k / r)

    def _metered(self, phase: str, fn: Callable[[], Any]) -> None:
        before = self.comm.meter.bytes_sent
        t0 = time.perf_counter()
        fn()
        if phase != "sync":
            self._timing.comm_seconds += time.perf_counter() - t0
        self.bytes_by_phase[phase] += self.comm.meter.bytes_sent - before

    # -- figures and state ---------------------------------------------------------------------
    def compression(self) -> dict[str, float | None]:
        """Full-rank parameters over factored (A + B) parameters: of the factored layers, and
        of the whole model (unfactored parameters counted in both)."""
        if not self.ranks:
            return {"factorized_layers": None, "model": None}
        full = sum(layer.weight.numel() for layer in self.layers.values())
        ab = sum(self.ranks[n] * sum(layer.shape) for n, layer in self.layers.items())
        return {"factorized_layers": full / ab, "model": self.full_params / (self.full_params - full + ab)}

    def stats(self) -> dict:
        return {"ab_phase": self.phase, "ab_rank_total": sum(self.ranks.values())}

    def summary_fields(self) -> dict:
        """Top-level summary.json entries."""
        return {"param_compression_ratio": self.compression(), "ranks": dict(self.ranks),
                "bytes_by_phase": dict(self.bytes_by_phase)}

    def report(self) -> dict[str, Any]:
        return {"method": self.spec, "groups": self.groups, "role": self.role,
                "factored_layers": {n: {"kind": layer.kind, "shape": list(layer.shape), "rank": self.ranks.get(n)}
                                    for n, layer in self.layers.items()},
                "factorisations": self.factorisations, "syncs": self.syncs,
                "steps_by_phase": dict(self.steps_by_phase), **self.summary_fields()}

    def state_dict(self) -> dict:
        """Phase and counters; the factors, their ranks and the layers' modes travel in the
        model's own state dict (``Factorized`` resizes ``a``/``b`` when it loads): restore the
        model, then the optimizer, then this. After :meth:`finish` the model holds no
        factors any more: the last ``A`` and ``B`` of each layer travel here instead
        (``factors``), beside ``exported``."""
        state = {"step": self.step, "phase": self.phase, "phase_started": self.phase_started,
                 "ranks": dict(self.ranks), "factorisations": self.factorisations, "syncs": self.syncs,
                 "bytes_by_phase": dict(self.bytes_by_phase), "steps_by_phase": dict(self.steps_by_phase),
                 "exported": self.exported}
        if self.exported:
            state["factors"] = {n: {"a": layer.a.detach(), "b": layer.b.detach()} for n, layer in self.layers.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (mutates the counters and the phase), after
        the model's state and the optimizer's. A run saved after :meth:`finish` trains on
        from where it ended: its plain model loads into the wrappers in mode ``full``, the
        optimizer's empty factor group gets the factors back without state (their moments
        start afresh at the next factorisation, as with ``reset_optimizer``), the last
        factors come back here, and the schedule goes on from the saved step (a full-rank
        phase). Raises ``ValueError`` for a group-phase state loaded before the model's."""
        self._require_live("load_state_dict()")
        self.step, self.phase = int(state["step"]), str(state["phase"])
        assert self._full_mean is not None  # dropped by finish() only
        self._full_mean.armed = self.phase == "warmup"
        self.phase_started = int(state["phase_started"])
        self.ranks = {k: int(v) for k, v in state["ranks"].items()}
        self.factorisations, self.syncs = int(state["factorisations"]), int(state["syncs"])
        self.bytes_by_phase = {k: float(v) for k, v in state["bytes_by_phase"].items()}
        self.steps_by_phase = {k: int(v) for k, v in state["steps_by_phase"].items()}
        for name, f in state.get("factors", {}).items():  # saved after finish(): the model holds none
            if name in self.layers and f["a"].dim() == 2:
                self.layers[name].set_factors(f["a"], f["b"])
        if self.phase == "group" and any(layer.mode != self.role for layer in self.layers.values()):
            raise ValueError("ab: load the model's state dict before the method's (the layers' modes and factor "
                             "shapes travel with the model)")
        self._group_mean = self._build_group_mean() if self.phase == "group" else None

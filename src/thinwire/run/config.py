"""The training run's configuration: parsed and validated before any rank starts."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from thinwire.algorithms.methods import (
    check_world,
    flat_only,
    own_optimizer,
    resolve_method,
    sharded_refusal,
    skip_unsafe,
)
from thinwire.codecs.config import require
from thinwire.knobs import env_seconds
from thinwire.run.memory_estimate import BYTES_PER_WORKER, check_batch

OPTIMIZERS = ("adam", "adamw", "sgd", "muon")  # --optimizer: sgd has momentum 0.9; muon: thinwire.optim.muon


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one run needs; ``resolve()`` fills task defaults and validates."""

    task: str = "mnist1d"
    method: str = "identity"
    policy: str | None = None  # a policy file (TOML): a codec per parameter instead of --method
    policy_rules: tuple[dict[str, Any], ...] = ()  # the file's rules, read once by resolve()
    # what the user typed for the method (the spec, or the --policy file): progress bars and tables name the
    # run by it (thinwire.run.labels); None: resolve() takes --policy or --method as given
    label: str | None = None
    workers: int = 2
    steps: int | None = None  # None: the task's default budget
    batch_size: int | None = None  # per rank; None: the task's default
    lr: float | None = None  # None: the task's default
    optimizer: str | None = None  # adam | adamw | sgd | muon; None: the task's default (DeMo: the method's name)
    lr_schedule: str = "constant"  # constant | cosine | wsd (thinwire.optim.schedule), of the run's optimizer
    warmup_steps: int = 0  # linear warm-up to --lr over this many steps
    min_lr: float = 0.0  # the share of --lr a cosine or wsd schedule decays to
    muon_lr: float | None = None  # --optimizer muon: Muon's own rate (None: --lr, rescaled to AdamW's RMS)
    seed: int = 0
    data_dir: str | None = None
    links: tuple[str, ...] = ()  # "1gbit,50us": report modeled time at each
    emulate_link: bool = False  # delay real collectives by the first link's modeled time
    out: str | None = None
    overwrite: bool = False
    eval_every: int | None = None  # None: the task's default
    bucket_mb: float = 25.0
    threads: int | None = None  # torch threads per rank; None: cores / workers
    task_options: dict[str, Any] = field(default_factory=dict)
    checkpoint_every: int = 0  # write a checkpoint into out/checkpoints every K steps (0: never)
    resume: str | None = None  # a run directory (its latest checkpoint) or one checkpoint directory
    on_nonfinite: str = "raise"  # a NaN/Inf gradient: raise (name it) or skip the step on every rank
    imports: tuple[str, ...] = ()  # modules (dotted names or .py files) imported before methods resolve: user codecs
    max_workers: int | None = None  # the most local ranks to spawn; None: what this machine can hold (worker_limit)
    # ranks per node (an int, or "auto": torchrun's LOCAL_WORLD_SIZE); None: flat, every rank its own node
    ranks_per_node: int | str | None = None
    intra_link: str | None = None  # the link inside a node (modeled, emulated); None: comm.nodes.INTRA_LINK
    intra_dtype: str | None = None  # of the collectives inside a node: fp32 (None) or bf16 (comm.layout.INTRA_DTYPES)
    shard: bool = False  # --shard: each group's replica sharded over its ranks with FSDP2 (needs ranks_per_node > 1)
    # TensorBoard event files beside metrics.jsonl: None when the tensorboard package is installed, True needs it
    tensorboard: bool | None = None
    # False: the evaluation steps write their records without test figures (thinwire cost's probes time
    # training steps only; a test set's evaluation of a large model would take longer than the probe)
    evaluate: bool = True
    # elastic training (thinwire.run.elastic): workers leave and join; torchft's Lighthouse decides the quorum
    elastic: bool = False
    min_workers: int | None = None  # no step commits with fewer workers (default with --elastic: 1)
    lighthouse: str | None = None  # HOST:PORT of a running Lighthouse: run one worker here (None: a local job)
    replica: int | None = None  # this worker's number with --lighthouse (default: $RANK, else 0)
    elastic_timeout: float = 4.0  # seconds: a collective, commit vote or state transfer longer than this fails
    elastic_wait: float = 60.0  # seconds a worker waits for a quorum of min_workers before it gives up
    job_secret_file: str | None = None  # the job's secret (thinwire.elastic.secret; else $THINWIRE_JOB_SECRET)
    worker_host: str | None = None  # with --lighthouse: the address this worker listens on and is reached at

    def resolve(self) -> TrainConfig:
        """Validate every field and fill defaults; raises ValueError naming the rule broken, or
        :class:`RunFinished` when a resume in place finds its run already at ``steps``.

        Three steps: :func:`plan` reads what the checks need from outside the config (the
        ``imports``, imported here and in every rank so that a method they register
        resolves like a built-in one; the environment; the files: a policy, a checkpoint's
        metadata, ``--out``), :meth:`validate` checks the config against those facts alone,
        then a batch too large for the machine's memory is refused (:func:`check_batch_memory`),
        and last the checkpoint's files are verified against their checksums."""
        facts = plan(self)
        resolved = self.validate(facts)
        check_batch_memory(resolved, facts.torchrun)
        facts.verify()
        return resolved

    def validate(self, facts: Facts) -> TrainConfig:
        """The config with every default filled, checked against ``facts``: no file or
        environment of the run's is read here (a method's own check may read its own input,
        a mixing-matrix file for a gossip topology)."""
        from thinwire.comm.link import Link

        d = facts.defaults
        require(self.workers >= 1, f"workers must be >= 1, got {self.workers}")
        # local ranks: bounded by the machine (torchrun's world is torchrun's; one elastic worker of a job
        # over machines runs here alone)
        if not facts.torchrun and not (self.elastic and self.lighthouse is not None):
            check_workers(self.workers, self.max_workers, limit=facts.worker_limit)
        steps, batch, lr, opt, eval_every = _filled(self, d)
        require(steps >= 1, f"steps must be >= 1, got {steps}")
        require(batch >= 1, f"batch-size must be >= 1, got {batch}")
        require(math.isfinite(lr) and lr >= 0, f"lr must be a finite number >= 0, got {lr}")
        require(eval_every >= 1, f"eval-every must be >= 1, got {eval_every}")
        require(math.isfinite(self.bucket_mb) and self.bucket_mb > 0,
                f"bucket-mb must be a finite number > 0, got {self.bucket_mb}")
        require(self.threads is None or self.threads >= 1, f"threads must be >= 1, got {self.threads}")
        links = tuple(str(Link.parse(s)) for s in self.links)
        require(not self.emulate_link or bool(links), "--emulate-link needs a --link to emulate")
        per_node, intra, intra_dtype = self._nodes(facts)
        require(self.checkpoint_every >= 0, f"checkpoint-every must be >= 0, got {self.checkpoint_every}")
        require(self.on_nonfinite in ("raise", "skip"),
                f"on-nonfinite must be raise or skip, got {self.on_nonfinite!r}")
        from thinwire.optim import schedule

        schedule.check(self.lr_schedule, self.warmup_steps, self.min_lr, steps)
        require(self.muon_lr is None or (math.isfinite(self.muon_lr) and self.muon_lr > 0),
                f"muon-lr must be a finite number > 0, got {self.muon_lr}")
        self._check_outputs(facts)
        method, rules = self._method(facts)
        min_workers = self._elastic(method, facts)
        if self.shard:
            require(per_node is not None and per_node > 1, "--shard needs --group-size of 2 or more ranks (the ranks "
                    "a replica is sharded over)")
            require(self.intra_dtype in (None, "fp32"), "--intra-dtype applies to groups of replicas: FSDP2 runs "
                    "the collectives of a sharded group")
            why = sharded_refusal(method)
            require(why is None, f"--shard: {method.split(':')[0]} cannot run between groups of sharded ranks: "
                    f"{why}; leave --shard out to run it between groups of replicas")
            require(opt != "muon", "--shard: Muon orthogonalises whole weight matrices, and a rank holds a shard of "
                    "each; use --optimizer adamw, or leave --shard out")
        elif per_node is not None and per_node > 1:
            why = flat_only(method)
            require(why is None, f"--group-size: {method.split(':')[0]} cannot average in two levels: {why}; "
                    "leave --group-size out to run it flat")
        own = own_optimizer(method)  # DeMo: the method is the optimizer (a resumed run's config names it)
        name = method.partition(":")[0]
        if facts.meta is not None:  # a checkpoint of another run says so first
            self._check_resume(facts, method, steps=steps, batch=batch, opt=name if own else opt, lr=lr,
                               groups=(per_node or 1, self.shard))
        if own:
            require(self.optimizer in (None, name), f"{name} is an optimizer itself, so it replaces "
                    f"--optimizer {self.optimizer}: drop --optimizer (--lr sets its learning rate)")
            opt = name
        else:
            require(opt in OPTIMIZERS, f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {opt!r}")
        require(self.muon_lr is None or opt == "muon", f"--muon-lr applies to --optimizer muon, not {opt}")
        return dataclasses.replace(
            self, method=method, policy_rules=rules, label=self.label or self.policy or self.method, steps=steps,
            batch_size=batch, lr=lr, optimizer=opt, eval_every=eval_every, links=links, out=facts.out,
            imports=facts.imports, ranks_per_node=per_node, intra_link=intra, intra_dtype=intra_dtype,
            tensorboard=self._tensorboard(), min_workers=min_workers,
        )

    def _elastic(self, method: str, facts: Facts) -> int | None:
        """The elastic options, checked; the minimum of workers (None when not elastic)."""
        if not self.elastic:
            for given, flag in ((self.min_workers, "--min-workers"), (self.lighthouse, "--lighthouse"),
                                (self.replica, "--replica"), (self.job_secret_file, "--job-secret-file"),
                                (self.worker_host, "--worker-host")):
                require(given is None, f"{flag} needs --elastic")
            return None
        from thinwire.algorithms.methods import elastic_refusal

        why = elastic_refusal(method)
        require(why is None, f"--elastic: {method.split(':')[0]} cannot run elastic: {why}")
        n = 1 if self.min_workers is None else self.min_workers
        require(1 <= n <= self.workers, f"--min-workers must be in 1..{self.workers} (--workers), got {n}")
        require(self.lighthouse is not None or not facts.torchrun,
                "--elastic under torchrun needs --lighthouse HOST:PORT (each rank is one worker of that job; start "
                "the Lighthouse with `thinwire lighthouse`)")
        require(self.replica is None or self.lighthouse is not None,
                "--replica needs --lighthouse (a local job numbers its workers itself)")
        require(self.worker_host is None or self.lighthouse is not None,
                "--worker-host needs --lighthouse (a local job's workers listen on 127.0.0.1)")
        require(self.replica is None or 0 <= self.replica < self.workers,
                f"--replica must be in 0..{self.workers - 1} (--workers {self.workers}), got {self.replica}")
        require(math.isfinite(self.elastic_timeout) and self.elastic_timeout > 0,
                f"--elastic-timeout must be a number of seconds > 0, got {self.elastic_timeout}")
        require(math.isfinite(self.elastic_wait) and self.elastic_wait > 0,
                f"--elastic-wait must be a number of seconds > 0, got {self.elastic_wait}")
        for bad, flag, why_not in (
                (self.policy is not None or bool(self.policy_rules), "--policy",
                 "give a preset or a codec with --method"),
                (self.ranks_per_node is not None, "--group-size", "a worker is one rank; the quorum is flat"),
                (self.emulate_link, "--emulate-link", "torchft's group is not thinwire's emulated one"),
                (self.on_nonfinite == "skip", "--on-nonfinite skip", "a worker's failed vote already drops a step"),
                (bool(self.links), "--link", "modeled times assume a fixed world")):
            require(not bad, f"--elastic does not take {flag}: {why_not}")
        return n

    def _tensorboard(self) -> bool:
        from thinwire.run.tensorboard import INSTALL, available

        have = available()
        require(self.tensorboard is not True or have, f"--tensorboard needs the tensorboard package: {INSTALL}")
        return have if self.tensorboard is None else self.tensorboard

    def _nodes(self, facts: Facts) -> tuple[int | None, str | None, str | None]:
        """Ranks per node (torchrun's for ``auto``), the link inside a node and the dtype of
        the collectives there, checked."""
        from thinwire.comm.layout import INTRA_DTYPES
        from thinwire.comm.link import Link
        from thinwire.comm.nodes import INTRA_LINK

        layout = facts.layout
        if layout is None:
            require(self.intra_link is None, "--intra-link needs --group-size (the link inside a group)")
            require(self.intra_dtype is None, "--intra-dtype needs --group-size (the dtype inside a group)")
            require(not self.shard, "--shard needs --group-size (the ranks a replica is sharded over)")
            return None, None, None
        dtype = self.intra_dtype or "fp32"
        require(dtype in INTRA_DTYPES, f"intra-dtype must be one of {', '.join(INTRA_DTYPES)}, got {dtype!r}")
        require(dtype == "fp32" or layout.ranks_per_node > 1,
                f"--intra-dtype {dtype} needs nodes of more than one rank (with --group-size 1 nothing runs "
                "inside a node)")
        return layout.ranks_per_node, str(Link.parse(self.intra_link or INTRA_LINK)), dtype

    def _check_outputs(self, facts: Facts) -> None:
        """Where the run writes: somewhere for checkpoints, nothing of another run replaced."""
        require(not self.checkpoint_every or facts.out is not None,
                "--checkpoint-every needs --out (where to write them)")
        if facts.continuing and facts.decides and facts.meta is not None:
            require(self.overwrite or facts.later is None,
                    f"--resume {self.resume}: continuing in {facts.own} from step {facts.meta['step']} would replace "
                    f"{facts.later}; pass --overwrite, or write elsewhere with --out")
        if facts.out is not None and not facts.continuing and facts.decides:  # under torchrun, rank 0 decides
            require(
                self.overwrite or not facts.holds_run,
                f"--out {facts.out} already holds a run (summary.json, metrics.jsonl or thinwire's checkpoints); "
                "pass --overwrite to replace it or choose another directory",
            )

    def _method(self, facts: Facts) -> tuple[str, tuple[dict[str, Any], ...]]:
        """The resolved method spec and a policy's rules (a ``--policy`` file's, read by :func:`plan`)."""
        from thinwire.policy import Policy

        if self.policy is not None:
            require(self.method == "identity", "--policy and --method are exclusive: the policy gives every "
                    "parameter its codec (leave --method out)")
            assert facts.policy is not None  # plan() read it
            return facts.policy.describe(), tuple(facts.policy.to_dicts())
        if self.policy_rules:
            return Policy(self.policy_rules).describe(), self.policy_rules
        method = resolve_method(self.method)
        if self.on_nonfinite == "skip":
            why = skip_unsafe(method)
            require(why is None, f"--on-nonfinite skip cannot keep {method.split(':')[0]} clean: {why}; "
                    "use --on-nonfinite raise")
        check_world(method, facts.world)  # under torchrun the world is torchrun's, not --workers
        if re.search(r"[:,]delay=auto(,|$)", method) and re.search(r"[:,]link=(,|$)", method):
            # streaming-diloco's delay=auto reads its link knob, or the emulated link (DaSGD's reads no link)
            require(self.emulate_link, "delay=auto needs a link to read: give the method link=RATE;LATENCY "
                    "(e.g. link=10mbit;50us), or --emulate-link with a --link")
        return method, ()

    def _check_resume(self, facts: Facts, method: str, **settings: Any) -> None:
        """The checkpoint belongs to this run and has steps left to train."""
        from thinwire.run import checkpoint

        meta = facts.meta
        assert meta is not None  # the caller's condition
        checkpoint.check_same_run(meta, workers=facts.world, task=self.task, method=method,
                                  task_options=self.task_options, seed=self.seed, batch_size=settings["batch"],
                                  optimizer=settings["opt"], lr=settings["lr"],
                                  schedule={"lr_schedule": self.lr_schedule, "warmup_steps": self.warmup_steps,
                                            "min_lr": self.min_lr}, groups=settings["groups"])
        if facts.continuing and facts.finished:
            raise RunFinished(f"{facts.own} already finished its {settings['steps']} steps (summary.json): nothing to "
                              "do; raise --steps to train longer")
        checkpoint.check_steps(meta, settings["steps"])

    def method_spec(self) -> Any:
        """What :func:`~thinwire.algorithms.build.build_method` builds: the policy of a
        ``--policy`` file (its rules, read once), else the method spec."""
        if self.policy_rules:
            from thinwire.policy import Policy

            return Policy(self.policy_rules)
        return self.method

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["links"] = list(self.links)
        d["policy_rules"] = list(self.policy_rules)
        d["imports"] = list(self.imports)
        return d


@dataclass(frozen=True)
class Facts:
    """What checking a config needs from outside it, read once by :func:`plan`."""

    defaults: Any  # the task's TaskDefaults
    imports: tuple[str, ...]  # the --import modules, .py paths made absolute (all imported)
    torchrun: bool  # RANK is set: the world is torchrun's
    world: int  # the run's ranks: torchrun's WORLD_SIZE, else --workers
    decides: bool  # this process decides for the run (rank 0 under torchrun; the launcher otherwise)
    worker_limit: tuple[int, str] | None  # the most local ranks this machine holds, and why (None: torchrun)
    out: str | None  # where the run writes (a resume without --out: its own run directory)
    layout: Any = None  # the NodeLayout --group-size asks for (None: flat)
    policy: Any = None  # the --policy file's Policy
    resume_dir: Any = None  # the checkpoint directory --resume means, its metadata and its run directory
    meta: dict[str, Any] | None = None
    own: Any = None
    continuing: bool = False  # the resume writes back into its own run
    later: str | None = None  # what continuing would replace (a newer checkpoint or summary)
    holds_run: bool = False  # --out already holds a run's files
    finished: bool = False  # the run to continue already finished the steps asked for

    def verify(self) -> None:
        """The checkpoint's files against their checksums (under torchrun, this rank's own)."""
        if self.resume_dir is not None and self.meta is not None:
            from thinwire.run import checkpoint

            ranks = [int(os.environ["RANK"])] if self.torchrun else None
            checkpoint.verify(self.resume_dir, self.meta, ranks)


def plan(cfg: TrainConfig) -> Facts:
    """Read what :meth:`TrainConfig.validate` needs: import the ``--import`` modules, look
    up the task, read the environment (torchrun's world, the collective timeout, the
    machine's room for local ranks), the ``--policy`` file, an elastic job's secret, a ``--resume`` checkpoint's
    metadata and what ``--out`` holds. Raises ValueError naming what cannot be read."""
    from thinwire.comm.torch_dist import collective_timeout
    from thinwire.tasks import get as get_task

    imports = tuple(_stored(name) for name in cfg.imports)
    import_modules(imports)
    defaults = get_task(cfg.task).defaults
    torchrun = "RANK" in os.environ
    collective_timeout()  # a bad THINWIRE_COLLECTIVE_TIMEOUT or THINWIRE_STOP_GRACE is refused here, before
    stop_grace()  # any rank starts
    facts = Facts(defaults=defaults, imports=imports, torchrun=torchrun,
                  world=int(os.environ["WORLD_SIZE"]) if torchrun else cfg.workers,
                  decides=os.environ.get("RANK", "0") == "0", worker_limit=None if torchrun else worker_limit(),
                  out=cfg.out)
    facts = dataclasses.replace(facts, layout=node_layout(cfg.ranks_per_node, facts.world, torchrun))
    if cfg.policy is not None and cfg.method == "identity":  # with a --method too, validate() refuses the pair
        from thinwire.policy import Policy

        facts = dataclasses.replace(facts, policy=Policy.from_toml(cfg.policy))
    if cfg.elastic:  # a secret that cannot be used is refused before any worker starts
        from thinwire.elastic import secret

        secret.read(cfg.job_secret_file)
    if cfg.resume is not None:
        facts = _resume_facts(cfg, facts)
    if facts.out is not None:
        check_out(facts.out)
        if facts.decides:
            check_own_outputs(facts.out)
        if not facts.continuing:
            facts = dataclasses.replace(facts, holds_run=_holds_run(facts.out))
    return facts


def planned_out(cfg: TrainConfig) -> str | None:
    """The folder a run of ``cfg`` writes to, before it is resolved: ``--out``, or the run
    directory of the checkpoint ``--resume`` names (None when there is none, or it cannot be
    found: resolving says why). The one whose lock the run holds (:func:`thinwire.run.outdir.hold`)."""
    if cfg.out is not None:
        return cfg.out
    if cfg.resume is None:
        return None
    from thinwire.run import checkpoint

    try:
        own = checkpoint.run_dir(checkpoint.locate(cfg.resume))
    except (ValueError, OSError):
        return None
    return None if own is None else str(own)


RUN_OUTPUTS = ("metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "summary.json.tmp", "checkpoints/latest.json",
               "checkpoints/.latest.json.tmp")  # what a run replaces in its --out


def check_own_outputs(out: str) -> None:
    """Refuse, before any rank starts, an ``--out`` where the run would have to replace a
    file thinwire did not write (:mod:`thinwire.run.outdir`): one of :data:`RUN_OUTPUTS`, or
    a checkpoint's file in a ``checkpoints/step-NNNNNNNN`` folder, that its manifest does not
    record, or a link in their place."""
    from thinwire.run import checkpoint, outdir

    if not os.path.isdir(out):
        return
    own = outdir.owned(out)
    steps = checkpoint.root(out)
    found = ["checkpoints"] if steps.is_symlink() else []  # the run writes into it: never through a link
    found += [name for name in RUN_OUTPUTS if not found and os.path.lexists(os.path.join(out, name))]
    if steps.is_dir() and not steps.is_symlink():
        found += [f"checkpoints/{p.name}" for p in sorted(steps.iterdir()) if checkpoint.STEP_NAME.fullmatch(p.name)]
    for name in found:
        path = os.path.join(out, name)
        if os.path.islink(path):
            raise ValueError(f"--out {out}: {name} is a symbolic link (to {os.readlink(path)}); thinwire writes "
                             "only files of its own there: remove the link or choose another --out")
        if name in RUN_OUTPUTS and not os.path.isfile(path):
            raise ValueError(f"--out {out}: {name} is not a file; a run there writes its own {name}: move it away "
                             "or choose another --out")
        if name not in own and os.path.isdir(path):  # a folder named like a checkpoint: only its files matter
            theirs = [p for p in sorted(os.listdir(path)) if checkpoint.OWN_FILE.fullmatch(p)]
            name = f"{name}/{theirs[0]}" if theirs else ""
        if name and name not in own:
            raise ValueError(f"--out {out}: {name} was not written by thinwire (it is not in "
                             f"{outdir.MANIFEST}), so a run there would replace it; move it away or choose "
                             "another --out")


def node_layout(ranks_per_node: int | str | None, world: int, torchrun: bool) -> Any:
    """The NodeLayout of ``--group-size`` over ``world`` ranks (under torchrun: checked
    against torchrun's own layout), or None."""
    from thinwire.comm.layout import layout_for

    if isinstance(ranks_per_node, str) and ranks_per_node != "auto":
        try:
            ranks_per_node = int(ranks_per_node)
        except ValueError:
            raise ValueError(f"group-size must be a number of ranks or auto, got {ranks_per_node!r}") from None
    return layout_for(world, ranks_per_node, rank=int(os.environ["RANK"]) if torchrun else None)


def _resume_facts(cfg: TrainConfig, facts: Facts) -> Facts:
    """The checkpoint ``--resume`` means: its metadata, its run, where the run writes."""
    from thinwire.run import checkpoint

    assert cfg.resume is not None  # the caller's condition
    resume_dir = checkpoint.locate(cfg.resume)  # CheckpointError (a ValueError) names what is missing
    meta = checkpoint.read_meta(resume_dir)  # its schema
    own = checkpoint.run_dir(resume_dir)
    out = facts.out
    if out is None:
        require(own is not None, f"--resume {cfg.resume} is not inside a run's checkpoints/ directory: "
                "say where to write with --out")
        out = str(own)  # continue in the run's own directory
    continuing = checkpoint.in_place(resume_dir, out)  # back into its own run
    steps = _filled(cfg, facts.defaults)[0]
    return dataclasses.replace(
        facts, resume_dir=resume_dir, meta=meta, own=own, out=out, continuing=continuing,
        later=checkpoint.later_results(own, meta["step"]) if continuing and own is not None else None,
        finished=continuing and checkpoint.finished(own, meta["step"], steps))


def _filled(cfg: TrainConfig, d: Any) -> tuple[Any, Any, Any, Any, Any]:
    """steps, batch size, lr, optimizer and eval interval, the task's defaults where unset."""
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return (pick(cfg.steps, d.steps), pick(cfg.batch_size, d.batch_size), pick(cfg.lr, d.lr),
            pick(cfg.optimizer, d.optimizer), pick(cfg.eval_every, d.eval_every))


class RunFinished(Exception):
    """A resume in place whose run already finished at the ``steps`` asked for: nothing to do
    (not an error: the command line that started the run can be repeated safely)."""


class ImportFailed(ValueError):
    """An ``--import`` module that cannot be imported; the message names it and the error."""


# -- resuming with the run's own settings -------------------------------------------------------
# never taken from the checkpoint
OWN_TO_EACH_COMMAND = frozenset({"out", "overwrite", "resume", "max_workers", "tensorboard", "evaluate"})
METHOD_FIELDS = ("method", "policy", "policy_rules", "label")  # given --method or --policy replaces all four
SEQUENCES = ("links", "policy_rules", "imports")  # lists in JSON, tuples here


def from_options(given: dict[str, Any]) -> TrainConfig:
    """The config of ``thinwire train`` from the options typed on its command line (a field
    absent from ``given`` was not typed). A fresh run takes the defaults for the rest; a
    resume (``given["resume"]``) takes them from its checkpoint's saved config, so it keeps
    the run's checkpoint interval, links, method, hyperparameters and imports, and an option
    typed again replaces the saved one (``resolve`` still refuses what must match)."""
    if given.get("resume") is None:
        return TrainConfig(**given)
    from thinwire.run import checkpoint

    saved = checkpoint.saved_config(given["resume"])  # CheckpointError (a ValueError) names what is missing
    return TrainConfig(**merge_saved(saved, given))


def merge_saved(saved: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """TrainConfig fields: ``given`` over the saved config's (task options merged key by key;
    the method, policy and its rules replaced together; a policy travels as its rules)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)} - OWN_TO_EACH_COMMAND
    kept = {k: saved[k] for k in names if k in saved}
    for k in SEQUENCES:
        if k in kept:
            kept[k] = tuple(kept[k])
    kept["policy"] = None  # the rules were read from the file once; it may have changed or moved since
    if any(k in given for k in METHOD_FIELDS):
        kept = {k: v for k, v in kept.items() if k not in METHOD_FIELDS}
    merged = {**kept, **given}
    if "task_options" in given:
        merged["task_options"] = {**kept.get("task_options", {}), **given["task_options"]}
    return merged


# -- user modules -------------------------------------------------------------------------------
def import_modules(names: Iterable[str]) -> None:
    """Import each module (``--import``): a dotted name, looked up on ``sys.path`` and then in
    the current directory, or a path to a ``.py`` file (see :func:`file_module_name`). A
    module imported already is not imported again. Raises :class:`ImportFailed`."""
    for name in names:
        try:
            _import_file(name) if name.endswith(".py") else _import_name(name)
        except Exception as e:  # noqa: BLE001  (ImportError, or whatever the module raised while importing)
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ImportFailed(f"--import {name}: {type(e).__name__}: {text}".rstrip(": ")) from None


def _stored(name: str) -> str:
    """A ``.py`` path made absolute (a resume from another directory still finds it); a dotted
    name as given."""
    return os.path.abspath(name) if name.endswith(".py") else name


def _import_name(name: str) -> None:
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)  # after every installed package: a local file never shadows one
    importlib.import_module(name)


def _import_file(path: str) -> None:
    name = file_module_name(path)
    if name in sys.modules:
        return
    if not os.path.isfile(path):
        raise ImportError(f"no such file {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be imported as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and typing look the module up by name while it runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)  # a failed import leaves nothing behind, as importlib's own
        raise


FILE_MODULE = "thinwire_file_"  # prefix of the name a .py file is imported under


def file_module_name(path: str) -> str:
    """The module name a ``.py`` file is imported under: its file name and a digest of its
    real path, so a file named like another module (``codecs.py``) takes nothing's place."""
    import hashlib

    real = os.path.realpath(path)
    stem = os.path.splitext(os.path.basename(real))[0]
    return f"{FILE_MODULE}{stem}_{hashlib.sha1(real.encode()).hexdigest()[:8]}"


# -- how long a stop request waits for a step's end ----------------------------------------------
STOP_GRACE_S = 10.0  # after a first SIGINT / SIGTERM, how long the ranks have to take up the stop at a step
STOP_GRACE_ENV = "THINWIRE_STOP_GRACE"  # seconds; replaces STOP_GRACE_S where set


def stop_grace() -> float:
    """Seconds the ranks have, after a first SIGINT / SIGTERM, to take the stop up at a step
    (then they are ended): :data:`STOP_GRACE_S`, or the ``THINWIRE_STOP_GRACE`` environment
    variable (a number > 0), for a scheduler whose own grace before its SIGKILL differs."""
    return env_seconds(STOP_GRACE_ENV, STOP_GRACE_S)


# -- what this machine can run ------------------------------------------------------------------
WORKERS_PER_CORE = 8  # local ranks per core at most (they share the cores; beyond this they only wait)


def worker_limit() -> tuple[int, str]:
    """The most local ranks this machine can hold, and why: :data:`WORKERS_PER_CORE` per
    core, and the memory available now over :data:`BYTES_PER_WORKER`. A guard against a
    typo exhausting the machine, not a promise that a large model fits."""
    cores = os.cpu_count() or 1
    limit, why = WORKERS_PER_CORE * cores, f"{cores} cores x {WORKERS_PER_CORE}"
    free = _available_memory()
    if free is not None and int(free // BYTES_PER_WORKER) < limit:
        limit = max(1, int(free // BYTES_PER_WORKER))
        why = f"{free / 1e9:.1f} GB of memory available / {BYTES_PER_WORKER / 1e9:.1f} GB per rank"
    return limit, why


def check_batch_memory(cfg: TrainConfig, torchrun: bool) -> None:
    """Refuse a batch that cannot fit the memory this machine has available, for all its local
    ranks together (estimated from the task's model: :mod:`thinwire.run.memory_estimate`)."""
    check_batch(cfg, torchrun=torchrun, available=_available_memory())


def _available_memory() -> float | None:
    """Bytes of memory available to new processes (Linux: MemAvailable), else the physical
    memory where the OS says, else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_workers(workers: int, max_workers: int | None = None, limit: tuple[int, str] | None = None) -> None:
    """Refuse more local ranks than :func:`worker_limit` allows (``limit``: its answer, read
    already), or than ``max_workers``, the user's own bound, which replaces it."""
    if max_workers is not None:
        require(max_workers >= 1, f"max-workers must be >= 1, got {max_workers}")
        require(workers <= max_workers, f"workers must be <= --max-workers {max_workers}, got {workers}")
        return
    most, why = limit if limit is not None else worker_limit()
    require(workers <= most, f"--workers {workers} is more local ranks than this machine can hold (at most {most}: "
            f"{why}); pass --max-workers N to allow up to N")


def check_out(out: str) -> None:
    """``--out`` must be a directory, or a path where one can be created (:func:`thinwire.run.outdir.check`)."""
    from thinwire.run import outdir

    outdir.check(out)


def _holds_run(path: str) -> bool:
    """Whether ``path`` holds a run's files: its summary, its metrics, or checkpoints of
    thinwire's (``checkpoints/latest.json`` or a ``checkpoints/step-NNNNNNNN``; a
    ``checkpoints/`` folder of someone else's does not count)."""
    from thinwire.run import checkpoint

    if any(os.path.exists(os.path.join(path, f)) for f in ("summary.json", "metrics.jsonl")):
        return True
    root = checkpoint.root(path)
    return (root / checkpoint.LATEST).exists() or (root.is_dir() and any(
        checkpoint.STEP_NAME.fullmatch(p.name) for p in root.iterdir()))


def for_method(base: TrainConfig, spec: str, **changes: Any) -> TrainConfig:
    """``base`` running ``spec``: a method that is an optimizer itself (DeMo) replaces the
    race's ``--optimizer`` (its runs say so in their summary), the others train with it."""
    optimizer = spec.partition(":")[0].strip() if _owns(spec) else base.optimizer
    return dataclasses.replace(base, method=spec, optimizer=optimizer, **changes)


def _owns(spec: str) -> bool:
    return own_optimizer(spec)  # False for a bad spec too: resolving it names the problem

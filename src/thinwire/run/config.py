"""The training run's configuration: parsed and validated before any rank starts."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from thinwire.algorithms.registry import check_world, resolve_method
from thinwire.codecs.config import require


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything one run needs; ``resolve()`` fills task defaults and validates."""

    task: str = "mnist1d"
    method: str = "identity"
    policy: str | None = None  # a policy file (TOML): a codec per parameter instead of --method
    policy_rules: tuple[dict[str, Any], ...] = ()  # the file's rules, read once by resolve()
    workers: int = 2
    steps: int | None = None  # None: the task's default budget
    batch_size: int | None = None  # per rank; None: the task's default
    lr: float | None = None  # None: the task's default
    optimizer: str | None = None  # adam | sgd; None: the task's default
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

    def resolve(self) -> "TrainConfig":
        """Validate every field and fill defaults; raises ValueError naming the rule broken."""
        from thinwire.comm.link import Link
        from thinwire.tasks import get as get_task

        task_cls = get_task(self.task)
        d = task_cls.defaults
        require(self.workers >= 1, f"workers must be >= 1, got {self.workers}")
        steps = d.steps if self.steps is None else self.steps
        require(steps >= 1, f"steps must be >= 1, got {steps}")
        batch = d.batch_size if self.batch_size is None else self.batch_size
        require(batch >= 1, f"batch-size must be >= 1, got {batch}")
        lr = d.lr if self.lr is None else self.lr
        require(lr >= 0, f"lr must be >= 0, got {lr}")
        opt = d.optimizer if self.optimizer is None else self.optimizer
        require(opt in ("adam", "sgd"), f"optimizer must be adam or sgd, got {opt!r}")
        eval_every = d.eval_every if self.eval_every is None else self.eval_every
        require(eval_every >= 1, f"eval-every must be >= 1, got {eval_every}")
        require(self.bucket_mb > 0, f"bucket-mb must be > 0, got {self.bucket_mb}")
        require(self.threads is None or self.threads >= 1, f"threads must be >= 1, got {self.threads}")
        links = tuple(str(Link.parse(s)) for s in self.links)
        require(not self.emulate_link or bool(links), "--emulate-link needs a --link to emulate")
        require(self.checkpoint_every >= 0, f"checkpoint-every must be >= 0, got {self.checkpoint_every}")
        require(self.on_nonfinite in ("raise", "skip"), f"on-nonfinite must be raise or skip, got {self.on_nonfinite!r}")
        out = self.out
        resume_dir = meta = own = None
        if self.resume is not None:
            from thinwire.run import checkpoint

            resume_dir = checkpoint.locate(self.resume)  # CheckpointError (a ValueError) names what is missing
            meta = checkpoint.read_meta(resume_dir)
            own = checkpoint.run_dir(resume_dir)
            if out is None:
                require(own is not None, f"--resume {self.resume} is not inside a run's checkpoints/ directory: "
                        "say where to write with --out")
                out = str(own)  # continue in the run's own directory
        require(not self.checkpoint_every or out is not None, "--checkpoint-every needs --out (where to write them)")
        continuing = resume_dir is not None and checkpoint.in_place(resume_dir, out)  # back into its own run
        if continuing and os.environ.get("RANK", "0") == "0":
            later = checkpoint.later_results(own, meta["step"])
            require(self.overwrite or later is None,
                    f"--resume {self.resume}: continuing in {own} from step {meta['step']} would replace {later}; "
                    "pass --overwrite, or write elsewhere with --out")
        if out is not None and not continuing and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 decides
            require(
                self.overwrite or not _holds_run(out),
                f"--out {out} already holds a run (summary.json, metrics.jsonl or checkpoints); "
                "pass --overwrite to replace it or choose another directory",
            )
        method, rules = self.method, self.policy_rules
        if self.policy is not None:
            from thinwire.policy import Policy

            require(self.method == "identity", "--policy and --method are exclusive: the policy gives every "
                    "parameter its codec (leave --method out)")
            policy = Policy.from_toml(self.policy)
            method, rules = policy.describe(), tuple(policy.to_dicts())
        elif rules:
            from thinwire.policy import Policy

            method = Policy(rules).describe()
        else:
            method = resolve_method(self.method)
            require(not (self.on_nonfinite == "skip" and method.startswith("torch-powersgd")),
                    "--on-nonfinite skip cannot keep torch-powersgd clean: PyTorch's hook folds a gradient into its "
                    "error feedback inside the backward pass, before the check, and would resend a NaN every later "
                    "step; use --on-nonfinite raise")
            # under torchrun the world is torchrun's, not --workers
            check_world(method, int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else self.workers)
        if meta is not None:
            world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else self.workers
            checkpoint.check_matches(meta, workers=world, task=self.task, method=method, steps=steps,
                                     task_options=self.task_options, seed=self.seed, batch_size=batch,
                                     optimizer=opt, lr=lr)
        return dataclasses.replace(
            self, method=method, policy_rules=rules, steps=steps, batch_size=batch, lr=lr,
            optimizer=opt, eval_every=eval_every, links=links, out=out,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["links"] = list(self.links)
        d["policy_rules"] = list(self.policy_rules)
        return d


def _holds_run(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in ("summary.json", "metrics.jsonl", "checkpoints"))

"""Learning-rate schedules of ``thinwire train``: a factor of the base learning rate per step.

``--lr-schedule`` is one of :data:`SCHEDULES`; ``--warmup-steps W`` and ``--min-lr r`` (a
share of the base rate) shape it. For the optimizer step with index ``s`` (0 for the run's
first step) of a run of ``T`` steps, the factor is:

* warm-up, ``s < W``: ``(s + 1) / W`` (linear, reaching the base rate at step ``W``);
* ``constant``: 1 after the warm-up;
* ``cosine``: ``r + (1 - r) · ½ (1 + cos(π p))``, ``p = (s - W) / (T - W)``, from 1 just
  after the warm-up down towards ``r`` at the last step;
* ``wsd`` (warm-up, stable, decay): 1 until the last :data:`WSD_DECAY_SHARE` of the steps
  after the warm-up, then linearly from 1 down to ``r`` at the last step (the decay's share
  and its linear shape are ours; the schedule's papers use 10-20% and several shapes).

The factor is a pure function of the step, so a resumed run sets exactly the rate the
unbroken run would have: nothing but the step needs saving.

**A resume with another ``--steps``** (a run extended, or cut short) changes ``T``, and with
it the rates of a cosine or wsd schedule. It is taken only when the rates of every step
already trained are the ones a run of the new length sets (:func:`refuse_new_span`): the
resumed run is then that run, unbroken. So a constant schedule always extends; wsd extends
while the checkpoint lies in its stable phase (its decay starts later in a longer run, and
that is the point of wsd); cosine only from inside its warm-up. Any other change of
``--steps`` would move the rate at the resume point (a cosine near its end would jump
back up towards the base rate) and is refused by name. :func:`apply` writes it into
every parameter group as ``base × factor``, the group's base kept as ``initial_lr`` (the
name PyTorch's schedulers use), so groups with their own rates (Muon's and AdamW's) keep
their ratio.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("constant", "cosine", "wsd")
WSD_DECAY_SHARE = 0.2


def check(schedule: str, warmup: int, min_lr: float, steps: int | None) -> None:
    """Raise ``ValueError`` naming the rule a schedule's settings break."""
    if schedule not in SCHEDULES:
        raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if warmup < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {warmup}")
    if steps is not None and warmup >= steps and warmup > 0:
        raise ValueError(f"--warmup-steps must be < --steps ({steps}), got {warmup}")
    if not (math.isfinite(min_lr) and 0 <= min_lr <= 1):
        raise ValueError(f"--min-lr is a share of the learning rate and must be in [0, 1], got {min_lr}")


def factor(step: int, steps: int, schedule: str = "constant", warmup: int = 0, min_lr: float = 0.0) -> float:
    """The learning rate's factor for the optimizer step with index ``step`` (0-based) of ``steps``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, steps - warmup)
    p = min(1.0, max(0.0, (step - warmup) / span))
    if schedule == "cosine":
        return min_lr + (1 - min_lr) * 0.5 * (1 + math.cos(math.pi * p))
    decay = WSD_DECAY_SHARE * span
    left = span - (step - warmup)  # steps from this one to the end, this one included
    if left > decay:
        return 1.0
    return min_lr + (1 - min_lr) * (left - 1) / max(1.0, decay - 1) if decay > 1 else min_lr


def refuse_new_span(schedule: str, warmup: int, min_lr: float, lr: float, step: int, steps: int,
                    new_steps: int) -> str | None:
    """Why a run of ``steps`` steps, resumed at ``step`` (steps done) with ``--steps
    new_steps``, cannot keep its schedule: None when the rates of the ``step`` steps trained
    are, every one, those a run of ``new_steps`` sets (then the resumed run is that run,
    unbroken); else one line with the rates at the resume point (``lr`` is the base rate)."""
    if new_steps == steps or all(factor(s, steps, schedule, warmup, min_lr) == factor(s, new_steps, schedule, warmup,
                                                                                      min_lr) for s in range(step)):
        return None
    last = lr * factor(step - 1, steps, schedule, warmup, min_lr)
    then = lr * factor(step, new_steps, schedule, warmup, min_lr)
    why = ("a cosine's span is the run's length, so it extends only from inside its warm-up" if schedule == "cosine"
           else f"wsd extends only from its stable phase, and the decay over the last {WSD_DECAY_SHARE:.0%} of "
                f"{steps} steps had begun")
    return (f"--steps {new_steps} would change the {schedule} schedule of a run of {steps} steps resumed at step "
            f"{step}: its last rate was {last:.3g}, the next would be {then:.3g} ({why}); resume with --steps {steps}, "
            "or start a run of the length wanted")


def apply(optimizer: torch.optim.Optimizer, value: float) -> None:
    """Set every parameter group's rate to its base (``initial_lr``, recorded on the first call)
    times ``value``."""
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * value

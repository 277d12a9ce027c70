"""Shared by the benchmark scripts: figures with targets, reports, step timing.

Not part of the package. Every script prints its tables and one line per
figure, ``figure NAME: VALUE target OP THRESHOLD PASS|MISS``, and with ``--json PATH`` also
writes them for ``run_all.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from thinwire.run.spawn import run_ranks

__all__ = ["Figure", "Report", "alternate_blocks", "load_note", "median", "paired_ratio", "parser", "run_ranks",
           "table", "training_step"]

# -- figures -----------------------------------------------------------------------------------------
@dataclass
class Figure:
    name: str
    value: float
    op: str  # "<=" or ">="
    threshold: float
    unit: str = ""  # "x", "%", ...
    detail: str = ""  # the absolute figures behind a ratio

    @property
    def passed(self) -> bool:
        return self.value <= self.threshold if self.op == "<=" else self.value >= self.threshold

    def line(self) -> str:
        v, t = _num(self.value), _num(self.threshold)
        out = f"figure {self.name}: {v}{self.unit} target {self.op} {t}{self.unit} {'PASS' if self.passed else 'MISS'}"
        return out + (f"  ({self.detail})" if self.detail else "")


def _num(x: float) -> str:
    return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"


@dataclass
class Report:
    """What one benchmark script produces: markdown sections (tables, notes) and figures."""

    title: str
    command: str
    sections: list[str] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, text: str) -> None:
        self.sections.append(text)
        print(text, flush=True)
        print(flush=True)

    def finish(self, json_path: str | None) -> int:
        print(f"== {self.title}: figures", flush=True)
        for f in self.figures:
            print(f.line(), flush=True)
        if json_path:
            data = asdict(self)
            data["figures"] = [dict(asdict(f), passed=f.passed, line=f.line()) for f in self.figures]
            with open(json_path, "w") as fh:
                json.dump(data, fh, indent=1)
        return 0 if all(f.passed for f in self.figures) else 1


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer blocks/repeats (still >= 5 after warm-up)")
    p.add_argument("--json", help="also write the report (figures and tables) to this JSON file")
    return p


def given_command(argv: Sequence[str] | None) -> str:
    """The arguments a benchmark was given, as a user would type them: ``--json PATH`` (where
    run_all collects the report) left out."""
    import sys

    args = list(argv if argv is not None else sys.argv[1:])
    if "--json" in args:
        i = args.index("--json")
        del args[i : i + 2]
    return " ".join(args)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def load_note() -> str:
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    return f"load average {load} on {os.cpu_count()} cores"


# -- alternating step-time blocks (inside the ranks) -------------------------------------------------
def alternate_blocks(
    arms: dict[str, Callable[[int], None]], steps: int, warmup: int, blocks: int,
    after_warmup: Callable[[], None] | None = None, lead: dict[str, Callable[[], None]] | None = None,
    settle: dict[str, Callable[[], None]] | None = None,
) -> dict[str, list[float]]:
    """Run every arm for ``steps`` steps per block, arms in turn (A B C A B C ...), ``warmup``
    rounds untimed then ``blocks`` timed (``after_warmup()`` runs in between, e.g. to reset
    byte counters). Each block starts after a barrier; its time is the slowest rank's, so
    every rank returns the same numbers. Returns seconds per step, per block.

    ``lead[arm]`` runs untimed before the arm's block and ``settle[arm]`` untimed after it:
    for an arm whose work runs behind later steps (a round's average behind the next round),
    the lead runs one untimed round, so that the timed block is a round with the previous
    round's average behind it, and the settle lands what is still in flight before another
    arm takes the link."""
    lead, settle = lead or {}, settle or {}
    import torch
    import torch.distributed as dist

    out: dict[str, list[float]] = {name: [] for name in arms}
    counters = {name: 0 for name in arms}
    for rnd in range(warmup + blocks):
        if rnd == warmup and after_warmup is not None:
            after_warmup()
        for name, step in arms.items():
            if name in lead:
                lead[name]()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step(counters[name])
                counters[name] += 1
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if name in settle:
                settle[name]()
            if rnd >= warmup:
                out[name].append(dt.item() / steps)
    return out


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of the per-round ratios a_i / b_i (the rounds are alternated, so pairs share noise)."""
    return median([x / y for x, y in zip(a, b)])


def training_step(model, optimizer, batches, loss_fn, after_backward: Callable[[], None] | None = None):
    """A step closure ``step(i)``: forward and backward on batch ``i`` (cycling through the
    pre-made ``batches``), ``after_backward()`` (e.g. a SyncReducer), optimizer step."""

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()

    return step


def mirror(world: int):
    """Rank 0 of ``world`` ranks whose peers send exactly what it sends, with no network: an
    all_reduce multiplies by ``world``, an all_gather copies the rank's payload into every row,
    a point-to-point exchange receives what it sends, and a broadcast or barrier does nothing.
    Its meter counts what one rank of ``world`` sends (thinwire's byte accounting)."""
    from thinwire.comm.base import Communicator, Done

    class Mirror(Communicator):
        def __init__(self) -> None:
            super().__init__(0, world)

        def _all_reduce(self, t, async_op):
            t.mul_(world)
            return Done()

        def _all_gather(self, t, out, async_op):
            for row in out:
                row.copy_(t)
            return Done()

        def _exchange(self, sends, recvs, async_op):
            for peer, t in recvs.items():
                t.copy_(sends[peer])  # what the peer sends this rank: bytes of the same size as what it is sent
            return Done()

        def _broadcast(self, t, src):
            pass

        def _barrier(self):
            pass

        def _subgroup(self, ranks):
            return Mirror() if len(ranks) == world else None

    return Mirror()

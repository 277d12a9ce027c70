"""``thinwire bench consensus``: gossip alone, no gradients: consensus error against bits sent.

The standard problem of the PowerGossip paper: ``workers`` ranks (default 8) on a topology
(default a ring), each holding one ``size x size`` matrix (default 100 x 100) of N(0, 1)
values seeded by its rank. Every step runs one gossip step of each method (``after_backward``
with no gradient and no optimizer) on in-process ranks, and records the consensus error
``mean_i ||x_i - mean_j x_j||^2`` relative to its start, and the bits each worker has sent
(from the byte meter). Methods: uncompressed gossip (``dpsgd``) and ``powergossip`` at ranks
1, 2 and 4, each until its error falls below ``1e-4`` of the start or ``max_steps``.

Reported per method: bits per worker to reach 1e-2 and 1e-4 of the initial error (or "not
reached"), steps taken, and the final error; ``--out FILE.csv`` writes every curve
(method, step, bits per worker, relative error) for plotting.
"""

from __future__ import annotations

import csv
import io
import sys

import torch
from torch import nn

from thinwire.comm.local import LocalComm, LocalWorld
from thinwire.run.labels import labels

LEVELS = (1e-2, 1e-4)
DEFAULT_METHODS = ("dpsgd", "powergossip:rank=1", "powergossip:rank=2", "powergossip:rank=4")


class _Matrix(nn.Module):
    def __init__(self, rank: int, size: int) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.randn(size, size, generator=torch.Generator().manual_seed(1000 + rank)))


def curve(spec: str, workers: int, size: int, topology: str, max_steps: int) -> list[tuple[int, float, float]]:
    """(step, bits per worker, relative consensus error) after every step of ``spec``."""
    from thinwire.algorithms.build import build_method

    name, _, knobs = spec.partition(":")
    full = f"{name}:topology={topology}" + (f",{knobs}" if knobs else "")
    every = 10  # steps between checks of the stopping level (all ranks take the same decision)

    def fn(comm: LocalComm) -> list[tuple[int, float, float]]:
        model = _Matrix(comm.rank, size)
        method = build_method(full, model, None, comm)
        total = torch.zeros(1, dtype=torch.float64)
        rows: list[tuple[int, float, float]] = []
        start: float | None = None
        for step in range(max_steps + 1):
            if step:
                method.after_backward()
            x = model.x.detach().double()
            with comm.meter.paused():  # measuring, not gossip
                mean = x.clone()
                comm.all_reduce(mean)
                mean /= comm.world_size
                total[0] = (x - mean).square().sum()
                comm.all_reduce(total)
            err = total.item() / comm.world_size
            start = err if start is None else start
            bits = torch.tensor([8.0 * comm.meter.bytes_sent], dtype=torch.float64)
            with comm.meter.paused():
                comm.all_reduce(bits)
            rows.append((step, bits.item() / comm.world_size, err / start))
            if step % every == 0 and err / start < LEVELS[-1]:
                break
        return rows

    return LocalWorld(workers, timeout_s=600).run(fn)[0]


def first_below(rows: list[tuple[int, float, float]], level: float) -> tuple[int, float] | None:
    """(step, bits per worker) of the first point under ``level``, or None."""
    return next(((s, b) for s, b, e in rows if e < level), None)


def table(curves: dict[str, list[tuple[int, float, float]]], workers: int, size: int, topology: str):
    """The results: one row per spec, named by the spec as typed (cut past
    :data:`~thinwire.run.labels.LABEL_WIDTH` by :func:`thinwire.run.labels.labels`), which
    is never cut further while the other columns can wrap between words."""
    from rich.markup import escape
    from rich.table import Table

    names = labels(list(curves), alone=False)
    out = Table(title=escape(f"consensus: {workers} workers, {topology}, one {size}x{size} N(0,1) matrix each, "
                             "no gradients"))
    out.add_column("method", no_wrap=True, overflow="ellipsis", min_width=max(map(len, names), default=6))
    for col in (*(f"bits / worker to {lv:g}" for lv in LEVELS), "steps", "final rel. error"):
        out.add_column(col, justify="right")
    for name, rows in zip(names, curves.values(), strict=True):
        hits = [first_below(rows, lv) for lv in LEVELS]
        out.add_row(escape(name), *(f"{h[1]:.3g} (step {h[0]})" if h else "not reached" for h in hits),
                    str(rows[-1][0]), f"{rows[-1][2]:.3g}")
    return out


def main(quick: bool = False, methods: str | None = None, *, workers: int = 8, size: int = 100,
         topology: str = "ring", max_steps: int | None = None, out: str | None = None) -> int:
    """Run the consensus benchmark; returns an exit code (0 ok, 2 bad input)."""
    from rich.console import Console

    from thinwire.algorithms.methods import check_world, resolve_method

    specs = [s.strip() for s in (methods.split(";") if methods else DEFAULT_METHODS) if s.strip()]
    steps = max_steps if max_steps is not None else (200 if quick else 3000)
    try:
        if workers < 2 or size < 1 or steps < 1:
            raise ValueError(f"need workers >= 2, size >= 1 and max-steps >= 1, got {workers}, {size}, {steps}")
        for s in specs:
            name, _, knobs = s.partition(":")
            if name not in ("dpsgd", "powergossip"):
                raise ValueError(f"consensus runs gossip methods (dpsgd, powergossip), got {name!r}")
            resolved = resolve_method(f"{name}:topology={topology}" + (f",{knobs}" if knobs else ""))
            check_world(resolved, workers)
        if out:
            from thinwire.run import outdir

            outdir.new_file(out)  # before measuring: an existing file is refused, never replaced
    except ValueError as e:
        print(f"thinwire: error: {e}", file=sys.stderr)
        return 2
    console = Console()
    curves = {}
    names = dict(zip(specs, labels(specs, alone=False), strict=True))
    for i, spec in enumerate(specs, 1):
        curves[spec] = rows = curve(spec, workers, size, topology, steps)
        console.print(f"[{i}/{len(specs)}] {names[spec]}: {rows[-1][0]} steps, relative error {rows[-1][2]:.3g}",
                      markup=False)
    console.print(table(curves, workers, size, topology))
    if out:
        from thinwire.run import outdir

        text = io.StringIO()
        w = csv.writer(text)
        w.writerow(["method", "step", "bits_per_worker", "relative_error"])
        for spec, rows in curves.items():
            w.writerows([spec, *r] for r in rows)
        outdir.write_new(out, text.getvalue(), newline="")
        console.print(f"wrote {out}")
    return 0

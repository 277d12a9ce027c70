"""Graphs of workers for decentralized training: who talks to whom, and with what weight.

A topology is a mixing matrix ``W`` over ``n`` workers: symmetric, doubly stochastic (every
row sums to 1; with symmetry, every column too) and connected (the graph of its non-zero
off-diagonal entries joins every worker to every other). One gossip step replaces worker
``i``'s model by ``sum_j W[i, j] x_j``; such a ``W`` keeps the network average and drives
every model to it at a rate set by the spectral gap ``1 - max(|lambda_2|, |lambda_n|)``.

Built-in graphs (``build_topology(name, n)``):

* ``ring``: each worker and its two neighbours weigh 1/3 (two workers: 1/2 each);
* ``torus``: a ``rows x cols`` grid wrapped at the edges, rows and cols >= 3 and as close
  to square as ``n`` allows; each worker and its four neighbours weigh 1/5;
* ``complete``: every worker talks to every other, all weights 1/n;
* ``exponential``: worker ``i`` talks to ``i +- 2^k (mod n)`` for every ``2^k < n``, with
  Metropolis-Hastings weights ``1 / (1 + max(deg_i, deg_j))`` (uniform: the graph is
  regular);
* a file: ``n`` rows of ``n`` numbers (whitespace or commas; ``#`` starts a comment), or
  any matrix through ``Topology(matrix)``.

Weights are kept in float64; validation allows 1e-9 of rounding in the sums and symmetry.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from thinwire.knobs import read_user_file
from thinwire.registry import Registry

TOLERANCE = 1e-9


class Topology:
    """A validated mixing matrix over ``n`` workers."""

    def __init__(self, weights: torch.Tensor | Sequence[Sequence[float]], name: str = "custom") -> None:
        w = torch.as_tensor(weights, dtype=torch.float64).clone()
        if w.dim() != 2 or w.shape[0] != w.shape[1] or w.shape[0] < 1:
            raise ValueError(f"a mixing matrix must be square and non-empty, got shape {tuple(w.shape)}")
        if not torch.isfinite(w).all():
            raise ValueError("a mixing matrix must hold finite numbers")
        if (w < -TOLERANCE).any():
            raise ValueError(f"a mixing matrix must be non-negative, got {w.min().item():g}")
        asym = (w - w.T).abs().max().item()
        if asym > TOLERANCE:
            i, j = divmod(int((w - w.T).abs().argmax()), w.shape[0])
            raise ValueError(f"a mixing matrix must be symmetric: W[{i},{j}] = {w[i, j].item():g} but "
                             f"W[{j},{i}] = {w[j, i].item():g}")
        sums = w.sum(1)
        bad = int((sums - 1).abs().argmax())
        if abs(sums[bad].item() - 1) > TOLERANCE:
            raise ValueError(f"a mixing matrix must be doubly stochastic: row {bad} sums to "
                             f"{sums[bad].item():.12g}, not 1")
        unreached = _unreached(w)
        if unreached:
            raise ValueError(f"a mixing matrix must connect every worker: worker {unreached[0]} cannot reach worker 0")
        self.weights = w
        self.name = name

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> Topology:
        """``n`` rows of ``n`` numbers, separated by whitespace or commas; ``#`` comments."""
        path = Path(path)
        text = read_user_file(path, "mixing matrix file")
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                rows.append([float(x) for x in re.split(r"[,\s]+", line) if x])
            except ValueError:
                raise ValueError(f"{path}:{lineno}: a mixing matrix row must hold numbers, got {line!r}") from None
        if not rows or any(len(r) != len(rows) for r in rows):
            raise ValueError(f"{path}: a mixing matrix file must hold n rows of n numbers, got rows of "
                             f"{sorted({len(r) for r in rows})} numbers in {len(rows)} rows")
        return cls(rows, name=str(path))

    # -- questions -----------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self.weights.shape[0]

    def neighbours(self, rank: int) -> list[int]:
        """The other workers ``rank`` exchanges with (non-zero weight), ascending."""
        self._check(rank)
        row = self.weights[rank]
        return [j for j in range(self.n) if j != rank and row[j].item() > 0]

    def degree(self, rank: int) -> int:
        return len(self.neighbours(rank))

    def weight(self, i: int, j: int) -> float:
        self._check(i)
        self._check(j)
        return self.weights[i, j].item()

    def spectral_gap(self) -> float:
        """``1 - max(|lambda_2|, |lambda_n|)`` of ``W``: 1 for the complete graph, near 0 for
        long rings (slow mixing)."""
        if self.n == 1:
            return 1.0
        eig = torch.linalg.eigvalsh(self.weights).abs().sort(descending=True).values  # (n,)
        return float(1 - eig[1])

    def edges(self) -> list[tuple[int, int]]:
        """Every edge once, as ``(lo, hi)``, ascending."""
        return [(i, j) for i in range(self.n) for j in self.neighbours(i) if i < j]

    def describe(self) -> str:
        return f"{self.name} ({self.n} workers, {len(self.edges())} edges, spectral gap {self.spectral_gap():.4f})"

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.n:
            raise ValueError(f"rank must be in [0, {self.n}), got {rank}")

    def __repr__(self) -> str:
        return f"<Topology {self.describe()}>"


def _unreached(w: torch.Tensor) -> list[int]:
    n = w.shape[0]
    seen, frontier = {0}, [0]
    while frontier:
        i = frontier.pop()
        for j in range(n):
            if j not in seen and w[i, j].item() > 0:
                seen.add(j)
                frontier.append(j)
    return [j for j in range(n) if j not in seen]


# -- built-in graphs ----------------------------------------------------------------------------
# the built-in graphs by name: each builds the topology of n workers (this module's functions)
TOPOLOGIES: Registry[Callable[[int], Topology]] = Registry("topology", builtins=("thinwire.topology",))


@TOPOLOGIES.register(summary="each worker and its two neighbours weigh 1/3")
def ring(n: int) -> Topology:
    _check_n(n)
    w = torch.zeros(n, n, dtype=torch.float64)
    if n <= 2:
        w.fill_(1 / n)
    else:
        for i in range(n):
            for j in (i - 1, i, i + 1):
                w[i, j % n] = 1 / 3
    return Topology(w, "ring")


def torus_shape(n: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows * cols == n``, both >= 3, as square as possible."""
    best = None
    for rows in range(3, math.isqrt(n) + 1):
        if n % rows == 0 and n // rows >= 3:
            best = (rows, n // rows)
    if best is None:
        raise ValueError(f"a torus needs workers = rows x cols with rows, cols >= 3 (9, 12, 15, 16, ...); "
                         f"{n} has no such factorisation")
    return best


@TOPOLOGIES.register(summary="a rows x cols grid (both >= 3) wrapped at the edges; five weights of 1/5")
def torus(n: int) -> Topology:
    _check_n(n)
    rows, cols = torus_shape(n)
    w = torch.zeros(n, n, dtype=torch.float64)
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            for dr, dc in ((0, 0), (1, 0), (-1, 0), (0, 1), (0, -1)):
                w[i, ((r + dr) % rows) * cols + (c + dc) % cols] = 1 / 5
    return Topology(w, "torus")


@TOPOLOGIES.register(summary="every worker talks to every other, all weights 1/n")
def complete(n: int) -> Topology:
    _check_n(n)
    return Topology(torch.full((n, n), 1 / n, dtype=torch.float64), "complete")


@TOPOLOGIES.register(summary="worker i talks to i +- 2^k (mod n), Metropolis-Hastings weights")
def exponential(n: int) -> Topology:
    _check_n(n)
    adj = torch.zeros(n, n, dtype=torch.bool)
    k = 1
    while k < n:
        for i in range(n):
            adj[i, (i + k) % n] = adj[(i + k) % n, i] = True
        k *= 2
    adj.fill_diagonal_(False)
    return Topology(metropolis(adj), "exponential")


def metropolis(adjacency: torch.Tensor) -> torch.Tensor:
    """Metropolis-Hastings weights of a symmetric adjacency matrix: ``1 / (1 + max(deg_i,
    deg_j))`` on each edge, the rest of each row on the diagonal (symmetric, doubly stochastic)."""
    adj = adjacency.to(torch.bool)
    deg = adj.sum(1).to(torch.float64)  # (n,)
    w = torch.where(adj, 1 / (1 + torch.maximum(deg[:, None], deg[None, :])), torch.zeros((), dtype=torch.float64))
    w += torch.diag(1 - w.sum(1))
    return w


NAMES = tuple(TOPOLOGIES)


def build_topology(spec: str, n: int) -> Topology:
    """A built-in graph by name (``ring``, ``torus``, ``complete``, ``exponential``) for ``n``
    workers, or a mixing matrix file (a path); errors name the rule broken."""
    if spec in TOPOLOGIES:
        return TOPOLOGIES[spec](n)
    if not Path(spec).exists():
        raise ValueError(f"unknown topology {spec!r}; use {', '.join(TOPOLOGIES)} or a mixing matrix file")
    topo = Topology.from_file(spec)
    if topo.n != n:
        raise ValueError(f"mixing matrix {spec} is for {topo.n} workers, the run has {n}")
    return topo


def _check_n(n: int) -> None:
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"a topology needs at least 1 worker, got {n!r}")

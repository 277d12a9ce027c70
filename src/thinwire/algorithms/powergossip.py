"""PowerGossip (Vogels, Karimireddy and Jaggi, NeurIPS 2020): decentralized SGD whose gossip
sends a low-rank power-iteration projection of each edge's model difference.

    gossip = thinwire.PowerGossip(model, topology="ring", rank=1)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        gossip.after_backward()   # compressed gossip with the graph neighbours
        optimizer.step()          # the local update computed before the gossip (D-PSGD order)

For every edge ``(lo, hi)`` of the topology and every matrix parameter ``X`` (viewed as
``(shape[0], -1)``, ``m x n``, ``r' = min(m, n, rank)``), both ends keep the same ``P``
(``m x r'``) and ``Q`` (``n x r'``), first drawn from a generator seeded by
``(seed, lo, hi, parameter index)``. One half-iteration (``iters`` per step, alternating by a
counter every rank shares): with ``v = orth(Q)`` each end sends ``X_self v``, with
``v = orth(P)`` it sends ``X_self^T v``; both ends compute ``out = msg_hi - msg_lo`` in that
order, so they hold bit-identical results, and ``delta = out v^T`` (or ``v out^T``), the
rank-``r'`` projection of ``X_hi - X_lo``. Then ``X_lo += gamma W_lo,hi delta`` and
``X_hi -= gamma W_lo,hi delta``: the network average is unchanged (up to fp32 rounding) and
no error feedback is needed. With ``warm_start`` the product becomes the edge's next ``P``
(or ``Q``); without, the next one is drawn afresh from ``(seed, lo, hi, index, counter)``.
Every half-iteration's messages to one neighbour travel as one flat buffer.

Parameters of one dimension or none (biases, norm weights) gossip uncompressed once per
step, ``x_i = sum_j W_ij x_j``, in the first half-iteration's buffer. Buffers (BatchNorm
statistics) stay local, as in the paper's accounting; the trainer averages them only to
evaluate the averaged model. Orthogonalisation: Gram-Schmidt, ``1e-8`` added to each norm
(rank 1 is a normalisation). Defaults follow the paper's (``rank`` 1, one half-iteration per
step, ``gamma`` 1, warm start). Unlike its code this also sends on the first step (models
that start apart mix at once); a warm-start column that comes back exactly zero, because the
models agree along it, keeps its previous value instead, or the edge would stop mixing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from thinwire.algorithms.base import Gossip, Loss
from thinwire.algorithms.methods import METHODS
from thinwire.comm.base import Communicator
from thinwire.knobs import knob, require
from thinwire.topology import NAMES

EPS = 1e-8


@dataclass(frozen=True, kw_only=True)
class PowerGossipConfig:
    topology: str = knob("ring", "the graph: ring, torus, complete, exponential, or a mixing matrix file",
                         "|".join(NAMES) + "|FILE")
    rank: int = knob(1, "rank of each edge's projection of the model difference; higher = more bytes, faster mixing",
                     ">= 1")
    iters: int = knob(1, "half power iterations (messages) per step", ">= 1")
    gamma: float = knob(1.0, "diffusion rate: the share of the projected difference applied", "> 0")
    warm_start: bool = knob(True, "start each half-iteration from the previous product", "true|false")
    seed: int = knob(0, "seed of the edges' initial P and Q (identical at both ends of an edge)", "any integer")

    def __post_init__(self) -> None:
        require(self.rank >= 1, f"rank must be >= 1, got {self.rank}")
        require(self.iters >= 1, f"iters must be >= 1, got {self.iters}")
        require(self.gamma > 0, f"gamma must be > 0, got {self.gamma}")
        require(bool(self.topology.strip()), "topology must name a graph or a mixing matrix file")


def orthonormalize(v: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``v`` (a new tensor), each norm plus 1e-8."""
    out = v.clone()
    for i in range(out.shape[1]):
        col = out[:, i]
        for k in range(i):
            col.sub_(torch.dot(col, out[:, k]) * out[:, k])
        col.div_(torch.linalg.vector_norm(col) + EPS)
    return out


def _keep_live(product: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """The warm start's next input: ``product``, except that a column which is exactly zero
    (the two models agree along it, as at the start of training) keeps ``previous``'s column.
    A zero column would stay zero in every later product, and the edge would never mix again.
    Both ends hold bit-identical ``product`` and ``previous``, so they choose alike."""
    dead = torch.linalg.vector_norm(product, dim=0) == 0
    if not bool(dead.any()):
        return product
    return torch.where(dead, previous, product)


@METHODS.register
class PowerGossip(Gossip):
    """Low-rank gossip of model differences with each graph neighbour, every step."""

    name = "powergossip"
    summary = "PowerGossip: decentralized; each edge sends rank-r power-iteration projections of the model difference"
    Config = PowerGossipConfig

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 comm: Communicator | None = None, config: PowerGossipConfig | None = None, *,
                 bucket_mb: float = 25.0, overlap: bool = True, **knobs: Any) -> None:
        super().__init__(model, optimizer, comm, config, bucket_mb=bucket_mb, overlap=overlap, **knobs)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.matrices = [(n, p) for n, p in named if p.dim() >= 2]
        self.vectors = [p for _, p in named if p.dim() < 2]
        self.counter = 0  # half-iterations done; identical on every rank
        self.pq: dict[int, list[list[torch.Tensor]]] = {}  # neighbour -> per matrix [P, Q]
        for j in self.neighbours:
            self.pq[j] = [self._draw(j, k, p, 0) for k, (_, p) in enumerate(self.matrices)]

    def _edge(self, j: int) -> tuple[int, int]:
        return (min(self.comm.rank, j), max(self.comm.rank, j))

    def _draw(self, j: int, k: int, p: torch.Tensor, counter: int) -> list[torch.Tensor]:
        """The edge's P and Q for matrix ``k``, from a generator both ends seed alike."""
        lo, hi = self._edge(j)
        m, n = p.shape[0], p[0].numel()
        r = min(m, n, self.config.rank)
        g = torch.Generator().manual_seed(((self.config.seed * 1_000_003 + lo) * 1_000_003 + hi) * 7_919 + k * 131
                                          + counter * 1_000_000_007)
        return [torch.randn(m, r, generator=g).to(p.device, p.dtype),
                torch.randn(n, r, generator=g).to(p.device, p.dtype)]

    # -- the trainer's interface --------------------------------------------------------------
    def after_backward(self, loss: Loss = None, *, scaler: Any = None) -> bool:
        """``iters`` half-iterations of compressed gossip (the first also mixes the vectors)."""
        for i in range(self.config.iters):
            self._half_iteration(with_vectors=i == 0)
        self.step += 1
        return True

    def _half_iteration(self, with_vectors: bool) -> None:
        t0 = time.perf_counter()
        use_q = self.counter % 2 == 1  # odd: v = orth(Q), send X v; even: v = orth(P), send X^T v
        rank, w = self.comm.rank, self.topology.weights
        mats = [p.detach().reshape(p.shape[0], -1) for _, p in self.matrices]  # (m, n) views
        vecs = [v.detach().reshape(-1) for v in self.vectors]
        basis: dict[int, list[torch.Tensor]] = {}
        sends: dict[int, torch.Tensor] = {}
        own: dict[int, list[torch.Tensor]] = {}
        for j in self.neighbours:
            vs = [orthonormalize(pq[1] if use_q else pq[0]) for pq in self.pq[j]]
            msgs = [x @ v if use_q else x.T @ v for x, v in zip(mats, vs)]  # (m, r') or (n, r')
            basis[j], own[j] = vs, msgs
            parts = [m.reshape(-1) for m in msgs] + (vecs if with_vectors else [])
            sends[j] = torch.cat(parts) if parts else torch.zeros(0)
        recvs = {j: torch.empty_like(sends[j]) for j in self.neighbours}
        t1 = time.perf_counter()
        self.comm.exchange(sends, recvs)
        t2 = time.perf_counter()
        updates = [torch.zeros_like(x) for x in mats]
        mixed = [v * w[rank, rank].item() for v in vecs] if with_vectors else []
        for j in self.neighbours:
            lo, hi = self._edge(j)
            off, theirs = 0, []
            for msg in own[j]:
                theirs.append(recvs[j][off : off + msg.numel()].view(msg.shape))
                off += msg.numel()
            sign = 1.0 if rank == lo else -1.0  # X_lo += gamma W delta, X_hi -= gamma W delta
            scale = sign * self.config.gamma * w[rank, j].item()
            for k, (mine, other, v) in enumerate(zip(own[j], theirs, basis[j])):
                out = (mine - other) if rank == hi else (other - mine)  # msg_hi - msg_lo, same at both ends
                delta = out @ v.T if use_q else v @ out.T  # (m, n): the projection of X_hi - X_lo
                updates[k].add_(delta, alpha=scale)
                if self.config.warm_start:  # the product is the next input
                    self.pq[j][k][0 if use_q else 1] = _keep_live(out, self.pq[j][k][0 if use_q else 1])
                else:
                    self.pq[j][k] = self._draw(j, k, self.matrices[k][1], self.counter + 1)
            if with_vectors:
                for v, acc in zip(vecs, mixed):
                    acc.add_(recvs[j][off : off + v.numel()], alpha=w[rank, j].item())
                    off += v.numel()
        for x, u in zip(mats, updates):
            x.add_(u)
        for v, acc in zip(vecs, mixed):
            v.copy_(acc)
        self.counter += 1
        self._timing.codec_seconds += (t1 - t0) + (time.perf_counter() - t2)
        self._timing.comm_seconds += t2 - t1

    # -- figures and state ---------------------------------------------------------------------
    def bytes_per_step(self) -> float:
        """Bytes this worker sends per step on average (see :func:`bytes_per_step`)."""
        return bytes_per_step(self.model, len(self.neighbours), self.config.rank, self.config.iters)

    def report(self) -> dict[str, Any]:
        return {**super().report(), "bytes_per_step_model": self.bytes_per_step()}

    def state_dict(self) -> dict:
        """The counter and every edge's P and Q, keyed by parameter name and edge."""
        pq = {}
        for j, mats in self.pq.items():
            lo, hi = self._edge(j)
            for (name, _), (p, q) in zip(self.matrices, mats):
                pq[f"{name}@{lo}-{hi}"] = (p.clone(), q.clone())
        return {"counter": self.counter, "step": self.step, "pq": pq}

    def load_state_dict(self, state: dict) -> None:
        self.counter, self.step = int(state["counter"]), int(state["step"])
        for j in self.neighbours:
            lo, hi = self._edge(j)
            for k, (name, _) in enumerate(self.matrices):
                p, q = state["pq"][f"{name}@{lo}-{hi}"]
                self.pq[j][k] = [p.clone(), q.clone()]


def bytes_per_step(model: torch.nn.Module, degree: int, rank: int = 1, iters: int = 1) -> float:
    """Bytes a worker of ``degree`` neighbours sends per step, on average over the alternating
    half-iterations: ``degree * 4 * (iters * sum r'(m + n) / 2 + sum numel(vectors))`` over the
    matrix parameters (``m x n`` views, ``r' = min(m, n, rank)``) and the vectors (parameters
    of fewer than two dimensions)."""
    mats = vecs = 0.0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.dim() >= 2:
            m, n = p.shape[0], p[0].numel()
            mats += min(m, n, rank) * (m + n) / 2
        else:
            vecs += p.numel()
    return degree * 4 * (iters * mats + vecs)

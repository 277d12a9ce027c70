"""A tiny seeded classifier and its batches, for the model-averaging tests: every rank builds
the same model, and batch ``(seed)`` is the same wherever it is drawn."""

from __future__ import annotations

import copy

import torch
from torch import nn


def net(inputs: int, hidden: int, classes: int, *, bn: bool = False, act: type[nn.Module] = nn.Tanh) -> nn.Module:
    """Linear, [BatchNorm], activation, Linear; every parameter drawn from N(0, 0.25), seed 0."""
    norm = [nn.BatchNorm1d(hidden)] if bn else []
    return seeded(nn.Sequential(nn.Linear(inputs, hidden), *norm, act(), nn.Linear(hidden, classes)))


def seeded(model: nn.Module, scale: float = 0.5) -> nn.Module:
    """``model`` with every parameter drawn from N(0, scale²), in order, from generator seed 0:
    the same model on every rank and in every process."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def rule_batch(rank: int, step: int, inputs: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of 16 at ``step`` (generator ``1000 step + rank``): gaussian inputs,
    and a learnable rule for 3 classes, how many of the first two inputs are positive."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, inputs, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def batch(seed: int, size: int, inputs: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` gaussian inputs and uniform labels from generator ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, inputs, generator=g), torch.randint(0, classes, (size,), generator=g)


def backward(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    """Rank ``rank``'s step ``step`` on a 5-input, 3-class model (``net(5, hidden, 3)``): zeroed
    gradients, then the cross-entropy's backward pass on its batch of 6 (seed ``100 step +
    rank``). The optimizer's step is the caller's. A model with bf16 weights gets its inputs
    cast and its loss computed in fp32 (both no-ops on an fp32 model)."""
    x, y = batch(100 * step + rank, 6, 5, 3)
    optimizer.zero_grad()
    dtype = next(model.parameters()).dtype
    nn.functional.cross_entropy(model(x.to(dtype)).float(), y).backward()


def step(model: nn.Module, optimizer: torch.optim.Optimizer, method, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step on the batch ``(x, y)``: zeroed gradients, the cross-entropy's backward pass,
    ``method.after_backward()``, the optimizer's step, ``method.after_step()`` (``method``
    None: the optimizer's step alone). The loss."""
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if method is not None:
        method.after_backward()
    optimizer.step()
    if method is not None:
        method.after_step()
    return loss


def flat(model: nn.Module) -> torch.Tensor:
    """The model's parameters and float buffers as one flat vector."""
    return torch.cat([t.detach().reshape(-1) for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()])


def train(comm, make, steps: int, base: nn.Module, *, cut: int | None = None, finish: bool = False):
    """``steps`` steps of a copy of ``base`` (inner SGD, lr 0.1, momentum 0.5) under the method
    ``make(model, optimizer, comm)`` builds; this rank's :func:`flat` state and the method.
    With ``cut``, everything is checkpointed after ``cut`` steps and resumed into fresh
    objects; with ``finish``, ``method.finish()`` ends the run."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    method = make(model, opt, comm)
    for step in range(steps):
        if step == cut:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), method.state_dict())
            model = copy.deepcopy(base)
            model.load_state_dict(saved[0])
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
            opt.load_state_dict(saved[1])
            method = make(model, opt, comm)
            method.load_state_dict(saved[2])
        backward(model, opt, comm.rank, step)
        method.after_backward()
        opt.step()
        method.after_step()
    if finish:
        method.finish()
    return flat(model), method


def rule_steps(comm, model: nn.Module, opt: torch.optim.Optimizer, steps: int, *, method=None,
               each_step=None) -> list[float]:
    """``steps`` steps of this rank's :func:`rule_batch` (cross-entropy): zeroed gradients,
    backward, ``method.after_backward()``, the optimizer's step, ``method.after_step()``
    (without a method, an optimizer that averages itself: its step alone); ``each_step(step)``
    after each. The losses, one per step."""
    losses = []
    for i in range(steps):
        losses.append(step(model, opt, method, *rule_batch(comm.rank, i)).item())
        if each_step is not None:
            each_step(i)
    return losses


def on_gloo(rank: int, world: int, fn, *args):
    """For ``run_ranks(on_gloo, n, fn, *args)``: ``fn(TorchComm(), *args)`` on this spawned rank
    (``fn`` a module-level function, so that the spawned process can import it)."""
    from thinwire.comm.torch_dist import TorchComm

    return fn(TorchComm(), *args)


def in_process(world: int, fn, *args) -> list:
    """``fn(comm, *args)`` on ``world`` in-process ranks with one torch thread, the spawned gloo
    ranks' kernels (a result can depend on the thread count): each rank's result."""
    from thinwire.comm.local import LocalWorld

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return LocalWorld(world).run(lambda comm: fn(comm, *args))
    finally:
        torch.set_num_threads(threads)


def deep_net() -> nn.Module:
    """6 inputs, hidden layers of 32 (with BatchNorm) and 16, 3 classes (:func:`rule_batch`'s);
    every parameter from :func:`seeded`."""
    return seeded(nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                                nn.Linear(16, 3)))


def built(comm, base: nn.Module, spec: str, optimizer=torch.optim.AdamW, **options):
    """A copy of ``base``, its optimizer (``optimizer(params, **options)``) and the method
    ``spec`` names over ``comm``."""
    from thinwire.algorithms.build import build_method

    model = copy.deepcopy(base)
    opt = optimizer(model.parameters(), **options)
    return model, opt, build_method(spec, model, opt, comm)


def fake_summary(**fields):
    """A run's :class:`thinwire.run.summary.Summary` with ``fields`` (names it does not have are
    the method's own), for stand-ins of ``launch``: task ``synthetic``, ``identity`` on 2
    workers for 1 step unless given."""
    from thinwire.run.summary import Summary

    return Summary.from_json({"task": "synthetic", "method": "identity", "workers": 2, "steps": 1, **fields})

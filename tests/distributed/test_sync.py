"""Synchronous averaging over real gloo ranks: exact against plain all_reduce and against
single-process training on the union of the ranks' batches."""

import pytest
import torch
import torch.distributed as dist

from spawn import run_ranks
from thinwire.algorithms.sync import SyncReducer


def _model() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.ReLU(), torch.nn.Linear(40, 5))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)


def _vs_allreduce(rank, world, spec):
    from thinwire.comm.torch_dist import TorchComm

    model = _model()
    x, y = _batch(rank, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)  # the plain reference: one all_reduce of everything, then the mean
    flat /= world
    SyncReducer(model, spec, TorchComm()).reduce()
    ours = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return (ours - flat).abs().max().item()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_identity_equals_plain_allreduce_mean_exactly(world):
    # power-of-two world sizes: dividing before the sum (as DDP does) is exact in fp32
    assert run_ranks(_vs_allreduce, world, "identity") == [0.0] * world


def _train(rank, world, steps, spec):
    from thinwire.comm.torch_dist import TorchComm

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reducer = SyncReducer(model, spec, TorchComm())
    for step in range(steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        reducer.reduce()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_identity_training_equals_single_process_on_union_of_batches(world):
    steps = 6
    results = run_ranks(_train, world, steps, "identity")
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        xs, ys = zip(*(_batch(r, step) for r in range(world)))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    for r in range(world):  # ranks agree bit for bit with each other
        for a, b in zip(results[r], results[0]):
            assert torch.equal(a, b)
    # and with the union batch up to fp32 summation order: stated tolerance 1e-5 absolute
    for a, b in zip(results[0], ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-5)


@pytest.mark.timeout(120)
def test_compressed_methods_keep_ranks_identical():
    # every rank applies the same averaged update, whatever the codec
    for spec in ("topk:ratio=0.1", "powersgd:rank=2", "qsgd", "signsgd", "bf16"):
        results = run_ranks(_train, 2, 3, spec)
        for a, b in zip(results[0], results[1]):
            assert torch.equal(a, b), spec

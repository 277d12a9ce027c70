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
    # the plain reference: one all_reduce of everything, laid out as the reducer buckets it
    # (last parameter first, as DDP does; gloo's sum order follows the position in the buffer)
    flat = torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))])
    dist.all_reduce(flat)
    flat /= world
    SyncReducer(model, spec, TorchComm()).reduce()
    ours = torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))])
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


def _compressed_step(rank, world, spec):
    """One real gloo step of a compressing codec (min_numel=0: every matrix is compressed),
    next to this rank's own decode, so the parent can form the reference mean."""
    from thinwire.codecs.specs import build_codec
    from thinwire.comm.torch_dist import TorchComm

    model = _model()
    x, y = _batch(rank, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    own = {}
    for name, p in model.named_parameters():
        codec = build_codec(spec)
        if not codec.compresses(p.shape):
            codec = build_codec("identity")
        codec.rank, codec.step = rank, 0
        own[name] = codec.decode(codec.encode(p.grad, key=name))
    SyncReducer(model, spec, TorchComm(), bucket_mb=0.001).reduce()  # small buckets: several in flight
    return {n: p.grad.clone() for n, p in model.named_parameters()}, own


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec", ["topk:ratio=0.1,min_numel=0", "qsgd:min_numel=0", "signsgd:min_numel=0,ef=false",
                                  "randomk:ratio=0.2,min_numel=0", "terngrad:min_numel=0"])
def test_compressed_mean_over_gloo_is_the_mean_of_each_ranks_decode(spec):
    results = run_ranks(_compressed_step, 2, spec)
    (out0, own0), (out1, own1) = results
    for name in out0:
        assert torch.equal(out0[name], out1[name]), name  # every rank applies the same update
        # GATHER: decoded then summed in rank order and divided; SUM: divided then summed
        torch.testing.assert_close(out0[name], (own0[name] + own1[name]) / 2, rtol=0, atol=1e-6)
    assert any(not torch.equal(out0[n], (own0[n] + own0[n]) / 2) for n in out0)  # ranks did differ


@pytest.mark.timeout(120)
def test_compressed_methods_keep_ranks_identical_over_steps():
    for spec in ("powersgd:rank=2", "bf16", "topk:ratio=0.1,min_numel=0"):
        results = run_ranks(_train, 2, 3, spec)
        for a, b in zip(results[0], results[1]):
            assert torch.equal(a, b), spec

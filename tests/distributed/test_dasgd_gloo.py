"""DaSGD over real gloo ranks: the asynchronous all_reduce gives the in-process result, the
training loss falls, and the models agree at every blocking average."""

import copy

import pytest
import torch
from torch import nn

import tiny
from spawn import run_ranks


def _base() -> nn.Module:
    return tiny.seeded(nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3)))


def _train(comm, spec: str, steps: int):
    model, opt, method = tiny.built(comm, _base(), spec, torch.optim.SGD, lr=0.05, momentum=0.9)
    losses = tiny.rule_steps(comm, model, opt, steps, method=method)
    return tiny.flat(model), losses, method.report()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spec", ["dasgd:period=4,delay=2,warmup=2", "dasgd:period=3,delay=3,warmup=0,codec=bf16",
                                  "localsgd:period=4,warmup=2"])
def test_gloo_matches_the_in_process_result_and_learns(spec):
    """Two ranks: a sum of two values is the same in any order, so gloo's asynchronous
    all_reduce must give the in-process communicator's result bit for bit."""
    steps = 40
    gloo = run_ranks(tiny.on_gloo, 2, _train, spec, steps)  # 1 torch thread per rank
    local = tiny.in_process(2, _train, spec, steps)
    for (a, losses, _report), (b, _, _) in zip(gloo, local):
        assert torch.equal(a, b)
        assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8
    assert gloo[0][2]["method"].startswith(spec.split(":")[0])


def _blocking_agreement(rank, world):
    from thinwire.algorithms.dasgd import DaSGD, DaSGDConfig
    from thinwire.comm.torch_dist import TorchComm

    model = copy.deepcopy(_base())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    m = DaSGD(model, opt, TorchComm(), DaSGDConfig(period=2, delay="0", warmup=0))
    flats = []
    for step in range(6):
        x, y = tiny.rule_batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        m.after_step()
        if (step + 1) % 2 == 0:
            flats.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return flats


@pytest.mark.timeout(120)
def test_delay_zero_leaves_every_average_identical_on_all_ranks():
    results = run_ranks(_blocking_agreement, 4)
    for flats in results[1:]:
        for a, b in zip(flats, results[0]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)

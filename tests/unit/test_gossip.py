"""D-PSGD on the in-process communicator: the complete graph is parameter averaging, gossip
keeps the network average, bytes follow the degree, and ranks mix in the D-PSGD order."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tiny
from thinwire.algorithms.gossip import DPSGD, DPSGDConfig
from thinwire.comm.local import LocalWorld

BASE = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batch(rank: int, step: int):
    return tiny.batch(1000 * step + rank, 8, 6, 3)


def _run(n, topology, steps, lr=0.1, mix=None):
    def fn(comm):
        model = copy.deepcopy(BASE)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        method = DPSGD(model, opt, comm, DPSGDConfig(topology=topology)) if mix is None else mix(model, comm)
        for step in range(steps):
            tiny.step(model, opt, method, *_batch(comm.rank, step))
        return tiny.flat(model), comm.meter.snapshot()

    return LocalWorld(n).run(fn)


class _MeanThenStep:
    """The reference: every step, average the model state over the ranks, then step."""

    def __init__(self, model, comm):
        from thinwire.algorithms.averaging import ModelState

        self.state, self.comm = ModelState(model), comm

    def after_backward(self):
        flat = self.state.gather()
        flat.mul_(1 / self.comm.world_size)  # the same scaling as W = 1/n on the complete graph
        out = torch.empty(self.comm.world_size, flat.numel())
        self.comm.all_gather(flat, out)
        total = out[self.comm.rank].clone()  # self first, then ascending ranks, as gossip sums
        for j in range(self.comm.world_size):
            if j != self.comm.rank:
                total.add_(out[j])
        self.state.scatter(total)

    def after_step(self):
        pass


@pytest.mark.parametrize("n", [2, 4])
def test_complete_graph_is_synchronous_parameter_averaging(n):
    ours = _run(n, "complete", 6)
    ref = _run(n, "complete", 6, mix=lambda m, c: _MeanThenStep(m, c))
    for (a, _), (b, _) in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # x * (1/n) vs W's 1/n in float64 -> fp32


@pytest.mark.parametrize("topology, n", [("ring", 4), ("ring", 8), ("exponential", 8), ("torus", 9)])
def test_gossip_keeps_the_network_average(topology, n):
    """lr = 0: only the mixing acts; the mean over ranks stays put (fp32 rounding) while the
    models move towards it."""
    def fn(comm):
        torch.manual_seed(0)
        model = copy.deepcopy(BASE)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(comm.rank)))
        before = tiny.flat(model)
        method = DPSGD(model, None, comm, DPSGDConfig(topology=topology))
        for _ in range(3):
            method.after_backward()
        return before, tiny.flat(model)

    results = LocalWorld(n).run(fn)
    before = torch.stack([r[0] for r in results])
    after = torch.stack([r[1] for r in results])
    torch.testing.assert_close(after.mean(0), before.mean(0), rtol=0, atol=1e-5)
    spread = lambda x: (x - x.mean(0)).square().sum().item()  # noqa: E731
    assert spread(after) < 0.5 * spread(before)


def test_bytes_per_step_are_degree_times_the_model():
    results = _run(8, "exponential", 3)
    numel = tiny.flat(BASE).numel()
    for _, meter in results:
        assert meter["send"]["bytes"] == 3 * 5 * 4 * numel  # 3 steps, degree 5, fp32
        assert meter["send"]["calls"] == 3 * 5


def test_topology_must_fit_the_world():
    with pytest.raises(ValueError, match="a torus needs workers"):
        LocalWorld(4).run(lambda comm: DPSGD(copy.deepcopy(BASE), None, comm, DPSGDConfig(topology="torus")))

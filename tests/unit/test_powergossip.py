"""PowerGossip on the in-process communicator: the network average is preserved, both ends
of an edge hold bit-identical P and Q, consensus falls monotonically on the standard
problem, and the bytes follow deg * 4 * (k * sum r'(m+n)/2 + sum numel(vectors))."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from thinwire.algorithms.powergossip import PowerGossip, PowerGossipConfig, orthonormalize
from thinwire.comm.local import LocalWorld


class Net(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(rank)
        self.w = nn.Parameter(torch.randn(20, 12, generator=g))
        self.conv = nn.Parameter(torch.randn(6, 3, 2, 2, generator=g))
        self.b = nn.Parameter(torch.randn(7, generator=g))


class Square(nn.Module):
    """The standard consensus problem: one 100 x 100 N(0, 1) matrix per worker."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.randn(100, 100, generator=torch.Generator().manual_seed(100 + rank)))


def _consensus_errors(results) -> list[float]:
    """mean_i ||x_i - x_mean||^2 at each recorded step; ``results[rank][t]`` is rank's x at t."""
    errors = []
    for t in range(len(results[0])):
        xs = torch.stack([r[t] for r in results]).double()
        errors.append((xs - xs.mean(0)).square().sum((1, 2)).mean().item())
    return errors


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("spec", [dict(rank=1), dict(rank=2, iters=2), dict(rank=1, warm_start=False, gamma=0.5)])
def test_the_network_average_is_preserved_after_every_step(n, spec):
    def fn(comm):
        model = Net(comm.rank)
        g = PowerGossip(model, None, comm, PowerGossipConfig(**spec))
        flats = [_flat(model)]
        for _ in range(4):
            g.after_backward()
            flats.append(_flat(model))
        return flats

    results = LocalWorld(n).run(fn)
    means = [torch.stack([r[t] for r in results]).mean(0) for t in range(5)]
    for m in means[1:]:
        torch.testing.assert_close(m, means[0], rtol=0, atol=1e-5)  # fp32 rounding of the +-delta pairs
    assert not torch.equal(results[0][-1], results[0][0])  # the models moved


def test_both_ends_of_an_edge_hold_bit_identical_p_and_q():
    def fn(comm):
        g = PowerGossip(Net(comm.rank), None, comm, PowerGossipConfig(rank=2))
        for _ in range(3):
            g.after_backward()
        return g.state_dict()["pq"]

    states = LocalWorld(4).run(fn)  # ring: edges (0,1) (1,2) (2,3) (0,3)
    for key in states[0]:
        lo, hi = (int(x) for x in key.split("@")[1].split("-"))
        for a, b in zip(states[lo][key], states[hi][key]):
            assert torch.equal(a, b)


def _mix(model, g, steps: int) -> list[torch.Tensor]:
    """The model's matrix before and after each of ``steps`` gossip steps (no gradients)."""
    xs = [model.x.detach().clone()]
    for _ in range(steps):
        g.after_backward()
        xs.append(model.x.detach().clone())
    return xs


def test_consensus_falls_monotonically_on_the_standard_problem():
    """8 workers on a ring, each a 100 x 100 N(0, 1) matrix, no gradients."""
    def fn(comm):
        model = Square(comm.rank)
        g = PowerGossip(model, None, comm, PowerGossipConfig(rank=1))
        return _mix(model, g, 30)

    errors = _consensus_errors(LocalWorld(8).run(fn))
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.75 * errors[0]  # 8725 -> 6270 in 30 rank-1 steps (random matrices mix slowly)


def test_bytes_per_step_follow_the_formula():
    def fn(comm):
        g = PowerGossip(Net(comm.rank), None, comm, PowerGossipConfig(rank=2, iters=1))
        for _ in range(2):  # two steps: one P and one Q half-iteration
            g.after_backward()
        return comm.meter.snapshot()["send"]["bytes"], g.bytes_per_step()

    sent, formula = LocalWorld(4).run(fn)[0]
    # deg 2; w: r'=2, (20 + 12) / 2; conv (6 x 12): r'=2, (6 + 12) / 2; vectors: b (7)
    expected = 2 * 4 * (1 * (2 * 32 / 2 + 2 * 18 / 2) + 7)
    assert formula == expected and sent == 2 * expected


def test_orthonormalize():
    v = orthonormalize(torch.randn(30, 3, generator=torch.Generator().manual_seed(0)))
    torch.testing.assert_close(v.T @ v, torch.eye(3), rtol=0, atol=1e-6)


@pytest.mark.parametrize("knobs, message", [(dict(rank=0), "rank must be >= 1"), (dict(iters=0), "iters must be >= 1"),
                                            (dict(gamma=0), "gamma must be > 0")])
def test_bad_knobs(knobs, message):
    with pytest.raises(ValueError, match=message):
        PowerGossipConfig(**knobs)


def test_resume_from_a_checkpoint_continues_exactly():
    """Per-edge P and Q (keyed by parameter name and edge) and the counter round-trip."""
    def fn(comm, cut):
        model = Net(comm.rank)
        g = PowerGossip(model, None, comm, PowerGossipConfig(rank=2))
        for step in range(5):
            if step == cut:
                saved = ({k: v.clone() for k, v in model.state_dict().items()}, g.state_dict())
                model = Net(comm.rank)
                model.load_state_dict(saved[0])
                g = PowerGossip(model, None, comm, PowerGossipConfig(rank=2))
                g.load_state_dict(saved[1])
            g.after_backward()
        return _flat(model)

    straight = LocalWorld(4).run(lambda comm: fn(comm, None))
    resumed = LocalWorld(4).run(lambda comm: fn(comm, 3))
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spec", [dict(rank=1), dict(rank=3, iters=2)])
def test_gossip_still_mixes_after_steps_where_the_models_agree(spec):
    """Identical models (the usual start of training) give a zero product on every edge; the
    edges must keep a usable P and Q, so that the models still mix once they drift apart."""
    def fn(comm):
        model = Square(0)  # the same matrix on every rank
        g = PowerGossip(model, None, comm, PowerGossipConfig(**spec))
        for _ in range(3):
            g.after_backward()  # nothing to mix yet
        with torch.no_grad():  # a local update: the models drift apart
            model.x.add_(torch.randn(100, 100, generator=torch.Generator().manual_seed(comm.rank)))
        return _mix(model, g, 30)

    errors = _consensus_errors(LocalWorld(8).run(fn))
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.8 * errors[0]

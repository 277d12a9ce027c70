"""DeMo over real gloo ranks: two ranks give the in-process result bit for bit, and four
ranks (1-bit values) end every step with the same parameters and learn."""

import copy

import pytest
import torch
from torch import nn

import tiny
from spawn import run_ranks


def _base() -> nn.Module:
    return tiny.seeded(nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3)))


def _train(comm, knobs: dict, steps: int):
    from thinwire.optim import DeMo

    model = copy.deepcopy(_base())
    opt = DeMo(model.named_parameters(), lr=0.01, comm=comm, **knobs)
    losses = tiny.rule_steps(comm, model, opt, steps)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), losses, comm.meter.bytes_sent


@pytest.mark.timeout(180)
def test_two_gloo_ranks_match_the_in_process_result_and_learn():
    knobs, steps = {"chunk": 16, "topk": 8}, 40
    gloo = run_ranks(tiny.on_gloo, 2, _train, knobs, steps)  # 1 torch thread per rank
    local = tiny.in_process(2, _train, knobs, steps)
    for (a, losses, sent), (b, _, sent_local) in zip(gloo, local):
        assert torch.equal(a, b) and sent == sent_local > 0
        assert sum(losses[-8:]) / 8 < 0.7 * sum(losses[:8]) / 8
    assert torch.equal(gloo[0][0], gloo[1][0])


@pytest.mark.timeout(180)
def test_four_gloo_ranks_with_one_bit_values_agree_bit_for_bit_and_learn():
    out = run_ranks(tiny.on_gloo, 4, _train, {"chunk": 16, "topk": 8, "values": "sign"}, 40)
    assert all(torch.equal(out[0][0], flat) for flat, _, _ in out[1:])
    for _, losses, _ in out:
        assert sum(losses[-8:]) / 8 < 0.8 * sum(losses[:8]) / 8

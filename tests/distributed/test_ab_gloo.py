"""AB-training over real gloo ranks (four, in groups of two on gloo sub-groups): the loss
falls, every rank ends with the same synced model, and the run matches the in-process
communicator's to fp32 summation-order rounding."""

import copy

import pytest
import torch
from torch import nn

import tiny
from spawn import run_ranks

SPEC = "ab:group_size=2,warmup=4,cycle=8,full_steps=2,cutoff=0.3,rebound=2"


def _base() -> nn.Module:
    return tiny.seeded(nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                     nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)))


def _train(comm, steps: int):
    model, opt, method = tiny.built(comm, _base(), SPEC, torch.optim.SGD, lr=0.05, momentum=0.9)
    losses = tiny.rule_steps(comm, model, opt, steps, method=method)
    method.finish()
    flat = torch.cat([t.detach().reshape(-1) for n, t in [*model.named_parameters(), *model.named_buffers()]
                      if t.is_floating_point() and not n.endswith((".a", ".b"))])
    return flat, losses, method.report()


@pytest.mark.timeout(180)
def test_four_gloo_ranks_in_two_groups_learn_and_end_in_agreement():
    steps = 44  # ends inside a group phase: finish() syncs
    gloo = run_ranks(tiny.on_gloo, 4, _train, steps)
    local = tiny.in_process(4, _train, steps)
    for flat, losses, report in gloo:
        assert torch.equal(flat, gloo[0][0])  # one model on every rank after the final sync
        assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8
        assert report["syncs"] == 6  # steps 8, 16, 24, 32, 40 and finish() and report["groups"] == [[0, 1], [2, 3]]
    assert [r[2]["role"] for r in gloo] == ["a", "a", "b", "b"]
    torch.testing.assert_close(gloo[0][0], local[0][0], rtol=1e-4, atol=1e-4)  # 4-way sums in another order


def _readme(rank, world, steps):
    """docs/guide.md's AB snippet, as written (default knobs: groups of half the world), on a
    real gloo world; the plain model's state and the method's report."""
    import thinwire

    model = copy.deepcopy(_base())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = nn.functional.cross_entropy
    loader = (tiny.rule_batch(rank, step) for step in range(steps))
    ab = thinwire.ABTraining(model, optimizer)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        ab.after_backward()
        optimizer.step()
        ab.after_step()
    ab.finish()
    plain = _base()
    plain.load_state_dict(model.state_dict(), strict=True)  # the original class, nothing left over
    kinds = [type(m).__name__ for m in model]
    return model.state_dict(), kinds, ab.report()


@pytest.mark.timeout(180)
def test_the_readme_snippet_on_two_gloo_ranks_ends_with_one_plain_model():
    steps = 150  # warm-up 100, factorised at 100 (untruncated), finish() syncs inside the group phase
    results = run_ranks(_readme, 2, steps)
    for state, kinds, report in results:
        assert kinds == ["Linear", "BatchNorm1d", "ReLU", "Linear", "ReLU", "Linear"]
        assert report["groups"] == [[0], [1]] and report["syncs"] == 1 and report["factorisations"] == 1
        for key, value in state.items():
            assert torch.equal(value, results[0][0][key]), key  # one model on both ranks
    assert [r[2]["role"] for r in results] == ["a", "b"]

"""Learning-rate schedules against their formulas, and Muon's split of a model's parameters."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn

from thinwire.optim import schedule
from thinwire.optim.muon import MuonAdamW, muon_adamw, split


@pytest.mark.parametrize("step, expected", [(0, 0.1), (4, 0.5), (9, 1.0)])
def test_warmup_is_linear_to_the_base_rate(step, expected):
    for kind in schedule.SCHEDULES:
        assert schedule.factor(step, 100, kind, warmup=10, min_lr=0.1) == pytest.approx(expected, rel=1e-12)


def test_cosine_at_named_steps():
    # T = 110, W = 10: p = (s - 10) / 100; r = 0.1
    f = lambda s: schedule.factor(s, 110, "cosine", warmup=10, min_lr=0.1)  # noqa: E731
    assert f(10) == 1.0
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-12)  # 0.55
    assert f(85) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.75)), rel=1e-12)
    assert f(109) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.99)), rel=1e-12)
    assert schedule.factor(50, 100, "constant", warmup=10) == 1.0


def test_wsd_is_stable_then_decays_linearly_over_the_last_fifth():
    # T = 1000, W = 0: the last 200 steps decay from 1 (step 800) to r (step 999)
    f = lambda s: schedule.factor(s, 1000, "wsd", warmup=0, min_lr=0.0)  # noqa: E731
    assert f(0) == f(500) == f(799) == f(800) == 1.0
    assert f(999) == 0.0
    assert f(900) == pytest.approx(99 / 199, rel=1e-12)  # 100 steps left, this one included
    assert schedule.factor(999, 1000, "wsd", min_lr=0.25) == 0.25


@pytest.mark.parametrize("args, message", [
    (("linear", 0, 0.0, 100), "--lr-schedule must be one of constant, cosine, wsd"),
    (("cosine", -1, 0.0, 100), "--warmup-steps must be >= 0"),
    (("cosine", 100, 0.0, 100), "--warmup-steps must be < --steps (100)"),
    (("cosine", 0, 1.5, 100), "--min-lr is a share of the learning rate and must be in [0, 1]"),
    (("cosine", 0, float("nan"), 100), "--min-lr"),
])
def test_bad_schedule_settings_name_the_rule(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        schedule.check(*args)


def test_a_new_length_is_taken_only_where_the_rates_so_far_are_the_new_runs():
    # T = 110, W = 10; wsd's decay is the last 20 of the 100 steps after the warm-up: from step 90
    span = lambda kind, step, new: schedule.refuse_new_span(kind, 10, 0.1, 0.5, step, 110, new)  # noqa: E731
    assert span("constant", 100, 1000) is None and span("constant", 100, 105) is None
    assert span("cosine", 10, 1000) is None  # steps 0..9 are the warm-up, the same in any length
    # steps 0..90: warm-up, then the stable rate (the decay's first step, 90, is still at 19/19 of it)
    assert span("wsd", 91, 1000) is None
    assert span("wsd", 91, 200) is None and span("wsd", 100, 110) is None  # the same length
    # step 91 of a 110-step wsd run has decayed to 0.5 · (0.1 + 0.9 · 18/19); a 1000-step run's has not
    why = span("wsd", 92, 1000)
    assert why == ("--steps 1000 would change the wsd schedule of a run of 110 steps resumed at step 92: its last "
                   "rate was 0.476, the next would be 0.5 (wsd extends only from its stable phase, and the decay over "
                   "the last 20% of 110 steps had begun); resume with --steps 110, or start a run of the length "
                   "wanted"), why
    assert span("cosine", 11, 120) is None  # step 10, the first after the warm-up, is at the base rate in both
    f_last, f_next = schedule.factor(11, 110, "cosine", 10, 0.1), schedule.factor(12, 120, "cosine", 10, 0.1)
    why = span("cosine", 12, 120)  # step 11 is not
    assert why is not None and f"its last rate was {0.5 * f_last:.3g}, the next would be {0.5 * f_next:.3g} " \
        "(a cosine's span is the run's length" in why, why
    assert span("cosine", 12, 105) is not None  # a shorter run is refused alike


def test_apply_keeps_each_groups_own_base_rate():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.02}])
    schedule.apply(opt, 0.5)
    schedule.apply(opt, 0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.025, 0.005]
    assert [g["initial_lr"] for g in opt.param_groups] == [0.1, 0.02]


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(11, 8)
        self.ln = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.head = nn.Linear(8, 11, bias=False)

    def forward(self, x):
        return self.head(self.fc2(torch.relu(self.fc1(self.ln(self.tok(x))))))


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    m = _LM()
    muon, adamw = split(m)
    assert [id(p) for p in muon] == [id(m.fc1.weight), id(m.fc2.weight)]
    assert {id(p) for p in adamw} == {id(p) for p in (m.tok.weight, m.ln.weight, m.ln.bias, m.fc1.bias, m.fc2.bias,
                                                      m.head.weight)}
    muon2, _ = split(m, head="fc2")  # a named head: the last linear is hidden again
    assert [id(p) for p in muon2] == [id(m.fc1.weight), id(m.head.weight)]
    with pytest.raises(ValueError, match="needs a model with 2-D hidden weights"):
        split(nn.Sequential(nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="no module named 'nosuch'"):
        split(m, head="nosuch")


def test_muon_adamw_is_one_optimizer_whose_state_resumes_exactly():
    torch.manual_seed(0)
    m = _LM()
    x, y = torch.randint(11, (4, 5)), torch.randint(11, (4, 5))

    def step(model, opt):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).reshape(-1, 11), y.reshape(-1)).backward()
        opt.step()

    opt = muon_adamw(m, 1e-2, weight_decay=0.01)
    assert isinstance(opt, MuonAdamW) and [g["kind"] for g in opt.param_groups] == ["muon", "adamw"]
    for _ in range(3):
        step(m, opt)
    m2 = copy.deepcopy(m)
    opt2 = muon_adamw(m2, 1e-2, weight_decay=0.01)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    step(m, opt)
    step(m2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters(), strict=True))
    # Muon's own update (orthogonalized) differs from AdamW's on the same matrix
    m3 = copy.deepcopy(m)
    before = m3.fc1.weight.detach().clone()
    step(m3, torch.optim.AdamW(m3.parameters(), lr=1e-2))
    adamw_delta = m3.fc1.weight.detach() - before
    m4 = copy.deepcopy(m)
    step(m4, muon_adamw(m4, 1e-2))
    assert not torch.allclose(m4.fc1.weight.detach() - before, adamw_delta)

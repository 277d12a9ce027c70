"""docs/adding_a_method.md's example, run as written: the page's code block is the whole
method, registers like a user's own, and does what the page says on two in-process ranks."""

from __future__ import annotations

import copy
import pathlib
import re
import sys
import types

import pytest
import torch

import tiny
from thinwire.algorithms.build import build_method
from thinwire.algorithms.local_sgd import LocalSGD, LocalSGDConfig
from thinwire.algorithms.methods import METHODS, resolve_method
from thinwire.comm.local import LocalWorld

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "adding_a_method.md"
TOL = 1e-6  # fp32: the anchor's arithmetic against the reference's, same operations in another order


def _example() -> types.ModuleType:
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    module = types.ModuleType("block_momentum_example")
    sys.modules[module.__name__] = module  # dataclasses look their module up while the class is made
    exec(compile(code, str(DOC), "exec"), module.__dict__)
    return module


EXAMPLE = _example()


@pytest.fixture
def registered():
    METHODS.register(EXAMPLE.BlockMomentum)
    yield EXAMPLE.BlockMomentum
    METHODS.remove("blockmomentum")


BASE = tiny.net(5, 8, 3)


def _train(comm, make, steps):
    model = copy.deepcopy(BASE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method = make(model, opt, comm)
    for step in range(steps):
        tiny.backward(model, opt, comm.rank, step)
        method.after_backward()
        opt.step()
        method.after_step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), method


def _reference(n: int, steps: int, period: int, beta: float) -> torch.Tensor:
    """The page's formula, by hand: n models stepping alone, averaged every period steps."""
    models = [copy.deepcopy(BASE) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
    anchor = velocity = None
    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            tiny.backward(m, o, r, step)
            o.step()
        if (step + 1) % period == 0:
            mean = sum(flat(m) for m in models) / n
            if anchor is None:
                anchor, velocity = mean, torch.zeros_like(mean)
            else:
                velocity = beta * velocity + (anchor - mean)
                anchor = anchor - velocity
            for m in models:
                torch.nn.utils.vector_to_parameters(anchor.clone(), m.parameters())
    return flat(models[0])


def test_the_example_follows_its_formula_on_two_ranks(registered):
    make = lambda model, opt, comm: build_method("blockmomentum:period=3,beta=0.6", model, opt, comm)  # noqa: E731
    got = LocalWorld(2).run(lambda comm: _train(comm, make, 12)[0])  # ends on an average
    want = _reference(2, 12, period=3, beta=0.6)
    assert torch.equal(got[0], got[1])  # every rank continues from the same anchor
    assert torch.allclose(got[0], want, atol=TOL, rtol=0)


def test_beta_zero_is_local_sgd(registered):
    mine = LocalWorld(2).run(lambda comm: _train(comm, lambda m, o, c: registered(m, o, c, beta=0.0, period=2), 9)[0])
    local = LocalWorld(2).run(
        lambda comm: _train(comm, lambda m, o, c: LocalSGD(m, o, c, LocalSGDConfig(period=2)), 9)[0])
    for a, b in zip(mine, local):  # rank by rank: the last step is a local one
        assert torch.allclose(a, b, atol=TOL, rtol=0)


def test_it_is_a_method_like_the_built_in_ones(registered):
    assert resolve_method("blockmomentum") == "blockmomentum:period=4,warmup=0,average_momentum=false,beta=0.5"
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\), got 1.0"):
        resolve_method("blockmomentum:beta=1")
    assert METHODS.names()[-1] == "blockmomentum"  # after the built-in ones


def test_it_resumes_exactly(registered):
    def fn(comm):
        model = copy.deepcopy(BASE)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        method = registered(model, opt, comm, period=2, beta=0.5)
        for step in range(9):
            if step == 5:  # into fresh objects, from the states
                saved = (copy.deepcopy(model.state_dict()), method.state_dict())
                model = copy.deepcopy(BASE)
                model.load_state_dict(saved[0])
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                method = registered(model, opt, comm, period=2, beta=0.5)
                method.load_state_dict(saved[1])
            tiny.backward(model, opt, comm.rank, step)
            method.after_backward()
            opt.step()
            method.after_step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    resumed = LocalWorld(2).run(fn)
    straight = LocalWorld(2).run(
        lambda comm: _train(comm, lambda m, o, c: registered(m, o, c, period=2, beta=0.5), 9)[0])
    assert torch.equal(resumed[0], straight[0])

"""AB-training gives back a plain model: after ``finish()`` the factored layers are the user's
own ``nn.Linear`` / ``nn.Conv2d`` objects again (same Parameter objects, ``W = A·B`` of the
synced model), the state dict loads with ``strict=True`` into a fresh instance of the
original class and gives the same outputs, the optimizer holds exactly the model's
parameters and still steps them, the method refuses to be stepped again, and a run saved
after the export loads into a new ABTraining (or the trainer's resume) and trains on."""

from __future__ import annotations

import copy

import pytest
import torch
from test_ab import _data
from torch import nn

from thinwire.algorithms.ab import ABConfig, ABTraining
from thinwire.comm.local import LocalWorld
from thinwire.nn import Factorized, factorize_model, unfactorize_model
from thinwire.run.config import TrainConfig
from thinwire.run.memory import tensor_bytes as _tensor_bytes
from thinwire.run.trainer import train_rank


class Plain(nn.Module):
    """conv0 (first, excluded), conv1 and fc1 (factored), skip (excluded by name), fc2 (last)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 2 * 2, 24)
        self.skip = nn.Linear(24, 24)
        self.fc2 = nn.Linear(24, 3)

    def forward(self, x):
        x = torch.relu(self.conv0(x))
        x = torch.relu(self.norm(self.conv1(x)))
        x = nn.functional.adaptive_avg_pool2d(x, 2).flatten(1)
        x = torch.relu(self.fc1(x))
        return self.fc2(torch.relu(self.skip(x)))


torch.manual_seed(0)
_INIT = {k: v.clone() for k, v in Plain().state_dict().items()}  # ranks are threads: no global RNG in them
# factorise at 2, sync at 6, re-factorise at 7, sync at 12; exclude the first, the last and skip
SPEC = dict(warmup=2, cycle=6, full_steps=1, cutoff=0.3, rebound=2, exclude="first;last;skip")
FACTORED = ("conv1", "fc1")


def _plain() -> Plain:
    model = Plain()
    model.load_state_dict(_INIT)
    return model


def _step(model, opt, ab, rank: int, step: int) -> None:
    x, y = _data(rank, step)  # test_ab.py's batches: three classes by the mean
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    if ab is not None:
        ab.after_backward()
    opt.step()
    if ab is not None:
        ab.after_step()


def _train(comm, steps: int, **spec):
    """(model, optimizer, method, the original layer objects and weight Parameters) after
    ``steps`` steps, before ``finish()``."""
    model = _plain()
    originals = {n: getattr(model, n) for n in FACTORED}
    weights = {n: getattr(model, n).weight for n in FACTORED}
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ab = ABTraining(model, opt, comm, ABConfig(**{**SPEC, **spec}))
    for step in range(steps):
        _step(model, opt, ab, comm.rank, step)
    return model, opt, ab, originals, weights


def _probe() -> torch.Tensor:
    return torch.randn(5, 1, 6, 6, generator=torch.Generator().manual_seed(7))


def _outputs(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = model(_probe())
    model.train()
    return out


# -- the exported model ------------------------------------------------------------------------
@pytest.mark.parametrize("sync", ["full", "with-stale", "only-learned", "only-b"])
def test_finish_gives_back_the_original_layers_with_the_synced_weights(sync):
    def fn(comm):
        model, opt, ab, originals, weights = _train(comm, 10, sync=sync)  # ends inside a group phase
        assert ab.phase == "group"
        ab.sync()  # what finish() does first: one model on every rank, W = A·B
        before = _outputs(model)
        products = {n: model.get_submodule(n).weight.detach().clone() for n in FACTORED}
        returned = ab.finish()
        assert returned is model
        for name in FACTORED:
            layer = getattr(model, name)
            assert layer is originals[name] and type(layer) in (nn.Conv2d, nn.Linear)
            assert layer.weight is weights[name] and layer.weight.requires_grad  # the optimizer's Parameter
            assert torch.equal(layer.weight, products[name])
        assert not any(isinstance(m, Factorized) for m in model.modules())
        fresh = Plain()
        fresh.load_state_dict(model.state_dict(), strict=True)
        # full-rank forward on the same weights: bit-identical (asserted to fp32 rounding, 1e-6)
        torch.testing.assert_close(_outputs(fresh), before, rtol=0, atol=1e-6)
        torch.testing.assert_close(_outputs(model), before, rtol=0, atol=0)
        return model.state_dict()

    states = LocalWorld(2).run(fn)
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key  # one plain model on both ranks


def test_only_b_weights_are_the_product_of_the_synced_factors():
    def fn(comm):
        model, opt, ab, _, _ = _train(comm, 10, sync="only-b")
        ab.finish()
        return [(getattr(model, n).weight.detach(), ab.layers[n].product().detach()) for n in FACTORED]

    for pairs in LocalWorld(2).run(fn):
        for weight, product in pairs:
            torch.testing.assert_close(weight, product, rtol=0, atol=0)


def test_the_optimizer_holds_the_models_parameters_and_steps_the_restored_weights():
    def fn(comm):
        model, opt, ab, _, _ = _train(comm, 10)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.99 ** step)  # built after ABTraining
        ab.finish()
        held = [p for g in opt.param_groups for p in g["params"]]
        assert [len(g["params"]) for g in opt.param_groups] == [11, 0]  # the factors' group is kept, empty
        assert [id(p) for p in held] == [id(p) for p in model.parameters()]
        assert all(id(p) in {id(q) for q in held} for p in opt.state)
        w0 = model.fc1.weight.detach().clone()
        fresh = Plain()
        fresh.load_state_dict(model.state_dict())
        twin = torch.optim.Adam(fresh.parameters(), lr=3e-3)
        state = copy.deepcopy(opt.state_dict())
        state["param_groups"] = [g for g in state["param_groups"] if g["params"]]  # the empty group dropped
        twin.load_state_dict(state)  # into an optimizer over the original class
        _step(model, opt, None, comm.rank, 50)
        schedule.step()  # the scheduler's groups still match the optimizer's
        _step(fresh, twin, None, comm.rank, 50)
        assert not torch.equal(model.fc1.weight, w0)
        for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
            assert torch.equal(p, q), name
        return True

    assert LocalWorld(2).run(fn) == [True, True]


@pytest.mark.parametrize("steps, phase", [(1, "warmup"), (2, "group"), (6, "full")],
                         ids=["in-the-warm-up", "on-the-factorising-step", "after-a-sync"])
def test_every_phase_exports_a_plain_model(steps, phase):
    def fn(comm):
        model, opt, ab, originals, _ = _train(comm, steps)
        assert ab.phase == phase and (phase != "group" or ab.step == ab.phase_started)
        before = _outputs(model)
        ab.finish()
        assert all(getattr(model, n) is originals[n] for n in FACTORED)
        Plain().load_state_dict(model.state_dict(), strict=True)
        # on the factorising step the factored forward ran on A·B, W to fp32 SVD rounding (~1e-8)
        torch.testing.assert_close(_outputs(model), before, rtol=0, atol=1e-6)
        assert [len(g["params"]) for g in opt.param_groups] == [11, 0]
        return True

    assert LocalWorld(2).run(fn) == [True, True]


def test_the_method_is_not_stepped_after_finish():
    def fn(comm):
        model, opt, ab, _, _ = _train(comm, 4)
        ab.finish()
        assert ab.finish() is model  # a second finish() changes nothing
        errors = []
        for call in (ab.after_backward, ab.after_step, ab.sync):
            with pytest.raises(RuntimeError, match="finish") as e:
                call()
            errors.append(str(e.value))
        return errors

    for errors in LocalWorld(2).run(fn):
        assert all("\n" not in e and "exported" in e for e in errors), errors


def test_figures_from_before_the_export_are_kept():
    def fn(comm):
        model, opt, ab, _, _ = _train(comm, 10)
        growth = sum(_tensor_bytes(t) for n in FACTORED for t in (ab.layers[n].a, ab.layers[n].b))
        ranks, compression, report = dict(ab.ranks), ab.compression(), ab.report()
        ab.finish()
        assert ab.ranks == ranks and ab.compression() == compression
        after = ab.report()
        assert after["factored_layers"] == report["factored_layers"] and after["syncs"] == report["syncs"] + 1
        assert after["param_compression_ratio"] == compression and None not in compression.values()
        return _tensor_bytes(ab.state_dict()), growth

    for state_bytes, growth in LocalWorld(2).run(fn):
        assert state_bytes == growth > 0  # the factors move from the model's state dict to the method's


# -- the trainer -------------------------------------------------------------------------------
OPTIONS = {"dim": 24, "hidden": 32, "classes": 4, "samples": 256, "test_samples": 64}


@pytest.mark.spawns
def test_the_trainer_ends_with_a_plain_model_and_the_factor_figures():
    cfg = TrainConfig(task="synthetic", method="ab:warmup=2,cycle=6,full_steps=1", workers=2, steps=10,
                      eval_every=5, batch_size=16,
                      task_options=OPTIONS).resolve()
    summary = LocalWorld(2).run(lambda comm: train_rank(cfg, comm))[0]
    (name, rank), = summary.method_fields["ranks"].items()  # fc2 (32 x 32) only: fc1 and out are the first and last
    assert name == "fc2" and 1 <= rank <= 32
    assert summary.method_state_bytes == 4 * rank * (32 + 32)  # A (32 x r) + B (r x 32), fp32
    assert summary.method_report["syncs"] == 2 and summary.final_accuracy is not None


# -- the layer-level helpers -------------------------------------------------------------------
def test_unfactorize_model_swaps_the_wrappers_back():
    model = _plain()
    originals = {n: getattr(model, n) for n in FACTORED}
    layers = factorize_model(model, ["first", "last", "skip"])
    layers["fc1"].factorize(rank=3)
    layers["fc1"].set_mode("b")  # a factored mode: the weight becomes A·B on the way out
    product = layers["fc1"].product().detach().clone()
    before = _outputs(model)
    model.eval()
    assert unfactorize_model(model) == {n: originals[n] for n in FACTORED}
    assert not model.fc1.training  # the wrapper's train/eval mode carries over
    assert torch.equal(model.fc1.weight, product) and model.fc1.weight.requires_grad
    model.train()
    torch.testing.assert_close(_outputs(model), before, rtol=0, atol=1e-6)
    Plain().load_state_dict(model.state_dict(), strict=True)


def test_a_plain_state_loads_into_a_wrapper_as_its_full_rank_layer():
    model = _plain()
    layers = factorize_model(model, ["first", "last", "skip"])
    layers["fc1"].factorize(rank=3)
    layers["fc1"].set_mode("b")
    plain = Plain()
    model.load_state_dict(plain.state_dict())  # strict: what export gave back loads into the wrappers again
    assert layers["fc1"].mode == "full" and layers["fc1"].rank == 0 and layers["fc1"].weight.requires_grad
    torch.testing.assert_close(_outputs(model), _outputs(plain), rtol=0, atol=0)


# -- training on after the export ----------------------------------------------------------------
@pytest.mark.parametrize("steps", [2, 10], ids=["ended-on-the-factorising-step", "ended-in-a-group-phase"])
def test_a_saved_exported_run_loads_into_a_new_ab_training_and_trains_on(steps):
    """A run saved after finish() (model, optimizer, method) loads into a fresh ABTraining:
    the layers take the plain weights in mode full, the optimizer's factor group gets its
    parameters back without state, and the schedule goes on from the saved step (re-factorise, group, sync)."""
    def fn(comm):
        model, opt, ab, _, _ = _train(comm, steps)
        ab.finish()
        saved = [copy.deepcopy(x.state_dict()) for x in (model, opt, ab)]
        model2 = _plain()
        opt2 = torch.optim.Adam(model2.parameters(), lr=3e-3)
        ab2 = ABTraining(model2, opt2, comm, ABConfig(**SPEC))
        for part, state in zip((model2, opt2, ab2), saved):
            part.load_state_dict(state)
        assert (ab2.step, ab2.phase, ab2.ranks, ab2.exported) == (ab.step, ab.phase, ab.ranks, False)
        torch.testing.assert_close(_outputs(model2), _outputs(model), rtol=0, atol=0)
        assert [g["lr"] for g in opt2.param_groups] == [3e-3, 3e-3] and not opt2.state.get(ab2.layers["fc1"].a)
        for step in range(steps, 14):  # re-factorised at 13 (and at 7 after step 2), a group phase
            _step(model2, opt2, ab2, comm.rank, step)
        ab2.finish()
        assert ab2.factorisations > ab.factorisations and ab2.syncs > ab.syncs
        Plain().load_state_dict(model2.state_dict(), strict=True)
        return model2.state_dict()

    states = LocalWorld(2).run(fn)
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key


@pytest.mark.spawns
def test_the_trainer_extends_a_finished_run_from_its_last_checkpoint(tmp_path):
    cfg = TrainConfig(task="synthetic", method="ab:warmup=2,cycle=6,full_steps=1", workers=2, steps=10,
                      eval_every=5, batch_size=16, checkpoint_every=5, out=str(tmp_path / "a"),
                      task_options=OPTIONS).resolve()
    first = LocalWorld(2).run(lambda comm: train_rank(cfg, comm))[0]
    longer = TrainConfig(task="synthetic", method=cfg.method, workers=2, steps=16, eval_every=5, batch_size=16,
                         out=str(tmp_path / "b"), resume=cfg.out, task_options=OPTIONS).resolve()
    summary = LocalWorld(2).run(lambda comm: train_rank(longer, comm))[0]
    assert summary.resumed_from == 10 and summary.steps_run == 6
    report = summary.method_report
    assert report["factorisations"] == first.method_report["factorisations"] + 1  # re-factorised at 13
    assert report["syncs"] == first.method_report["syncs"] + 1  # by finish() at 16, inside the group phase

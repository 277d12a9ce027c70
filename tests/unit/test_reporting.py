"""A method that implements only the training calls is complete: registered, it trains under
``thinwire train``'s loop and under ``thinwire.attach``, and the run's records and summary take
the reporting protocol's defaults (thinwire.algorithms.reporting)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import thinwire
import thinwire.tasks
from thinwire.algorithms import reporting
from thinwire.algorithms.base import Method
from thinwire.algorithms.methods import METHODS
from thinwire.comm.link import Link
from thinwire.comm.local import LocalWorld
from thinwire.run.config import TrainConfig
from thinwire.run.trainer import train_rank
from thinwire.timing import Timing

SMALL = {"dim": 8, "hidden": 16, "classes": 3, "samples": 128, "test_samples": 32}


@dataclass(frozen=True)
class ModelMeanConfig:
    pass


class ModelMean(Method):
    """Averages the model after every optimizer step: the training calls alone."""

    name = "model-mean-test"
    summary = "the model's mean after every step (a test's)"
    Config = ModelMeanConfig

    def __init__(self, model, optimizer=None, comm=None, config=None, **kw) -> None:
        super().__init__(model, optimizer, comm, config, **kw)
        self._timing = Timing()

    def after_backward(self, loss=None, *, scaler=None) -> bool:
        return True

    def after_step(self) -> None:
        assert self.model is not None
        for p in self.model.parameters():
            self.comm.all_reduce(p.data)
            p.data /= self.comm.world_size

    @property
    def timing(self) -> Timing:
        return self._timing


@pytest.fixture
def registered():
    METHODS.register(ModelMean)
    yield
    METHODS.remove(ModelMean.name)


def test_the_protocol_gives_its_defaults_to_a_method_without_it():
    method = LocalWorld(1).run(lambda comm: ModelMean(torch.nn.Linear(2, 2), comm=comm))[0]
    assert not any(hasattr(method, hook) for hook in ("stats", "report", "summary_fields", "per_parameter",
                                                      "overlap_report", "hidden_seconds", "hidden_fraction"))
    assert reporting.report(method) == {"method": method.spec} and method.spec.startswith("model-mean-test")
    assert reporting.stats(method) == {} and reporting.summary_fields(method) == {}
    assert reporting.per_parameter(method) == [] and reporting.overlap_report(method) is None
    assert reporting.hidden_seconds(method, Link.parse("1gbit,50us")) == 0.0
    assert reporting.hidden_fraction(method) is None


def test_the_trainer_runs_it_and_its_summary_takes_the_defaults(registered):
    cfg = TrainConfig(task="synthetic", method="model-mean-test", workers=2, steps=6, eval_every=3,
                      task_options=SMALL, batch_size=16, links=("100mbit,1ms",)).resolve()
    summaries = LocalWorld(2).run(lambda comm: train_rank(cfg, comm))
    s = summaries[0]
    assert s.status == "ok" and s.method_report == {"method": s.method} and s.method_fields == {}
    assert s.per_parameter == [] and s.hidden_fraction is None
    params = sum(p.numel() for p in thinwire.tasks.get("synthetic")(seed=0, **SMALL).build_model().parameters())
    assert s.bytes_sent_per_worker == 6 * 4 * params  # one fp32 all_reduce of every parameter a step, 2 ranks


def test_attach_drives_it_and_its_figures_have_no_method_part(registered):
    def fn(comm):
        model = torch.nn.Linear(3, 2)
        torch.nn.init.constant_(model.weight, float(comm.rank))
        run = thinwire.attach(model, torch.optim.SGD(model.parameters(), lr=0.0), "model-mean-test", comm=comm)
        model(torch.ones(1, 3)).sum().backward()
        run.after_backward()
        run.after_step()
        return model.weight.detach().clone(), run.scalars()

    (w0, figures), (w1, _) = LocalWorld(2).run(fn)
    assert torch.equal(w0, torch.full((2, 3), 0.5)) and torch.equal(w0, w1)
    assert "thinwire/bytes_sent" in figures

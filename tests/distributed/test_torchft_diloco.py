"""torchft's own DiLoCo as the peer ``torch-diloco``: over real gloo ranks it ends with the
parameters thinwire's ``diloco`` ends with, sends the same metered bytes, trains through the
trainer and exits cleanly; a bad knob is one line."""

import copy
import sys

import pytest
import torch
from torch import nn

import tiny
from spawn import run_ranks
from thinwire.peers.torchft_diloco import torchft_available

# not imported here: the method imports torchft itself, after quieting its servers' logs
pytestmark = pytest.mark.skipif(not torchft_available(), reason="torchft is not installed (pip install torchft)")

STEPS = 9  # three rounds of period 3
PERIOD = 3
SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}


def _base() -> nn.Module:
    return tiny.seeded(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)), 0.3)


def _batch(rank: int, step: int):
    return tiny.rule_batch(rank, step, inputs=8)


def _train(rank, spec, inner):
    from thinwire.algorithms.build import build_method
    from thinwire.comm.torch_dist import TorchComm

    model = copy.deepcopy(_base())
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if inner == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    comm = TorchComm()
    method = build_method(spec, model, opt, comm)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        method.after_backward()
        opt.step()
        method.after_step()
    method.finish()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, comm.meter.bytes_sent, comm.meter.ops["all_reduce"].calls, method.timing.comm_seconds, method.report()


def _race(rank, world, cases):
    return {case: _train(rank, *case) for case in cases}  # one spawn for every run


CASES = [(f"{name}:period={PERIOD},outer_momentum={mu}", inner)
         for mu, inner in ((0.9, "sgd"), (0.0, "adamw")) for name in ("torch-diloco", "diloco")]


@pytest.mark.timeout(120)
def test_torchft_diloco_matches_diloco_and_sends_the_same_bytes():
    """Both take the outer SGD step on the mean of ``global - local`` from the same global
    weights, elementwise in fp32 the same way (a sum over two ranks, then a halving: exact),
    so the final parameters are bit for bit the same (tolerance 0); torchft sends one
    allreduce per parameter tensor, thinwire one flat one: the same bytes in more calls."""
    from thinwire.comm.meter import sent_bytes

    by_rank = run_ranks(_race, 2, CASES)
    tensors = len(list(_base().parameters()))
    numel = sum(p.numel() for p in _base().parameters())
    per_sync = sent_bytes("all_reduce", 4 * numel, 2)  # the fp32 pseudo-gradient, once per sync
    for runs in by_rank:
        for i in range(0, len(CASES), 2):
            ft, tw = runs[CASES[i]], runs[CASES[i + 1]]
            assert torch.equal(ft[0], tw[0]), (ft[0] - tw[0]).abs().max()
            assert ft[1] == tw[1] == (STEPS // PERIOD) * per_sync
            assert ft[2] == (STEPS // PERIOD) * tensors and tw[2] == STEPS // PERIOD  # per tensor vs one flat
            assert ft[3] > 0 and ft[4]["outer_steps"] == STEPS // PERIOD
            assert ft[4]["peer"].startswith("torchft")
    for case in CASES:  # the last step ended a round: every rank holds the same model
        assert torch.equal(by_rank[0][case][0], by_rank[1][case][0])


@pytest.mark.timeout(120)
def test_trainer_runs_torch_diloco_and_exits_cleanly():
    from thinwire.run.config import TrainConfig
    from thinwire.run.launch import launch

    cfg = TrainConfig(task="synthetic", method="torch-diloco:period=3", workers=2, steps=9, eval_every=9,
                      task_options=SMALL, batch_size=16).resolve()
    summary = launch(cfg, show_progress=False)
    assert summary is not None and summary.status == "ok"
    assert summary.method.startswith("torch-diloco") and summary.bytes_sent_per_worker > 0
    assert summary.method_report["outer_steps"] == 3
    # the fp32 pseudo-gradient once per round: a third of what fp32 gradient averaging sends
    assert summary.bytes_sent_per_worker == pytest.approx(summary.fp32_bytes_per_worker / 3)


@pytest.mark.parametrize("spec, needle", [
    ("torch-diloco:period=0", "period must be >= 1, got 0"),
    ("torch-diloco:period=4,fragments=3", "period must be a multiple of fragments"),
    ("torch-diloco:period=4,fragments=2,delay=2", "delay must be < period/fragments"),
    ("torch-diloco:alpha=2", "alpha must be in [0, 1], got 2"),
    ("torch-diloco:outer_momentum=1", "outer_momentum must be in [0, 1), got 1"),
])
def test_bad_knob_is_one_line(spec, needle, capsys):
    from thinwire.cli import main

    assert main(["train", "--method", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle.lower() in err.lower(), err


def test_without_torchft_the_error_names_the_fix(monkeypatch):
    from thinwire.algorithms.methods import check_world
    from thinwire.peers.torchft_diloco import TorchFTDiLoCo

    for name in [m for m in sys.modules if m == "torchft" or m.startswith("torchft.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchft", None)  # an import of it fails
    with pytest.raises(ValueError, match=r"pip install torchft \(or thinwire\[peers\]\)$"):
        check_world("torch-diloco", 2)
    model = _base()
    with pytest.raises(ImportError, match=r"pip install torchft"):
        TorchFTDiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_resume_is_refused():
    from thinwire.peers.torchft_diloco import TorchFTDiLoCo

    with pytest.raises(ValueError, match="resume is not supported for torch-diloco"):
        TorchFTDiLoCo.load_state_dict(object.__new__(TorchFTDiLoCo), {})

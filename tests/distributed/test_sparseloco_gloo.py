"""SparseLoCo over real gloo ranks: two ranks give the in-process result bit for bit (a sum
of two payloads is the same in any order), four ranks learn and hold one model after every
sync and after finish(), every sync sends exactly the payload layout's bytes, and a run of
``thinwire train`` resumed mid-period from its checkpoint ends bit for bit where the
unbroken run does."""

from __future__ import annotations

import pytest
import torch

import tiny
from resumes import rank_states, straight_and_resumed
from spawn import run_ranks

SPEC = "sparseloco:period=4,chunk=8,k=6,beta=0.9"


def _train(comm, spec: str, steps: int):
    model, opt, method = tiny.built(comm, tiny.deep_net(), spec, lr=0.01)
    at_syncs: list[torch.Tensor] = []

    def after(step: int) -> None:
        if (step + 1) % method.config.period == 0:
            at_syncs.append(tiny.flat(model))

    losses = tiny.rule_steps(comm, model, opt, steps, method=method, each_step=after)
    method.finish()
    theta = torch.cat([t.detach().reshape(-1) for t in method.outer_params])
    return tiny.flat(model), theta, losses, at_syncs, comm.meter.bytes_sent, method.report()


@pytest.mark.timeout(180)
def test_two_gloo_ranks_match_the_in_process_result_and_learn():
    steps = 42  # ten syncs and two local steps, then finish()'s sync
    gloo = run_ranks(tiny.on_gloo, 2, _train, SPEC, steps)  # 1 torch thread per rank
    local = tiny.in_process(2, _train, SPEC, steps)
    for (a, theta_a, losses, *_), (b, theta_b, *_) in zip(gloo, local):
        assert torch.equal(a, b) and torch.equal(theta_a, theta_b)
        assert sum(losses[-8:]) / 8 < 0.6 * sum(losses[:8]) / 8
    assert torch.equal(gloo[0][0], gloo[1][0])  # one model after finish()
    report = gloo[0][5]
    assert report["syncs_before_finish"] == 10 and report["outer_steps"] == 11


@pytest.mark.timeout(180)
def test_four_gloo_ranks_agree_after_every_sync_and_send_exactly_the_layout():
    out = run_ranks(tiny.on_gloo, 4, _train, SPEC, 26)  # six syncs, two local steps, finish()
    models, thetas = [o[0] for o in out], [o[1] for o in out]
    assert all(torch.equal(models[0], m) for m in models[1:]) and all(torch.equal(thetas[0], t) for t in thetas[1:])
    for i in range(6):  # parameters and BatchNorm statistics, right after each sync
        assert all(torch.equal(out[0][3][i], o[3][i]) for o in out[1:])
    for _, _, losses, _, sent, report in out:
        assert sum(losses[-6:]) / 6 < 0.8 * sum(losses[:6]) / 6
        # per sync: an all_gather of the payload ((4 − 1) copies) and the fp32 ring all_reduce
        # of BatchNorm's 64 floats (2 (4 − 1) / 4 of 256 bytes)
        assert sent == report["outer_steps"] * (3 * report["payload_bytes_per_sync"] + 1.5 * 4 * 64)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sync", ["blocking", "eager"])  # eager: the checkpoint lands the average in flight
def test_the_trainer_resumes_mid_period_bit_for_bit(sync, tmp_path):
    from thinwire.run.config import TrainConfig

    small = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}
    k = 5  # mid-period: syncs after steps 3, 6 and 9
    cfg = TrainConfig(task="synthetic", method=f"sparseloco:period=3,chunk=8,k=4,sync={sync}", workers=2, steps=2 * k,
                      eval_every=k, out=str(tmp_path / "a"), checkpoint_every=k, task_options=small,
                      batch_size=16).resolve()
    straight, resumed = straight_and_resumed(cfg, k, tmp_path)
    assert resumed.final_loss == straight.final_loss and resumed.resumed_from == k
    for rank, a, b in rank_states(cfg.out, tmp_path / "b", 2 * k, 2):
        for name, t in a["model"].items():
            assert torch.equal(t, b["model"][name]), (rank, name)
        residual = a["method"]["fragments"][0]["agg"]["feedback"]["model"]
        assert torch.equal(residual, b["method"]["fragments"][0]["agg"]["feedback"]["model"])
    report = straight.method_report
    # steps 3, 6, 9, then finish()'s on step 10; eager lands each mean a round late, the last in finish()
    assert report["outer_steps"] == 4
    assert straight.bytes_sent_per_worker == 4 * report["payload_bytes_per_sync"]

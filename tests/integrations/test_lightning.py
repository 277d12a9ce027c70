"""thinwire.lightning: a real Lightning Trainer, two CPU processes on gloo under torchrun,
against the same training in a plain loop (DDP with thinwire's hook, or thinwire.attach)."""

from __future__ import annotations

import pytest
from _torchrun import torchrun

import thinwire.lightning

CASES = ("powersgd:rank=2", "localsgd:period=3", "hylo:t_fc=64")  # hylo: 2-bit codes for both linear weights


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return torchrun("lightning_fit.py", tmp_path_factory.mktemp("lightning"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", CASES)
def test_trainer_equals_the_plain_loop_bit_for_bit(ranks, method):
    for rank in ranks:
        case = rank[method]
        assert case["max_diff"] == 0.0  # same buckets, same codec, same order: the same bits
        assert case["bytes"] == case["ref_bytes"] > 0
    assert ranks[0][method]["kind"] == ("schedule" if method.startswith("localsgd") else "gradient")


@pytest.mark.timeout(240)
def test_the_codec_ran_instead_of_ddps_all_reduce(ranks):
    for method in CASES:
        assert ranks[0][method]["params"] != ranks[0]["identity"]["params"], method
    # gradient codecs keep every rank's model the same; local SGD's ranks drift between averages
    assert ranks[0]["powersgd:rank=2"]["params"] == ranks[1]["powersgd:rank=2"]["params"]
    assert ranks[0]["hylo:t_fc=64"]["params"] == ranks[1]["hylo:t_fc=64"]["params"]
    assert ranks[0]["localsgd:period=3"]["params"] != ranks[1]["localsgd:period=3"]["params"]


@pytest.mark.timeout(240)
def test_gradient_accumulation_equals_the_plain_loops_micro_batches(ranks):
    for rank in ranks:
        for method in ("powersgd:rank=2", "dasgd:period=2,warmup=2,delay=1"):
            case = rank[f"accumulate {method}"]
            assert case["max_diff"] == 0.0 and case["bytes"] == case["ref_bytes"] > 0, method


@pytest.mark.timeout(240)
def test_manual_optimization_averages_after_every_manual_backward(ranks):
    for rank in ranks:  # localsgd with a warm-up: gradients averaged after manual_backward, models after the step
        assert rank["manual"]["max_diff"] == 0.0 and rank["manual"]["bytes"] == rank["manual"]["ref_bytes"] > 0


@pytest.mark.timeout(240)
def test_a_scaler_overflow_on_one_rank_skips_the_step_on_every_rank(ranks):
    for rank in ranks:
        amp = rank["amp"]
        # Lightning's MixedPrecision (fp16 autocast, GradScaler) equals the plain AMP loop with the hook
        assert amp["max_diff"] == 0.0 and amp["finite"]
        assert (amp["skipped"], amp["steps"]) == (1.0, 7.0)  # 8 steps: one skipped by both ranks
    assert ranks[0]["amp"]["params"] == ranks[1]["amp"]["params"]


@pytest.mark.timeout(240)
def test_checkpoint_carries_every_ranks_state_and_resumes_exactly(ranks):
    for rank in ranks:
        assert rank["resume_max_diff"] == 0.0
        assert rank["saved"]["world_size"] == 2 and rank["saved"]["ranks"] == 2 and rank["saved"]["steps"] == [4, 4]
        assert rank["saved"]["spec"].startswith("powersgd:") and "rank=2" in rank["saved"]["spec"]
        assert rank["other_method"].startswith("the checkpoint's thinwire state is for powersgd:")
        assert "this strategy runs topk:" in rank["other_method"]
        assert rank["validate_other"] > 0  # validate(ckpt_path=) with another method: no thinwire state read
        assert rank["second_fit"].startswith("this strategy already ran a fit of localsgd:")


@pytest.mark.parametrize("spec, reason", [
    ("ab", "replaces the model's layers"),
    ("demo", "an optimizer of its own"),
    ("torch-powersgd", "DDPStrategy(ddp_comm_hook=...)"),
    ("nosuch", "unknown method 'nosuch'"),
])
def test_methods_lightning_cannot_run_are_refused_with_the_reason(spec, reason):
    with pytest.raises(ValueError, match=r".*" + reason.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        thinwire.lightning.strategy(spec)


def test_ddps_own_hook_arguments_are_refused():
    with pytest.raises(ValueError, match="ddp_comm_hook is DDPStrategy's own"):
        thinwire.lightning.strategy("topk", ddp_comm_hook=lambda s, b: None)


def test_model_averaging_keeps_ddp_from_broadcasting_buffers_unless_told():
    assert thinwire.lightning.strategy("localsgd")._ddp_kwargs == {"broadcast_buffers": False}
    assert thinwire.lightning.strategy("localsgd", broadcast_buffers=True)._ddp_kwargs == {"broadcast_buffers": True}
    assert thinwire.lightning.strategy("topk")._ddp_kwargs == {}  # codecs: DDP's own defaults


def test_strategy_resolves_the_spec_and_has_no_figures_before_fit():
    s = thinwire.lightning.strategy("topk:ratio=0.05", find_unused_parameters=True)
    assert s.spec.startswith("topk:") and "ratio=0.05" in s.spec and s.kind == "gradient"
    assert s.scalars() == {}
    assert thinwire.lightning.strategy("dasgd:period=4").kind == "schedule"

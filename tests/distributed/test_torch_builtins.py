"""PyTorch's DDP hooks as methods over real gloo ranks: torch-ddp equals thinwire's identity,
and every byte the hooks and the averager send is counted by thinwire's meter."""

import copy

import pytest
import torch
from torch import nn

import tiny
from spawn import run_ranks

STEPS = 12


def _base() -> nn.Module:
    return tiny.seeded(nn.Sequential(nn.Linear(8, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 3)), 0.3)


def _batch(rank: int, step: int):
    return tiny.rule_batch(rank, step, inputs=8)


def _train(rank, world, spec):
    from thinwire.algorithms.build import build_method
    from thinwire.comm.torch_dist import TorchComm

    model = copy.deepcopy(_base())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    comm = TorchComm()
    method = build_method(spec, model, opt, comm)
    net = getattr(method, "module", model)
    losses = [tiny.step(net, opt, method, *_batch(rank, step)).item() for step in range(STEPS)]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return losses, comm.meter.bytes_sent, flat, method.timing.comm_seconds


def _train_all(rank, world, specs):
    return {spec: _train(rank, world, spec) for spec in specs}  # one spawn for every method


@pytest.mark.timeout(240)
def test_torch_ddp_equals_identity_and_the_hooks_are_metered():
    from thinwire.comm.meter import sent_bytes

    specs = ("identity", "torch-ddp", "torch-fp16", "torch-powersgd:rank=1,start_iter=4",
             "torch-postlocalsgd:period=4,warmup=3")
    by_rank = run_ranks(_train_all, 2, specs)
    runs = {spec: [r[spec] for r in by_rank] for spec in specs}
    numel = sum(p.numel() for p in _base().parameters())
    full = sent_bytes("all_reduce", 4 * numel, 2)  # one fp32 gradient all_reduce
    ident, ddp = runs["identity"], runs["torch-ddp"]
    for a, b in zip(ident, ddp):
        assert a[0] == pytest.approx(b[0], rel=1e-6)  # the same losses (summation order may differ)
        assert a[1] == b[1] == STEPS * full
        assert b[3] > 0  # the all_reduce time was measured inside the hook
    for _losses, sent, _, _ in runs["torch-fp16"]:
        assert sent == STEPS * full / 2  # 2-byte floats
    for losses, sent, _, _ in runs["torch-powersgd:rank=1,start_iter=4"]:
        assert 0 < sent < STEPS * full / 2 and all(map(lambda v: v == v, losses))
    # post-local SGD: 3 all_reduce steps, then parameters averaged after steps 4, 8 and 12
    local = runs["torch-postlocalsgd:period=4,warmup=3"]
    for _losses, sent, _flat, _ in local:
        assert sent == 3 * full + 3 * full  # the averaged parameters are as big as the gradients
    assert torch.equal(local[0][2], local[1][2])  # step 12 ended with an average: one model


def _unavailable(rank, world):
    from thinwire.comm.torch_dist import TorchComm
    from thinwire.peers.torch_builtins import TorchBF16

    try:
        TorchBF16(copy.deepcopy(_base()), None, TorchComm())
    except ValueError as e:
        return str(e)
    return "ran"


@pytest.mark.timeout(120)
def test_torch_bf16_reports_pytorchs_reason_on_gloo():
    for message in run_ranks(_unavailable, 2):
        assert message.startswith("torch-bf16 is unavailable here") and "NCCL" in message

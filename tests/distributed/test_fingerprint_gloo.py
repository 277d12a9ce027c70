"""Ranks whose parameters disagree, on real gloo ranks: every entry point (thinwire.attach for a
codec, a model-averaging method and a GATHER codec, SyncReducer, the DDP hook, PyTorch's own
DDP peers) raises the same one-line ParameterMismatch on every rank when it is built, instead of
averaging one layer with another or hanging; ranks that agree pay no metered byte for the check."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from spawn import run_ranks

RULE = "every rank must build the same model, its parameters registered in the same order"
SWAPPED = ("ranks disagree on the model's parameters: parameter 0 is fc1.weight (64x32, float32) on rank 0 but "
           f"fc2.weight (10x64, float32) on rank 1; {RULE}")


def _register(module: torch.nn.Module, layers: dict[str, tuple[int, int]], swapped: bool) -> None:
    """Linear layers of the given (in, out) sizes, built in the given order from seed 0 (so
    each has the same weights either way) and registered in it, or the reverse (``swapped``)."""
    torch.manual_seed(0)
    built = [(name, torch.nn.Linear(*size)) for name, size in layers.items()]
    for name, layer in reversed(built) if swapped else built:
        setattr(module, name, layer)


class Net(torch.nn.Module):
    """fc1 then fc2 in the forward pass, whatever order they were registered in (``swapped``:
    fc2 first); ``extra``: a third layer after them."""

    def __init__(self, swapped: bool = False, extra: bool = False) -> None:
        super().__init__()
        _register(self, {"fc1": (32, 64), "fc2": (64, 10)}, swapped)
        self.fc3 = torch.nn.Linear(10, 10) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.relu(self.fc1(x)))
        return out if self.fc3 is None else self.fc3(out)


class Twins(torch.nn.Module):
    """Two layers of one shape (``swapped``: b registered first): DDP's own shape check passes."""

    def __init__(self, swapped: bool = False) -> None:
        super().__init__()
        _register(self, {"a": (16, 16), "b": (16, 16)}, swapped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x)))


def _steps(run, net: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int = 2) -> None:
    """``steps`` training steps of ``run`` (an attached method) on this rank's batches."""
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 32, generator=g)
        F.cross_entropy(net(x), torch.randint(0, 10, (8,), generator=g)).backward()
        run.after_backward()
        opt.step()
        run.after_step()


def _attach_each(rank: int, world: int, specs: list[str], extra: bool) -> dict[str, tuple[str, str]]:
    """Per spec: the error's class and message when attaching on a model rank 1 holds
    differently (or 'trained' when it attached and trained two steps)."""
    import thinwire

    out = {}
    for spec in specs:
        model = Net(swapped=rank == 1 and not extra, extra=rank == 1 and extra)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            run = thinwire.attach(model, opt, spec)
        except ValueError as e:
            out[spec] = (type(e).__name__, str(e))
            continue
        _steps(run, run.model, opt, rank)
        out[spec] = ("", "trained")
    return out


@pytest.mark.timeout(120)
def test_parameters_in_another_order_are_named_on_every_rank_by_attach():
    """identity finished silently, diloco too, and topk hung: now each raises at attach, on
    both ranks, naming parameter 0 as each rank holds it."""
    specs = ["identity", "diloco", "topk:ratio=0.01"]
    for rank in run_ranks(_attach_each, 2, specs, False, timeout=60):
        for spec in specs:
            assert rank[spec] == ("ParameterMismatch", SWAPPED), spec


@pytest.mark.timeout(120)
def test_an_extra_layer_on_one_rank_is_counted_and_named():
    want = ("ranks disagree on the model's parameters: rank 1 has 6 parameters, rank 0 has 4; the first extra is "
            f"fc3.weight (10x10, float32) on rank 1; {RULE}")
    for rank in run_ranks(_attach_each, 2, ["identity", "localsgd:period=2"], True, timeout=60):
        assert rank == {"identity": ("ParameterMismatch", want), "localsgd:period=2": ("ParameterMismatch", want)}


def _ddp_paths(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """The DDP hook and PyTorch's own DDP peer on layers of one shape that rank 1 registered
    in the other order (DDP's constructor cannot tell)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire

    out = {}
    model = DDP(Twins(swapped=rank == 1))
    try:
        thinwire.ddp.register(model, "topk:ratio=0.25")
        out["hook"] = ("", "registered")
    except ValueError as e:
        out["hook"] = (type(e).__name__, str(e))
    del model
    plain = Twins(swapped=rank == 1)
    try:
        thinwire.attach(plain, torch.optim.SGD(plain.parameters(), lr=0.1), "torch-ddp")
        out["torch-ddp"] = ("", "attached")
    except ValueError as e:
        out["torch-ddp"] = (type(e).__name__, str(e))
    gc.collect()
    return out


@pytest.mark.timeout(120)
def test_the_ddp_hook_and_pytorchs_peer_name_layers_swapped_between_ranks():
    want = ("ranks disagree on the model's parameters: parameter 0 is a.weight (16x16, float32) on rank 0 but "
            f"b.weight (16x16, float32) on rank 1; {RULE}")
    for rank in run_ranks(_ddp_paths, 2, timeout=60):
        assert rank == {"hook": ("ParameterMismatch", want), "torch-ddp": ("ParameterMismatch", want)}


def _agreeing(rank: int, world: int) -> dict[str, object]:
    """Matching ranks: the meter after building (attach, SyncReducer, the DDP hook) and after
    one identity step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import thinwire
    from thinwire.comm.torch_dist import TorchComm

    out: dict[str, object] = {}
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = thinwire.attach(model, opt, "identity")
    out["attach"] = run.comm.meter.snapshot()
    _steps(run, model, opt, rank, steps=1)
    out["step"] = run.comm.meter.bytes_sent
    comm = TorchComm()
    thinwire.SyncReducer(list(Net().named_parameters()), "topk:ratio=0.01", comm)
    out["reducer"] = comm.meter.snapshot()
    ddp = DDP(Net())
    state = thinwire.ddp.register(ddp, "identity")
    out["hook"] = state.comm.meter.snapshot()
    del ddp, state
    gc.collect()
    return out


@pytest.mark.timeout(120)
def test_ranks_that_agree_pay_no_metered_byte_for_the_check():
    from thinwire.comm.meter import sent_bytes

    n = sum(p.numel() for p in Net().parameters())
    for rank in run_ranks(_agreeing, 2, timeout=60):
        assert rank["attach"] == rank["reducer"] == rank["hook"] == {}  # nothing counted, not even a call
        assert rank["step"] == sent_bytes("all_reduce", 4 * n, 2)  # the step's one fp32 all_reduce, alone

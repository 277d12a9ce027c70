"""SyncReducer's overlap with the backward pass, over real gloo ranks: bit-identical to
averaging everything in reduce(), with accumulation, unused and frozen parameters, for
every codec; collectives really start while backward goes on; the rules a loop must keep
raise instead of averaging wrongly; the warm-ups of local SGD, DaSGD and AB-training."""

import threading

import pytest
import torch

from spawn import run_ranks
from thinwire.algorithms.ab import ABTraining


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                        torch.nn.ReLU(), torch.nn.Linear(64, 4))
        self.spare = torch.nn.Linear(8, 8)  # never used: its parameters get no gradient
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, x):
        return self.body(x)


def _batch(rank: int, step: int, part: int):
    g = torch.Generator().manual_seed(100 * step + 10 * part + rank)
    return torch.randn(16, 30, generator=g), torch.randint(0, 4, (16,), generator=g)


# backward passes per reduce(), step by step: accumulation from the first step, one shorter
# window (averaged at reduce()), then the longest again
PASSES = [2, 2, 2, 1, 2, 2]
FREEZE_AT = 4  # the first layer's weight is frozen from this step on


def _train(rank, spec, overlap):
    from thinwire.algorithms.sync import SyncReducer
    from thinwire.comm.torch_dist import TorchComm

    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    comm = TorchComm()
    method = spec if spec != "hylo" else "hylo:t_fc=1000"
    reducer = SyncReducer(model, method, comm, bucket_mb=0.004, overlap=overlap)
    for step, passes in enumerate(PASSES):
        if step == FREEZE_AT:
            model.body[0].weight.requires_grad_(False)
            model.body[0].weight.grad = None
        opt.zero_grad(set_to_none=False)
        for part in range(passes):
            x, y = _batch(rank, step, part)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        reducer.reduce()
        opt.step()
    launched = reducer.overlap_report()["steps"]
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()], grads, comm.meter.bytes_sent, launched


# four ranks (where gloo's sum order follows a value's place in the buffer): one codec of each
# kind (fused casts, a two-round SUM codec, GATHER codecs, a policy)
FOUR_RANKS = ["identity", "bf16", "powersgd:rank=2", "topk:ratio=0.05", "fft", "hylo"]


def _overlap_equals_reduce_time(rank, world):
    from thinwire.codecs.specs import available

    differs = []
    specs = [*available(), "powersgd:rank=2", "topk:ratio=0.05", "hylo"] if world == 2 else FOUR_RANKS
    for spec in specs:
        a_params, a_grads, a_bytes, launched = _train(rank, spec, True)
        b_params, b_grads, b_bytes, none = _train(rank, spec, False)
        same = all(torch.equal(x, y) for x, y in zip(a_params, b_params))
        same &= all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                    for x, y in zip(a_grads, b_grads))
        if not same or a_bytes != b_bytes or launched < len(PASSES) - 2 or none != 0:
            differs.append((spec, same, a_bytes, b_bytes, launched, none))
    return differs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_overlap_averages_bit_identically_to_averaging_in_reduce_for_every_codec(world):
    # with accumulation, a shorter window, a parameter no rank uses and one frozen mid-run;
    # the overlapping run launched in backward at every step after the first but the short one;
    # every codec on two ranks, one of each kind on four
    for r in run_ranks(_overlap_equals_reduce_time, world):
        assert r == []


LAUNCH_WAIT_S = 30  # a guard against a hang only: how long the backward pass waits for a bucket's launch


class _WaitForLaunch(torch.autograd.Function):
    """Identity whose backward (the last op of the backward pass) waits, when ``ctx.expect``
    says a launch is due, until a bucket's collective has been issued: a collective started by
    the backward pass is then issued before ``backward()`` returns, by ordering, not by time."""

    @staticmethod
    def forward(ctx, x, launched, expect):
        ctx.launched, ctx.expect = launched, expect
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.expect:
            ctx.launched.wait(LAUNCH_WAIT_S)  # if it never comes the test fails: no collective during backward
        return g, None, None


def _launch_times(rank, world, overlap):
    from thinwire.algorithms.sync import SyncReducer
    from thinwire.comm.torch_dist import TorchComm

    phase = ["forward"]  # where the training thread is: "forward", "backward" or "reduce"
    launched = threading.Event()  # a collective was issued

    class Watching(TorchComm):
        during: list = []  # per collective: the training thread's phase when it was issued

        def _all_reduce(self, t, async_op):
            self.during.append(phase[0])
            launched.set()
            return super()._all_reduce(t, async_op)

    model = _Net()
    reducer = SyncReducer(model, "identity", Watching(), bucket_mb=0.004, overlap=overlap)
    steps = []
    for step in range(3):
        launched.clear()
        Watching.during.clear()
        x, y = _batch(rank, step, 0)
        # the first step averages everything in reduce() (the reducer learns the step); later
        # ones launch the last layers' buckets in backward when overlapping
        x = _WaitForLaunch.apply(x.requires_grad_(), launched, overlap and step > 0)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        phase[0] = "backward"
        loss.backward()
        phase[0] = "reduce"
        reducer.reduce()  # waits for every collective of the step
        phase[0] = "forward"
        steps.append(list(Watching.during))
    return steps, reducer.overlap_report()["steps"]


def _both(rank, world):
    return _launch_times(rank, world, True), _launch_times(rank, world, False)


@pytest.mark.timeout(120)
def test_buckets_are_sent_while_the_backward_pass_goes_on():
    for (ours, launched), (later, none) in run_ranks(_both, 2):
        # after the first step (which the reducer learns from), the last layers' buckets went during
        # backward: the backward pass was held until one was issued, and would have waited in vain
        assert all("backward" in step for step in ours[1:]) and launched == 2, ours
        # overlap=False: everything at reduce()
        assert none == 0 and all(phase == "reduce" for step in later for phase in step), later
        assert all(len(step) >= 3 for step in later), later


def _accumulate_more(rank, world, overlap):
    from thinwire.algorithms.sync import SyncReducer
    from thinwire.comm.torch_dist import TorchComm

    model = _Net()
    reducer = SyncReducer(model, "identity", TorchComm(), bucket_mb=0.004, overlap=overlap)
    try:
        for step, passes in enumerate([1, 1, 2]):
            model.zero_grad()
            for part in range(passes):
                x, y = _batch(rank, step, part)
                torch.nn.functional.cross_entropy(model(x), y).backward()
            reducer.reduce()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _accumulate_both(rank, world):
    return _accumulate_more(rank, world, True), _accumulate_more(rank, world, False)


@pytest.mark.timeout(120)
def test_more_backward_passes_than_ever_before_raises_instead_of_averaging_wrongly():
    for ours, synchronous in run_ranks(_accumulate_both, 2):
        assert "grew after its bucket was sent during backward" in ours and "overlap=False" in ours, ours
        assert synchronous == "no error"


METHODS = ["localsgd:warmup=3,period=2", "dasgd:warmup=3,period=2,delay=1", "ab:warmup=3,cycle=4,full_steps=1"]


def _method_run(rank, spec, overlap):
    import thinwire

    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    attached = thinwire.attach(model, opt, spec, bucket_mb=0.004, overlap=overlap)
    for step in range(6):
        opt.zero_grad(set_to_none=False)
        x, y = _batch(rank, step, 0)
        torch.nn.functional.cross_entropy(attached.model(x), y).backward()
        attached.after_backward()
        opt.step()
        attached.after_step()
    m = attached.method
    warmup = m._full_mean if isinstance(m, ABTraining) else m.warmup
    return [p.detach().clone() for p in attached.model.parameters()], warmup.reducer.overlap_figures["steps"]


def _methods_equal(rank, world):
    out = {}
    for spec in METHODS:
        (a, launched), (b, none) = _method_run(rank, spec, True), _method_run(rank, spec, False)
        out[spec] = (len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), launched, none)
    return out


@pytest.mark.timeout(180)
def test_warm_ups_of_model_averaging_methods_overlap_with_the_same_bits():
    # three warm-up steps: the second and third launch in backward (the first learns), and
    # nothing launches once the warm-up is over (those steps never call reduce())
    for r in run_ranks(_methods_equal, 2):
        assert r == {spec: (True, 2, 0) for spec in METHODS}

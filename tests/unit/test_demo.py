"""DeMo (``thinwire.optim.DeMo`` and the ``demo`` method) on the in-process communicator.

The exact relation to SGD: with one worker, ``topk`` = a block's size and fp32 values, the
whole momentum is sent every step, so after ``m ← β m + g`` the codec's error feedback
leaves ``m = m − idct(dct(m)) = 0`` (up to the transforms' fp32 rounding), the update is
``β·0 + g = g``, and with ``sign=False`` the step is ``θ ← (1 − lr λ) θ − lr g``: SGD with
momentum 0 and decoupled weight decay. Momentum only carries what a step did not send.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import thinwire
import tiny
from thinwire.algorithms.build import build_method
from thinwire.algorithms.methods import resolve_method
from thinwire.comm.local import LocalWorld
from thinwire.comm.meter import sent_bytes
from thinwire.numerics import dct_basis
from thinwire.optim import DeMo

BASE = tiny.net(5, 40, 3)  # tensors (40, 5), (40,), (3, 40), (3,)
# the (16, 16) weight and both (16,) biases tile 8 x 8 and 8 blocks exactly (momenta as
# coefficients); the (16, 5) and (3, 16) weights and the (3,) bias pad
MIXED = tiny.seeded(nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)))


def _momenta(opt) -> list[torch.Tensor]:
    return [m for s in opt.state.values() for k, m in s.items() if k in ("momentum", "momentum_dct")]


def _run(comm, steps, *, cut=None, base=BASE, **knobs):
    """This rank's flat parameters after ``steps`` DeMo steps on its own batches; with
    ``cut``, the optimizer's state is saved after ``cut`` steps and loaded into a fresh one."""
    model = copy.deepcopy(base)
    def make(m):
        return DeMo(m.named_parameters(), lr=0.05, comm=comm, **knobs)

    opt = make(model)
    for step in range(steps):
        if step == cut:
            saved = copy.deepcopy(opt.state_dict())
            opt = make(model)
            opt.load_state_dict(saved)
        tiny.backward(model, opt, comm.rank, step)
        opt.step()
    return tiny.flat(model), opt


@pytest.mark.parametrize("base", [BASE, MIXED], ids=["padded", "mixed"])
def test_one_worker_sending_everything_is_sgd_with_decoupled_weight_decay(base):
    LocalWorld(1).run(lambda comm: _sgd_relation(comm, base))


def _sgd_relation(comm, base):
    steps, lr, wd = 6, 0.05, 0.1
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = DeMo(model.parameters(), lr=lr, chunk=64, topk=4096, values="fp32", sign=False, decay=0.9,
               weight_decay=wd, comm=comm)
    sgd = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.0)
    for step in range(steps):
        tiny.backward(model, opt, 0, step)
        opt.step()
        tiny.backward(ref, sgd, 0, step)
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(1 - lr * wd)
        sgd.step()
    torch.testing.assert_close(tiny.flat(model), tiny.flat(ref), rtol=0, atol=1e-5)
    moms = _momenta(opt)  # nothing left over: the momentum is zero up to rounding
    assert len(moms) == len(list(model.parameters())) and all(m.abs().max().item() < 1e-5 for m in moms)


def _by_hand(n, steps, *, chunk, topk, decay, lr, wd, sign, base=BASE):
    """n models, the update written out: m ← β m + g; per block the top-k DCT coefficients
    of m (fp32 values), m ← m − idct(kept); Δ = mean of the ranks' idct(kept); θ ← (1 − lr
    λ) θ − lr Δ (or sign Δ)."""
    models = [copy.deepcopy(base) for _ in range(n)]
    moms = [[torch.zeros_like(p) for p in base.parameters()] for _ in range(n)]
    sgd = [torch.optim.SGD(m.parameters(), lr=0.0) for m in models]  # for zero_grad only
    for step in range(steps):
        for r, m in enumerate(models):
            tiny.backward(m, sgd[r], r, step)
        sent = []
        for r, m in enumerate(models):
            mine = []
            for mom, p in zip(moms[r], m.parameters()):
                mom.mul_(decay).add_(p.grad)
                t = dct_basis.tiling(tuple(p.shape), chunk)
                c = dct_basis.forward(mom, t)
                k = min(topk, t.size)
                idx = c.abs().topk(k, dim=1).indices
                kept = torch.zeros_like(c).scatter_(1, idx, c.gather(1, idx))
                mine.append(kept)
                mom.sub_(dct_basis.inverse(kept, t))
            sent.append(mine)
        with torch.no_grad():
            for i, p0 in enumerate(base.parameters()):
                t = dct_basis.tiling(tuple(p0.shape), chunk)
                delta = dct_basis.inverse(sum(s[i] for s in sent), t) / n
                step_dir = delta.sign() if sign else delta
                for m in models:
                    p = list(m.parameters())[i]
                    p.mul_(1 - lr * wd).sub_(lr * step_dir)
    return [tiny.flat(m) for m in models]


@pytest.mark.parametrize("base", [BASE, MIXED], ids=["padded", "mixed"])
@pytest.mark.parametrize("n", [2, 3])
def test_ranks_follow_the_update_by_hand(n, base):
    """The momentum kept in the tensor's domain (padded blocks) and as DCT coefficients
    (whole blocks) both follow the update written out in the tensor's domain."""
    knobs = dict(chunk=8, topk=5, decay=0.9, sign=False)
    got = LocalWorld(n).run(lambda comm: _run(comm, 5, values="fp32", weight_decay=0.1, base=base, **knobs)[0])
    want = _by_hand(n, 5, lr=0.05, wd=0.1, base=base, **knobs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


@pytest.mark.parametrize("values", ["bf16", "sign", "rangefloat"])
def test_every_rank_ends_with_the_same_bits_and_sends_what_the_layout_says(values):
    def run(comm):
        flat, opt = _run(comm, 12, chunk=16, topk=8, values=values)
        return flat, opt.comm.meter.bytes_sent

    out = LocalWorld(3).run(run)
    assert all(torch.equal(out[0][0], f) for f, _ in out[1:])
    assert not torch.equal(out[0][0], tiny.flat(BASE))
    # bytes: every step, one all_gather of each tensor's payload (as the dct codec lays it out)
    from thinwire.codecs.specs import build_codec

    codec = build_codec(f"dct:chunk=16,topk=8,values={values}")
    per_step = sum(sent_bytes("all_gather", codec.nbytes(p.shape, torch.float32), 3) for p in BASE.parameters())
    assert all(b == pytest.approx(12 * per_step) for _, b in out)


@pytest.mark.parametrize("base", [BASE, MIXED], ids=["padded", "mixed"])
def test_a_resumed_optimizer_continues_exactly(base):
    straight = LocalWorld(2).run(lambda comm: _run(comm, 8, chunk=8, topk=3, base=base)[0])
    resumed = LocalWorld(2).run(lambda comm: _run(comm, 8, chunk=8, topk=3, cut=4, base=base)[0])
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_whole_blocks_keep_coefficients_and_a_state_saved_in_the_tensors_domain_loads_as_them():
    """Momenta of whole-block tensors are (blocks, coefficients); a state that holds them
    parameter-shaped (saved before) loads as their coefficients and continues as the
    straight run does, up to the transforms' rounding; another chunk is refused by name."""

    def run(comm):
        model = copy.deepcopy(MIXED)
        make = lambda: DeMo(model.named_parameters(), lr=0.05, chunk=8, topk=3, comm=comm)  # noqa: E731
        opt = make()
        for step in range(6):
            if step == 3:
                saved = copy.deepcopy(opt.state_dict())
                kinds = {i: sorted(k for k in st if "momentum" in k) for i, st in saved["state"].items()}
                for i, p in enumerate(model.parameters()):
                    st = saved["state"][i]
                    if "momentum_dct" in st:  # the same momentum as a parameter-shaped tensor
                        st["momentum"] = dct_basis.inverse(st.pop("momentum_dct"), dct_basis.tiling(tuple(p.shape), 8))
                opt = make()
                opt.load_state_dict(saved)
            tiny.backward(model, opt, comm.rank, step)
            opt.step()
        refused = None
        try:
            DeMo(model.named_parameters(), lr=0.05, chunk=4, topk=3, comm=comm).load_state_dict(opt.state_dict())
        except ValueError as e:
            refused = str(e)
        return tiny.flat(model), kinds, refused

    straight = LocalWorld(2).run(lambda comm: _run(comm, 6, chunk=8, topk=3, base=MIXED)[0])
    for (flat, kinds, refused), want in zip(LocalWorld(2).run(run), straight):
        torch.testing.assert_close(flat, want, rtol=0, atol=1e-5)
        assert [kinds[i] for i in range(6)] == [["momentum"], ["momentum_dct"], ["momentum_dct"], ["momentum_dct"],
                                                ["momentum"], ["momentum"]]
        assert refused is not None and "chunk" in refused


def test_a_none_gradient_stays_none_and_frozen_weights_stay_put():
    def run(comm):
        model = copy.deepcopy(BASE)
        first, bias0, second, _ = model.parameters()
        bias0.requires_grad_(False)
        opt = DeMo(model.parameters(), lr=0.05, comm=comm)
        before = [p.detach().clone() for p in model.parameters()]
        tiny.backward(model, opt, comm.rank, 0)
        second.grad = None  # e.g. a branch unused this step, on every rank
        opt.step()
        assert second.grad is None and bias0.grad is None
        assert torch.equal(second, before[2]) and torch.equal(bias0, before[1])
        assert second not in opt.state and bias0 not in opt.state
        assert not torch.equal(first, before[0])
        return True

    assert LocalWorld(2).run(run) == [True, True]


def test_bad_knobs_name_the_rule():
    params = list(BASE.parameters())
    for knobs, needle in [({"decay": 1.0}, "decay must be in"), ({"values": "fp8"}, "values must be one of"),
                          ({"topk": 0}, "topk must be in"), ({"chunk": 48}, "chunk must be a power of two"),
                          ({"lr": -1.0}, "lr must be >= 0")]:
        kw = {"lr": 0.1, **knobs}
        with pytest.raises(ValueError, match=needle):
            DeMo(params, **kw)  # refused before any communicator is needed
    for spec, needle in [("demo:decay=1", "decay must be in"), ("demo:topk=5000", "topk must be in 1..4096"),
                         ("demo:values=int4", "values"), ("demo:chunk=1", "chunk must be >= 2")]:
        with pytest.raises(ValueError, match=needle):
            resolve_method(spec)


def test_the_method_refuses_an_optimizer_that_is_not_demo():
    model = copy.deepcopy(BASE)
    with pytest.raises(ValueError, match="demo is an optimizer itself"):
        build_method("demo", model, torch.optim.Adam(model.parameters()), LocalWorld(1))


def test_attach_with_another_optimizer_or_none_names_the_one_call_that_works():
    import thinwire

    model = copy.deepcopy(BASE)
    said = []
    for optimizer in (torch.optim.AdamW(model.parameters()), None):
        with pytest.raises(ValueError) as e:
            thinwire.attach(model, optimizer, "demo")
        said.append(str(e.value))
    assert said[0] == said[1] and "thinwire.method_optimizer('demo', model.parameters(), lr)" in said[0]
    assert "thinwire.attach(model, opt, 'demo')" in said[0]


def test_the_method_steps_with_its_optimizer_and_reports_its_seconds():
    def run(comm):
        from thinwire.algorithms.methods import method_config

        model = copy.deepcopy(BASE)
        cls, config = method_config("demo:chunk=8,topk=2")
        opt = cls.make_optimizer(config, list(model.parameters()), 0.05, 0.0, comm)
        method = build_method("demo:chunk=8,topk=2", model, opt, comm)
        for step in range(3):
            tiny.backward(model, opt, comm.rank, step)
            assert method.after_backward() is True
            opt.step()
            method.after_step()
        return method.timing.codec_seconds > 0 and method.timing.comm_seconds > 0, tiny.flat(model)

    (ok_a, a), (ok_b, b) = LocalWorld(2).run(run)
    assert ok_a and ok_b and torch.equal(a, b)


def test_a_bf16_model_resumes_with_fp32_momenta():
    base = copy.deepcopy(BASE).to(torch.bfloat16)

    def run(comm, cut=None):
        model = copy.deepcopy(base)
        opt = DeMo(model.parameters(), lr=0.05, chunk=8, topk=3, comm=comm)
        for step in range(6):
            if step == cut:
                saved = copy.deepcopy(opt.state_dict())
                opt = DeMo(model.parameters(), lr=0.05, chunk=8, topk=3, comm=comm)
                opt.load_state_dict(saved)
                assert all(m.dtype == torch.float32 for m in _momenta(opt))
            x, y = tiny.batch(100 * step + comm.rank, 6, 5, 3)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x.bfloat16()).float(), y).backward()
            opt.step()
        return tiny.flat(model)

    straight = LocalWorld(2).run(run)
    resumed = LocalWorld(2).run(lambda comm: run(comm, cut=3))
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_the_method_refuses_an_enabled_grad_scaler():
    def run(comm):
        model = copy.deepcopy(BASE)
        opt = thinwire.method_optimizer("demo", model.parameters(), 0.05, comm=comm)
        method = build_method("demo", model, opt, comm)
        with pytest.raises(ValueError, match="enabled GradScaler"):
            method.after_backward(scaler=torch.amp.GradScaler("cpu", enabled=True))
        return method.after_backward(scaler=torch.amp.GradScaler("cpu", enabled=False))

    assert LocalWorld(1).run(run) == [True]
    assert thinwire.method_optimizer("topk", BASE.parameters(), 0.05) is None  # a codec: your own optimizer

"""detonation's DeMo as the peer ``peer-demo``: over real gloo ranks the parameters agree bit
for bit, the meter counts exactly the positions and values detonation all_gathers, each step
matches a DeMo step written out here (own DCT, own block sizes, own top-k and averaging),
a resumed run continues exactly, in-process ``LocalWorld`` ranks end where gloo ranks end,
the trainer runs it (and resumes it) and bad knobs or set-ups are one line."""

import copy
import dataclasses
import io
import math

import pytest
import torch
from torch import nn

pytest.importorskip("detonation", reason="detonation is not installed (pip install detonation mltiming)")

from resumes import rank_states  # noqa: E402
from spawn import run_ranks  # noqa: E402
from thinwire.peers.detonation_demo import PeerDeMo, PeerDeMoConfig  # noqa: E402

LR = 0.05
STEPS = 5
CUT = 3  # the resumed run is checkpointed after this many steps
# blocks of 4 (12 and 8), 1 (7 is prime: every coefficient sent) and topk clamped to small blocks
CFG = PeerDeMoConfig(chunk=4, topk=5, decay=0.9)
HAND = [PeerDeMoConfig(chunk=4, topk=5, decay=0.9, sign=False),
        PeerDeMoConfig(chunk=4, topk=3, decay=0.5, sign=True, weight_decay=0.1)]
SMALL = {"dim": 24, "hidden": 32, "classes": 4, "samples": 512, "test_samples": 128}


def _base() -> nn.Module:
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 7))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _backward(model: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 7, (16,), generator=g)
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _build(comm, cfg, model):
    opt = PeerDeMo.make_optimizer(cfg, list(model.parameters()), LR, 0.0, comm)
    return opt, PeerDeMo(model, opt, comm, cfg)


def _train(comm, cfg=CFG, steps=STEPS, cut=None):
    """``steps`` steps; with ``cut``, everything is saved (torch.save, loaded weights_only)
    after ``cut`` steps and the run continues in fresh objects. The final parameters, the
    all_gather payload bytes and calls of each step, and the method's timing and report."""
    model = _base()
    opt, method = _build(comm, cfg, model)
    payload, calls = [], []
    for step in range(steps):
        if step == cut:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "method": method.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            model = _base()
            model.load_state_dict(saved["model"])
            opt, method = _build(comm, cfg, model)
            opt.load_state_dict(saved["opt"])
            method.load_state_dict(saved["method"])
        op = comm.meter.ops.get("all_gather")
        before = (op.payload_bytes, op.calls) if op else (0, 0)
        _backward(model, comm.rank, step)
        method.after_backward()
        opt.step()
        method.after_step()
        op = comm.meter.ops.get("all_gather")
        after = (op.payload_bytes, op.calls) if op else (0, 0)
        payload.append(after[0] - before[0])
        calls.append(after[1] - before[1])
    return _flat(model), payload, calls, comm.meter.bytes_sent, method.timing, method.report(), method.step


# -- a DeMo step written out, in float64 ------------------------------------------------------
def _side(n: int, chunk: int) -> int:
    """The block side detonation uses along a dimension of length ``n``: its largest divisor <= chunk."""
    return max(d for d in range(1, min(n, chunk) + 1) if n % d == 0)


def _dct(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix, rows the frequencies."""
    k, i = torch.arange(n, dtype=torch.float64)[:, None], torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d


def _encode(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Coefficients of every block, one row each: (blocks, block size)."""
    if x.dim() == 1:
        s = _side(x.shape[0], chunk)
        return x.reshape(-1, s) @ _dct(s).T
    a, b = _side(x.shape[0], chunk), _side(x.shape[1], chunk)
    blocks = x.reshape(x.shape[0] // a, a, x.shape[1] // b, b).permute(0, 2, 1, 3)
    return (_dct(a) @ blocks @ _dct(b).T).reshape(-1, a * b)


def _decode(c: torch.Tensor, shape: torch.Size, chunk: int) -> torch.Tensor:
    if len(shape) == 1:
        return (c @ _dct(c.shape[1])).reshape(shape)
    a, b = _side(shape[0], chunk), _side(shape[1], chunk)
    blocks = _dct(a).T @ c.reshape(shape[0] // a, shape[1] // b, a, b) @ _dct(b)
    return blocks.permute(0, 2, 1, 3).reshape(shape)


def _reference_step(params, deltas, grads, cfg):
    """One DeMo step of every rank's residuals ``deltas[r][i]`` with gradients ``grads[r][i]``:
    the parameters after it (the same on every rank) and the new residuals."""
    new_params: list[tuple[torch.Tensor, torch.Tensor]] = []
    new_deltas: list[list[torch.Tensor]] = [[] for _ in deltas]
    for i, p in enumerate(params):
        kept, masks = [], []
        for r in range(len(deltas)):
            delta = cfg.decay * deltas[r][i] + LR * grads[r][i]
            coef = _encode(delta, cfg.chunk)
            keep = torch.zeros_like(coef).scatter_(1, coef.abs().topk(min(cfg.topk, coef.shape[1]), dim=1).indices,
                                                   1.0)
            new_deltas[r].append(delta - _decode(coef * keep, p.shape, cfg.chunk))
            kept.append(coef * keep)
            masks.append(keep)
        sums, counts = torch.stack(kept).sum(0), torch.stack(masks).sum(0)
        update = _decode(torch.where(counts > 0, sums / counts.clamp(min=1), 0.0), p.shape, cfg.chunk)
        step = torch.sign(update) if cfg.sign else update
        new_params.append((p * (1 - LR * cfg.weight_decay) - LR * step, update))
    return new_params, new_deltas


def _hand(comm, cfg, steps=2):
    """Each step of the method against :func:`_reference_step` from the same parameters and
    gradients (every rank's, replayed here), the reference's residuals carried over. The
    largest differences in the parameters (away from an update of about zero, whose sign is
    either) and in this rank's residual."""
    model = _base()
    opt, method = _build(comm, cfg, model)
    params = list(model.parameters())
    deltas = [[torch.zeros_like(p, dtype=torch.float64) for p in params] for _ in range(comm.world_size)]
    worst_p = worst_d = 0.0
    ambiguous = 0
    for step in range(steps):
        grads = []
        for r in range(comm.world_size):
            replay = copy.deepcopy(model)
            _backward(replay, r, step)
            grads.append([(torch.zeros_like(q) if q.grad is None else q.grad).double() for q in replay.parameters()])
        expected, deltas = _reference_step([p.detach().double() for p in params], deltas, grads, cfg)
        _backward(model, comm.rank, step)
        method.after_backward()
        opt.step()
        method.after_step()
        for i, p in enumerate(params):
            want, update = expected[i]
            clear = update.abs() > 1e-6 if cfg.sign else torch.ones_like(update, dtype=torch.bool)
            ambiguous += int((~clear).sum())
            worst_p = max(worst_p, float((p.detach().double() - want)[clear].abs().max()))
            worst_d = max(worst_d, float((opt.state[p]["demo_delta"].double() - deltas[comm.rank][i]).abs().max()))
    return worst_p, worst_d, ambiguous


def _ranks(rank, world):
    from thinwire.comm.torch_dist import TorchComm

    out = {"train": _train(TorchComm())}
    out["resume"] = _train(TorchComm(), cut=CUT)[0]
    out["hand"] = [_hand(TorchComm(), cfg) for cfg in HAND]
    return out


def _expected_payload(model: nn.Module, chunk: int, topk: int) -> int:
    """Per parameter: blocks × min(topk, block size) coefficients, an fp32 value and an int32 position each."""
    total = 0
    for p in model.parameters():
        block = math.prod(_side(n, chunk) for n in p.shape)
        total += p.numel() // block * min(topk, block) * (4 + 4)
    return total


@pytest.fixture(scope="module")
def gloo():
    return run_ranks(_ranks, 2, timeout=90)


@pytest.mark.timeout(120)
def test_ranks_agree_and_the_meter_counts_what_detonation_sends(gloo):
    flat, payload, calls, sent, timing, report, step = gloo[0]["train"]
    assert torch.equal(flat, gloo[1]["train"][0])  # bit for bit: every rank decodes the same gathered data
    assert not torch.equal(flat, _flat(_base()))
    want = _expected_payload(_base(), CFG.chunk, CFG.topk)
    assert want == 1064  # 6·5 + 3·4 + 21·4 + 7·1 coefficients, 8 bytes each
    assert payload == [want] * STEPS and report["payload_bytes_per_step"] == want
    assert calls == [2 * len(list(_base().parameters()))] * STEPS  # positions and values, per parameter
    assert sent == STEPS * (2 - 1) * want  # all_gather: each of n ranks sends its payload to n - 1
    assert timing.comm_seconds > 0 and timing.codec_seconds > 0 and step == STEPS
    assert report["blocks"] == {12: 4, 8: 4, 7: 1} and report["peer"].startswith("detonation")


@pytest.mark.timeout(120)
def test_each_step_is_the_demo_step_written_out(gloo):
    """Tolerance 1e-6 on parameters of about 0.3 and residuals of about 1e-2 (fp32 against
    float64); with sign, entries whose decoded update is within 1e-6 of zero are left out
    (their sign may go either way), and there are few of them."""
    for rank in range(2):
        for worst_p, worst_d, ambiguous in gloo[rank]["hand"]:
            assert worst_p < 1e-6 and worst_d < 1e-6 and ambiguous <= 2, (worst_p, worst_d, ambiguous)


@pytest.mark.timeout(120)
def test_resume_continues_exactly(gloo):
    for rank in range(2):
        assert torch.equal(gloo[rank]["resume"], gloo[rank]["train"][0])


@pytest.mark.timeout(60)
def test_local_world_ends_where_gloo_ends(gloo):
    from thinwire.comm.local import LocalWorld

    runs = LocalWorld(2).run(_train)
    for rank in range(2):
        assert torch.equal(runs[rank][0], gloo[rank]["train"][0])
        assert runs[rank][1:3] == gloo[rank]["train"][1:3]


# -- through the trainer --------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_trainer_runs_and_resumes_it(tmp_path):
    from thinwire.run import checkpoint
    from thinwire.run.config import TrainConfig
    from thinwire.run.launch import launch

    out = str(tmp_path / "a")
    cfg = TrainConfig(task="synthetic", method="peer-demo:chunk=8,topk=4", workers=2, steps=6, eval_every=3,
                      lr=0.003, out=out, checkpoint_every=3, task_options=SMALL, batch_size=16).resolve()
    assert cfg.optimizer == "peer-demo"
    straight = launch(cfg, show_progress=False)
    assert straight is not None and straight.status == "ok", straight
    assert straight.method_report["payload_bytes_per_step"] > 0
    assert straight.bytes_sent_per_worker == 6 * straight.method_report["payload_bytes_per_step"]
    resumed = launch(dataclasses.replace(cfg, out=str(tmp_path / "b"), resume=str(checkpoint.step_dir(out, 3))),
                     show_progress=False)
    assert resumed is not None and resumed.resumed_from == 3
    for _, a, b in rank_states(out, tmp_path / "b", 6, 2):
        for name, t in a["model"].items():
            assert torch.equal(t, b["model"][name]), name
    assert resumed.final_loss == straight.final_loss


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("knobs, needle", [
    ({"chunk": "0"}, "chunk must be >= 1, got 0"),
    ({"topk": "0"}, "topk must be in [1, chunk²=4096]"),
    ({"chunk": "2", "topk": "5"}, "topk must be in [1, chunk²=4]"),
    ({"decay": "1"}, "decay must be in [0, 1)"),
    ({"decay": "-0.1"}, "decay must be in [0, 1)"),
    ({"weight_decay": "-1"}, "weight_decay must be >= 0, got -1"),
    ({"sign": "maybe"}, "sign must be true or false"),
    ({"chunk": "1.5"}, "chunk must be an integer"),
])
def test_bad_knob_is_one_line(knobs, needle):
    from thinwire.codecs.specs import build_config

    with pytest.raises(ValueError) as e:
        build_config(PeerDeMoConfig, knobs, "peer-demo")
    assert len(str(e.value).splitlines()) == 1 and needle in str(e.value), str(e.value)


def test_without_detonation_the_error_names_the_fix(monkeypatch):
    import sys

    PeerDeMo.check_world(CFG, 2)  # installed: any world
    monkeypatch.setitem(sys.modules, "mltiming", None)  # an import of it fails
    with pytest.raises(ValueError, match=r"imports mltiming without declaring it: pip install mltiming"):
        PeerDeMo.check_world(CFG, 2)
    monkeypatch.setitem(sys.modules, "detonation", None)
    with pytest.raises(ValueError, match=r"pip install detonation mltiming \(or thinwire\[peers\]; Python >= 3.11\)$"):
        PeerDeMo.check_world(CFG, 2)


def _one_rank(fn):
    from thinwire.comm.local import LocalWorld

    return LocalWorld(1).run(fn)[0]


def test_bad_set_ups_are_refused():
    conv = nn.Sequential(nn.Conv2d(2, 4, 3))
    with pytest.raises(ValueError, match=r"1-D and 2-D parameters only; 0.weight has shape \(4, 2, 3, 3\)$"):
        PeerDeMo.check_model(CFG, conv)

    def refusals(comm):
        model = _base()
        with pytest.raises(ValueError, match="build it with PeerDeMo.make_optimizer"):
            PeerDeMo(model, torch.optim.SGD(model.parameters(), lr=0.1), comm, CFG)
        opt = PeerDeMo.make_optimizer(CFG, list(model.parameters()), LR, 0.0, comm)
        with pytest.raises(ValueError, match="the optimizer was built with"):
            PeerDeMo(model, opt, comm, dataclasses.replace(CFG, topk=3))
        with pytest.raises(ValueError, match="lr \\* weight_decay must be < 1"):
            PeerDeMo.make_optimizer(dataclasses.replace(CFG, weight_decay=100.0), list(model.parameters()), LR, 0.0,
                                    comm)
        method = PeerDeMo(model, opt, comm, CFG)
        scaler = torch.amp.GradScaler("cpu", enabled=True)
        with pytest.raises(ValueError, match="cannot run with a GradScaler") as e:
            method.after_backward(scaler=scaler)
        assert len(str(e.value).splitlines()) == 1
        with pytest.raises(ValueError, match="keeps only its step"):
            method.load_state_dict({"step": 1, "delta": 0})

    _one_rank(refusals)


def test_one_rank_sends_nothing_and_prints_nothing(capsys):
    flat, payload, calls, sent, _, report, _ = _one_rank(lambda comm: _train(comm, steps=2))
    assert payload == [0, 0] and sent == 0 and report["payload_bytes_per_step"] == 0
    assert not torch.equal(flat, _flat(_base()))
    assert capsys.readouterr().out == ""  # detonation's block-size line is dropped

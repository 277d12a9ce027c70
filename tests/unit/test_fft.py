"""FFT sparsification: Parseval selection, passthrough, spectra summed before one inverse."""

import math

import pytest
import torch

from thinwire.aggregate import Aggregator
from thinwire.codecs.fft import fast_length
from thinwire.codecs.specs import build_codec
from thinwire.comm.local import LocalWorld


def spectrum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``x``'s rfft at the codec's padded length, in float64: the bins, each bin's weight in
    Parseval's sum (2, but 1 for DC and, at an even length, Nyquist), their weighted energies
    and the length."""
    length = fast_length(x.numel())
    spec = torch.fft.rfft(x.reshape(-1).double(), n=length)
    w = torch.full((spec.numel(),), 2.0, dtype=torch.float64)
    w[0] = 1
    if length % 2 == 0:
        w[-1] = 1
    return spec, w, w * spec.abs().square(), length


def _x(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(64, 60), (1000,), (5, 9, 15), (64, 65), (7, 11, 13), (512, 300)])
def test_kept_energy_is_one_minus_the_relative_error_squared(shape):
    """Before quantization (bits=32), Parseval: kept weighted energy / total == 1 - ||u-û||²/||u||²
    when the length is already 5-smooth (3840, 1000, 153600: even, the last with enough bins for
the sampled selection; 675: odd). Padded lengths (4160 ->
    4320, 1001 -> 1024) drop the error that falls on the padding, so there 1 - err >= kept."""
    x = _x(shape).double().float()
    codec = build_codec("fft:theta=0.7,bits=32")
    out = codec.decode(codec.encode(x))
    spec, _, energy, length = spectrum(x)
    kept = energy.topk(math.ceil(0.3 * spec.numel())).values.sum() / energy.sum()
    err = ((x - out).double().square().sum() / x.double().square().sum()).item()
    if length == x.numel():
        assert abs(kept.item() - (1 - err)) < 1e-5
    else:
        assert 1 - err >= kept.item() - 1e-5


def test_theta_zero_full_precision_is_a_passthrough():
    x = _x((300, 17))
    codec = build_codec("fft:theta=0,bits=32")
    out = codec.decode(codec.encode(x))
    assert ((out - x).norm() / x.norm()).item() < 1e-6


def test_summed_spectra_equal_the_sum_of_each_decode():
    """One inverse FFT of the summed spectra == the sum of per-payload inverse FFTs (linearity)."""
    codec = build_codec("fft:theta=0.8")
    payloads = [codec.encode(_x((50, 40), seed=s)) for s in range(4)]
    out = torch.empty(50, 40)
    codec.decode_sum(payloads, out)
    torch.testing.assert_close(out, sum(codec.decode(p) for p in payloads), rtol=0, atol=1e-5)


def test_aggregator_mean_over_ranks_equals_the_mean_of_each_ranks_decode():
    named = [("w", torch.zeros(48, 40))]

    def fn(comm):
        codec = build_codec("fft:theta=0.8")
        g = _x((48, 40), seed=comm.rank)
        own = codec.decode(codec.encode(g, key="w"))
        Aggregator(named, lambda n, t: codec, comm).reduce_({"w": g})
        return g, own

    results = LocalWorld(3).run(fn)
    mean = sum(own for _, own in results) / 3
    for out, _ in results:
        torch.testing.assert_close(out, mean, rtol=0, atol=1e-5)


def test_positions_take_the_smaller_encoding_and_decode_the_same():
    x = _x((64, 65))
    bins = fast_length(x.numel()) // 2 + 1
    for theta, kind in [(0.99, "index"), (0.5, "bitmap")]:  # few bins kept: indices; many: a bitmap
        auto = build_codec(f"fft:theta={theta}")
        kept = math.ceil((1 - theta) * bins)
        expected = 4 * kept if kind == "index" else math.ceil(bins / 8)
        assert auto.encode(x).tensors[1].numel() * auto.encode(x).tensors[1].element_size() == expected
        forced = build_codec(f"fft:theta={theta},positions={'bitmap' if kind == 'index' else 'index'}")
        assert torch.equal(auto.decode(auto.encode(x)), forced.decode(forced.encode(x)))


def test_fast_length_is_the_next_5_smooth_number():
    def smooth(m):
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        return m == 1

    for n in list(range(1, 200)) + [25_557_032]:
        length = fast_length(n)
        assert length >= n and smooth(length)
        assert all(not smooth(m) for m in range(n, length))


@pytest.mark.parametrize("spec, expected", [
    ("fft:schedule=constant", {0: 0.9, 700: 0.9, 5000: 0.9}),
    ("fft", {0: 0.9, 500: 0.7, 1000: 0.5, 5000: 0.5}),  # cosine: halfway is the midpoint
    ("fft:schedule=linear,horizon=10,theta_min=0.1", {0: 0.9, 5: 0.5, 10: 0.1, 99: 0.1}),
    ("fft:schedule=step,theta=0.8,every=100,factor=2,theta_min=0.1", {99: 0.8, 100: 0.4, 200: 0.2, 300: 0.1, 900: 0.1}),
    ("fft:theta=0.3", {0: 0.3, 1000: 0.3}),  # theta_min is capped at theta
])
def test_theta_schedules(spec, expected):
    from thinwire.codecs.fft import theta_at

    codec = build_codec(spec)
    for step, theta in expected.items():
        assert theta_at(codec.config, step) == pytest.approx(theta, abs=1e-12)


def test_a_falling_theta_sends_more_bins_and_the_aggregator_follows():
    """The payload grows as theta falls; every rank agrees on the size at each step, so the
    gathered layout follows step by step."""
    named = [("w", torch.zeros(40, 45))]

    def fn(comm):
        codec = build_codec("fft:schedule=linear,horizon=4,theta=0.9,theta_min=0.1")
        agg = Aggregator(named, lambda n, t: codec, comm)
        sizes, errs = [], []
        for step in range(5):
            g = _x((40, 45), seed=10 * step + comm.rank)
            before = comm.meter.bytes_sent
            out = g.clone()
            agg.reduce_({"w": out})
            sizes.append(comm.meter.bytes_sent - before)
            mean = sum(_x((40, 45), seed=10 * step + r) for r in range(comm.world_size)) / comm.world_size
            errs.append(((out - mean).norm() / mean.norm()).item())
        return sizes, errs

    for sizes, errs in LocalWorld(2).run(fn):
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
        assert errs[-1] < errs[0]


def test_recover_lowers_theta_when_the_window_loss_stalls_or_rises():
    codec = build_codec("fft:schedule=recover,theta=0.9,factor=1.5,theta_min=0.3,tolerance=0.01,every=7")
    assert codec.loss_window() == 7 and codec.theta() == 0.9
    seen = []
    # best 2.0 -> 1.5; 1.49 misses 1.5 - 1% of 1.5 = 1.485: stall; 1.0 improves; 1.2 rises;
    # NaN counts as a rise (and is never the best); 0.5 improves; at the floor theta stays
    for loss in [2.0, 1.5, 1.49, 1.0, 1.2, math.nan, 0.5, 0.6]:
        codec.observe_loss(loss)
        seen.append(round(codec.theta(), 12))
    assert seen == [0.9, 0.9, 0.6, 0.6, 0.4, 0.3, 0.3, 0.3]
    assert codec.stats() == {"theta": 0.3}  # no encode yet: the current theta
    restored = build_codec(codec.describe())
    restored.load_state_dict(codec.state_dict())
    assert restored.theta() == 0.3 and restored.state_dict() == {"theta": 0.3, "best_loss": 0.5}
    assert build_codec("fft").loss_window() == 0 and build_codec("fft").state_dict() == {}


def test_recover_theta_follows_the_loss_agreed_across_ranks():
    """Rank 0's loss keeps falling, rank 1's rises more: the mean stalls in window 2, so both
    ranks lower theta together (a rank-local rule would split them), and the wire follows."""
    from thinwire.algorithms.sync import SyncReducer

    local = {0: [4, 4, 3, 3, 2, 2], 1: [4, 4, 5, 5, 6.5, 6.5]}  # window means 4, 4, 4.25 (every=2)

    def fn(comm):
        model = torch.nn.Linear(80, 64, bias=False)
        reducer = SyncReducer(model, "fft:schedule=recover,every=2,theta=0.8,factor=2,theta_min=0.1", comm)
        thetas, sent = [], []
        for step, loss in enumerate(local[comm.rank]):
            model.weight.grad = torch.randn(64, 80, generator=torch.Generator().manual_seed(step))
            before = comm.meter.bytes_sent
            reducer.reduce(loss=torch.tensor(float(loss)))
            thetas.append(reducer.stats()["theta"])
            sent.append(comm.meter.bytes_sent - before)
        with pytest.raises(ValueError, match=r"follows the training loss: call reduce\(loss=\.\.\.\)"):
            reducer.reduce()
        return thetas, sent, reducer.state_dict()["loss_sum"]

    (t0, s0, _), (t1, s1, _) = LocalWorld(2).run(fn)
    # the theta each step used: window 2 ties window 1 (a stall), window 3 rises
    assert t0 == t1 == [0.8, 0.8, 0.8, 0.8, 0.4, 0.4]
    assert s0 == s1 and s0[0] == s0[2] < s0[4] == s0[5] - 8  # lower theta: more bins on the wire
    assert s0[1] == s0[3] == s0[0] + 8  # window ends: the 8-byte loss all_reduce, metered


def test_a_ddp_hook_refuses_a_loss_driven_schedule():
    from thinwire.integrations import ddp

    with pytest.raises(ValueError, match="follows the training loss, which a DDP hook never sees"):
        ddp.register(None, "fft:schedule=recover")


def test_fused_buckets_send_one_signal_per_bucket_and_average_it():
    """bucket_mb > 0: the compressed tensors are concatenated per bucket and sent as one FFT
    payload; each rank's output is the mean of every rank's decode of its flat bucket."""
    shapes = {"a.weight": (30, 40), "a.bias": (30,), "b.weight": (50, 24), "c.weight": (20, 70)}
    n, spec = 3, "fft:theta=0.8,schedule=constant,min_numel=500,bucket_mb=0.01"  # 2,621 floats a bucket

    def grads(rank):
        g = torch.Generator().manual_seed(rank)
        return {k: torch.randn(s, generator=g) for k, s in shapes.items()}

    def fn(comm):
        codec = build_codec(spec)
        agg = Aggregator([(k, torch.zeros(s)) for k, s in shapes.items()], lambda name, t: codec, comm)
        g = grads(comm.rank)
        agg.reduce_(g)
        return g, [(b.key, [s.name for s in b.slots]) for b in agg.buckets if b.fused and b.codec is codec], comm.meter

    results = LocalWorld(n).run(fn)
    fused = results[0][1]
    assert fused == [("a.weight..b.weight", ["a.weight", "b.weight"]), ("c.weight", ["c.weight"])]
    assert results[0][2].ops["all_gather"].calls == 2  # one per fused bucket (a.bias: all_reduce)
    for key, names in fused:
        codec = build_codec(spec)
        decodes = [codec.decode(codec.encode(torch.cat([grads(r)[k].reshape(-1) for k in names]), key=key))
                   for r in range(n)]
        mean, off = sum(decodes) / n, 0
        for k in names:
            numel = math.prod(shapes[k])
            for out, _, _ in results:
                torch.testing.assert_close(out[k].reshape(-1), mean[off : off + numel], rtol=0, atol=1e-5)
            off += numel
    for out, _, _ in results:  # the bias travels as fp32: the exact mean
        torch.testing.assert_close(out["a.bias"], sum(grads(r)["a.bias"] for r in range(n)) / n)


def test_bucket_knob_rules():
    with pytest.raises(ValueError, match="bucket_mb > 0 needs ef=false"):
        build_codec("fft:bucket_mb=1,ef=true")
    with pytest.raises(ValueError, match="bucket_mb must be >= 0"):
        build_codec("fft:bucket_mb=-1")
    assert not build_codec("fft").fusable and build_codec("fft:bucket_mb=2").bucket_cap(25 << 20) == 2 << 20


def _torch_path(codec, x, key):
    """The wire tensors and the 2-payload sum the torch code path (the one other devices
    take) gives for ``x``: the reference of the CPU path's NumPy passes."""
    from thinwire.payload import Payload

    plan = codec._plan(x.numel())
    spec = torch.fft.rfft(x.reshape(-1), n=plan.length)
    pos, kept = codec._select(spec, plan, key)
    e_max, values = codec.wire.encode(torch.view_as_real(kept).reshape(-1))
    p = Payload((torch.tensor([e_max], dtype=torch.int32), pos, values), x.shape, x.dtype)
    total = torch.zeros(plan.bins, dtype=torch.complex64)
    for q in (p, p):
        codec.spectrum_add(q, total)
    return p, torch.fft.irfft(total, n=plan.length)[: x.numel()].view(x.shape)


@pytest.mark.parametrize("spec", ["fft:theta=0.5", "fft:theta=0.9", "fft:theta=0.995", "fft:theta=0.6,positions=index",
                                  "fft:theta=0.5,bits=16,exp_bits=5", "fft:theta=0.7,bits=32",
                                  "fft:theta=0.8,bits=4,exp_bits=2", "fft:theta=0"])
@pytest.mark.parametrize("shape", [(7, 9), (64, 60), (40, 101, 3)])
def test_the_cpu_path_sends_the_bytes_of_the_torch_path_in_chunks_and_threads(spec, shape, monkeypatch):
    """On the CPU, selection, quantization and the spectra's sum run as NumPy passes over
    chunks, split across threads for large spectra; with chunks and thresholds shrunk (so
    that every size here goes through many chunks, the sampled selection and 3 parts) the
    payload is the torch path's byte for byte, and decode_sum agrees."""
    import thinwire.codecs.fft as fft

    monkeypatch.setattr(fft, "_CHUNK", 256)
    monkeypatch.setattr(fft, "_SPLIT_MIN", 1024)
    monkeypatch.setattr(fft, "_PAIR_TABLE_MIN", 64)
    monkeypatch.setattr("thinwire.numerics.select.SAMPLED_MIN", 512)
    monkeypatch.setattr(fft, "SAMPLED_MIN", 512)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    codec = build_codec(spec + ",schedule=constant")
    x = _x(shape, seed=len(spec)) * torch.logspace(-3, 3, math.prod(shape)).view(shape)  # spread spectra
    want, want_sum = _torch_path(codec, x, "w")
    got = codec.encode(x, key="w")
    assert [t.dtype for t in got.tensors] == [t.dtype for t in want.tensors]
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors))
    out = torch.empty_like(x)
    codec.decode_sum([got, got], out)
    torch.testing.assert_close(out, want_sum, rtol=0, atol=1e-5 * want_sum.abs().max().item())

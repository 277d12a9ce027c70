"""SparseLoCo on the in-process communicator: a two-rank, two-sync example worked by hand
(error feedback with its decay, chunked top-k, 2-bit values, the outer step), an
independent reference on a small net (padded blocks, vectors, several tensors), the bytes
of the wire layout, ranks bit-identical after each sync and after finish(), exact resume,
the knobs' errors and a run through the trainer."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import tiny
from thinwire.algorithms.local_sgd import LocalSGD, LocalSGDConfig
from thinwire.algorithms.methods import resolve_method
from thinwire.algorithms.sparseloco import ChunkedTopK, ChunkedTopKConfig, SparseLoCo, SparseLoCoConfig
from thinwire.comm.local import LocalWorld
from thinwire.payload import PayloadError

BASE, BASE_BN = tiny.net(5, 8, 3), tiny.net(5, 8, 3, bn=True)


# -- the example by hand ------------------------------------------------------------------
class _Matrix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 4))


# Pseudo-gradients Δ_i = θ − θ_i of each rank, per sync (rows of the 2 × 4 weight). With
# chunk=2 the matrix is two 2 × 2 blocks, columns 0-1 and 2-3; a block's positions are
# row-major (0: top left, 1: top right, 2: bottom left, 3: bottom right); k=2 keeps two.
DELTA = [
    [torch.tensor([[8.0, 1.0, 0.5, -4.0], [0.5, -4.0, -4.0, -0.25]]),  # sync 1, rank 0
     torch.tensor([[-2.0, 6.0, 1.0, 0.25], [3.0, 0.5, 0.5, 5.0]])],  # rank 1
    [torch.tensor([[1.0, 2.0, -6.0, 0.5], [-1.0, 0.25, 3.0, 5.0]]),  # sync 2, rank 0
     torch.tensor([[4.0, -1.0, 0.5, -2.0], [0.25, 3.0, -1.0, 6.0]])],  # rank 1
]
# The work, with β = 0.5, α = 0.5, bits = 2 (L = 4 bins), sigmas = 6 (bin width 1.5 σ),
# code q = clamp(round(c / width + 2), 0, 3), level = mean of the centred values in the bin.
#
# Sync 1, e_i = Δ_i (the buffers start empty).
#   rank 0: kept 8 (block 0, pos 0), -4 (block 0, pos 3), -4 (block 1, pos 1), -4 (block 1, pos 2)
#     shift -1; c = 9, -3, -3, -3; σ = sqrt(108 / 3) = 6, width 9; c / 9 + 2 = 3, 1.67 ×3
#     codes 3, 2, 2, 2; levels 9, -3: decoded 8, -4, -4, -4 (lossless)
#     residual e_0 = [[0, 1, 0.5, 0], [0.5, 0, 0, -0.25]]
#   rank 1: kept 6 (block 0, pos 1), 3 (block 0, pos 2), 1 (block 1, pos 0), 5 (block 1, pos 3)
#     shift 3.75; c = 2.25, -0.75, -2.75, 1.25; σ = 2.2174, width 3.326
#     c / width + 2 = 2.68, 1.77, 1.17, 2.38: codes 3, 2, 1, 2
#     levels: bin 3 2.25, bin 2 (-0.75 + 1.25) / 2 = 0.25, bin 1 -2.75
#     decoded 6, 4, 1, 4 (3 and 5 share a bin: both 4)
#     residual e_1 = [[-2, 0, 0, 0.25], [-1, 0.5, 0.5, 1]]
#   mean [[4, 3, 0.5, -2], [2, -2, -2, 2]]; θ = 0 − 0.5 · mean = [[-2, -1.5, -0.25, 1], [-1, 1, 1, -1]]
#
# Sync 2, e_i = 0.5 · e_i + Δ_i.
#   rank 0: e = [[1, 2.5, -5.75, 0.5], [-0.75, 0.25, 3, 4.875]]
#     kept 1, 2.5 (block 0, pos 0, 1), -5.75, 4.875 (block 1, pos 0, 3)
#     shift 0.65625; c = 0.34375, 1.84375, -6.40625, 4.21875; σ = 4.5591, width 6.8386
#     c / width + 2 = 2.05, 2.27, 1.06, 2.62: codes 2, 2, 1, 3
#     levels: bin 2 1.09375, bin 1 -6.40625, bin 3 4.21875: decoded 1.75, 1.75, -5.75, 4.875
#     residual [[-0.75, 0.75, 0, 0.5], [-0.75, 0.25, 3, 0]]
#   rank 1: e = [[3, -1, 0.5, -1.875], [-0.25, 3.25, -0.75, 6.5]]
#     kept 3, 3.25 (block 0, pos 0, 3), -1.875, 6.5 (block 1, pos 1, 3)
#     shift 2.71875; c = 0.28125, 0.53125, -4.59375, 3.78125; σ = 3.4526, width 5.1789
#     c / width + 2 = 2.05, 2.10, 1.11, 2.73: codes 2, 2, 1, 3
#     levels: bin 2 0.40625, bin 1 -4.59375, bin 3 3.78125: decoded 3.125, 3.125, -1.875, 6.5
#     residual [[-0.125, -1, 0.5, 0], [-0.25, 0.125, -0.75, 0]]
#   mean [[2.4375, 0.875, -2.875, -0.9375], [0, 1.5625, 0, 5.6875]]
#   θ = θ − 0.5 · mean = [[-3.21875, -1.9375, 1.1875, 1.46875], [-1, 0.21875, 1, -3.84375]]
THETA_1 = torch.tensor([[-2.0, -1.5, -0.25, 1.0], [-1.0, 1.0, 1.0, -1.0]])
THETA_2 = torch.tensor([[-3.21875, -1.9375, 1.1875, 1.46875], [-1.0, 0.21875, 1.0, -3.84375]])
RESIDUAL_2 = [torch.tensor([[-0.75, 0.75, 0.0, 0.5], [-0.75, 0.25, 3.0, 0.0]]),
              torch.tensor([[-0.125, -1.0, 0.5, 0.0], [-0.25, 0.125, -0.75, 0.0]])]
PAYLOAD_BYTES = 4 * (1 + 4) + 4 + 1  # shift and 4 levels (fp32), 4 uint8 positions, 4 codes of 2 bits in a byte


def test_two_ranks_two_syncs_follow_the_worked_example():
    def fn(comm):
        model = _Matrix()
        method = SparseLoCo(model, None, comm, period=2, chunk=2, k=2, beta=0.5, outer_lr=0.5)
        thetas = []
        for sync in range(2):
            for local in range(2):  # a round of two inner steps: only where it ends counts
                with torch.no_grad():
                    model.w.copy_(method.outer_params[0] - (DELTA[sync][comm.rank] if local else 3.0))
                method.after_backward()
                method.after_step()
            thetas.append(model.w.detach().clone())
        residual = method.fragments[0].agg.feedback.residuals["model"].view(2, 4).clone()
        return thetas, residual, comm.meter.bytes_sent

    for rank, (thetas, residual, sent) in enumerate(LocalWorld(2).run(fn)):
        assert torch.equal(thetas[0], THETA_1) and torch.equal(thetas[1], THETA_2)
        assert torch.equal(residual, RESIDUAL_2[rank])
        assert sent == 2 * PAYLOAD_BYTES  # two all_gathers of one payload on two ranks: (2 − 1) each


def test_one_encoded_payload_by_hand():
    """The first sync's payload of rank 1: its statistics, positions and packed codes."""
    codec = ChunkedTopK(ChunkedTopKConfig(chunk=2, k=2, bits=2), [(2, 4)])
    stats, positions, codes = codec.encode(DELTA[0][1].reshape(-1)).tensors
    assert torch.equal(stats, torch.tensor([[3.75, 0.0, -2.75, 0.25, 2.25]]))  # shift, levels of codes 0..3
    assert positions.dtype == torch.uint8 and positions.tolist() == [1, 2, 0, 3]
    assert codes.tolist() == [0b11_10_01_10]  # codes 3, 2, 1, 2, the first in the top bits
    assert torch.equal(codec.decode(codec.encode(DELTA[0][1].reshape(-1))).view(2, 4),
                       torch.tensor([[0.0, 6.0, 1.0, 0.0], [4.0, 0.0, 0.0, 4.0]]))


# -- an independent reference on a small net ------------------------------------------------
def _side(n: int, chunk: int) -> int:
    return min(chunk, 1 << max(0, n - 1).bit_length())


def _reference_decoded(e: torch.Tensor, shapes, chunk: int, k: int, bits: int, sigmas: float) -> torch.Tensor:
    """What one rank sends, decoded, for its buffer ``e``: entry by entry, block by block."""
    out = torch.zeros_like(e)
    offset = 0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 1
        cols = numel // rows
        b1, b2 = (_side(rows, chunk) if rows > 1 else 1), _side(cols, chunk)
        kept_per_block = min(k, b1 * b2)
        chosen = []  # flat indices in the tensor
        for top in range(0, rows, b1):
            for left in range(0, cols, b2):
                block = [r * cols + c for r in range(top, min(top + b1, rows))
                         for c in range(left, min(left + b2, cols))]
                block.sort(key=lambda i: -abs(float(e[offset + i])))
                chosen += block[:kept_per_block]
        v = [float(e[offset + i]) for i in chosen]
        if bits == 32:
            for i, x in zip(chosen, v):
                out[offset + i] = x
        else:
            levels = 1 << bits
            shift = sum(v) / len(v)
            c = [x - shift for x in v]
            std = math.sqrt(sum(x * x for x in c) / (len(c) - 1)) if len(c) > 1 else 0.0
            width = sigmas * std / levels or 1.0
            codes = [min(levels - 1, max(0, round(x / width + levels // 2))) for x in c]
            table = {q: sum(x for x, b in zip(c, codes) if b == q) / codes.count(q) for q in set(codes)}
            for i, q in zip(chosen, codes):
                out[offset + i] = torch.tensor(table[q], dtype=torch.float32) + torch.tensor(shift, dtype=torch.float32)
        offset += numel
    return out


def _reference(n: int, steps: int, period: int, *, chunk: int, k: int, bits: int, beta: float, lr: float,
               sigmas: float = 6.0) -> torch.Tensor:
    """The paper's update by hand on ``n`` copies of the net (inner SGD with momentum 0.5,
    its state kept): every ``period`` steps e_i = β e_i + (θ − θ_i), every rank's decoded
    payload, θ ← θ − lr · their mean, every model set to θ."""
    import copy

    models = [copy.deepcopy(BASE) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in models]
    shapes = [tuple(p.shape) for p in BASE.parameters()]
    theta = tiny.flat(models[0]).clone()
    errors = [torch.zeros_like(theta) for _ in range(n)]
    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            tiny.backward(m, o, r, step)
            o.step()
        if (step + 1) % period == 0:
            sent = []
            for r, m in enumerate(models):
                errors[r] = errors[r] * beta + (theta - tiny.flat(m))
                sent.append(_reference_decoded(errors[r], shapes, chunk, k, bits, sigmas))
                errors[r] = errors[r] - sent[-1]
            theta = theta - lr * (sum(sent) / n)
            for m in models:
                torch.nn.utils.vector_to_parameters(theta.clone(), m.parameters())
    return theta


@pytest.mark.parametrize("chunk, k, bits", [(4, 3, 2), (4, 5, 4), (2, 1, 1), (8, 64, 32)])
def test_a_small_net_follows_an_independent_reference(chunk, k, bits):
    """tiny.net(5, 8, 3): an 8 × 5 matrix (blocks padded to 4 × 4 or 8 × 8), two vectors
    (one padded) and a 3 × 8 matrix; three rounds of three inner steps on two ranks."""
    make = lambda m, o, c: SparseLoCo(m, o, c, period=3, chunk=chunk, k=k, bits=bits, beta=0.9, outer_lr=0.8)  # noqa: E731
    got = LocalWorld(2).run(lambda comm: tiny.train(comm, make, 9, BASE)[0])
    assert torch.equal(got[0], got[1])
    want = _reference(2, 9, 3, chunk=chunk, k=k, bits=bits, beta=0.9, lr=0.8)
    assert torch.allclose(got[0], want, atol=1e-6, rtol=0)


def test_every_entry_at_fp32_with_no_decay_and_lr_one_is_local_sgd():
    """k = a whole block, fp32 values, β = 0, α = 1: θ − mean(θ − θ_i), local SGD up to rounding."""
    make = lambda m, o, c: SparseLoCo(m, o, c, period=3, chunk=8, k=64, bits=32, beta=0.0, outer_lr=1.0)  # noqa: E731
    mine = LocalWorld(2).run(lambda comm: tiny.train(comm, make, 10, BASE)[0])
    local = LocalWorld(2).run(lambda comm: tiny.train(
        comm, lambda m, o, c: LocalSGD(m, o, c, LocalSGDConfig(period=3)), 10, BASE)[0])
    for a, b in zip(mine, local):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


# -- the wire -------------------------------------------------------------------------------
def test_bytes_per_sync_are_the_layouts():
    """tiny.net(5, 8, 3) with chunk=4, k=3, 2 bits: the 8 × 5 weight in 4 blocks of 4 × 4, the
    bias of 8 in 2 runs of 4, the 3 × 8 weight in 2 blocks of 4 × 4 (one padded row), the bias
    of 3 in one run of 4 (one padded entry): 4·3 + 2·3 + 2·3 + 1·3 = 27 kept entries, each a
    uint8 position and a 2-bit code, and per tensor a shift and 4 levels in fp32."""
    kept = 4 * 3 + 2 * 3 + 2 * 3 + 1 * 3
    payload = 4 * 4 * (1 + 4) + kept + math.ceil(2 * kept / 8)
    for n in (2, 3):
        def fn(comm):
            method = tiny.train(comm, lambda m, o, c: SparseLoCo(m, o, c, period=2, chunk=4, k=3), 4, BASE)[1]
            return comm.meter.bytes_sent, method.wire_bytes(), method.report()

        for sent, wire, report in LocalWorld(n).run(fn):
            assert wire == payload == 114
            assert sent == 2 * (n - 1) * payload  # two syncs, each an all_gather of one payload
            assert report["payload_bytes_per_sync"] == payload and report["peak_bytes_per_sync"] == (n - 1) * payload


@pytest.mark.parametrize("chunk, dtype", [(16, torch.uint8), (32, torch.int16), (256, torch.int32)])
def test_positions_take_the_smallest_integer_type_a_block_needs(chunk, dtype):
    codec = ChunkedTopK(ChunkedTopKConfig(chunk=chunk, k=10, bits=2), [(256, 256)])
    blocks = (256 // chunk) ** 2
    spec = codec.wire_spec(torch.Size([256 * 256]), torch.float32)
    assert spec == [((1, 5), torch.float32), ((blocks * 10,), dtype), ((math.ceil(blocks * 10 * 2 / 8),), torch.uint8)]
    nbytes = 20 + blocks * 10 * dtype.itemsize + math.ceil(blocks * 10 / 4)
    assert codec.nbytes(torch.Size([256 * 256]), torch.float32) == nbytes


def test_blocks_kept_whole_send_no_positions_and_vectors_of_two_sizes_share_one_type():
    codec = ChunkedTopK(ChunkedTopKConfig(chunk=64, k=64, bits=2), [(128, 64), (64,), (10,)])
    spec = codec.wire_spec(torch.Size([128 * 64 + 64 + 10]), torch.float32)
    # the matrix: 2 blocks of 4096 keep 64 each (int16 positions); the vectors travel whole
    # (a run of 64, and one of 16 with 6 entries of padding: positions implied)
    codes = math.ceil((128 + 64 + 16) * 2 / 8)
    assert spec == [((3, 5), torch.float32), ((128,), torch.int16), ((codes,), torch.uint8)]


def test_a_malformed_payload_is_refused():
    codec = ChunkedTopK(ChunkedTopKConfig(chunk=2, k=2, bits=2), [(2, 4)])
    payload = codec.encode(DELTA[0][1].reshape(-1))
    stats, positions, codes = payload.tensors
    with pytest.raises(PayloadError, match="positions must lie in"):
        codec.decode(payload.with_tensors((stats, torch.tensor([1, 4, 0, 3], dtype=torch.uint8), codes)))
    with pytest.raises(PayloadError, match="ascend"):
        codec.decode(payload.with_tensors((stats, torch.tensor([2, 1, 0, 3], dtype=torch.uint8), codes)))


# -- agreement, finish, resume ---------------------------------------------------------------
def test_ranks_agree_after_every_sync_and_after_finish():
    def fn(comm):
        flat, method = tiny.train(comm, lambda m, o, c: SparseLoCo(m, o, c, period=3, chunk=4, k=3), 9, BASE_BN)
        at_sync = flat.clone()  # step 9 ended a round
        flat_end, method = tiny.train(comm, lambda m, o, c: SparseLoCo(m, o, c, period=3, chunk=4, k=3), 11, BASE_BN,
                                      finish=True)
        return at_sync, flat_end, method.report()

    (a0, e0, r0), (a1, e1, r1) = LocalWorld(2).run(fn)
    assert torch.equal(a0, a1)  # parameters and BatchNorm statistics
    assert torch.equal(e0, e1)  # two local steps after the last sync, then finish()'s sync
    assert r0["syncs_before_finish"] == 3 and r0["outer_steps"] == 4


def test_without_final_sync_each_rank_keeps_its_own_steps():
    make = lambda m, o, c: SparseLoCo(m, o, c, period=3, final_sync=False)  # noqa: E731
    a, b = LocalWorld(2).run(lambda comm: tiny.train(comm, make, 5, BASE, finish=True)[0])
    assert not torch.equal(a, b)


@pytest.mark.parametrize("cut", [2, 3, 4, 7])
@pytest.mark.parametrize("warmup", [0, 2])
def test_resume_mid_period_and_right_after_a_sync_continues_exactly(cut, warmup):
    make = lambda m, o, c: SparseLoCo(m, o, c, period=3, warmup=warmup, chunk=4, k=3)  # noqa: E731
    resumed = LocalWorld(2).run(lambda comm: tiny.train(comm, make, 11, BASE_BN, cut=cut, finish=True)[0])
    straight = LocalWorld(2).run(lambda comm: tiny.train(comm, make, 11, BASE_BN, finish=True)[0])
    assert all(torch.equal(a, b) for a, b in zip(resumed, straight))


def test_the_error_buffer_is_in_the_state():
    make = lambda m, o, c: SparseLoCo(m, o, c, period=2, chunk=4, k=3)  # noqa: E731

    def fn(comm):
        method = tiny.train(comm, make, 4, BASE)[1]
        state = method.state_dict()
        return state["fragments"][0]["agg"]["feedback"]["model"], method.fragments[0].agg.feedback.residuals["model"]

    for saved, live in LocalWorld(2).run(fn):
        assert torch.equal(saved, live) and saved.abs().sum() > 0


# -- knobs, spec, trainer ---------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    ("sparseloco:period=0", "period must be >= 1, got 0"),
    ("sparseloco:warmup=-1", "warmup must be >= 0, got -1"),
    ("sparseloco:beta=1", r"beta must be in \[0, 1\), got 1.0"),
    ("sparseloco:beta=-0.1", r"beta must be in \[0, 1\), got -0.1"),
    ("sparseloco:chunk=0", "chunk must be in 1..1024, got 0"),
    ("sparseloco:chunk=2048", "chunk must be in 1..1024, got 2048"),
    ("sparseloco:chunk=4,k=17", r"k must be in 1..16 \(a 4 x 4 block's entries\), got 17"),
    ("sparseloco:k=0", "k must be in 1..4096"),
    ("sparseloco:bits=9", "bits must be in 1..8 or 32, got 9"),
    ("sparseloco:sigmas=0", "sigmas must be > 0, got 0.0"),
    ("sparseloco:outer_lr=0", "outer_lr must be > 0, got 0.0"),
    ("sparseloco:momentum=0.9", "momentum"),
])
def test_bad_knobs_name_the_rule(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_method(spec)


def test_the_spec_fills_every_default():
    assert resolve_method("sparseloco") == ("sparseloco:period=15,warmup=0,beta=0.95,chunk=64,k=64,bits=2,"
                                            "sigmas=6.0,outer_lr=1.0,final_sync=true,sync=blocking")
    cfg = SparseLoCoConfig()
    assert (cfg.codec, cfg.average_momentum) == ("identity", False)  # fixed by the method, not knobs


def test_nodes_are_refused():
    from thinwire.algorithms.methods import flat_only

    assert "cut" in (flat_only("sparseloco") or "")


@pytest.mark.spawns
def test_the_trainer_runs_it_and_meters_the_layout():
    from thinwire.run.config import TrainConfig
    from thinwire.run.trainer import train_rank

    cfg = TrainConfig(task="synthetic", method="sparseloco:period=3,chunk=8,k=8", workers=2, steps=7, eval_every=7,
                      batch_size=8,
                      task_options={"dim": 8, "hidden": 16, "classes": 2, "samples": 64, "test_samples": 16}).resolve()
    summaries = LocalWorld(2).run(lambda comm: train_rank(cfg, comm))
    report = summaries[0].method_report
    assert report["syncs_before_finish"] == 2 and report["outer_steps"] == 3  # steps 3, 6, then finish()
    assert summaries[0].bytes_sent_per_worker == 3 * report["payload_bytes_per_sync"]
    assert summaries[0].warnings == []


@pytest.mark.parametrize("shapes", [[(1, 64)], [(64,)], [(4, 64)], [(3, 100), (7,)]])  # views of the input among them
def test_encoding_leaves_the_pseudo_gradient_as_it_was(shapes):
    """The block magnitudes are taken in place only on a copy: where the cut into blocks is a
    view of the input (one row of blocks a whole tensor wide), the input is left alone."""
    codec = ChunkedTopK(ChunkedTopKConfig(chunk=64, k=8), shapes)
    x = torch.randn(codec.numel, generator=torch.Generator().manual_seed(0))
    before = x.clone()
    codec.encode(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("bits", [2, 32])
@pytest.mark.parametrize("shapes", [[(128, 128)], [(3, 100), (7,), (64, 130)], [(5,), (9, 9)]])  # whole, padded, small
def test_decode_sub_is_the_dense_subtraction_bit_for_bit(shapes, bits):
    """The error buffer's update subtracts the kept entries alone: the same bits as
    ``out - decode(payload)``, padded tilings and blocks sent whole included."""
    codec = ChunkedTopK(ChunkedTopKConfig(chunk=64, k=8, bits=bits), shapes)
    g = torch.Generator().manual_seed(3)
    payload = codec.encode(torch.randn(codec.numel, generator=g))
    out = torch.randn(codec.numel, generator=g)
    expected = out - codec.decode(payload)
    codec.decode_sub(payload, out)
    assert torch.equal(out, expected)

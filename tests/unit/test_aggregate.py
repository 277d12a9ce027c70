"""The aggregator against the in-process communicator: means, EF, buckets, bytes, state."""

import ast
import math
import pathlib

import pytest
import torch

from thinwire.aggregate import Aggregator
from thinwire.codecs.base import Codec
from thinwire.codecs.specs import available, build_codec
from thinwire.comm.local import LocalWorld
from thinwire.comm.meter import sent_bytes
from thinwire.payload import Aggregation

SHAPES = {"conv.weight": (16, 8, 3), "conv.bias": (16,), "fc.weight": (40, 64), "fc.bias": (40,), "out.weight": (5, 40)}


def _named() -> list[tuple[str, torch.Tensor]]:
    return [(k, torch.zeros(s)) for k, s in SHAPES.items()]


def _grads(rank: int, step: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _run(spec: str, n: int, steps: int = 1, bucket_mb: float = 25.0):
    def fn(comm):
        codec = build_codec(spec)
        agg = Aggregator(_named(), lambda name, t: codec, comm, bucket_mb=bucket_mb)
        outs = []
        for step in range(steps):
            g = _grads(comm.rank, step)
            agg.reduce_(g)
            outs.append(g)
        return outs, agg, comm.meter

    return LocalWorld(n).run(fn)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_identity_is_the_exact_mean(n):
    results = _run("identity", n)
    for name in SHAPES:
        # the aggregator divides each contribution by n before summing in rank order
        ref = sum(_grads(r)[name] / n for r in range(n))
        for outs, _, _ in results:
            assert torch.equal(outs[0][name], ref)


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "signsgd", "qsgd", "terngrad", "randomk:ratio=0.2", "bf16",
                                  "twobit", "twobit:stat=max", "kernels:min_numel=100",
                                  "kernels:granularity=filter,min_numel=100"])
def test_compressed_mean_is_the_mean_of_each_ranks_decode(spec):
    n = 3

    def fn(comm):
        codec = build_codec(spec)
        agg = Aggregator(_named(), lambda name, t: codec, comm)
        g = _grads(comm.rank)
        own = {}
        for name, x in g.items():  # this rank's own decode, as the aggregator computes it
            c = codec if codec.compresses(x.shape) else build_codec("identity")
            c.rank, c.step = comm.rank, 0
            own[name] = c.decode(c.encode(x, key=name))
        agg.reduce_(g)
        return g, own

    results = LocalWorld(n).run(fn)
    for name in SHAPES:
        ref = sum(own[name] for _, own in results) / n
        for out, _ in results:
            # SUM codecs divide in the wire dtype before the sum; tolerance covers bf16 rounding
            torch.testing.assert_close(out[name], ref, rtol=0, atol=2e-2 if "bf16" in spec else 1e-6)


def test_error_feedback_keeps_what_was_not_sent():
    def fn(comm):
        codec = build_codec("topk:ratio=0.05")
        agg = Aggregator(_named(), lambda name, t: codec, comm)
        g = _grads(comm.rank)
        sent = {k: v.clone() for k, v in g.items()}
        agg.reduce_(sent)
        return g, agg.feedback.residuals

    (g, residuals), = LocalWorld(1).run(fn)
    for name, x in g.items():
        if len(x.shape) >= 2 and x.numel() >= 1024:
            r = residuals[name]
            k = math.ceil(0.05 * x.numel())
            assert int((r == 0).sum()) == k  # exactly the k sent entries left the residual
            kept = x.abs().reshape(-1).topk(k).indices
            assert torch.equal(r.reshape(-1)[kept], torch.zeros(k))
        else:
            assert name not in residuals  # small and 1-D tensors travel as fp32, no EF


@pytest.mark.parametrize("spec", ["identity", "bf16", "topk:ratio=0.01", "powersgd:rank=2", "qsgd", "signsgd",
                                  "fft:min_numel=100", "fft:min_numel=100,bucket_mb=1"])
@pytest.mark.parametrize("n", [2, 4])
def test_meter_counts_the_declared_wire_bytes(spec, n):
    results = _run(spec, n, bucket_mb=0.004)  # small buckets: several collectives
    for _, agg, meter in results:
        per_op = {}
        assert sum(row["wire_bytes"] for row in agg.plan()) == sum(
            b.codec.nbytes(torch.Size([b.numel]) if b.fused else s.shape, torch.float32)
            for b in agg.buckets for s in (b.slots[:1] if b.fused else b.slots))
        for b in agg.buckets:
            op = "all_reduce" if b.codec.aggregation is Aggregation.SUM else "all_gather"
            for r in range(b.codec.rounds):
                shapes = [torch.Size([b.numel])] if b.fused else [s.shape for s in b.slots]
                nbytes = sum(_spec_bytes(b.codec, shape, r) for shape in shapes)
                per_op[op] = per_op.get(op, 0) + sent_bytes(op, nbytes, n)
        assert meter.bytes_sent == pytest.approx(sum(per_op.values()), rel=1e-12)
        assert {op: c.bytes for op, c in meter.ops.items()} == pytest.approx(per_op)


def _spec_bytes(codec: Codec, shape, r) -> int:
    from thinwire.payload import spec_nbytes

    return spec_nbytes(codec.wire_spec(torch.Size(shape), torch.float32, r))


def test_small_buckets_give_one_collective_per_bucket_and_round():
    results = _run("powersgd:rank=1", 2, bucket_mb=0.004)
    _, agg, meter = results[0]
    expected = sum(b.codec.rounds for b in agg.buckets)
    assert sum(c.calls for c in meter.ops.values()) == expected
    assert len(agg.buckets) >= 3


def test_declined_tensors_travel_as_fp32():
    _, agg, _ = _run("topk:ratio=0.01", 1)[0]
    codecs = {row["name"]: row["codec"] for row in agg.plan()}
    assert codecs["conv.bias"].startswith("identity") and codecs["fc.bias"].startswith("identity")
    assert codecs["fc.weight"].startswith("topk")


class _IntSum(Codec):
    name, aggregation = "intsum", Aggregation.SUM
    Config = type(build_codec("identity").config)

    def wire_spec(self, shape, dtype, round=0):
        return [((4,), torch.int32)]


def test_refuses_a_sum_codec_with_integer_wire_tensors():
    codec = _IntSum(_IntSum.Config())
    with pytest.raises(ValueError, match="SUM.*int32"):
        LocalWorld(1).run(lambda comm: Aggregator(_named(), lambda n, t: codec, comm))


def test_state_dict_resumes_exactly():
    spec = "powersgd:rank=2"

    def fn(comm):
        codec = build_codec(spec)
        agg = Aggregator(_named(), lambda n, t: codec, comm)
        for step in range(3):
            agg.reduce_(_grads(comm.rank, step))
        state = agg.state_dict()
        tail = []
        for step in range(3, 5):
            g = _grads(comm.rank, step)
            agg.reduce_(g)
            tail.append(g)
        fresh_codec = build_codec(spec)
        fresh = Aggregator(_named(), lambda n, t: fresh_codec, comm)
        fresh.load_state_dict(state)
        again = []
        for step in range(3, 5):
            g = _grads(comm.rank, step)
            fresh.reduce_(g)
            again.append(g)
        return tail, again

    for tail, again in LocalWorld(2).run(fn):
        for a, b in zip(tail, again):
            for name in SHAPES:
                assert torch.equal(a[name], b[name])


def test_codecs_never_import_torch_distributed():
    root = pathlib.Path(__file__).resolve().parents[2] / "src" / "thinwire"
    for folder in ("codecs", "numerics"):
        for path in (root / folder).glob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                    names += [f"{node.module}.{a.name}" for a in node.names]
                for name in names:
                    assert not name.startswith("torch.distributed"), f"{path.name} imports {name}"
                    assert not name.startswith("thinwire.comm"), f"{path.name} imports {name}"


def test_every_codec_decodes_from_wire_tensors_alone():
    # GATHER payloads cross the wire as bytes: decode must not rely on local metadata
    x = torch.randn(64, 48)
    for name, cls in available().items():
        codec = cls(cls.Config())
        if codec.aggregation is not Aggregation.GATHER:
            continue
        p = codec.encode(x, key="w")
        bare = type(p)(tuple(t.clone() for t in p.tensors), p.shape, p.dtype)
        assert torch.equal(codec.decode(bare), codec.decode(p)), name


@pytest.mark.parametrize(
    "spec", ["topk:ratio=0.05", "signsgd", "randomk:ratio=0.1", "powersgd:rank=2", "identity:ef=true", "bf16:ef=true"]
)
def test_in_place_error_feedback_equals_the_reference_formula(spec):
    """The aggregator's allocation-free EF (residual buffer reused as u) equals the textbook
    u = g + r, r = u - decode(own payload), computed separately, over several steps."""
    from thinwire.feedback import ErrorFeedback

    named = [("w", torch.zeros(48, 40))]

    def fn(comm):
        codec, ref_codec = build_codec(spec), build_codec(spec)
        agg = Aggregator(named, lambda n, t: codec, comm)
        r = torch.zeros(48, 40)
        ref = ErrorFeedback()
        for step in range(4):
            g = torch.randn(48, 40, generator=torch.Generator().manual_seed(step))
            ref_codec.step = step
            u = g + r
            p = ref_codec.encode(u, key="w")
            for _ in range(1, ref_codec.rounds):
                p = ref_codec.encode_next(p, key="w")
            ref_codec.update("w", p)
            r = u - ref_codec.decode(p)
            agg.reduce_({"w": g.clone()})
            torch.testing.assert_close(agg.feedback.residuals["w"], r, rtol=0, atol=1e-6)
        del ref
        return True

    assert LocalWorld(1).run(fn) == [True]


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "randomk:ratio=0.1", "qsgd", "signsgd"])
def test_state_dict_survives_a_file_round_trip(spec, tmp_path):
    def fn(comm):
        codec = build_codec(spec)
        agg = Aggregator(_named(), lambda n, t: codec, comm)
        for step in range(2):
            agg.reduce_(_grads(comm.rank, step))
        path = tmp_path / f"agg{comm.rank}.pt"
        torch.save(agg.state_dict(), path)
        g1 = _grads(comm.rank, 2)
        agg.reduce_(g1)
        fresh_codec = build_codec(spec)
        fresh = Aggregator(_named(), lambda n, t: fresh_codec, comm)
        fresh.load_state_dict(torch.load(path, weights_only=True, map_location="cpu"))
        g2 = _grads(comm.rank, 2)
        fresh.reduce_(g2)
        return all(torch.equal(g1[k], g2[k]) for k in SHAPES)

    assert LocalWorld(2).run(fn) == [True, True]


def test_load_refuses_state_from_other_codecs():
    def fn(comm):
        a = Aggregator(_named(), lambda n, t: build_codec("topk:ratio=0.1"), comm)
        b = Aggregator(_named(), lambda n, t: build_codec("topk:ratio=0.2"), comm)
        with pytest.raises(ValueError, match="saved with codecs"):
            b.load_state_dict(a.state_dict())
        return True

    assert LocalWorld(1).run(fn) == [True]


@pytest.mark.spawns
def test_registry_loads_safely_from_many_threads():
    import subprocess
    import sys

    code = (
        "from thinwire.comm.local import LocalWorld\n"
        "from thinwire.codecs.specs import build_codec\n"
        "print(LocalWorld(4).run(lambda c: build_codec('terngrad').name))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(["terngrad"] * 4)


@pytest.mark.parametrize("spec", ["bf16", "fp16", "bf16:ef=true", "fp16:min_numel=100"])
def test_casts_encode_into_kept_buffers_with_the_same_means_and_residuals(spec):
    """A cast's wire is written into the bucket's kept buffer (no fresh allocation a step),
    the memory unchanged from step to step, and every mean and residual bit for bit what a
    fresh tensor each step (the codec's plain ``encode``) gives."""
    n, steps = 2, 3

    def fn(comm, kept):
        codec = build_codec(spec)
        if not kept:  # the reference: a fresh wire tensor every step
            codec.encode_into = lambda x, buffer, key="": codec.encode(x, key=key)
        agg = Aggregator(_named(), lambda name, t: codec, comm)
        outs, ptrs = [], []
        for step in range(steps):
            g = _grads(comm.rank, step)
            agg.reduce_(g)
            outs.append(g)
            ptrs.append({k: v.data_ptr() for b in agg.buckets for k, v in b.buffers.items() if k.startswith("wire:")})
        residuals = {k: r.clone() for k, r in agg.feedback.residuals.items()}
        return outs, ptrs, residuals

    got = LocalWorld(n).run(lambda comm: fn(comm, True))
    ref = LocalWorld(n).run(lambda comm: fn(comm, False))
    for (outs, ptrs, res), (ref_outs, ref_ptrs, ref_res) in zip(got, ref):
        for out, want in zip(outs, ref_outs):
            for name in SHAPES:
                assert torch.equal(out[name], want[name]), name
        assert res.keys() == ref_res.keys() and all(torch.equal(res[k], ref_res[k]) for k in res)
        assert ptrs[0] and ptrs[0] == ptrs[-1]  # kept: the same memory every step
        assert not ref_ptrs[0]  # the reference allocated its wires afresh

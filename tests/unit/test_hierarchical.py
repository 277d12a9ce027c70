"""Two-level averaging against the in-process communicator: exact against flat with identity,
every codec's stage between nodes equal to that codec's flat average of the node means,
shards that cover every tensor once, per-shard residuals that resume exactly, and the
meter's two links."""

import pytest
import torch

from thinwire.codecs.specs import build_codec
from thinwire.comm.layout import NodeLayout, layout_for
from thinwire.comm.local import LocalWorld
from thinwire.comm.meter import sent_bytes
from thinwire.comm.nodes import build_hierarchy
from thinwire.hierarchical import HierarchicalAggregator, build_aggregator, shard

# a conv kernel, matrices, odd sizes (element pieces of unequal length) and 1-D tensors (fp32)
SHAPES = {"conv.weight": (16, 8, 3, 3), "conv.bias": (16,), "fc.weight": (41, 63), "fc.bias": (41,),
          "out.weight": (5, 41), "tiny": (1,)}
CODECS = ["identity", "bf16", "topk:ratio=0.1", "qsgd", "signsgd", "terngrad", "randomk:ratio=0.2", "twobit",
          "rangefloat", "powersgd:rank=2,min_numel=16", "dct:chunk=8,topk=4", "fft", "kernels:min_numel=100"]


def _named() -> list[tuple[str, torch.Tensor]]:
    return [(k, torch.zeros(s)) for k, s in SHAPES.items()]


def _grads(rank: int, step: int = 0, integer: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if integer:  # multiples of 6: every division by 2, 3 or 6 and every sum below is exact in fp32
        return {k: 6.0 * torch.randint(-1000, 1000, s, generator=g).float() for k, s in SHAPES.items()}
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _world(comm, ranks_per_node):
    build_hierarchy(comm, NodeLayout(comm.world_size, ranks_per_node))
    return comm


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 3), (3, 2)])
def test_identity_equals_flat_exactly(nodes, per_node):
    n = nodes * per_node

    def fn(comm):
        flat_g, hier_g = _grads(comm.rank, integer=True), _grads(comm.rank, integer=True)
        build_aggregator(_named(), lambda _n, _t: build_codec("identity"), comm).reduce_(flat_g)
        _world(comm, per_node)
        agg = build_aggregator(_named(), lambda _n, _t: build_codec("identity"), comm)
        assert isinstance(agg, HierarchicalAggregator)
        agg.reduce_(hier_g)
        return flat_g, hier_g

    for flat_g, hier_g in LocalWorld(n).run(fn):
        for name in SHAPES:
            ref = sum(_grads(r, integer=True)[name] for r in range(n)) / n
            assert torch.equal(flat_g[name], ref) and torch.equal(hier_g[name], ref), name


def _node_means(nodes: int, per_node: int, step: int) -> list[dict[str, torch.Tensor]]:
    """Each node's mean, summed in local-rank order after dividing by the ranks per node (the
    in-process reduce_scatter's order): what stage 1 must give, bit for bit."""
    out = []
    for k in range(nodes):
        g = [_grads(k * per_node + r, step) for r in range(per_node)]
        out.append({name: sum((x[name] / per_node for x in g[1:]), g[0][name] / per_node) for name in SHAPES})
    return out


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 3)])
def test_each_codec_averages_the_node_means_between_nodes(spec, nodes, per_node):
    """Stage 1 is lossless and stage 3 hands every rank of a node the same bits: every rank's
    result equals, bit for bit, the codec's flat average over the nodes of the exact node
    means, piece by piece (two steps, so error feedback and codec state are in play)."""
    steps = 2

    def hier(comm):
        _world(comm, per_node)
        codecs = {}
        agg = build_aggregator(_named(), lambda name, _t: codecs.setdefault("c", build_codec(spec)), comm)
        outs = []
        for step in range(steps):
            g = _grads(comm.rank, step)
            agg.reduce_(g)
            outs.append(g)
        return outs, agg

    results = LocalWorld(nodes * per_node).run(hier)
    agg0 = results[0][1]
    for r, (outs, _) in enumerate(results):  # the same bits on every rank of the world
        for step in range(steps):
            for name in SHAPES:
                assert torch.equal(outs[step][name], results[0][0][step][name]), (r, step, name)

    means = [_node_means(nodes, per_node, step) for step in range(steps)]
    for b, st in zip(agg0.buckets, agg0.stages):
        for local, pieces in enumerate(st.shards):
            if not pieces:
                continue

            def flat(comm, pieces=pieces, codec_spec=spec, bucket=b):
                codec = build_codec(codec_spec) if not bucket.codec.is_identity else bucket.codec
                ref = build_aggregator([(p.name, torch.zeros(p.shape)) for p in pieces], lambda _n, _t: codec, comm,
                                 as_given=True)
                outs = []
                for step in range(steps):
                    x = {p.name: means[step][comm.rank][p.name].reshape(-1)[p.start : p.start + p.numel]
                         .clone().view(p.shape) for p in pieces}
                    ref.reduce_(x)
                    outs.append(x)
                return outs

            ref_outs = LocalWorld(nodes).run(flat)[0]
            for step in range(steps):
                for p in pieces:
                    got = results[0][0][step][p.name].reshape(-1)[p.start : p.start + p.numel]
                    assert torch.equal(got, ref_outs[step][p.name].reshape(-1)), (spec, local, p.name, step)


def test_one_node_averages_without_the_codec():
    def fn(comm):
        _world(comm, 3)
        g = _grads(comm.rank)
        build_aggregator(_named(), lambda _n, _t: build_codec("topk:ratio=0.01"), comm).reduce_(g)
        return g, comm.meter.link_bytes("inter")

    ref = _node_means(1, 3, 0)[0]
    for g, inter in LocalWorld(3).run(fn):
        assert inter == 0
        for name in SHAPES:
            assert torch.equal(g[name], ref[name])


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
def test_shards_cover_every_tensor_once(ranks):
    slots = [(k, torch.Size(s)) for k, s in SHAPES.items()] + [("big", torch.Size([300, 7]))]
    by_element = shard(slots, ranks, by_element=True)
    for name, shape in slots:
        covered = torch.zeros(shape.numel(), dtype=torch.int64)
        for pieces in by_element:
            for p in pieces:
                if p.name == name:
                    covered[p.start : p.start + p.numel] += 1
        assert torch.equal(covered, torch.ones_like(covered)), name
    sizes = [sum(p.numel for p in pieces) for pieces in by_element]
    assert max(sizes) - min(sizes) <= len(slots)  # at most one element more per tensor

    whole = shard(slots, ranks, by_element=False)
    owners = [p.name for pieces in whole for p in pieces]
    assert sorted(owners) == sorted(name for name, _ in slots)  # each tensor once, whole
    assert all(p.start == 0 and p.numel == torch.Size(p.shape).numel() for pieces in whole for p in pieces)
    loads = [sum(p.numel for p in pieces) for pieces in whole]
    assert max(loads) - min(loads) <= max(s.numel() for _, s in slots)  # greedy, largest first
    for pieces in whole + by_element:  # segments: pieces back to back from 0
        offsets = [p.offset for p in pieces]
        assert offsets == [sum(q.numel for q in pieces[:i]) for i in range(len(pieces))]


def test_residuals_are_per_parameter_and_resume_exactly():
    def fn(comm):
        _world(comm, 2)
        make = lambda: build_aggregator(_named(), lambda _n, _t: build_codec("topk:ratio=0.05"), comm)  # noqa: E731
        agg = make()
        for step in range(2):
            agg.reduce_(_grads(comm.rank, step))
        state = agg.state_dict()
        cont = _grads(comm.rank, 2)
        agg.reduce_(cont)
        again = make()
        again.load_state_dict(state)
        resumed = _grads(comm.rank, 2)
        again.reduce_(resumed)
        return cont, resumed, agg.feedback.residuals, state, agg, comm.rank % 2

    for cont, resumed, residuals, state, agg, local in LocalWorld(4).run(fn):
        for name in SHAPES:
            assert torch.equal(cont[name], resumed[name]), name
        assert state["nodes"] == [2, 2]
        # one residual per compressed parameter, shaped as this local rank's piece of it
        pieces = {p.name: p for b, st in zip(agg.buckets, agg.stages) if not b.codec.is_identity
                  for p in st.shards[local]}
        assert set(residuals) == set(pieces) and len(pieces) == 2  # conv and fc weights (the rest: fp32)
        for name, p in pieces.items():
            assert tuple(residuals[name].shape) == p.shape


def test_a_hierarchical_state_does_not_load_into_a_flat_run():
    def fn(comm):
        build = lambda: build_aggregator(_named(), lambda _n, _t: build_codec("topk:ratio=0.05"), comm)  # noqa: E731
        flat = build()
        _world(comm, 2)
        hier = build()
        hier.reduce_(_grads(comm.rank))
        with pytest.raises(ValueError, match="2 node.*no nodes"):
            flat.load_state_dict(hier.state_dict())
        with pytest.raises(ValueError, match="no nodes.*2 node"):
            hier.load_state_dict(flat.state_dict())
        return True

    assert all(LocalWorld(4).run(fn))


def test_a_state_loads_only_with_the_intra_dtype_it_was_saved_with():
    from thinwire.algorithms.local_sgd import LocalSGD, LocalSGDConfig

    def fn(comm):
        build_hierarchy(comm, NodeLayout(4, 2), intra_dtype="bf16")
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        agg = build_aggregator(_named(), lambda _n, _t: build_codec("topk:ratio=0.05"), comm)
        local = LocalSGD(model, opt, comm, LocalSGDConfig(period=2, warmup=0), overlap=False)
        saved, saved_local = agg.state_dict(), local.state_dict()
        build_hierarchy(comm, NodeLayout(4, 2))  # fp32 inside the node
        fresh = build_aggregator(_named(), lambda _n, _t: build_codec("topk:ratio=0.05"), comm)
        with pytest.raises(ValueError, match="saved with --intra-dtype bf16, this run has fp32"):
            fresh.load_state_dict(saved)
        with pytest.raises(ValueError, match="saved with --intra-dtype bf16, this run has fp32"):
            LocalSGD(model, opt, comm, LocalSGDConfig(period=2, warmup=0), overlap=False).load_state_dict(saved_local)
        return True

    assert all(LocalWorld(4).run(fn))


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 2), (2, 3)])
def test_the_meter_counts_each_link(nodes, per_node):
    n = nodes * per_node
    numel = sum(torch.Size(s).numel() for s in SHAPES.values())

    def fn(comm):
        _world(comm, per_node)
        agg = build_aggregator(_named(), lambda _n, _t: build_codec("identity"), comm)
        agg.reduce_(_grads(comm.rank))
        return comm.meter, agg, comm.rank % per_node

    for meter, agg, local in LocalWorld(n).run(fn):
        (st,) = agg.stages  # identity: one fused fp32 bucket
        seg = st.segment
        intra = sent_bytes("reduce_scatter", 4 * per_node * seg, per_node) + sent_bytes("all_gather", 4 * seg, per_node)
        assert meter.link_bytes("intra") == pytest.approx(intra, rel=1e-12)
        mine = sum(p.numel for p in st.shards[local])  # the shard, not its padding, crosses nodes
        assert meter.link_bytes("inter") == pytest.approx(sent_bytes("all_reduce", 4 * mine, nodes), rel=1e-12)
        assert numel // per_node - len(SHAPES) <= mine <= seg <= numel // per_node + len(SHAPES)  # 1/L of it


def test_a_flat_ring_over_nodes_crosses_from_each_nodes_last_rank():
    def fn(comm):
        comm.nodes = NodeLayout(4, 2)
        comm.all_reduce(torch.zeros(1000))
        comm.exchange({(comm.rank + 1) % 4: torch.zeros(10)}, {(comm.rank - 1) % 4: torch.zeros(10)})
        return comm.meter

    meters = LocalWorld(4).run(fn)
    ring = sent_bytes("all_reduce", 4000, 4)
    for rank, meter in enumerate(meters):
        last = rank % 2 == 1  # its successor is on the other node
        assert meter.link_bytes("inter") == (ring + 40 if last else 0)
        assert meter.link_bytes("intra") == (0 if last else ring + 40)
        assert ("all_reduce", 4, "inter") in meter.by_group  # the slow link bounds the flat collective


def test_bad_layouts_are_refused_in_one_line():
    with pytest.raises(ValueError, match="--group-size 3 must divide the world of 4 ranks"):
        NodeLayout(4, 3)
    with pytest.raises(ValueError, match="disagrees with torchrun's layout: LOCAL_WORLD_SIZE=4"):
        layout_for(8, 2, rank=0, env={"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="auto takes the layout from torchrun"):
        layout_for(4, "auto")
    with pytest.raises(ValueError, match="not 2 consecutive ranks per node"):
        layout_for(4, "auto", rank=1, env={"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_RANK": "0"})
    assert layout_for(4, "auto", rank=3, env={"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                                               "LOCAL_RANK": "1"}) == NodeLayout(4, 2)
    assert layout_for(4, None) is None


def test_ranks_that_disagree_on_the_layout_are_refused():
    def fn(comm):
        build_hierarchy(comm, NodeLayout(4, 2 if comm.rank else 4))

    with pytest.raises(ValueError, match="ranks disagree on the node layout"):
        LocalWorld(4).run(fn)


@pytest.mark.parametrize("spec", ["identity", "topk:ratio=0.1", "powersgd:rank=2,min_numel=16"])
def test_bf16_inside_the_node_rounds_once_and_halves_the_node_bytes(spec):
    """--intra-dtype bf16: each gradient divided and rounded to bf16 once before the node's
    sum; the codec between nodes still gets fp32; every rank ends with the same bits; the
    node's collectives send half the bytes of fp32's."""

    def run(dtype):
        def fn(comm):
            build_hierarchy(comm, NodeLayout(comm.world_size, 2), intra_dtype=dtype)
            grads = _grads(comm.rank)
            agg = build_aggregator(_named(), lambda _n, _t: build_codec(spec), comm)
            agg.reduce_(grads)
            return grads, comm.meter.link_bytes("intra")

        return LocalWorld(4).run(fn)

    fp32, bf16 = run("fp32"), run("bf16")
    for name in SHAPES:
        assert all(torch.equal(g[name], bf16[0][0][name]) for g, _ in bf16), name
        assert bf16[0][0][name].dtype == torch.float32
    if spec == "identity":  # the node means of bf16-rounded halves, summed in bf16, then fp32 between nodes
        for name in SHAPES:
            node = [(_grads(2 * k)[name] / 2).bfloat16() + (_grads(2 * k + 1)[name] / 2).bfloat16() for k in (0, 1)]
            ref = (node[0].float() / 2 + node[1].float() / 2).bfloat16().float()
            assert torch.equal(bf16[0][0][name], ref), name
            exact = sum(_grads(r)[name] for r in range(4)) / 4
            torch.testing.assert_close(bf16[0][0][name], exact, rtol=2e-2, atol=2e-2)
    assert any(not torch.equal(fp32[0][0][n], bf16[0][0][n]) for n in SHAPES)  # bf16 really ran
    assert bf16[0][1] == fp32[0][1] / 2


def test_half_precision_gradients_average_in_two_levels_and_keep_their_dtype():
    """A bf16 model's gradients: divided in the node's fp32, averaged, written back as bf16
    (small multiples of 4: every step is exact, so the mean is the exact mean)."""

    def grads(rank):
        g = torch.Generator().manual_seed(rank)
        return {"w": (4.0 * torch.randint(-8, 9, (7, 5), generator=g)).bfloat16()}

    def fn(comm):
        _world(comm, 2)
        t = grads(comm.rank)
        build_aggregator([("w", torch.zeros(7, 5, dtype=torch.bfloat16))], lambda _n, _t: build_codec("identity"),
                   comm).reduce_(t)
        return t["w"]

    out = LocalWorld(4).run(fn)
    ref = sum(grads(r)["w"].float() for r in range(4)) / 4
    assert all(o.dtype == torch.bfloat16 and torch.equal(o.float(), ref) for o in out)


def test_a_bad_intra_dtype_is_refused():
    def fn(comm):
        with pytest.raises(ValueError, match="intra-dtype must be one of fp32, bf16, got 'fp16'"):
            build_hierarchy(comm, NodeLayout(2, 2), intra_dtype="fp16")

    LocalWorld(2).run(fn)


def _local_sgd(comm, dtype: str, period: int, steps: int) -> torch.nn.Module:
    """``steps`` local steps of two-level local SGD over 2 nodes x 2 ranks, nodes in ``dtype``."""
    from thinwire.algorithms.local_sgd import LocalSGD, LocalSGDConfig

    build_hierarchy(comm, NodeLayout(4, 2), intra_dtype=dtype)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method = LocalSGD(model, opt, comm, LocalSGDConfig(period=period, warmup=0), overlap=False)
    for step in range(steps):
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 * step + comm.rank)
        model(torch.randn(8, 64, generator=g)).square().mean().backward()
        method.after_backward()
        opt.step()
        method.after_step()
    return model


def test_two_level_local_sgd_averages_inside_the_node_in_bf16_when_asked():
    def fn(comm, dtype):
        _local_sgd(comm, dtype, period=4, steps=3)  # local steps only: the node's gradient means
        return comm.meter.link_bytes("intra"), comm.meter.link_bytes("inter")

    fp32 = LocalWorld(4).run(lambda c: fn(c, "fp32"))
    bf16 = LocalWorld(4).run(lambda c: fn(c, "bf16"))
    assert fp32[0][0] > 0 and bf16[0][0] == fp32[0][0] / 2
    assert fp32[0][1] == bf16[0][1] == 0  # no average between nodes before the period


def test_bf16_inside_the_node_leaves_the_model_averages_in_fp32():
    """Past a period: the weights averaged between nodes come back in full fp32 (a bf16 node
    stage would round every weight to bf16 at each sync), the same on every rank."""

    def fn(comm):
        model = _local_sgd(comm, "bf16", period=2, steps=4)  # two averages between nodes
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    out = LocalWorld(4).run(fn)
    assert all(torch.equal(o, out[0]) for o in out)
    assert (out[0] != out[0].bfloat16().float()).float().mean() > 0.9


# -- two-level model averaging: local steps local to a node, averages on the schedule -------------
def _local_model_methods():
    from thinwire.algorithms.dasgd import DaSGD, DaSGDConfig
    from thinwire.algorithms.diloco import DiLoCo, DiLoCoConfig
    from thinwire.algorithms.local_sgd import LocalSGD, LocalSGDConfig

    # no overlap: the reference sets each gradient after two backward passes
    return {"localsgd": lambda m, o, c: LocalSGD(m, o, c, LocalSGDConfig(period=3, warmup=2), overlap=False),
            "dasgd": lambda m, o, c: DaSGD(m, o, c, DaSGDConfig(period=3, delay="1"), overlap=False),
            "diloco": lambda m, o, c: DiLoCo(m, o, c, DiLoCoConfig(period=3, outer_lr=0.7), overlap=False)}


@pytest.mark.parametrize("name", ["localsgd", "dasgd", "diloco"])
def test_two_level_model_averaging_is_flat_averaging_over_nodes_of_node_mean_gradients(name):
    """2 nodes x 2 ranks: every step's gradients are averaged inside the node, the scheduled
    averages run between nodes. Bit for bit the run of 2 flat ranks whose gradient is the mean
    of their node's two batches' gradients (dividing by 2 and summing two terms rounds alike)."""
    import copy

    from torch import nn

    import tiny

    make = _local_model_methods()[name]
    base = tiny.net(6, 16, 3)
    steps = 8

    def train(comm, batches_of):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        method = make(model, opt, comm)
        for step in range(steps):
            grads = []
            for seed in batches_of(comm.rank, step):
                opt.zero_grad()
                x, y = tiny.batch(seed, 8, 6, 3)
                nn.functional.cross_entropy(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, *gs in zip(model.parameters(), *grads):
                p.grad = sum((g / len(gs) for g in gs[1:]), gs[0] / len(gs)) if len(gs) > 1 else gs[0]
            method.after_backward()
            opt.step()
            method.after_step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def two_level(comm):
        _world(comm, 2)
        return train(comm, lambda rank, step: [100 * step + rank])

    def flat(comm):  # node k's ranks are 2k and 2k + 1
        return train(comm, lambda node, step: [100 * step + 2 * node, 100 * step + 2 * node + 1])

    hier = LocalWorld(4).run(two_level)
    ref = LocalWorld(2).run(flat)
    for rank, got in enumerate(hier):
        assert torch.equal(got, ref[rank // 2]), (name, rank)


def test_dasgd_hides_each_averages_traffic_between_nodes():
    """What DaSGD credits as hidden is each average's traffic behind the steps as the meter
    counted it at the launch: flat, one all_reduce of the model; in two levels, the shard's
    all_reduce between nodes (the node's link shared by its 2 ranks), not the node's
    reduce_scatter, which blocked before the steps began."""
    import copy

    from torch import nn

    import tiny
    from thinwire.algorithms.dasgd import DaSGD, DaSGDConfig
    from thinwire.comm.link import Link

    base = tiny.net(6, 16, 3)
    numel = sum(p.numel() for p in base.parameters())
    slow = Link.parse("100mbit,1ms")

    def train(comm):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        method = DaSGD(model, opt, comm, DaSGDConfig(period=2, delay="1", warmup=2), overlap=False)
        for step in range(10):
            opt.zero_grad()
            x, y = tiny.batch(100 * step + comm.rank, 8, 6, 3)
            nn.functional.cross_entropy(model(x), y).backward()
            method.after_backward()
            opt.step()
            method.after_step()
        return method

    def hier(comm):
        _world(comm, 2)
        return train(comm)

    shared = Link(latency_s=slow.latency_s, bandwidth_Bps=slow.bandwidth_Bps / 2)
    for ranks_per_node, methods in ((None, LocalWorld(4).run(train)), (2, LocalWorld(4).run(hier))):
        for method in methods:
            windows = method._windows
            assert len(windows) >= 3
            if ranks_per_node is None:
                counted, share = {("all_reduce", 4, "inter"): (1, 4 * numel)}, 1
                one = slow.all_reduce_time(4 * numel, 4)
            else:  # the one flat tensor in two pieces, the first one element longer when odd
                half = -(-numel // 2)
                mine = half if method.comm.rank % 2 == 0 else numel - half
                counted, share = {("all_reduce", 2, "inter"): (1, 4 * mine)}, 2
                one = shared.all_reduce_time(4 * mine, 2)
            for sent, _ in windows:
                assert {k: (c.calls, c.payload_bytes) for k, c in sent.by_group.items()} == counted
                assert sent.inter_share == share
            expect = sum(min(one, window) for _, window in windows)
            assert method.hidden_seconds(slow) == pytest.approx(expect, rel=1e-9) and expect > 0


def test_methods_that_run_flat_only_refuse_a_communicator_with_nodes():
    from thinwire.algorithms.build import build_method

    def fn(comm):
        _world(comm, 2)
        model = torch.nn.Linear(4, 2)
        with pytest.raises(ValueError, match="powergossip cannot average in two levels: it exchanges with its graph"):
            build_method("powergossip", model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
        return build_method("localsgd", model, torch.optim.SGD(model.parameters(), lr=0.1), comm).comm.hierarchy

    assert all(h is not None for h in LocalWorld(4).run(fn))


def test_the_ddp_hook_keeps_two_level_buckets_on_one_thread():
    """Identity buckets pipeline across threads in a flat hook; over nodes a bucket runs
    collectives inside the node at launch and at landing, so the hook keeps both on one thread."""
    from thinwire.integrations.ddp import HookState

    def fn(comm):
        flat = HookState(build_codec("identity"), comm, {}).pipelines
        _world(comm, 2)
        return flat, HookState(build_codec("identity"), comm, {}).pipelines

    assert LocalWorld(4).run(fn) == [(True, False)] * 4


# -- the cost model's two links --------------------------------------------------------------------
def test_modeled_seconds_time_each_link_and_share_the_nodes_link():
    from thinwire.comm.link import Link, meter_seconds
    from thinwire.comm.meter import ByteMeter

    slow, fast = Link.parse("100mbit,1ms"), Link.parse("100gbit,10us")
    meter = ByteMeter()
    meter.record("reduce_scatter", 4_000_000, 2, "intra")
    meter.record("all_gather", 2_000_000, 2, "intra")
    meter.record("all_reduce", 2_000_000, 2, "inter")
    intra = fast.reduce_scatter_time(4_000_000, 2) + fast.all_gather_time(2_000_000, 2)
    assert meter_seconds(slow, meter, 4, fast) == pytest.approx(intra + slow.all_reduce_time(2_000_000, 2), rel=1e-12)
    meter.inter_share = 2  # two ranks of the node send between nodes at once: each gets half the link
    half = Link(latency_s=slow.latency_s, bandwidth_Bps=slow.bandwidth_Bps / 2)
    assert meter_seconds(slow, meter, 4, fast) == pytest.approx(intra + half.all_reduce_time(2_000_000, 2), rel=1e-12)
    assert meter.bound_bytes("intra") == sent_bytes("reduce_scatter", 4_000_000, 2) + sent_bytes("all_gather",
                                                                                                 2_000_000, 2)


def test_cost_rows_time_the_intra_node_collectives_apart():
    from thinwire.comm.link import Link
    from thinwire.lab.cost import from_rows

    first = {"step": 2, "compute_seconds": 1.0, "codec_seconds": 0.0, "comm_seconds": 0.0, "bytes_sent": 0.0,
             "messages": 0, "intra_bytes": 0.0, "intra_messages": 0, "inter_share": 2}
    last = dict(first, step=4, compute_seconds=1.2, bytes_sent=3e6, messages=10, intra_bytes=2e6, intra_messages=6)
    fast, slow = Link.parse("8gbit,10us"), Link.parse("80mbit,1ms")
    c = from_rows("m", first, last, fast)
    assert c.bytes == pytest.approx(2 * 0.5e6) and c.messages == pytest.approx(2)  # the node's link: twice ours
    assert c.intra_s == pytest.approx(3 * 10e-6 + 1e6 / 1e9)
    assert c.seconds(slow) == pytest.approx(0.1 + c.intra_s + 2 * 1e-3 + 1e6 / 1e7)
    one = from_rows("m", first, last)  # no intra link: everything on the one link (the node's share twice)
    assert (one.bytes, one.messages, one.intra_s) == (2 * 0.5e6 + 1e6, 5, 0.0)


def test_cost_from_a_summary_times_the_intra_node_bytes_apart_too():
    """Without two metrics records, the summary's per-link counts give the same split."""
    from thinwire.comm.link import Link
    from thinwire.lab.cost import from_summary
    from tiny import fake_summary

    summary = fake_summary(steps=2, compute_seconds=0.2, codec_seconds=0.0, comm_seconds=0.0,
                           bytes_sent_per_worker=3e6, messages_per_worker=10, ranks_per_node=2,
                           bytes_by_link_per_worker={"intra": 2e6, "inter": 1e6},
                           messages_by_link_per_worker={"intra": 6, "inter": 4})
    fast = Link.parse("8gbit,10us")
    c = from_summary("m", summary, fast)
    assert c.bytes == pytest.approx(2 * 0.5e6) and c.messages == pytest.approx(2)
    assert c.intra_s == pytest.approx(3 * 10e-6 + 1e6 / 1e9)
    one = from_summary("m", summary)  # no intra link: every byte on the one link, as before
    assert (one.bytes, one.messages, one.intra_s) == (1.5e6, 5, 0.0)


def test_an_emulated_world_gives_each_rank_its_part_of_the_nodes_link():
    from thinwire.comm.link import EmulatedLink, Link

    def fn(comm):
        world = EmulatedLink(comm, Link.parse("100mbit,1ms"), sleep=False)
        h = build_hierarchy(world, NodeLayout(4, 2), "10gbit,5us")
        return h.intra.link, h.inter.link, world.meter.inter_share

    for intra, inter, share in LocalWorld(4).run(fn):
        assert intra == Link.parse("10gbit,5us") and share == 2
        assert inter == Link.parse("50mbit,1ms")


def test_a_flat_aggregator_over_nodes_is_refused_naming_the_builder():
    """Over a world grouped into nodes a plain Aggregator would average flat, silently: it is
    refused, and build_aggregator gives the two-level one."""
    from thinwire.aggregate import Aggregator

    def fn(comm):
        _world(comm, 2)
        with pytest.raises(ValueError, match="build_aggregator"):
            Aggregator(_named(), lambda _n, _t: build_codec("identity"), comm)
        return type(build_aggregator(_named(), lambda _n, _t: build_codec("identity"), comm)).__name__

    assert LocalWorld(4).run(fn) == ["HierarchicalAggregator"] * 4

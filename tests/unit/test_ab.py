"""AB-training on the in-process communicator: factorisation to SVD precision, identical
synced weights, identical factors within a group, agreed ranks, bytes per phase by the
formulas of docs/methods.md's `ab` table, optimizer state across rank changes, resume, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from thinwire.algorithms.ab import ABConfig, ABTraining, groups_of
from thinwire.comm.local import LocalWorld
from thinwire.comm.meter import sent_bytes
from thinwire.nn.factorized import Factorized, factorize_model, rank_for


class Net(nn.Module):
    """first (conv0), two factored layers (conv1: wide 8 x 36, fc1: tall 64 x 24), last (fc2)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 3)

    def forward(self, x):
        x = torch.relu(self.conv0(x))
        x = torch.relu(self.norm(self.conv1(x)))
        x = nn.functional.adaptive_avg_pool2d(x, 2).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


torch.manual_seed(0)
_INIT = {k: v.clone() for k, v in Net().state_dict().items()}  # ranks are threads: no global RNG in them


def _net() -> Net:
    model = Net()
    model.load_state_dict(_INIT)
    return model


def _data(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 1, 6, 6, generator=g)
    m = x.mean((1, 2, 3))
    y = (m > -0.07).long() + (m > 0.07).long()  # three classes by the mean: learnable
    return x, y


def _train(comm, spec: dict, steps: int, optimizer: str = "adam", watch=None, cut: int | None = None,
           finish: bool = True):
    model = _net()
    opt = (torch.optim.Adam(model.parameters(), lr=3e-3) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4))
    ab = ABTraining(model, opt, comm, ABConfig(**spec))
    losses = []
    for step in range(steps):
        if step == cut:  # checkpoint, rebuild everything, load
            saved = (_clone(dict(model.state_dict())), _clone(opt.state_dict()), ab.state_dict())
            model = _net()
            opt = torch.optim.Adam(model.parameters(), lr=3e-3)
            ab = ABTraining(model, opt, comm, ABConfig(**spec))
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            ab.load_state_dict(saved[2])
        x, y = _data(comm.rank, step)
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        ab.after_backward(loss.detach())
        opt.step()
        ab.after_step()
        losses.append(loss.item())
        if watch is not None:
            watch(step + 1, model, ab)
    if finish:
        ab.finish()
    return model, ab, losses


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


# -- the layer -------------------------------------------------------------------------------
@pytest.mark.parametrize("layer", [nn.Linear(24, 64), nn.Linear(64, 24), nn.Conv1d(3, 5, 4), nn.Conv2d(4, 8, 3)],
                         ids=["linear-tall", "linear-wide", "conv1d", "conv2d"])
def test_ab_reproduces_w_to_svd_precision_before_truncation(layer):
    torch.manual_seed(0)
    f = Factorized(layer)
    x = torch.randn(2, *((24,) if isinstance(layer, nn.Linear) and layer.in_features == 24 else
                         (64,) if isinstance(layer, nn.Linear) else
                         (3, 9) if isinstance(layer, nn.Conv1d) else
                         (4, 6, 6)))
    full = f(x)
    r = f.factorize()
    m, n = f.shape
    assert m >= n and r == n and f.a.shape == (m, r) and f.b.shape == (r, n)
    torch.testing.assert_close(f.product(), f.weight.detach(), rtol=0, atol=1e-5)  # fp32 SVD of O(1) entries
    f.set_mode("a")
    assert f.a.requires_grad and not f.b.requires_grad and not f.weight.requires_grad
    torch.testing.assert_close(f(x), full, rtol=0, atol=1e-5)


def test_truncation_keeps_the_singular_values_above_the_cutoff():
    s = torch.tensor([10.0, 5.0, 1.6, 1.4, 0.1])
    assert rank_for(s, 0.15) == 3 and rank_for(s, 0.45) == 2 and rank_for(s, 0.5) == 1 and rank_for(s, 0.99) == 1
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(12, 5))
    v, _ = torch.linalg.qr(torch.randn(5, 5))
    f = Factorized(nn.Linear(5, 12))
    with torch.no_grad():
        f.weight.copy_(u @ torch.diag(s) @ v.T)
    assert f.factorize(cutoff=0.15) == 3
    best = u[:, :3] @ torch.diag(s[:3]) @ v[:, :3].T  # Eckart-Young: the best rank-3 approximation
    torch.testing.assert_close(f.product(), best, rtol=0, atol=1e-5)


def test_state_dict_restores_rank_and_mode():
    torch.manual_seed(0)
    model = Net()
    layers = factorize_model(model)
    assert list(layers) == ["conv1", "fc1"]  # first and last excluded
    names = [n for n, _ in model.named_parameters()]
    assert "conv1.weight" in names and "fc1.a" in names and "conv0.weight" in names
    layers["fc1"].factorize(rank=3)
    layers["fc1"].set_mode("b")
    fresh = Net()
    factorize_model(fresh)
    fresh.load_state_dict(model.state_dict())
    f = fresh.fc1
    assert f.rank == 3 and f.mode == "b" and f.b.requires_grad and not f.a.requires_grad
    x = torch.randn(2, 1, 6, 6)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


# -- the schedule on 4 ranks, groups of 2 ------------------------------------------------------
SPEC = dict(group_size=2, warmup=4, cycle=6, full_steps=2, cutoff=0.3, rebound=2)


@pytest.mark.parametrize("sync", ["full", "with-stale", "only-learned", "only-b"])
def test_synced_weights_agree_and_groups_share_their_factors(sync):
    seen = {"sync": [], "group": []}

    def fn(comm):
        def watch(step, model, ab):
            if ab.phase == "full" and ab.phase_started == step and ab.syncs:  # just synced
                seen["sync"].append((comm.rank, step, {k: v.clone() for k, v in model.state_dict().items()
                                                       if not k.endswith(("_extra_state", ".a", ".b"))}))
            if ab.phase == "group":
                seen["group"].append((comm.rank, step, ab.role, model.fc1.a.detach().clone(),
                                      model.fc1.b.detach().clone(), model.conv0.weight.detach().clone()))
        model, ab, losses = _train(comm, dict(SPEC, sync=sync), 20, watch=watch)
        return ab.ranks, ab.groups, ab.role, losses

    results = LocalWorld(4).run(fn)
    ranks = [r[0] for r in results]
    assert all(r == ranks[0] for r in ranks)  # MAX-agreed shapes
    assert results[0][1] == [[0, 1], [2, 3]]
    assert [r[2] for r in results] == (["b"] * 4 if sync == "only-b" else ["a", "a", "b", "b"])
    syncs = {}
    for rank, step, state in seen["sync"]:
        syncs.setdefault(step, {})[rank] = state
    assert sorted(syncs) == [6, 12, 18]
    for step, by_rank in syncs.items():
        for rank in range(1, 4):
            for key, value in by_rank[0].items():
                assert torch.equal(value, by_rank[rank][key]), (step, rank, key)
    groups = {}
    for rank, step, _role, a, b, conv0 in seen["group"]:
        groups.setdefault((step, rank // 2), []).append((a, b, conv0))
    assert groups
    for (step, g), members in groups.items():
        assert len(members) == 2
        for x, y in zip(*members):
            assert torch.equal(x, y), (step, g)  # same trained factor, same frozen factor, same unfactored layer


def test_bytes_per_phase_follow_the_formulas():
    """Group: all_reduce over G ranks of r*m (A groups) or r*n (B groups) plus the unfactored
    parameters; sync: all_reduce over all of (per mode) + unfactored + float buffers."""
    def fn(comm):
        model, ab, _ = _train(comm, dict(SPEC, sync="with-stale"), 12)
        return ab.bytes_by_phase, ab.steps_by_phase, ab.ranks, ab.role, ab.factorisations

    results = LocalWorld(4).run(fn)
    ref = Net()
    full_numel = sum(p.numel() for p in ref.parameters())
    others = full_numel - ref.conv1.weight.numel() - ref.fc1.weight.numel()
    buffers = sum(b.numel() for b in ref.buffers() if b.is_floating_point())
    shapes = {"conv1": (36, 8), "fc1": (64, 8 * 2 * 2)}  # tall (m, n)
    for by_phase, steps, ranks, role, facts in results:
        assert steps == {"warmup": 4, "group": 6, "full": 2} and facts == 2
        assert by_phase["warmup"] == 4 * sent_bytes("all_reduce", 4 * full_numel, 4)
        # full: 2 steps of full gradients + the rank agreement (all_gather of 2 int64)
        assert by_phase["full"] == 2 * sent_bytes("all_reduce", 4 * full_numel, 4) + sent_bytes("all_gather", 16, 4)
        # group steps 4-5 at full rank min(m, n), steps 8-11 at the agreed ranks
        def group_bytes(rank_of, role=role):
            factor = sum(rank_of[n] * (m if role == "a" else n_) for n, (m, n_) in shapes.items())
            return sent_bytes("all_reduce", 4 * (factor + others), 2)
        untruncated = {n: min(s) for n, s in shapes.items()}
        assert by_phase["group"] == 2 * group_bytes(untruncated) + 4 * group_bytes(ranks)
        # syncs at steps 6 and 12, with-stale: A and B, untruncated then at the agreed ranks, with
        # the unfactored parameters, their two Adam moments and the float buffers
        stale = lambda rank_of: sum(rank_of[n] * (m + n_) for n, (m, n_) in shapes.items())  # noqa: E731
        assert by_phase["sync"] == sum(sent_bytes("all_reduce", 4 * (stale(r) + 3 * others + buffers), 4)
                                       for r in (untruncated, ranks))


def test_sync_modes_send_what_they_reconcile():
    sizes = {}
    for sync in ("full", "with-stale", "only-learned", "only-b"):
        def fn(comm, sync=sync):
            _, ab, _ = _train(comm, dict(SPEC, sync=sync, warmup=6), 7, finish=False)  # factorised at 6, untruncated
            before = ab.bytes_by_phase["sync"]
            ab.sync()
            return ab.bytes_by_phase["sync"] - before
        sizes[sync] = LocalWorld(4).run(fn)[0]
    ref = Net()
    rest = 3 * (sum(p.numel() for p in ref.parameters()) - ref.conv1.weight.numel() - ref.fc1.weight.numel())
    rest += sum(b.numel() for b in ref.buffers() if b.is_floating_point())  # parameters + 2 Adam moments + buffers
    per = lambda numel: sent_bytes("all_reduce", 4 * (numel + rest), 4)  # noqa: E731
    assert sizes["full"] == per(36 * 8 + 64 * 32)  # the products
    assert sizes["with-stale"] == sizes["only-learned"] == per(8 * (36 + 8) + 32 * (64 + 32))
    assert sizes["only-b"] == per(8 * 8 + 32 * 32)  # B of each layer (r x n)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_rank_changes_keep_the_optimizer_consistent_and_the_loss_falls(optimizer):
    def fn(comm):
        model, ab, losses = _train(comm, dict(SPEC, cutoff=0.5), 40, optimizer=optimizer)
        finite = all(torch.isfinite(p).all() for p in model.parameters())
        return losses, finite, ab.factorisations, ab.phase

    for losses, finite, facts, phase in LocalWorld(4).run(fn):
        assert finite and facts >= 5 and phase == "full"  # finish() synced the last group phase
        assert sum(losses[-8:]) / 8 < 0.92 * sum(losses[:4]) / 4, losses  # ~0.87 here; flat at ~1.09 if broken


def test_optimizer_state_is_sliced_to_the_new_rank():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def fn(comm):
        ab = ABTraining(model, opt, comm, ABConfig(group_size=1, sync="only-b", warmup=0))
        layer = model.fc1
        x, y = _data(0, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        ab.after_backward()
        opt.step()
        ab.after_step()
        before = opt.state[layer.b]["exp_avg"].clone()
        r_old = layer.rank
        layer_old = (layer.a.shape, layer.b.shape)
        layer.set_factors(layer.a[:, :3].detach(), layer.b[:3].detach())
        ab._refit_state(layer, layer_old)
        return before, r_old, opt.state[layer.b]["exp_avg"]

    before, r_old, after = LocalWorld(1).run(fn)[0]
    assert r_old == 32 and after.shape == (3, 32)
    torch.testing.assert_close(after, before[:3], rtol=0, atol=0)


def test_resume_from_a_checkpoint_continues_exactly():
    def straight(comm):
        return [p.detach().clone() for p in _train(comm, SPEC, 16)[0].parameters()]

    def resumed(comm):  # cut inside the second group phase (steps 14-18 train the factors)
        return [p.detach().clone() for p in _train(comm, SPEC, 16, cut=15)[0].parameters()]

    for a, b in zip(LocalWorld(4).run(straight), LocalWorld(4).run(resumed)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_learning_rate_ramps_after_each_phase_change():
    lrs = []

    def fn(comm):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ab = ABTraining(model, opt, comm, ABConfig(group_size=1, sync="only-b", warmup=2, cycle=6, full_steps=2,
                                                   rebound=3))
        for step in range(10):
            x, y = _data(0, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            ab.after_backward()
            if comm.rank == 0:
                lrs.append(round(opt.param_groups[0]["lr"], 8))
            opt.step()
            ab.after_step()
        return opt.param_groups[0]["lr"]

    assert LocalWorld(1).run(fn) == [0.1]
    ramp = [1e-5, round(1e-5 + (0.1 - 1e-5) / 3, 8), round(1e-5 + 2 * (0.1 - 1e-5) / 3, 8)]
    # warm-up 0-1; factorise at 2; sync at 6; re-factorise at 8
    assert lrs == [0.1, 0.1, *ramp, 0.1, *ramp[:2], *ramp[:2]]


# -- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("knobs, message", [
    (dict(cutoff=0), "cutoff must be in"), (dict(cutoff=1.0), "cutoff must be in"),
    (dict(cycle=10, full_steps=10), "cycle must be > full_steps"), (dict(warmup=-1), "warmup must be >= 0"),
    (dict(sync="both"), "sync must be one of"), (dict(group_size=-1), "group_size must be >= 0"),
    (dict(rebound=-2), "rebound must be >= 0"),
])
def test_bad_knobs(knobs, message):
    with pytest.raises(ValueError, match=message):
        ABConfig(**knobs)


def test_groups_must_give_an_a_and_a_b_group():
    assert groups_of(ABConfig(), 4) == [[0, 1], [2, 3]]
    assert groups_of(ABConfig(group_size=1), 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="must divide the 6 workers"):
        groups_of(ABConfig(group_size=4), 6)
    with pytest.raises(ValueError, match="needs at least one A group and one B group"):
        groups_of(ABConfig(group_size=4), 4)
    assert groups_of(ABConfig(group_size=4, sync="only-b"), 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="even number of workers"):
        groups_of(ABConfig(), 3)


def test_an_excluded_name_must_match_a_layer():
    with pytest.raises(ValueError, match="'fc9' matches no Linear or Conv layer"):
        ABTraining.check_model(ABConfig(exclude="first;fc9"), Net())
    with pytest.raises(ValueError, match="no Linear or Conv layer left"):
        ABTraining.check_model(ABConfig(exclude="conv0;conv1;fc1;fc2"), Net())
    ABTraining.check_model(ABConfig(exclude="none"), Net())  # every layer factored: fine
    assert list(factorize_model(Net(), ABConfig(exclude="none").excluded())) == ["conv0", "conv1", "fc1", "fc2"]


def test_transposed_convolutions_are_left_alone():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ConvTranspose2d(4, 4, 3), nn.Conv2d(4, 4, 3), nn.Linear(4, 2))
    assert list(factorize_model(model, [])) == ["0", "2", "3"]
    with pytest.raises(TypeError, match="non-transposed"):
        Factorized(nn.ConvTranspose1d(2, 2, 3))


def test_full_rank_steps_after_a_sync_run_identically_on_every_rank():
    """The groups averaged the unfactored parameters' gradients apart; the sync averages their
    optimizer state too, so a run that ends inside the full-rank phase ends with one model."""
    def fn(comm):
        model, ab, _ = _train(comm, SPEC, 7)  # sync at 6, full-rank step 6 (of 6-7)
        assert ab.phase == "full"
        # parameters (BatchNorm's running statistics are local to each rank, as under identity)
        return torch.cat([p.detach().reshape(-1) for k, p in model.named_parameters() if not k.endswith((".a", ".b"))])

    flats = LocalWorld(4).run(fn)
    for f in flats[1:]:
        assert torch.equal(f, flats[0])


def test_a_run_ending_on_the_factorising_step_keeps_its_full_rank_weights():
    def fn(comm):
        seen = {}

        def watch(step, model, ab):
            if step == 7:
                seen["w"] = model.fc1.weight.detach().clone()
        model, ab, _ = _train(comm, SPEC, 8, watch=watch)  # step 8 = 8 % 6 == 2: re-factorised, then finish()
        return seen["w"], model.fc1.weight.detach().clone(), (type(model.fc1), ab.layers["fc1"].mode), ab.syncs

    for before, after, mode, syncs in LocalWorld(4).run(fn):
        assert mode == (nn.Linear, "full") and syncs == 1  # no sync of the truncated factors; exported
        assert not torch.equal(before, after)  # step 8 trained W ...
    results = LocalWorld(4).run(fn)
    assert all(torch.equal(r[1], results[0][1]) for r in results)  # ... identically on every rank


def test_the_method_state_must_load_after_the_model():
    def fn(comm):
        kept = {}
        _train(comm, SPEC, 5, watch=lambda step, model, ab: kept.setdefault(step, ab.state_dict()))
        saved = kept[5]  # inside the first group phase
        model = _net()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        fresh = ABTraining(model, opt, comm, ABConfig(**SPEC))
        try:
            fresh.load_state_dict(saved)
        except ValueError as e:
            return str(e)
        return "loaded"

    messages = LocalWorld(4).run(fn)
    assert all("load the model's state dict before the method's" in m for m in messages), messages


def test_multihead_attention_projections_stay_full_rank():
    model = nn.Sequential(nn.Linear(8, 8), nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), nn.Linear(8, 2))
    names = list(factorize_model(model, []))
    assert "1.self_attn.out_proj" not in names and "1.linear1" in names

"""Bundled tasks: deterministic models, disjoint shards, data formats, metrics, learning."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest
import torch

from thinwire import tasks
from thinwire.run import arguments
from thinwire.tasks import TaskError
from thinwire.tasks.cifar10 import MEAN, RECORD, STD, augment, normalize

SMALL_SYNTHETIC = dict(dim=8, hidden=16, depth=2, classes=3, samples=400, test_samples=100)
SMALL_CHARLM = dict(context=16, d_model=32, heads=2, layers=1)


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    """A tiny CIFAR-10 binary copy: 20 random records per file; returns (dir, {file: (labels, pixels)})."""
    root = tmp_path_factory.mktemp("cifar")
    return root, write_cifar(root)


def write_cifar(folder, records=20, seed=0):
    rng = np.random.default_rng(seed)
    written = {}
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        labels = rng.integers(0, 10, records, dtype=np.uint8)
        pixels = rng.integers(0, 256, (records, 3072), dtype=np.uint8)
        np.concatenate([labels[:, None], pixels], axis=1).tofile(folder / name)
        written[name] = (labels, pixels)
    return written


def make(name, seed=0, cifar=None):
    """A small instance of each task (the defaults for mnist1d, which is small already)."""
    options = {"synthetic": SMALL_SYNTHETIC, "charlm": SMALL_CHARLM}.get(name, {})
    data_dir = str(cifar[0]) if name == "cifar10" else None
    return tasks.get(name)(seed=seed, data_dir=data_dir, **options)


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- registry and options -------------------------------------------------------------------
def test_registry_lists_the_five_tasks_and_names_them_on_error():
    assert list(tasks.available()) == ["mnist1d", "charlm", "text", "cifar10", "synthetic"]
    assert tasks.get("charlm").metric == "bpc"
    with pytest.raises(TaskError) as e:
        tasks.get("x")
    assert str(e.value) == "unknown task 'x'; available: mnist1d, charlm, text, cifar10, synthetic"
    assert isinstance(e.value, ValueError)


def test_defaults_are_per_rank_and_valid():
    for cls in tasks.available().values():
        d = cls.defaults
        assert d.optimizer in ("adam", "sgd") and d.steps >= d.eval_every >= 1 and d.lr > 0
    assert tasks.get("mnist1d").defaults.batch_size == 64  # 2 workers x 64 = 128 per step


def test_options_convert_cli_strings_and_reject_bad_ones():
    task = tasks.get("synthetic")(seed=1, **{k: str(v) for k, v in SMALL_SYNTHETIC.items()})
    assert task.options.dim == 8 and task.x.shape == (400, 8)
    for bad, rule in [({"dimm": 3}, "unknown option 'dimm'"), ({"dim": "x"}, "must be an integer"),
                      ({"dim": 0}, "dim must be >= 1")]:
        with pytest.raises(TaskError, match=rule):
            tasks.get("synthetic")(**bad)
    with pytest.raises(TaskError, match="one of default|large"):
        tasks.get("mnist1d")(size="huge")
    with pytest.raises(TaskError, match="takes no data_dir"):
        tasks.get("mnist1d")(data_dir="/tmp")


# -- models -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mnist1d", "charlm", "cifar10", "synthetic"])
def test_build_model_is_deterministic_and_leaves_global_rng_alone(name, cifar_dir):
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    np_before, py_before = np.random.get_state()[1].copy(), random.getstate()
    a, b, c = make(name, 0, cifar_dir), make(name, 0, cifar_dir), make(name, 1, cifar_dir)
    pa, pb, pc = (flat_params(t.build_model()) for t in (a, b, c))
    next(a.train_batches(0, 2, 4))
    assert torch.equal(torch.get_rng_state(), rng_before)  # nothing above touched the global RNG
    assert np.array_equal(np.random.get_state()[1], np_before) and random.getstate() == py_before
    assert torch.equal(pa, pb), "same seed must give identical parameters"
    assert not torch.equal(pa, pc), "different seeds must give different parameters"


def test_mnist1d_model_has_the_large_layers_compression_rules_need():
    model = tasks.get("mnist1d")(seed=0).build_model()
    sizes = {name: sum(p.numel() for p in m.parameters()) for name, m in model.named_children()}
    assert sizes["conv2"] == sizes["conv3"] == 64 * 64 * 5 + 64 == 20544
    assert sum(1 for k, n in sizes.items() if k.startswith("conv") and n > 16384) >= 2
    assert sizes["fc1"] == 640 * 256 + 256 > 65536
    assert model(torch.zeros(3, 1, 40)).shape == (3, 10)


def test_cifar_models_have_the_documented_sizes(cifar_dir):
    resnet = make("cifar10", cifar=cifar_dir).build_model()
    assert sum(p.numel() for p in resnet.parameters()) == 269722  # He et al.'s ResNet-20 (option A): 0.27M
    vgg = tasks.get("cifar10")(data_dir=str(cifar_dir[0]), model="vgg").build_model()
    assert 0.7e6 < sum(p.numel() for p in vgg.parameters()) < 0.9e6
    x = torch.zeros(2, 3, 32, 32)
    assert resnet(x).shape == vgg(x).shape == (2, 10)


# -- shards -----------------------------------------------------------------------------------
def row_keys(x):
    return [row.numpy().tobytes() for row in x.reshape(len(x), -1)]


@pytest.mark.parametrize("name", ["mnist1d", "synthetic", "cifar10"])
def test_shards_are_disjoint_deterministic_and_cover_the_data(name, cifar_dir):
    task = make(name, cifar=cifar_dir)
    if name == "cifar10":  # without augmentation a training image is its normalised stored image
        task = tasks.get("cifar10")(data_dir=str(cifar_dir[0]), augment=False)
    data = normalize(task.x) if name == "cifar10" else task.x
    n = len(task.y)
    all_rows = set(row_keys(data))
    assert len(all_rows) == n  # rows are unique, so contents identify examples
    for world in (1, 2, 4):
        per_rank = n // world
        batch = math.gcd(per_rank, 50)  # divides the shard: one epoch is a whole number of batches
        shards = []
        for rank in range(world):
            stream = task.train_batches(rank, world, batch)
            rows = [k for _ in range(per_rank // batch) for k in row_keys(next(stream)[0])]
            assert len(set(rows)) == per_rank  # no repeats within an epoch
            shards.append(set(rows))
            idx = tasks.base.shard_indices(name, 0, n, rank, world, 0)
            assert set(row_keys(data[idx])) == shards[-1]  # the stream reads exactly the index shard
        for i in range(world):
            for j in range(i + 1, world):
                assert not shards[i] & shards[j], f"ranks {i} and {j} of {world} share examples"
        if world == 1:
            assert shards[0] == all_rows


def test_batches_repeat_exactly_and_reshuffle_each_epoch():
    task = make("synthetic")
    stream = task.train_batches(1, 2, 50)
    first = [next(stream) for _ in range(8)]  # 2 epochs of this rank's 200
    again = task.train_batches(1, 2, 50)
    for x, y in first:
        x2, y2 = next(again)
        assert torch.equal(x, x2) and torch.equal(y, y2)
    epoch0, epoch1 = torch.cat([x for x, _ in first[:4]]), torch.cat([x for x, _ in first[4:]])
    assert set(row_keys(epoch0)) != set(row_keys(epoch1))  # a fresh shared permutation each epoch
    solo = task.train_batches(0, 1, 100)
    solo0, solo1 = (torch.cat([next(solo)[0] for _ in range(4)]) for _ in range(2))
    assert set(row_keys(solo0)) == set(row_keys(solo1)) and not torch.equal(solo0, solo1)  # same data, new order
    other_seed = tasks.get("synthetic")(seed=1, **SMALL_SYNTHETIC).train_batches(1, 2, 50)
    assert not torch.equal(next(other_seed)[0], first[0][0])
    with pytest.raises(TaskError, match="cannot be split over 1000 ranks"):
        next(task.train_batches(0, 1000, 4))
    with pytest.raises(TaskError, match="rank < world_size"):
        next(task.train_batches(2, 2, 4))


@pytest.mark.parametrize("name", ["mnist1d", "charlm", "cifar10", "synthetic"])
def test_a_stream_started_at_batch_k_continues_the_full_stream_exactly(name, cifar_dir):
    task = make(name, cifar=cifar_dir)
    if name == "cifar10":  # with augmentation: batch b's crops and flips follow b, not the start
        task = tasks.get("cifar10")(data_dir=str(cifar_dir[0]))
    full = task.train_batches(1, 3, 150)
    head = [next(full) for _ in range(12)]  # 1,800 examples: past an epoch of every set, batches across its end
    for k in (0, 1, 5, 11):
        rest = task.train_batches(1, 3, 150, start=k)
        for x, y in head[k:]:
            x2, y2 = next(rest)
            assert torch.equal(x, x2) and torch.equal(y, y2), k
    with pytest.raises(TaskError, match="start must be >= 0, got -1"):
        next(task.train_batches(1, 3, 150, start=-1))


@pytest.mark.parametrize(
    "name, x_shape, y_shape, dtype",
    [
        ("mnist1d", (5, 1, 40), (5,), torch.float32),
        ("charlm", (5, 16), (5, 16), torch.long),
        ("cifar10", (5, 3, 32, 32), (5,), torch.float32),
        ("synthetic", (5, 8), (5,), torch.float32),
    ],
)
def test_train_batches_have_the_requested_shapes(name, x_shape, y_shape, dtype, cifar_dir):
    task = make(name, cifar=cifar_dir)
    stream = task.train_batches(1, 3, 5)
    for _ in range(3):
        x, y = next(stream)
        assert x.shape == x_shape and y.shape == y_shape and x.dtype == dtype and y.dtype == torch.long


# -- evaluation -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mnist1d", "charlm", "cifar10", "synthetic"])
def test_evaluate_returns_the_documented_keys_and_restores_the_mode(name, cifar_dir):
    task = make(name, cifar=cifar_dir)
    model = task.build_model()
    result = task.evaluate(model, max_batches=1)
    assert set(result) == {"loss", "accuracy", "bpc"} and model.training
    assert 0 <= result["accuracy"] <= 1 and result["loss"] > 0
    assert (result["bpc"] is not None) == (task.metric == "bpc")
    model.eval()
    task.evaluate(model, max_batches=1)
    assert not model.training


class Uniform(torch.nn.Module):
    """Equal logits for every class: loss ln(V) nats, bpc log2(V)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.dummy = vocab, torch.nn.Parameter(torch.zeros(()))

    def forward(self, ids):
        return torch.zeros(*ids.shape, self.vocab) + 0 * self.dummy


def test_charlm_default_model_is_the_tiny_preset_with_unchanged_weights():
    plain, tiny = tasks.get("charlm")(seed=0), tasks.get("charlm")(seed=0, model="tiny")
    assert plain.options == tiny.options
    assert (plain.options.layers, plain.options.d_model, plain.options.heads, plain.options.context) == (2, 128, 4, 64)
    a, b = plain.build_model(), tiny.build_model()
    assert sum(p.numel() for p in a.parameters()) == 431360
    assert torch.equal(flat_params(a), flat_params(b))
    small = make("charlm").build_model()  # explicit size knobs still build the model they name
    assert sum(p.numel() for p in small.parameters()) == 19872


def test_charlm_gpt_small_preset_size_shape_and_overrides():
    options = arguments.parse_options(["model=gpt-small"])  # `thinwire train --task charlm --option model=gpt-small`
    task = tasks.get("charlm")(seed=0, **options)
    o = task.options
    assert (o.model, o.layers, o.d_model, o.heads, o.context) == ("gpt-small", 8, 512, 8, 64)
    model = task.build_model()
    assert sum(p.numel() for p in model.parameters()) == 25_358_336 >= 20_000_000
    assert sum(p.numel() for p in model.blocks.parameters()) == 8 * (12 * 512**2 + 13 * 512)
    x, _ = next(task.train_batches(0, 1, 2))
    with torch.no_grad():
        assert model(x[:, :8]).shape == (2, 8, len(task.vocab))
    # an explicit size knob (a CLI string) overrides the preset's value; the rest keep theirs
    typed = arguments.parse_options(["model=gpt-small", "layers=1", "context=8"])
    shallow = tasks.get("charlm")(seed=0, **typed).options
    assert (shallow.layers, shallow.d_model, shallow.heads, shallow.context) == (1, 512, 8, 8)


def test_charlm_bad_model_name_lists_the_valid_ones():
    with pytest.raises(TaskError) as e:
        tasks.get("charlm")(model="gpt-huge")
    assert str(e.value) == "charlm: model must be one of tiny, gpt-small, got 'gpt-huge'"
    with pytest.raises(TaskError, match="d_model must be a multiple of heads, got 512 and 7"):
        tasks.get("charlm")(model="gpt-small", heads=7)


def test_charlm_vocab_split_and_uniform_bpc():
    task = make("charlm")
    text = tasks.charlm.corpus()
    assert len(text) > 100_000 and task.vocab == sorted(set(text))
    assert len(task.train_ids) == int(0.9 * len(text)) and len(task.train_ids) + len(task.test_ids) == len(text)
    assert task.decode(task.test_ids[:200]) == text[len(task.train_ids) : len(task.train_ids) + 200]
    result = task.evaluate(Uniform(len(task.vocab)))
    assert result["bpc"] == pytest.approx(math.log2(len(task.vocab)), abs=1e-6)
    assert result["loss"] == pytest.approx(math.log(len(task.vocab)), abs=1e-6)


def test_charlm_windows_stay_in_their_rank_region():
    task = make("charlm")
    t = task.options.context
    regions = [task.shard_region(r, 4) for r in range(4)]
    assert all(hi <= lo for (_, hi), (lo, _) in zip(regions, regions[1:]))  # contiguous, disjoint
    for rank, (lo, hi) in enumerate(regions):
        starts = task.window_starts(rank, 4, 64, batch=3)
        assert starts.min() >= lo and starts.max() + t + 1 <= hi
        x, y = list(zip(range(4), task.train_batches(rank, 4, 64)))[3][1]  # batch number 3 again
        assert torch.equal(x, torch.stack([task.train_ids[s : s + t] for s in starts.tolist()]))
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


# -- cifar10 format ---------------------------------------------------------------------------
def test_cifar10_reads_the_binary_format_exactly(cifar_dir):
    folder, written = cifar_dir
    task = tasks.get("cifar10")(data_dir=str(folder), augment=False)
    labels, pixels = written["test_batch.bin"]
    assert torch.equal(task.y_test, torch.from_numpy(labels.astype(np.int64)))
    assert torch.equal(task.x_test, torch.from_numpy(pixels).view(20, 3, 32, 32))  # R plane, G, B
    assert torch.equal(task.y[20:40], torch.from_numpy(written["data_batch_2.bin"][0].astype(np.int64)))
    assert len(task.y) == 100
    x, _ = next(task.test_batches())
    red_pixel = pixels[0, 5 * 32 + 7] / 255.0  # record 0, red plane, row 5, column 7
    assert x[0, 0, 5, 7].item() == pytest.approx((red_pixel - MEAN[0, 0, 0, 0].item()) / STD[0, 0, 0, 0].item(),
                                                 abs=1e-5)


def test_cifar10_accepts_the_archive_subfolder(tmp_path):
    (tmp_path / "cifar-10-batches-bin").mkdir()
    write_cifar(tmp_path / "cifar-10-batches-bin")
    assert len(tasks.get("cifar10")(data_dir=str(tmp_path)).y_test) == 20


def test_cifar10_data_errors_are_one_line_and_name_the_rule(tmp_path):
    cases = []
    with pytest.raises(TaskError) as e:
        tasks.get("cifar10")()
    cases.append((e.value, "needs --data-dir"))
    with pytest.raises(TaskError) as e:
        tasks.get("cifar10")(data_dir=str(tmp_path / "nope"))
    cases.append((e.value, "does not exist"))
    write_cifar(tmp_path)
    (tmp_path / "data_batch_4.bin").unlink()
    with pytest.raises(TaskError) as e:
        tasks.get("cifar10")(data_dir=str(tmp_path))
    cases.append((e.value, "missing .*data_batch_4.bin"))
    write_cifar(tmp_path)
    with open(tmp_path / "data_batch_3.bin", "r+b") as f:
        f.truncate(20 * RECORD - 5)
    with pytest.raises(TaskError) as e:
        tasks.get("cifar10")(data_dir=str(tmp_path))
    cases.append((e.value, "data_batch_3.bin has 61455 bytes, not a positive multiple of 3073"))
    for error, rule in cases:
        assert "\n" not in str(error)
        assert re.search(rule, str(error)), str(error)


def test_cifar10_augmentation_is_a_padded_crop_and_maybe_a_flip():
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    out = augment(images, torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    for img, aug in zip(padded, out):
        crops = [img[:, dy : dy + 32, dx : dx + 32] for dy in range(9) for dx in range(9)]
        assert any(torch.equal(aug, c) or torch.equal(aug, c.flip(-1)) for c in crops)
    assert torch.equal(out, augment(images, torch.Generator().manual_seed(0)))


# -- learning ---------------------------------------------------------------------------------
# Observed after 40 steps, seeds 0-2: loss ratio 0.53-0.60 (mnist1d), 0.74-0.75 (charlm);
# a model that does not learn stays at ~1.0.
@pytest.mark.parametrize("name, steps, factor", [("mnist1d", 40, 0.75), ("charlm", 40, 0.85)])
def test_a_few_steps_reduce_the_training_loss(name, steps, factor):
    """Default optimizer and lr, 2 shards' batches per step (as a 2-worker run takes them):
    the loss on a fixed training batch drops below `factor` x its initial value."""
    task = make(name)
    d = task.defaults
    model = task.build_model()
    opt = (torch.optim.Adam if d.optimizer == "adam" else torch.optim.SGD)(model.parameters(), lr=d.lr)
    streams = [task.train_batches(r, 2, 32) for r in range(2)]
    probe = next(task.train_batches(0, 1, 256))

    def probe_loss():
        with torch.no_grad():
            return task.loss(model(probe[0]), probe[1]).item()

    before = probe_loss()
    for _ in range(steps):
        parts = [next(s) for s in streams]
        loss = task.loss(model(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = probe_loss()
    assert after < factor * before, f"{name}: loss {before:.3f} -> {after:.3f}, wanted < {factor} x"


def test_mnist1d_keeps_a_generated_set_on_disk_and_regenerates_a_damaged_one(tmp_path, monkeypatch):
    from thinwire.tasks import mnist1d

    monkeypatch.setenv("THINWIRE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mnist1d, "_cache", {})  # this process's own cache starts empty, and is restored after
    made, real_make, sets = [], mnist1d._make, []

    def make(n, seed):  # generates once for real, then hands out that set (each generation takes seconds)
        made.append((n, seed))
        if not sets:
            sets.append(real_make(n, seed))
        return sets[0]

    monkeypatch.setattr(mnist1d, "_make", make)
    first = mnist1d.generate(*mnist1d.SIZES["default"])
    path = mnist1d.cache_path(*mnist1d.SIZES["default"])
    assert made == [mnist1d.SIZES["default"]] and path.is_file() and path.parent == tmp_path / "cache"
    mnist1d._cache.clear()
    again = mnist1d.generate(*mnist1d.SIZES["default"])  # read from disk: not generated again, the same tensors
    assert len(made) == 1 and all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(first, again))
    for damage in (b"not an npz", path.read_bytes()[:1000]):  # garbage, truncated: generated again
        path.write_bytes(damage)
        mnist1d._cache.clear()
        assert all(torch.equal(a, b) for a, b in zip(first, mnist1d.generate(*mnist1d.SIZES["default"])))
    assert len(made) == 3
    monkeypatch.setenv("THINWIRE_CACHE", str(path))  # a file where the directory should be: no cache, no error
    mnist1d._cache.clear()
    monkeypatch.setattr(mnist1d, "_make", lambda n, seed: first)
    assert mnist1d.generate(*mnist1d.SIZES["default"]) is first

"""The ranks agree on the model's parameters when a method is built (thinwire.comm.fingerprint),
on in-process ranks: what the one-line error names (order, counts, dtypes, requires_grad, a third
rank, many ranks), that every rank raises it alike, that agreeing ranks and a world of one send
nothing the meter counts, and that the check holds for a SyncReducer built from (name, parameter)
pairs and for the methods of the registry."""

from __future__ import annotations

import pytest
import torch

import thinwire
from thinwire.comm.base import Communicator
from thinwire.comm.fingerprint import ParameterMismatch, agree_on_parameters, entries, mismatch_message
from thinwire.comm.local import LocalWorld

RULE = "every rank must build the same model, its parameters registered in the same order"
HEAD = "ranks disagree on the model's parameters: "


def _mlp(*sizes: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])))


def _errors(n: int, named_of) -> list[str | None]:
    """Each rank's ParameterMismatch message (None: it passed) when rank ``r`` checks
    ``named_of(r)``; every rank must raise alike or pass alike."""

    def fn(comm):
        try:
            agree_on_parameters(named_of(comm.rank), comm)
        except ParameterMismatch as e:
            return str(e)
        finally:
            assert comm.meter.ops == {}  # neither path is the method's traffic
        return None

    return LocalWorld(n).run(fn)


def test_a_third_rank_in_another_order_is_named_against_the_other_two():
    def named(rank):
        pairs = list(_mlp(8, 4, 2).named_parameters())
        return pairs[::-1] if rank == 2 else pairs

    want = f"{HEAD}parameter 0 is 0.weight (4x8, float32) on ranks 0, 1 but 1.bias (2, float32) on rank 2; {RULE}"
    assert _errors(3, named) == [want] * 3


def test_a_frozen_parameter_and_another_dtype_are_named():
    def frozen(rank):
        model = _mlp(8, 4)
        model[0].bias.requires_grad_(rank != 1)
        return model.named_parameters()

    want = f"{HEAD}parameter 1 is 0.bias (4, float32) on rank 0 but 0.bias (4, float32, frozen) on rank 1; {RULE}"
    assert _errors(2, frozen) == [want] * 2
    want = f"{HEAD}parameter 0 is 0.weight (4x8, float32) on rank 0 but 0.weight (4x8, float64) on rank 1; {RULE}"
    assert _errors(2, lambda r: _mlp(8, 4).to(torch.float64 if r else torch.float32).named_parameters()) == [want] * 2


def test_a_rank_with_fewer_parameters_names_the_first_extra_on_the_others():
    want = f"{HEAD}rank 1 has 2 parameters, rank 0 has 4; the first extra is 1.weight (2x4, float32) on rank 0; {RULE}"
    assert _errors(2, lambda r: _mlp(8, 4, 2).named_parameters() if r == 0 else _mlp(8, 4).named_parameters()) \
        == [want] * 2


def test_ranks_that_agree_and_a_world_of_one_send_nothing_counted():
    assert _errors(4, lambda r: _mlp(8, 4, 2).named_parameters()) == [None] * 4

    class Silent(Communicator):
        def _all_gather(self, t, out, async_op):
            raise AssertionError("a world of one has no one to agree with")

    agree_on_parameters(_mlp(8, 4).named_parameters(), Silent(0, 1))


def test_the_message_names_an_inserted_layer_and_stays_short_over_many_ranks():
    a = entries(_mlp(8, 4, 2).named_parameters())
    b = a[:2] + [("extra.weight", (4, 4), "float32", True)] + a[2:]
    assert mismatch_message([a, b]) == (
        f"{HEAD}rank 1 has 5 parameters, rank 0 has 4; parameter 2 is 1.weight (2x4, float32) on rank 0 but "
        f"extra.weight (4x4, float32) on rank 1; {RULE}")
    every = [a] + [[(f"w{r}", (r,), "float32", True)] for r in range(1, 40)]
    message = mismatch_message(every)
    assert "\n" not in message and len(message) < 400, message
    assert message.startswith(f"{HEAD}ranks 1, 2, 3, 4 and 35 more have 1 parameter, rank 0 has 4; parameter 0 is "
                              "0.weight (4x8, float32) on rank 0 but w1 (1, float32) on rank 1, w2 (2, float32) on "
                              "rank 2, w3 (3, float32) on rank 3, w4 (4, float32) on rank 4, and 35 more ranks differ")


def test_a_reducer_built_from_pairs_and_every_kind_of_method_check_the_ranks():
    """SyncReducer over (name, parameter) pairs (no model), a codec, a model-averaging method
    and gossip through thinwire.attach: each raises on both ranks; agreeing ranks build with
    nothing counted."""

    def fn(comm):
        caught = []
        pairs = list(_mlp(8, 4, 2).named_parameters())
        with pytest.raises(ParameterMismatch, match=r"parameter 0 is 0\.weight \(4x8, float32\) on rank 0 but "
                                                    r"1\.bias \(2, float32\) on rank 1"):
            thinwire.SyncReducer(pairs[::-1] if comm.rank else pairs, "identity", comm)
        caught.append("pairs")
        for spec in ("topk:ratio=0.5", "dasgd:period=2", "dpsgd:topology=ring"):
            model = _mlp(8, 4, 2) if comm.rank == 0 else _mlp(8, 4)
            with pytest.raises(ParameterMismatch, match="rank 1 has 2 parameters, rank 0 has 4"):
                thinwire.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), spec, comm)
            caught.append(spec)
        model = _mlp(8, 4, 2)
        thinwire.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), "dasgd:period=2", comm)
        thinwire.SyncReducer(list(model.named_parameters()), "identity", comm)
        assert comm.meter.ops == {}
        return caught

    assert LocalWorld(2).run(fn) == [["pairs", "topk:ratio=0.5", "dasgd:period=2", "dpsgd:topology=ring"]] * 2


def test_the_trainer_names_ranks_whose_task_built_another_model(monkeypatch):
    """A task whose model differs between ranks (here: the second rank to build gets an extra
    layer) is named before the trainer's first broadcast, not left to gloo."""
    import itertools
    import threading

    from thinwire.run.config import TrainConfig
    from thinwire.run.trainer import train_rank
    from thinwire.tasks.synthetic import Synthetic

    built, lock = itertools.count(), threading.Lock()
    plain = Synthetic.build_model

    def build_model(self):
        with lock:
            n = next(built)
        model = plain(self)
        if n == 1:  # the second rank to build adds a layer
            model.add_module("extra", torch.nn.Linear(2, 2))
        return model

    monkeypatch.setattr(Synthetic, "build_model", build_model)
    cfg = TrainConfig(task="synthetic", workers=2, steps=2, eval_every=2, batch_size=8,
                      task_options={"dim": 8, "hidden": 8, "classes": 2, "samples": 64, "test_samples": 16}).resolve()
    with pytest.raises(ParameterMismatch, match=r"parameters, rank \d has \d+; the first extra is extra\.weight"):
        LocalWorld(2).run(lambda comm: train_rank(cfg, comm))

"""The compressed reduce-scatter + all-gather (thinwire.scatter) against a hand-built reference."""

from __future__ import annotations

import pytest
import torch

from thinwire.codecs.specs import build_codec
from thinwire.comm.local import LocalWorld
from thinwire.comm.meter import sent_bytes
from thinwire.hierarchical import flat_aggregator
from thinwire.scatter import ScatterMean

FOUR_BIT = "rangefloat:ef=false,min_numel=1024,bits=4,exp_bits=2,man_bits=1"


def inputs(n: int, numel: int) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(10 + r)) for r in range(n)]


def reference(xs: list[torch.Tensor], spec: str) -> torch.Tensor:
    """Chunk j's n payloads decoded and averaged in fp32, the mean encoded and decoded again."""
    n, numel = len(xs), xs[0].numel()
    c = -(-numel // n)
    codec = build_codec(spec)
    out = []
    for j in range(n):
        acc = torch.zeros(c)
        for x in xs:
            chunk = torch.zeros(c)
            part = x[j * c : (j + 1) * c]
            chunk[: part.numel()] = part
            acc += codec.decode(codec.encode(chunk))
        out.append(codec.decode(codec.encode(acc / n)))
    return torch.cat(out)[:numel]


@pytest.mark.parametrize("n,numel", [(4, 4096), (3, 5000), (2, 1031)])
def test_the_mean_is_each_chunks_decoded_average_encoded_once_more(n, numel):
    xs = inputs(n, numel)

    def rank(comm):
        x = xs[comm.rank].clone()
        mean = ScatterMean("model", x, build_codec(FOUR_BIT), comm)
        mean.reduce_({"model": x})
        return x, mean.sent_bytes["model"], mean.row_bytes, mean.step

    results = LocalWorld(n).run(rank)
    want = reference(xs, FOUR_BIT)
    for x, sent, row, step in results:
        assert torch.equal(x, results[0][0])  # every rank holds the same mean, bit for bit
        torch.testing.assert_close(x, want, rtol=0, atol=0)
        assert sent == 2 * (n - 1) * row  # n - 1 chunk payloads out, n - 1 gathered means out
        assert step == 1
    exact = torch.stack(xs).mean(0)
    assert (results[0][0] - exact).abs().max() < 0.5 * exact.abs().max()  # a 4-bit mean, not noise


def test_four_bits_send_at_least_seven_times_fewer_bytes_than_fp32_all_reduce_on_four_ranks():
    numel, n = 431_000, 4
    xs = inputs(n, numel)

    def rank(comm):
        x = xs[comm.rank].clone()
        scatter = ScatterMean("model", x, build_codec(FOUR_BIT), comm)
        scatter.reduce_({"model": x})
        gather = flat_aggregator("model", x, build_codec(FOUR_BIT), comm)
        gather.reduce_({"model": x.clone()})
        return scatter.sent_bytes["model"], gather.sent_bytes["model"]

    scatter, gather = LocalWorld(n).run(rank)[0]
    fp32 = sent_bytes("all_reduce", 4 * numel, n)
    assert fp32 / scatter >= 7.0  # 8x less the per-chunk headers
    assert gather / scatter == pytest.approx(n / 2, rel=0.01)  # all_gather: (n - 1) payloads, here 2(n - 1)/n


def test_error_feedback_keeps_what_this_ranks_chunks_did_not_carry_and_resumes_exactly():
    n, numel, spec = 2, 3000, FOUR_BIT.replace("ef=false", "ef=true")
    xs = inputs(n, numel)

    def rank(comm):
        x = xs[comm.rank].clone()
        mean = ScatterMean("model", x, build_codec(spec), comm)
        mean.reduce_({"model": x.clone()})
        codec = build_codec(spec)
        c = mean.chunk
        padded = torch.zeros(n * c)
        padded[:numel] = xs[comm.rank]
        sent = torch.cat([codec.decode(codec.encode(padded[j * c : (j + 1) * c])) for j in range(n)])[:numel]
        residual = mean.feedback.residuals["model"].clone()
        state = mean.state_dict()
        again = x.clone()
        mean.reduce_({"model": again})
        fresh = ScatterMean("model", x, build_codec(spec), comm)
        fresh.load_state_dict(state)
        resumed = x.clone()
        fresh.reduce_({"model": resumed})
        return residual, xs[comm.rank] - sent, again, resumed, fresh.step

    for residual, want, again, resumed, step in LocalWorld(n).run(rank):
        torch.testing.assert_close(residual, want, rtol=0, atol=0)
        assert torch.equal(again, resumed)
        assert step == 2


def test_a_summed_codec_or_a_gather_state_is_refused_by_name():
    def rank(comm):
        x = torch.zeros(8)
        with pytest.raises(ValueError, match="gathered codec"):
            ScatterMean("model", x, build_codec("identity"), comm)
        gather = flat_aggregator("model", x, build_codec(FOUR_BIT), comm)
        with pytest.raises(ValueError, match="scatter=true"):
            ScatterMean("model", x, build_codec(FOUR_BIT), comm).load_state_dict(gather.state_dict())
        return True

    assert LocalWorld(2).run(rank) == [True, True]


def test_a_codec_whose_wire_size_follows_its_step_is_laid_out_anew_at_every_step():
    spec = "fft:schedule=linear,theta=0.9,theta_min=0.5,horizon=4,min_numel=0"  # more bins kept each step
    n, numel = 2, 2000
    xs = inputs(n, numel)

    def rank(comm):
        mean = ScatterMean("model", xs[comm.rank], build_codec(spec), comm)
        outs, rows = [], []
        for _ in range(3):
            x = xs[comm.rank].clone()
            mean.reduce_({"model": x})
            outs.append(x)
            rows.append(mean.row_bytes)
        return outs, rows

    results = LocalWorld(n).run(rank)
    rows = results[0][1]
    assert rows[0] < rows[1] < rows[2]  # the payload grew with the schedule
    exact = torch.stack(xs).mean(0)
    errors = [float((results[0][0][step] - exact).norm() / exact.norm()) for step in range(3)]
    for step in range(3):
        assert torch.equal(results[0][0][step], results[1][0][step])  # one mean on every rank
    # a mean, not bytes read at the wrong offsets: below the whole signal, and closer as more bins travel
    assert 0.9 > errors[0] > errors[1] > errors[2], errors

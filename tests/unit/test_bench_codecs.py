"""`thinwire bench codecs` reports true bytes and errors (not its speed: no timed assertions)."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from thinwire.codecs.specs import build_codec
from thinwire.lab.bench_codecs import main, split_specs
from thinwire.tasks.mnist1d import cnn

SPECS = "identity;topk:ratio=0.01"
SIZE = 4096  # the large input becomes a 64x64 matrix


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(quick=True, methods=SPECS, repeats=5, out=str(out), size=SIZE, inputs=("mnist1d", "large"))
    rows = json.loads((out / "codecs.json").read_text())["rows"]
    return code, out, {(r["method"], r["input"]): r for r in rows}


def test_runs_and_writes_every_row(report):
    code, out, rows = report
    assert code == 0
    assert set(rows) == {(m, i) for m in ("identity", "topk:ratio=0.01") for i in ("mnist1d grad", "gaussian 64x64")}
    with open(out / "codecs.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert "| identity | mnist1d grad |" in (out / "codecs.md").read_text()


def test_identity_is_exact_and_sends_fp32(report):
    _, _, rows = report
    mnist_fp32 = 4 * sum(p.numel() for p in cnn().parameters())
    for inp, fp32 in (("mnist1d grad", mnist_fp32), ("gaussian 64x64", 4 * SIZE)):
        r = rows[("identity", inp)]
        assert r["rel_error"] == 0.0
        assert r["fp32_bytes"] == r["wire_bytes"] == r["nbytes"] == fp32
        assert r["compression"] == 1.0
        assert r["seconds"] > 0 and r["copy_seconds"] > 0 and r["repeats"] == 5


def test_topk_wire_bytes_equal_codec_nbytes(report):
    _, _, rows = report
    codec = build_codec("topk:ratio=0.01")
    shapes = [p.shape for p in cnn().parameters()]
    # declined tensors (1-D, or fewer than min_numel elements) travel as fp32, as in the Aggregator
    expect = sum(codec.nbytes(s, torch.float32) if codec.compresses(s) else 4 * s.numel() for s in shapes)
    r = rows[("topk:ratio=0.01", "mnist1d grad")]
    assert r["wire_bytes"] == r["nbytes"] == expect
    assert r["compressed"] == sum(codec.compresses(s) for s in shapes) == 4
    assert r["compression"] == pytest.approx(r["fp32_bytes"] / expect)

    big = rows[("topk:ratio=0.01", "gaussian 64x64")]
    k = math.ceil(0.01 * SIZE)  # 41 fp32 values + 41 int32 indices
    assert big["wire_bytes"] == big["nbytes"] == 8 * k == codec.nbytes(torch.Size([64, 64]), torch.float32)
    # top 1% of a gaussian keeps ~10% of its energy: the error is well inside (0, 1)
    assert 0.85 < big["rel_error"] < 0.99


def test_bad_spec_is_exit_code_2(capsys):
    assert main(quick=True, methods="nosuchcodec", repeats=5, size=SIZE, inputs=("large",)) == 2
    assert "unknown codec" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, specs",
    [
        ("identity;topk:ratio=0.01,ef=false", ["identity", "topk:ratio=0.01,ef=false"]),
        ("identity,topk:ratio=0.01,ef=false,powersgd:rank=4",
         ["identity", "topk:ratio=0.01,ef=false", "powersgd:rank=4"]),
        ("bf16, qsgd", ["bf16", "qsgd"]),
    ],
)
def test_split_specs(text, specs):
    assert split_specs(text) == specs

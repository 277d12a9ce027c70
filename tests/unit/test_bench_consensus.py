"""``thinwire bench consensus``: curves fall, the CSV holds them, bad input exits 2."""

import csv

from thinwire.cli import main
from thinwire.lab.bench_consensus import curve, first_below


def test_uncompressed_gossip_reaches_consensus_and_powergossip_falls():
    rows = curve("dpsgd", 4, 10, "ring", 200)
    assert rows[0][2] == 1.0 and rows[-1][2] < 1e-4  # relative to its start
    hit = first_below(rows, 1e-2)
    assert hit is not None and hit[1] == hit[0] * 2 * 4 * 100 * 8  # 2 neighbours x 100 fp32 per step, in bits
    pg = curve("powergossip:rank=2", 4, 10, "ring", 60)
    assert all(b[2] < a[2] for a, b in zip(pg, pg[1:]))


def test_cli_writes_the_curves(tmp_path, capsys):
    out = tmp_path / "c.csv"
    code = main(["bench", "consensus", "--workers", "4", "--size", "8", "--max-steps", "30", "--methods",
                 "dpsgd;powergossip:rank=1", "--out", str(out)])
    assert code == 0
    rows = list(csv.DictReader(out.open()))
    assert {r["method"] for r in rows} == {"dpsgd", "powergossip:rank=1"}
    text = capsys.readouterr().out
    assert "[2/2] powergossip:rank=1: 30 steps" in text and f"wrote {out}" in text


def test_cli_bad_input_exits_2(capsys):
    assert main(["bench", "consensus", "--methods", "topk"]) == 2
    assert "consensus runs gossip methods" in capsys.readouterr().err
    assert main(["bench", "consensus", "--topology", "torus", "--workers", "8"]) == 2
    assert "8 has no such factorisation" in capsys.readouterr().err

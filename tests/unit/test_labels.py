"""Runs are named by what the user typed (one helper: labels, short, slug), and the progress
bars and tables fit 80 columns without splitting a word: a long label is cut with '…'."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from thinwire.lab.bench_consensus import table as consensus_table
from thinwire.run.config import TrainConfig
from thinwire.run.console import spaced, summary_tables
from thinwire.run.labels import labels, short, slug
from thinwire.run.progress import ProgressView, bar_label
from tiny import fake_summary

POLICY = "examples/policies/a-rather-long-policy-file-for-conv-nets.toml"
RESOLVED = ("policy[kernels:r_max=0.3,ef=true,granularity=kernel,score=l1,min_numel=0; twobit:alpha=1.0,ef=true; "
            "identity:ef=false,min_numel=0]")


def test_short_cuts_the_middle_and_keeps_both_ends():
    assert short("topk:ratio=0.01") == "topk:ratio=0.01"
    assert short("abcdefghij", 7) == "abc…hij"
    assert short("abcdefghij", 6) == "abc…ij"
    assert short("abcdefghij", 2) == "a…"
    assert short("  two   words ") == "two words"
    assert short(POLICY) == "examples/policie…-conv-nets.toml"  # 32 characters


def test_labels_name_a_method_alone_unless_two_runs_share_it():
    assert labels(["identity", "topk:ratio=0.01", "torch-ddp"]) == ["identity", "topk", "torch-ddp"]
    assert labels(["dpsgd", "powergossip:rank=1", "powergossip:rank=2"]) == [
        "dpsgd", "powergossip:rank=1", "powergossip:rank=2"]
    assert labels(["dpsgd", "powergossip:rank=1"], alone=False) == ["dpsgd", "powergossip:rank=1"]
    assert labels(["dpsgd", "powergossip:rank=1"]) == ["dpsgd", "powergossip"]
    # variants that differ only in the part a cut takes away stay apart by their position
    a, b = "topk:" + "x" * 20 + "1" + "y" * 20, "topk:" + "x" * 20 + "2" + "y" * 20
    assert labels([a, b], width=12) == ["topk…yyy #1", "topk…yyy #2"]


@pytest.mark.parametrize("spec, folder", [
    ("torch-ddp", "torch-ddp"), ("torch-ddp:", "torch-ddp"), ("topk:ratio=0.01", "topk-ratio=0.01"),
    ("dasgd:codec=randomk:ratio=0.1;seed=1", "dasgd-codec=randomk-ratio=0.1_seed=1"),
    (" :: ", "method"), ("a b/c", "a_b_c"),
])
def test_run_folder_names_never_end_in_a_separator(spec, folder):
    assert slug(spec) == folder


def _render(*renderables, width: int = 80) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    for r in renderables:
        console.print(r)
    return console.export_text()


def _tokens(text: str) -> list[str]:
    """The rendered words: whitespace and table rules apart."""
    return re.sub(r"[│┃┏┓┗┛┡┩└┘┌┐├┤┬┴┼━─╇╈╋╭╮╰╯═║]", " ", text).split()


def assert_fits(text: str, words: list[str], width: int = 80) -> None:
    """No line is wider than ``width``; every word is shown whole, or cut with '…' (its
    start before it, its end after it), never split across two lines."""
    assert max(len(line) for line in text.splitlines()) <= width, text
    shown = _tokens(text)
    for word in words:
        if word in shown:
            continue
        cut = [t for t in shown if "…" in t and word.startswith(t.split("…")[0]) and word.endswith(t.split("…")[1])
               and len(t) > 1]
        assert cut, f"{word!r} is split or missing in:\n{text}"


def test_the_progress_bar_fits_80_columns_with_a_long_policy_label():
    cfg = TrainConfig(task="mnist1d", method=RESOLVED, label=POLICY, workers=4, steps=12000)
    console = Console(width=80, record=True, file=io.StringIO())
    view = ProgressView(cfg, console=console)
    view.handle("step", step=400, loss=2.301049)
    view.handle("eval", step=400, train_loss=2.3, test_accuracy=0.91234)
    console.print(view.progress.get_renderable())
    text = console.export_text()
    first, second = [line for line in text.splitlines() if line.strip()][-2:]
    assert first.startswith("mnist1d examples/poli…nv-nets.toml x4 ")  # the typed file, cut to fit
    assert "400/12000" in first and re.search(r" eta -:--:--$", first.rstrip())
    assert second.strip() == "train loss 2.3010  test acc 0.912"
    assert_fits(text, ["mnist1d", POLICY, "x4", "400/12000", "train", "loss", "2.3010", "test", "acc", "0.912", "eta"])


def test_the_bar_label_is_the_typed_spec_and_never_the_resolved_one():
    cfg = TrainConfig(task="charlm", method="topk:ef=true,min_numel=1024,ratio=0.01", label="topk:ratio=0.01",
                      workers=2).resolve()
    assert bar_label(cfg, 60) == "charlm topk:ratio=0.01 x2"
    assert TrainConfig(task="charlm", method="topk:ratio=0.01").resolve().label == "topk:ratio=0.01"


def _summary(**over):
    s = {"task": "charlm", "method": RESOLVED, "config": {"label": POLICY}, "workers": 4, "steps": 800,
         "final_accuracy": None, "final_bpc": 2.1, "final_loss": 1.4567, "bytes_sent_per_worker": 1.5e6,
         "fp32_bytes_per_worker": 6e6, "compression_ratio": 4.0, "wall_seconds": 12.0, "compute_seconds": 9.0,
         "codec_seconds": 1.0, "comm_seconds": 2.0,
         "modeled_seconds_by_link": {"1gbit,50us": 13.0, "100mbit,1ms": 19.0}, "method_report": {"policy": True},
         "per_parameter": [{"name": "blocks.0.attention.query_key_value_projection.weight", "shape": [384, 128],
                            "codec": "kernels:r_max=0.3", "bytes_sent_per_worker": 1000.0,
                            "fp32_bytes_per_worker": 4000.0}]}
    return fake_summary(**{**s, **over})


def test_the_summary_tables_fit_80_columns_and_say_which_loss():
    text = _render(*summary_tables(_summary()))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in text.splitlines()
            if line.count("│") == 3}
    assert rows["final test loss"] == "1.4567" and rows["final test bpc"] == "2.1000"
    assert "final loss" not in text
    assert rows["method"] == "examples/policie…-conv-nets.toml"
    assert_fits(text, [*spaced(RESOLVED).split(), POLICY, "blocks.0.attention.query_key_value_projection.weight",
                       "384x128", "kernels", "1.0", "KB", "4.0x"])


def test_figures_of_the_validation_windows_are_named_so():
    text = _render(*summary_tables(_summary(config={"label": POLICY, "task_options": {"eval_split": "valid"}})))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in text.splitlines()
            if line.count("│") == 3}
    assert rows["final validation loss"] == "1.4567" and "final test" not in text


def test_resolved_specs_break_between_knobs():
    assert spaced("topk:ef=true,ratio=0.01") == "topk:ef=true, ratio=0.01"
    assert spaced("policy[a:x=1; b:y=2,z=3]") == "policy[a:x=1; b:y=2, z=3]"


def test_bench_consensus_names_each_variant_whole_at_80_columns():
    specs = ["dpsgd", "powergossip:rank=1", "powergossip:rank=2", "powergossip:rank=4"]
    curves = {s: [(0, 0.0, 1.0), (120, 1.234e6, 0.009), (3000, 9.87e7, 2.3e-5)] for s in specs}
    text = _render(consensus_table(curves, 8, 100, "ring"))
    names = [line.split("│")[1].strip() for line in text.splitlines() if line.count("│") == 6]
    assert [n for n in names if n] == specs
    assert_fits(text, [*specs, "1.23e+06", "9.87e+07", "(step", "120)", "3000", "2.3e-05"])


def test_thinwire_methods_fits_80_columns_and_keeps_every_choice_whole(monkeypatch, capsys):
    from thinwire.algorithms.methods import METHODS
    from thinwire.cli import main
    from thinwire.codecs.specs import CODECS, knob_table

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    words = set(out.split())
    for registry in (CODECS, METHODS):
        for entry in registry.entries():
            for _, _, allowed, _ in knob_table(entry.Config):
                if "|" in allowed and len(allowed) > 24:  # the long lists of choices, wrapped between choices
                    assert set(allowed.split("|")) <= words, allowed


def test_the_cost_table_on_an_80_column_terminal_is_a_block_per_method():
    from thinwire.lab.commands import print_cost

    columns = ["method", "MB / step", "compute ms", "ms @ 100mbit,1ms", "beats bf16", "its bandwidths over the repeats"]
    rows = [["bf16", "0.624", "21.0 [20.3–25.8]", "75.4 [74.9–80.0]", "(the reference)", "-"],
            ["topk:ratio=0.05", "0.054", "23.2 [21.4–25.4]", "42.7 [41.0–46.6]", "below 207 Mbit/s",
             "repeats: above 665 Mbit/s; above 668 Mbit/s; never"]]
    title = "mnist1d · 4 workers · predicted milliseconds per step (median \\[min-max] of 3 repeats)"
    caption = "step = compute + G - min(window, early x G); " * 4
    narrow = Console(width=80, record=True, file=io.StringIO(), force_terminal=True)
    print_cost(narrow, title, caption, columns, rows, wide=260)
    text = narrow.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "topk:ratio=0.05" in lines and "  its bandwidths over the repeats: repeats: above 665 Mbit/s; above" in text
    assert "(median [min-max] of 3" in text and "\\[" not in text  # the title's markup escape is not printed
    for row in rows:  # every cell whole: no word split across lines
        for cell in row:
            assert set(cell.split()) <= set(text.split()), cell
    wide = Console(width=260, record=True, file=io.StringIO(), force_terminal=True)
    print_cost(wide, title, caption, columns, rows, wide=260)
    assert any(line.startswith("│ topk:ratio=0.05 ") for line in wide.export_text().splitlines())  # the table

"""benchmarks/bench_gpu.py at tiny sizes on the CPU: every section in its files, figures that
agree with one another and with thinwire's cost model, what `thinwire cost --compute-from`
reads, and a run the time guard cuts short (no timed assertions)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from thinwire.codecs.specs import available
from thinwire.comm.link import Link

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"
GPU_MD = ROOT / "benchmarks" / "results" / "gpu.md"
MODELS = ("transformer", "resnet18")
SLOW_LINK = ("diloco-4bit", "sparseloco", "demo")

pytestmark = [pytest.mark.spawns, pytest.mark.timeout(180)]


def _run(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=150)


def _state(path: Path) -> tuple[bool, float | None]:
    return path.exists(), path.stat().st_mtime if path.exists() else None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "gpu.md"
    before = _state(GPU_MD)
    done = _run(out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _state(GPU_MD) == before  # a CPU run leaves the GPU's results file alone
    return out, out.read_text(), json.loads(out.with_suffix(".json").read_text())


def test_every_section_is_in_both_files(run):
    _, md, data = run
    for title in ("## Compute step", "## Codecs: encode + decode", "## FFT against top-k at equal bytes",
                  "## DDP hook on one device", "## Figures", "## Sections"):
        assert title in md
    assert data["sections"] == {"compute": "done", "codecs": "done", "fft_vs_topk": "done", "ddp": "done"}
    assert data["skipped"] == [] and data["failed"] == [] and data["tiny"] is True
    for key in MODELS:
        assert data["models"][key]["compute"]["ms"] > 0 and f"| {key} |" in md
        assert data["ddp"][key]["ratio"] > 0 and data["ddp"][key]["ddp_ms"] > 0
        assert set(data["fft_vs_topk"][key]["links"]) == {"10gbit,10us", "1gbit,50us"}
    assert md.count("| thinwire / DDP |") == 1


def test_a_row_per_codec_and_model(run):
    _, md, data = run
    for key in MODELS:
        codecs = data["models"][key]["codecs"]
        assert set(codecs) == {*available(), "hylo", *SLOW_LINK}
        for label in codecs:
            assert f"| {label} | {key} |" in md


def test_the_figures_agree_with_one_another(run):
    _, _, data = run
    n = data["workers"]
    assert n == 8
    for key in MODELS:
        model = data["models"][key]
        compute_ms, rows = model["compute"]["ms"], model["codecs"]
        for label, r in rows.items():
            assert r["share"] == pytest.approx(r["ms"] / compute_ms, rel=1e-12), label
            assert r["gbps"] == pytest.approx(4 * model["gradient_elements"] / (r["ms"] / 1e3) / 1e9, rel=1e-12)
        # identity: every gradient element as fp32, summed (ring all_reduce: 2(n-1)/n of it sent)
        elements = model["gradient_elements"]
        assert rows["identity"]["payload_bytes"] == 4 * elements
        assert rows["identity"]["sent_bytes"] == pytest.approx(2 * (n - 1) / n * 4 * elements, rel=1e-12)
        assert rows["bf16"]["payload_bytes"] == 2 * elements  # every tensor cast (min_numel 0)


def _break_even(row: dict, ref: dict) -> list[float]:
    """compute + codec + sent / B = compute + codec_ref + sent_ref / B, by hand (no latency)."""
    dsent, dcodec = ref["sent_bytes"] - row["sent_bytes"], (row["ms"] - ref["ms"]) / 1e3
    if dcodec == 0 or dsent == 0 or (dsent > 0) != (dcodec > 0):
        return []
    return [dsent / dcodec]


def test_the_break_even_bandwidths_are_the_hand_computed_ones(run):
    _, _, data = run
    assert data["break_even_latency_s"] == 0.0
    checked = 0
    for key in MODELS:
        rows = data["models"][key]["codecs"]
        for label, r in rows.items():
            if r["kind"] == "slow-link" and label != "demo":
                assert "beats_bf16" not in r  # once per sync: no per-step verdict
                continue
            for ref, field in (("bf16", "beats_bf16"), ("identity", "beats_fp32")):
                if label == ref:
                    assert r[field] == "(the reference)"
                    continue
                want = _break_even(r, rows[ref])
                assert r[f"{field}_Bps"] == pytest.approx(want, rel=1e-9), (key, label, ref)
                mine, theirs = (r["ms"], r["sent_bytes"]), (rows[ref]["ms"], rows[ref]["sent_bytes"])
                words = r[field]
                if want:  # a crossing: faster on the side where it sends fewer bytes
                    assert words.startswith("below" if mine[1] < theirs[1] else "above"), (label, words)
                else:  # none: faster everywhere when never slower and never sending more
                    always = mine[0] <= theirs[0] and mine[1] <= theirs[1] and mine != theirs
                    assert words == ("always" if always else "never"), (label, words)
                checked += 1
    assert checked > 20


def test_fft_against_topk_is_at_equal_bytes_and_the_modelled_steps_are_the_cost_model_s(run):
    _, md, data = run
    n = data["workers"]
    for key in MODELS:
        entry = data["fft_vs_topk"][key]
        fft, topk = entry["fft"], entry["topk"]
        assert entry["topk_spec"] == f"topk:ratio={entry['topk_ratio']:g}" and 0 < entry["topk_ratio"] < 1
        assert topk["payload_bytes"] == pytest.approx(fft["payload_bytes"], rel=0.02)
        compute = data["models"][key]["compute"]["ms"] / 1e3
        for text, figures in entry["links"].items():
            link = Link.parse(text)
            for name, r in (("fft", fft), ("topk", topk)):
                wire = r["messages"] * link.latency_s + r["sent_bytes"] / link.bandwidth_Bps  # alpha-beta
                by_hand = compute + r["ms"] / 1e3 + wire
                assert figures[f"{name}_ms"] / 1e3 == pytest.approx(by_hand, rel=1e-9)
            assert figures["speedup"] == pytest.approx(figures["topk_ms"] / figures["fft_ms"], rel=1e-12)
        assert n == 8 and f"| {key} | {entry['topk_spec']} |" in md


def test_the_figures_are_marked_as_the_gpu_s_and_no_machine_path_is_written(run):
    out, md, data = run
    names = [f["name"] for f in data["figures"]]
    assert {f"codec_share[{c}]" for c in [*available(), "hylo"]} <= set(names)
    assert {"ddp_hook_identity[transformer]", "ddp_hook_identity[resnet18]", "wall_time"} <= set(names)
    assert "fft_speedup_over_topk[transformer @ 1gbit,50us]" in names
    assert all(f["verdict"] == "n/a (CPU tiny)" for f in data["figures"])
    assert "PASS" not in md and "MISS" not in md and "targets are GPU targets" in md
    assert data["wall_s"] > 0 and math.isfinite(data["wall_s"])
    for text in (md, out.with_suffix(".json").read_text()):
        assert str(out.parent) not in text and str(ROOT) not in text
    assert data["command"] == "python benchmarks/bench_gpu.py --out gpu.md"


def test_thinwire_cost_reads_the_file_it_writes(run):
    from thinwire.algorithms.methods import resolve_method
    from thinwire.lab.gpu_results import checked, model_for

    out, _, data = run
    checked(data, str(out))
    record = data["models"]["transformer"]
    got = model_for(data, "gpu.json", task=record["task"], options=record["task_options"],
                    batch_size=record["batch_size"], parameters=record["parameters"])
    assert got.compute_s == record["compute"]["ms"] / 1e3 and got.workers == 8
    assert got.codec_s[resolve_method("topk")] == record["codecs"]["topk"]["ms"] / 1e3
    assert got.codec_s[resolve_method("hylo")] == record["codecs"]["hylo"]["ms"] / 1e3
    assert record["task"] == "text" and record["task_options"]["model"] == "gpt-small"
    assert data["models"]["resnet18"]["task"] is None  # no thinwire task builds it: no probe matches it


def test_a_run_cut_short_keeps_what_it_finished_and_names_what_it_skipped(tmp_path):
    out = tmp_path / "short.md"
    done = _run(out, "--time-budget", "0", "--models", "transformer", "--codecs", "identity")
    assert done.returncode == 0, done.stderr[-3000:]
    md, data = out.read_text(), json.loads(out.with_suffix(".json").read_text())
    # the compute section always runs; the others found the budget spent before they began
    assert "## Compute step" in md and "| transformer |" in md and data["models"]["transformer"]["compute"]["ms"] > 0
    assert data["sections"] == {"compute": "done", "codecs": "skipped (time guard)",
                                "fft_vs_topk": "skipped (time guard)", "ddp": "skipped (time guard)"}
    for title in ("Codecs: encode + decode of each gradient set", "FFT against top-k at equal bytes",
                  "DDP hook on one device"):
        assert f"- {title}: skipped (time guard)" in md
        assert any(s.startswith(f"{title}: the time guard") for s in data["skipped"])
    assert "## Codecs" not in md and "## DDP hook" not in md

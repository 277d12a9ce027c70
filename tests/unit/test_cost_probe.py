"""thinwire cost's probes on real spawned ranks (gloo, a tiny task): a budget in seconds bounds
a probe, a periodic method's bounded probe still holds its sync, the ranks skip evaluation, and
SIGTERM prints what was probed so far."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from thinwire.lab import cost
from thinwire.run.config import TrainConfig

TINY = {"dim": 8, "hidden": 8, "classes": 2, "samples": 64, "test_samples": 16}
OPTIONS = [a for k, v in TINY.items() for a in ("--option", f"{k}={v}")]


def _base() -> TrainConfig:
    return TrainConfig(task="synthetic", workers=2, task_options=TINY, batch_size=8).resolve()


@pytest.mark.spawns
@pytest.mark.timeout(240)
def test_a_budget_bounds_a_real_probe_and_a_periodic_one_keeps_its_sync():
    from thinwire.run.launch import launch
    from thinwire.tasks import get

    records: list[list[dict]] = []

    def keep(cfg, show_progress=False):  # the real launch; its records read before the probe's folder goes
        summary = launch(cfg, show_progress=show_progress)
        records.append([json.loads(line) for line in Path(cfg.out, "metrics.jsonl").read_text().splitlines()])
        return summary

    # 0.5 s of steps at 0.1 s a step: 5 steps of the 50 + 50 asked, one of them the warm-up
    costs, failed = cost.probe(_base(), ["bf16"], 50, pace=cost.Pace(0.5, 0.1), launch=keep, say=lambda line: None)
    assert not failed and costs["bf16"].probe_steps == 4
    assert [r["step"] for r in records[0]] == [1, 2, 3, 4, 5]  # a record at every step: both ends of the span
    assert all("test_loss" not in r and "test_accuracy" not in r for r in records[0])  # evaluation skipped
    # DiLoCo every 6 steps with room for 2 steps: 1 + 6, so the one sync is in the timed span
    costs, failed = cost.probe(_base(), ["diloco:period=6"], 4, pace=cost.Pace(0.2, 0.1), launch=keep,
                               say=lambda line: None)
    numel = sum(p.numel() for p in get("synthetic")(**TINY).build_model().parameters())
    sync = 2 * (2 - 1) / 2 * 4 * numel  # one fp32 ring all_reduce of the model on 2 ranks
    d = costs["diloco:period=6"]
    assert not failed and d.probe_steps == 6 and [r["step"] for r in records[1]] == list(range(1, 8))
    assert d.bytes == pytest.approx(sync / 6) and d.peak_bytes == pytest.approx(sync)


@pytest.mark.spawns
@pytest.mark.timeout(240)
def test_probe_seconds_bounds_each_probe_of_the_command():
    r = subprocess.run([sys.executable, "-m", "thinwire", "cost", "--task", "synthetic", *OPTIONS, "--batch-size", "8",
                        "--workers", "2", "--probe-steps", "5000", "--probe-seconds", "0.5", "--methods", "identity",
                        "--link", "1gbit,50us"], capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr
    probes = re.findall(r"probing (\w+): (\d+) \+ (\d+) steps on 2 workers \(0\.5 s of steps at about ([\d.e-]+) s a "
                        r"step\)", r.stdout)
    assert [p[0] for p in probes] == ["bf16", "identity"], r.stdout
    for _, warm, timed, step_s in probes:  # sized to the pace printed (3 digits): what fits in 0.5 s, or 1 + 1
        steps = int(warm) + int(timed)
        assert int(warm) == 1 and 1 <= int(timed) < 5000
        assert steps == 2 or steps * float(step_s) <= 0.5 * 1.01, (steps, step_s)
    rows = [line.split("│")[1].strip() for line in r.stdout.splitlines() if line.startswith("│")]
    assert rows == ["bf16", "identity"]


@pytest.mark.spawns
@pytest.mark.timeout(240)
def test_sigterm_prints_the_methods_probed_so_far_and_exits_143():
    p = subprocess.Popen([sys.executable, "-m", "thinwire", "cost", "--task", "synthetic", *OPTIONS, "--batch-size",
                          "8", "--workers", "2", "--probe-steps", "20000", "--probe-seconds", "2", "--methods",
                          "identity", "--link", "1gbit,50us"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        seen = []
        assert p.stdout is not None
        for line in p.stdout:  # bf16's 2 s of steps, then its row
            seen.append(line)
            if line.startswith("  bf16: "):
                break
        assert seen and seen[-1].startswith("  bf16: "), "".join(seen)
        for line in p.stdout:  # identity's probe starts (2 s of steps, after its ranks' start-up)
            seen.append(line)
            if line.startswith("[2/2] probing identity"):
                break
        p.send_signal(signal.SIGTERM)  # in its launch (or just before it: the command's own handler)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 143, err
    assert "thinwire cost: stopped by SIGTERM; the methods probed so far:\n" in out
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert rows == ["bf16"]
    assert err.strip().splitlines()[-1] == "thinwire: stopped by SIGTERM"

"""``thinwire cost``: before training, predict each method's step time on a link and say
where compression pays off.

Each method runs a short probe on this machine (real training steps on the task with
``--workers`` spawned ranks, as ``thinwire train`` would): ``--probe-steps`` warm-up steps,
then as many timed ones, which give per step: compute seconds, codec seconds, bytes and
messages each worker sends (rank 0's; the warm-up's start-up costs are left out). The alpha-beta
model (METHODS.md §0.4) then predicts the step time on a link of latency α and bandwidth
β::

    T(α, β) = compute + codec + messages · α + bytes / β

(every collective's modeled time is linear in its messages and bytes, so per-step totals
suffice; this is what ``--emulate-link`` delays by). The verdict compares a method with
``bf16`` (a 2-byte cast all_reduce, the bar a user has today): at the first link's α the
two times are equal at one bandwidth β*, and the method pays off below β* when it sends
fewer bytes (above it when it sends more). Overlap that DaSGD gets by hiding averages
behind computation is not credited: its prediction is an upper bound.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from thinwire.comm.link import Link
from thinwire.run.config import TrainConfig

DEFAULT_METHODS = "identity,bf16,topk:ratio=0.01,powersgd:rank=2,fft,hylo"
REFERENCE = "bf16"


@dataclass(frozen=True)
class StepCost:
    """Per-step figures of one method from its probe."""

    method: str
    compute_s: float
    codec_s: float
    bytes: float  # sent by one worker
    messages: float

    def seconds(self, link: Link) -> float:
        return self.compute_s + self.codec_s + self.messages * link.latency_s + self.bytes / link.bandwidth_Bps


def crossover_Bps(m: StepCost, ref: StepCost, latency_s: float) -> float | None:
    """The bandwidth (bytes/s) at which ``m`` and ``ref`` take equally long per step at this
    latency; None when their times never cross (one is faster at every bandwidth)."""
    bytes_diff = m.bytes - ref.bytes
    fixed_diff = (ref.compute_s + ref.codec_s + ref.messages * latency_s) - (m.compute_s + m.codec_s + m.messages * latency_s)
    if bytes_diff == 0 or fixed_diff == 0 or (bytes_diff > 0) != (fixed_diff > 0):
        return None
    return bytes_diff / fixed_diff


def verdict(m: StepCost, ref: StepCost, latency_s: float) -> str:
    """Where ``m`` beats ``ref`` at this latency, in words: ``below X`` (links slower than
    X), ``above X``, ``always``, ``never`` (bandwidths in Gbit/s or Mbit/s)."""
    if m.method == ref.method:
        return "(the reference)"
    beta = crossover_Bps(m, ref, latency_s)
    if beta is None:
        fixed_m = m.compute_s + m.codec_s + m.messages * latency_s
        fixed_ref = ref.compute_s + ref.codec_s + ref.messages * latency_s
        return "always" if fixed_m <= fixed_ref and m.bytes <= ref.bytes else "never"
    return f"{'below' if m.bytes < ref.bytes else 'above'} {_rate(beta)}"


def _rate(bytes_per_s: float) -> str:
    bits = 8 * bytes_per_s
    return f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"


def from_summary(method: str, summary: dict[str, Any]) -> StepCost:
    steps = summary["steps"]
    return StepCost(method=method, compute_s=summary["compute_seconds"] / steps,
                    codec_s=summary["codec_seconds"] / steps,
                    bytes=summary["bytes_sent_per_worker"] / steps,
                    messages=summary["messages_per_worker"] / steps)


def from_rows(method: str, first: dict[str, Any], last: dict[str, Any]) -> StepCost:
    """Per-step figures between two metrics.jsonl records (cumulative counters)."""
    steps = last["step"] - first["step"]
    if steps <= 0:
        raise ValueError(f"records at steps {first['step']} and {last['step']} span no steps")
    return StepCost(method=method, compute_s=(last["compute_seconds"] - first["compute_seconds"]) / steps,
                    codec_s=(last["codec_seconds"] - first["codec_seconds"]) / steps,
                    bytes=(last["bytes_sent"] - first["bytes_sent"]) / steps,
                    messages=(last["messages"] - first["messages"]) / steps)


def probe(base: TrainConfig, specs: list[str], steps: int, *, launch: Callable[..., Any] | None = None,
          say: Callable[[str], None] = print) -> tuple[dict[str, StepCost], dict[str, str]]:
    """Run ``steps`` warm-up and ``steps`` timed training steps of every method; per-step
    costs of the timed steps by spec, and the error of each probe that failed (the others
    still run)."""
    if launch is None:
        from thinwire.run.launch import launch
    out: dict[str, StepCost] = {}
    failed: dict[str, str] = {}
    for i, spec in enumerate(specs, 1):
        say(f"[{i}/{len(specs)}] probing {spec.split(':')[0]}: {steps} + {steps} steps on {base.workers} workers")
        with tempfile.TemporaryDirectory(prefix="thinwire-probe-") as tmp:
            cfg = dataclasses.replace(base, method=spec, steps=2 * steps, eval_every=steps, out=tmp, overwrite=True)
            try:
                summary = launch(cfg, show_progress=False)
                rows = _rows(Path(tmp) / "metrics.jsonl")
                out[spec] = from_rows(spec, rows[-2], rows[-1]) if len(rows) >= 2 else from_summary(spec, summary)
            except Exception as e:  # noqa: BLE001  (a failed probe is reported; the others go on)
                failed[spec] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return out, failed


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

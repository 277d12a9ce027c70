"""``thinwire cost``: before training, predict each method's step time on a link and say
where compression pays off.

Each method runs a short probe on this machine (real training steps on the task with
``--workers`` spawned ranks, as ``thinwire train`` would): ``--probe-steps`` warm-up steps,
then as many timed ones, which give per step: compute seconds, codec seconds, bytes and
messages each worker sends, and the seconds its collectives took here with no link in the
way (rank 0's figures; the warm-up's start-up costs are left out). The alpha-beta model
(METHODS.md §0.4) then predicts the step time on a link of latency α and bandwidth β::

    T(α, β) = compute + codec + max(wait, messages · α + bytes / β)

``messages · α + bytes / β`` is the link's time for the step's collectives (every model time
is linear in messages and bytes, so per-step totals suffice; ``--emulate-link`` delays by
exactly this). ``wait`` is the probe's own communication time: ranks waiting for one
another (a rank that computes or encodes longer holds the others up) and the transport's
own work. No link makes a collective faster than that, and a slow link hides it, hence the
``max`` (ours; it is also how ``--emulate-link`` combines the real and the modeled time).

The verdict compares a method with ``bf16`` (a 2-byte cast all_reduce, the bar a user has
today) at the first link's α: both times are piecewise linear in 1/β, so the bandwidths
where they are equal are found exactly, and the verdict names the bandwidths where the
method is faster ("below X", "above X", "between X and Y", "always", "never"). Overlap
that DaSGD gets by hiding averages behind computation is not credited: its prediction is
an upper bound.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
    wait_s: float = 0.0  # its collectives' time here, with no link

    def seconds(self, link: Link) -> float:
        return self._at(link.latency_s, 1.0 / link.bandwidth_Bps)

    def _at(self, latency_s: float, x: float) -> float:
        """Step time at latency ``latency_s`` and ``x`` = 1 / bandwidth (seconds per byte)."""
        return self.compute_s + self.codec_s + max(self.wait_s, self.messages * latency_s + self.bytes * x)

    def _kink(self, latency_s: float) -> float | None:
        """The ``x`` where the link's time overtakes ``wait`` (None: it always has, or never will)."""
        fixed = self.messages * latency_s
        return (self.wait_s - fixed) / self.bytes if self.bytes > 0 and self.wait_s > fixed else None

    def _slope(self, latency_s: float, x: float) -> float:
        return self.bytes if self.messages * latency_s + self.bytes * x >= self.wait_s else 0.0


def crossings_Bps(m: StepCost, ref: StepCost, latency_s: float) -> list[float]:
    """The bandwidths (bytes/s, ascending) at which ``m`` and ``ref`` take equally long per step
    at this latency. Both step times are piecewise linear in x = 1/β with at most one kink
    each, so the difference is solved exactly piece by piece."""
    kinks = sorted({k for k in (m._kink(latency_s), ref._kink(latency_s)) if k is not None and k > 0})
    bounds = [0.0, *kinks, math.inf]
    roots: set[float] = set()
    for lo, hi in zip(bounds, bounds[1:]):
        inside = (lo + hi) / 2 if hi < math.inf else 2 * lo + 1.0
        slope = m._slope(latency_s, inside) - ref._slope(latency_s, inside)
        d_lo = m._at(latency_s, lo) - ref._at(latency_s, lo)
        if slope == 0:
            continue  # parallel on this piece: equal everywhere (no single crossing) or nowhere
        x = lo - d_lo / slope
        if lo < x < hi or (x == hi and hi < math.inf):
            roots.add(1.0 / x)
    return sorted(roots)


def crossover_Bps(m: StepCost, ref: StepCost, latency_s: float) -> float | None:
    """The lowest bandwidth (bytes/s) at which ``m`` and ``ref`` take equally long per step at
    this latency; None when their times never cross."""
    found = crossings_Bps(m, ref, latency_s)
    return found[0] if found else None


def verdict(m: StepCost, ref: StepCost, latency_s: float) -> str:
    """Where ``m`` beats ``ref`` at this latency, in words: ``below X`` (links slower than
    X), ``above X``, ``between X and Y``, ``below X or above Y``, ``always``, ``never``
    (bandwidths in Gbit/s or Mbit/s)."""
    if m.method == ref.method:
        return "(the reference)"
    roots = crossings_Bps(m, ref, latency_s)

    def faster(beta: float) -> bool:
        return m._at(latency_s, 1.0 / beta) < ref._at(latency_s, 1.0 / beta)

    if not roots:
        return "always" if faster(1e9) else "never"
    edges = [roots[0] / 2, *[math.sqrt(a * b) for a, b in zip(roots, roots[1:])], roots[-1] * 2]
    wins = [faster(beta) for beta in edges]  # one probe per stretch between crossings
    spans = []
    for i, win in enumerate(wins):
        if not win:
            continue
        if i == 0:
            spans.append(f"below {_rate(roots[0])}")
        elif i == len(roots):
            spans.append(f"above {_rate(roots[-1])}")
        else:
            spans.append(f"between {_rate(roots[i - 1])} and {_rate(roots[i])}")
    return " or ".join(spans) if spans else "never"


def _rate(bytes_per_s: float) -> str:
    bits = 8 * bytes_per_s
    return f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"


def from_summary(method: str, summary: dict[str, Any]) -> StepCost:
    steps = summary["steps"]
    return StepCost(method=method, compute_s=summary["compute_seconds"] / steps,
                    codec_s=summary["codec_seconds"] / steps,
                    bytes=summary["bytes_sent_per_worker"] / steps,
                    messages=summary["messages_per_worker"] / steps,
                    wait_s=summary.get("comm_seconds", 0.0) / steps)


def from_rows(method: str, first: dict[str, Any], last: dict[str, Any]) -> StepCost:
    """Per-step figures between two metrics.jsonl records (cumulative counters)."""
    steps = last["step"] - first["step"]
    if steps <= 0:
        raise ValueError(f"records at steps {first['step']} and {last['step']} span no steps")
    return StepCost(method=method, compute_s=(last["compute_seconds"] - first["compute_seconds"]) / steps,
                    codec_s=(last["codec_seconds"] - first["codec_seconds"]) / steps,
                    bytes=(last["bytes_sent"] - first["bytes_sent"]) / steps,
                    messages=(last["messages"] - first["messages"]) / steps,
                    wait_s=(last["comm_seconds"] - first["comm_seconds"]) / steps)


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
                if summary is not None and summary.get("stopped_at") is not None:
                    raise KeyboardInterrupt  # a signal stopped the probe: so does thinwire cost
                rows = _rows(Path(tmp) / "metrics.jsonl")
                out[spec] = from_rows(spec, rows[-2], rows[-1]) if len(rows) >= 2 else from_summary(spec, summary)
            except Exception as e:  # noqa: BLE001  (a failed probe is reported; the others go on)
                failed[spec] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return out, failed


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

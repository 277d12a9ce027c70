"""``thinwire cost``: before training, predict each method's step time on a link and say
where compression pays off.

Each method runs a short probe on this machine (real training steps on the task with
``--workers`` spawned ranks, as ``thinwire train`` would): ``--probe-steps`` warm-up steps,
then as many timed ones, which give per step: compute seconds, codec seconds, bytes and
messages each worker sends, the seconds its collectives took here with no link in the
way, and, for methods that average gradients during the backward pass, the overlap window
and the share of the average launched in it (rank 0's figures, between the metrics records
at the end of the warm-up and at the end: the warm-up's start-up costs, and its first step,
which launches nothing in backward, are left out). The alpha-beta model (``thinwire.comm.link``)
then predicts the step time on a link of latency α and bandwidth β::

    G(α, β) = codec + max(wait, messages · α + bytes / β)        codec and communication
    T(α, β) = compute + G − min(window, early · G)               the step (one window)
    T(α, β) = compute + (1 − early) · G + max(0, max_i(S_i · G − lead_i))   (the queue)

``messages · α + bytes / β`` is the link's time for the step's collectives (every model time
is linear in messages and bytes, so per-step totals suffice; ``--emulate-link`` delays by
exactly this). ``wait`` is the probe's own communication time: ranks waiting for one
another (a rank that computes or encodes longer holds the others up) and the transport's
own work. No link makes a collective faster than that, and a slow link hides it, hence the
``max`` (ours; it is also how ``--emulate-link`` combines the real and the modeled time).

**Overlap with the backward pass** (``SyncReducer``'s methods; the alpha-beta model has no term
for it, this one is ours). ``compute`` holds the whole backward pass. During it, a bucket whose
gradients have all arrived is averaged on a background thread (encode, collectives,
decode, one bucket after another), and ``reduce()`` waits for those buckets before it
averages the rest. On a step that launched in backward, with ``W`` the seconds from the
first launch to the call of ``reduce()`` (``overlap_window_seconds``) and ``s`` the share of
the step's elements in the launched buckets, the launched buckets' work is ``s · G`` (their
codec time, bytes and messages taken in proportion to their elements: the only split the
run records), it starts ``W`` before ``reduce()``, and ``reduce()`` blocks for whatever of it
is left, then does the remaining ``(1 − s) · G``. So the step costs ``compute + G −
min(W, s · G)``: a link slow enough that the launched buckets outlast the window hides
exactly ``W``, a fast one hides all of ``s · G``. Steps that launch nothing (the first step,
steps with a GradScaler or ``find_unused_parameters``, methods without overlap) hide
nothing. Over a span of steps with equal figures, ``Σ min(W_i, s_i · G) = min(Σ W_i, s̄ ·
Σ G)``, ``s̄`` being the share of all averaged elements launched in backward: so ``window``
is the overlap window *per step of the span* (``overlap_window_seconds`` / steps, steps
without overlap counting 0) and ``early`` = ``s̄`` (``overlap_early_share``, measured over
the span), and the formula holds for per-step figures and run totals alike.
:func:`overlap_hidden_seconds` is this hidden term, for the trainer's modeled time too. The
window is the backward pass's own time, measured here with no link: a link changes how
much of it the communication fills, not its length (CPU contention between the
background thread and backward is in the measured ``compute``). Where the runs record no
overlap (older runs, methods without ``overlap_report()``), ``window`` = ``early`` = 0 and
``T`` is the model without overlap. The queue form refines the window one where the run
recorded each launched bucket's lead (seconds from its launch to ``reduce()``) and share
(``S_i``: the share of bucket ``i`` and of every bucket launched after it): the buckets run
one after another on the background thread, and what is left of them at ``reduce()``
adds to the step.

``T`` is ``compute + max(G − window, (1 − early) · G)``: with ``G`` the larger of two lines in
x = 1/β, ``T`` is the largest of four lines in x, a convex piecewise linear function. The
verdict compares a method with ``bf16`` (a 2-byte cast all_reduce, the bar a user has
today) at the first link's α: the bandwidths where the two times are equal are found
exactly, piece by piece between every point where two of either method's lines meet, and
the verdict names the bandwidths where the method is faster ("below X", "above X",
"between X and Y", "always", "never"). Overlap that DaSGD gets by hiding averages behind
whole steps is not credited: its prediction is an upper bound.

**The probes.** A probe spawns its ranks as ``thinwire train`` would, with one change: its
ranks skip the task's evaluation (``TrainConfig.evaluate`` False: the records carry no test
figures), since a probe times training steps
and nothing else, and a language model's test set can take longer than its steps. The
records after the warm-up and at the end are still written. ``--probe-seconds S`` bounds each
probe's training steps (start-up of the ranks apart): warm-up and timed steps are
:func:`probe_plan`'s, at most ``S`` seconds of them at the step time known when the probe
starts: the first probe's from one step timed in this process (:func:`estimate_step_seconds`),
each later one's from the training seconds per step the probe before it measured. A probe
whose ``--probe-steps`` fit runs them all; one that does not runs one warm-up step and as
many timed ones as fit, never fewer than one (one whole period for a periodic method, so its
sync is in the span, however long that takes). As each probe ends, ``thinwire cost`` prints
its row; on SIGINT or SIGTERM the probe in flight stops at its next step and the table of the
methods probed so far is printed.

**One compute figure.** The methods that run the task's plain forward, backward and
optimizer step (:func:`thinwire.algorithms.methods.own_compute` false: every codec and
every method but AB-training and DeMo) do the same computation each step, so their probes'
compute figures differ by this machine's noise alone. They share one figure
(:func:`shared_compute`): each probe's timed span is a block, and the figure is the median
of the blocks of every such probe (every repeat's), with the blocks' quartiles as its range
(:func:`thinwire.lab.compute.summarize`; the smallest and largest block for fewer than 4).
A method's predicted step is then that shared compute plus its own measured codec and wait
seconds plus its modeled communication, less what its overlap hides (:func:`at_compute`; its
overlap window and bucket leads, parts of its backward pass, scale with the compute put in
place of its own measured one). A method with its own compute keeps its measured figure.
``--compute-ms MS`` (or ``--compute-from RUN_DIR``: ``compute_seconds`` / ``steps`` of the
run's ``summary.json``) puts the compute of the user's own hardware in place of the shared
figure (and scales an own-compute method's by MS over the shared figure); the codec and wait
seconds stay those measured here. ``--compute-from GPU_JSON`` (what ``benchmarks/bench_gpu.py``
measured: :mod:`thinwire.lab.gpu_results`) gives the compute step of the probe's model there,
and, for a probe of as many workers, the codec seconds of the methods it measured too.

Two methods sharing the compute differ in step time by codec, communication and overlap
alone, so their verdict barely moves with it; a method with its own compute is compared with
``bf16``'s shared one, and there the noise counts. The verdict is therefore computed at the
shared figure and at both ends of its range (:func:`ranged_verdict`): it is stated as is
where it is the same at both ends, with each bandwidth's range where only the bandwidths
move (``below 1.78 Gbit/s (1.52 Gbit/s–2.05 Gbit/s within the compute range)``), and as
``tie with bf16 within the measured compute range`` (with the verdict at each end) where it
changes within the range. With ``--compute-ms`` or ``--compute-from`` the compute is given,
and the verdict is the one at it.

**Repeats** (``--repeats R``): the probes run in R rounds, every method once a round, so that
repeat i of each method ran at about the same time as repeat i of ``bf16``. Every figure shown
is the median over the repeats with its range (``median [min–max]``), the shared compute
apart (one figure over every round's blocks); the verdict is computed from the median of
each per-step figure (:func:`median_cost`), and each of its bandwidths comes with its range
over the repeats, repeat i of the method against repeat i of ``bf16`` (:func:`bound_ranges`).
"""

from __future__ import annotations

import math
import re
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinwire import jsonfile
from thinwire.comm.link import Link
from thinwire.comm.overlap import clamp_share, hidden_part, launch_groups, overlap_hidden_seconds, tail_shares
from thinwire.lab.compute import SharedCompute
from thinwire.run.config import TrainConfig
from thinwire.run.summary import Summary

DEFAULT_METHODS = "identity,bf16,topk:ratio=0.01,powersgd:rank=2,fft,hylo"
REFERENCE = "bf16"
_SAME = 1e-9  # relative distance under which two crossings (in x = 1/β) are one


@dataclass(frozen=True)
class StepCost:
    """Per-step figures of one method from its probe."""

    method: str
    compute_s: float
    codec_s: float
    bytes: float  # sent by one worker
    messages: float
    wait_s: float = 0.0  # its collectives' time here, with no link
    window_s: float = 0.0  # overlap window per step: backward time after the first bucket launched (0: none)
    early_share: float = 0.0  # share of the averaged elements launched during backward
    leads: tuple[tuple[float, float], ...] = ()  # per launched bucket: (seconds before reduce(), share)
    peak_bytes: float | None = None  # the most one worker sent in one step (methods that report it)
    probe_steps: int = 0  # timed steps of the probe (a whole number of periods for periodic methods)
    # hierarchical runs: the collectives inside a node, timed on the intra-node link (bytes and
    # messages above are then those of the collectives between nodes)
    intra_s: float = 0.0

    def seconds(self, link: Link) -> float:
        return self._at(link.latency_s, 1.0 / link.bandwidth_Bps)

    def hidden_s(self, link: Link) -> float:
        """Seconds per step of codec and communication work hidden behind the backward pass."""
        return overlap_hidden_seconds(link, bytes=self.bytes, messages=self.messages, codec_s=self.codec_s,
                                      window_s=self.window_s, early_share=self.early_share, wait_s=self.wait_s,
                                      leads=self.leads, intra_s=self.intra_s)

    def _at(self, latency_s: float, x: float) -> float:
        """Step time at latency ``latency_s`` and ``x`` = 1 / bandwidth (seconds per byte)."""
        busy = self.codec_s + max(self.wait_s, self.intra_s + self.messages * latency_s + self.bytes * x)
        return self.compute_s + busy - hidden_part(busy, launch_groups(self.leads, self.window_s, self.early_share))

    def _lines(self, latency_s: float) -> list[tuple[float, float]]:
        """The step time at this latency as the largest of these lines in ``x``, each
        (value at x = 0, slope): ``compute + max((1 − early) · G, max_i((1 − early + S_i) · G −
        lead_i))`` with ``G`` = ``codec + max(wait, messages · α + bytes · x)`` (one group
        (window, early): ``compute + max((1 − early) · G, G − window)``)."""
        groups = launch_groups(self.leads, self.window_s, self.early_share)
        keep = 1.0 - min(sum(share for _, share in groups), 1.0)
        out = []
        for at0, slope in ((self.codec_s + self.wait_s, 0.0),
                           (self.codec_s + self.intra_s + self.messages * latency_s, self.bytes)):
            out.append((self.compute_s + keep * at0, keep * slope))
            for lead, tail in tail_shares(groups):
                out.append((self.compute_s + (keep + tail) * at0 - lead, (keep + tail) * slope))
        return out

    def _kinks(self, latency_s: float) -> list[float]:
        """Every ``x`` > 0 where two of the lines meet: the step time is linear between them."""
        lines = self._lines(latency_s)
        out = set()
        for i, (a1, c1) in enumerate(lines):
            for a2, c2 in lines[i + 1:]:
                if c1 != c2:
                    x = (a2 - a1) / (c1 - c2)
                    if 0 < x < math.inf:
                        out.add(x)
        return sorted(out)

    def _active(self, latency_s: float, x: float) -> tuple[float, float]:
        """The line that is the step time at ``x`` (inside a piece: any of the largest)."""
        return max(self._lines(latency_s), key=lambda line: (line[0] + line[1] * x, line[1]))


def crossings_Bps(m: StepCost, ref: StepCost, latency_s: float) -> list[float]:
    """The bandwidths (bytes/s, ascending) at which ``m`` and ``ref`` take equally long per step
    at this latency. Both step times are convex piecewise linear in x = 1/β (the largest of
    a few lines each), so the difference is linear between the points where two lines of
    either meet, and it is solved exactly there, piece by piece. A stretch where the two are
    equal throughout has no single crossing and gives none."""
    bounds = [0.0, *sorted({*m._kinks(latency_s), *ref._kinks(latency_s)}), math.inf]
    found: list[float] = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        inside = (lo + hi) / 2 if hi < math.inf else 2 * lo + 1.0
        (a_m, c_m), (a_r, c_r) = m._active(latency_s, inside), ref._active(latency_s, inside)
        if c_m == c_r:
            continue  # parallel on this piece: equal everywhere (no single crossing) or nowhere
        x = (a_r - a_m) / (c_m - c_r)
        slack = _SAME * abs(x)  # a crossing at a kink may land a rounding error outside either piece
        if x > 0 and lo - slack <= x <= hi + slack and x < math.inf:
            found.append(x)
    found.sort()
    xs = [x for i, x in enumerate(found) if i == 0 or x - found[i - 1] > _SAME * x]
    return sorted(1.0 / x for x in xs)


def crossover_Bps(m: StepCost, ref: StepCost, latency_s: float) -> float | None:
    """The lowest bandwidth (bytes/s) at which ``m`` and ``ref`` take equally long per step at
    this latency; None when their times never cross."""
    found = crossings_Bps(m, ref, latency_s)
    return found[0] if found else None


def verdict(m: StepCost, ref: StepCost, latency_s: float) -> str:
    """Where ``m`` beats ``ref`` at this latency, in words: ``below X`` (links slower than
    X), ``above X``, ``between X and Y``, ``below X or above Y``, ``always``, ``never``
    (bandwidths in Gbit/s or Mbit/s). A bandwidth where the two only touch (``m`` faster, or
    slower, on both sides) divides nothing."""
    if m.method == ref.method:
        return "(the reference)"
    roots = crossings_Bps(m, ref, latency_s)

    def faster(beta: float) -> bool:
        return m._at(latency_s, 1.0 / beta) < ref._at(latency_s, 1.0 / beta)

    if not roots:
        return "always" if faster(1e9) else "never"
    edges = [roots[0] / 2, *[math.sqrt(a * b) for a, b in zip(roots, roots[1:], strict=False)], roots[-1] * 2]
    wins = [faster(beta) for beta in edges]  # one probe per stretch between crossings
    # stretches: (lower bound or None, upper bound or None, faster there), touching points merged
    stretches: list[list[Any]] = [[None, roots[0], wins[0]]]
    for i, win in enumerate(wins[1:]):
        if win == stretches[-1][2]:
            stretches[-1][1] = roots[i + 1] if i + 1 < len(roots) else None
        else:
            stretches.append([roots[i], roots[i + 1] if i + 1 < len(roots) else None, win])
    spans = []
    for lo, hi, win in stretches:
        if not win:
            continue
        if lo is None and hi is None:
            return "always"
        if lo is None:
            spans.append(f"below {_rate(hi)}")
        elif hi is None:
            spans.append(f"above {_rate(lo)}")
        else:
            spans.append(f"between {_rate(lo)} and {_rate(hi)}")
    return " or ".join(spans) if spans else "never"


def _rate(bytes_per_s: float) -> str:
    bits = 8 * bytes_per_s
    return f"{bits / 1e9:.3g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:.3g} Mbit/s"


def from_summary(method: str, summary: Summary, intra: Link | None = None) -> StepCost:
    """Per-step figures of a whole run from its summary.json (runs without ``overlap``: none).
    ``intra``, as for :func:`from_rows`: the link inside a node, which times the bytes and
    messages the summary counts there apart; the bytes between nodes then count
    ``ranks_per_node`` times (the node's ranks share its link)."""
    steps = summary.steps
    overlap = summary.method_fields.get("overlap") or {}  # a synchronous method's (SyncReducer's)
    nbytes, messages, intra_s = summary.bytes_sent_per_worker, float(summary.messages_per_worker), 0.0
    by_link = summary.bytes_by_link_per_worker
    if intra is not None and by_link:
        inside = by_link.get("intra", 0.0)
        inside_messages = summary.messages_by_link_per_worker.get("intra", 0.0)
        intra_s = (inside_messages * intra.latency_s + inside / intra.bandwidth_Bps) / steps
        nbytes = summary.ranks_per_node * (nbytes - inside)
        messages -= inside_messages
    return StepCost(method=method, compute_s=summary.compute_seconds / steps,
                    codec_s=summary.codec_seconds / steps,
                    bytes=nbytes / steps, messages=messages / steps, intra_s=intra_s,
                    wait_s=summary.comm_seconds / steps,
                    window_s=(overlap.get("window_seconds") or 0.0) / steps,
                    early_share=overlap.get("early_share") or 0.0,
                    leads=tuple((float(a), float(b)) for a, b in overlap.get("leads") or ()))


def probe_steps(spec: str, steps: int) -> int:
    """Timed (and warm-up) steps of ``spec``'s probe: ``steps``, or for a method that syncs
    every ``period`` steps (local SGD, DaSGD, the DiLoCo family, post-local SGD) the smallest
    multiple of its period that is at least ``steps``, so the timed window holds whole
    periods: one sync of every fragment per period, its bytes and seconds spread over the
    period's steps (a sync every H steps costs 1/H of itself per step)."""
    period = _period(spec)
    if period <= 1:
        return steps
    return -(-max(steps, period) // period) * period


def _period(spec: str) -> int:
    """The steps between two syncs of a periodic method (1 for every other spec)."""
    from thinwire.algorithms.methods import kind_of, method_config

    if kind_of(spec) != "method":
        return 1
    _, config = method_config(spec)
    period = getattr(config, "period", None)
    return period if isinstance(period, int) and period > 1 else 1


def probe_plan(spec: str, steps: int, budget_steps: int | None = None) -> tuple[int, int]:
    """(warm-up, timed) steps of ``spec``'s probe. Without a budget, or with one of at least
    twice :func:`probe_steps`: that many of each. Else ``budget_steps`` steps in all: as many
    timed steps as fit after one warm-up step, a whole number of periods and no more than
    :func:`probe_steps` (never fewer than one period: one step, or a periodic method's
    ``period`` steps, whose sync must be in the span), and the rest of the budget, up to
    :func:`probe_steps`, as warm-up (at least one step: the first step's start-up costs are
    never timed). A budget under 2 steps gives the least there is: 1 + 1 (1 + ``period``)."""
    n = probe_steps(spec, steps)
    if budget_steps is None or budget_steps >= 2 * n:
        return n, n
    period = _period(spec)
    timed = min(n, max(period, (budget_steps - 1) // period * period))
    return max(1, min(n, budget_steps - timed)), timed


def from_rows(method: str, first: dict[str, Any], last: dict[str, Any], intra: Link | None = None) -> StepCost:
    """Per-step figures between two metrics.jsonl records (cumulative counters; records
    without the overlap counters: no overlap).

    ``overlap_lead_seconds_and_shares`` (per launched bucket: seconds before ``reduce()``,
    share) are the run's means so far, read from ``last``. ``overlap_early_share`` is a
    cumulative share, of the elements averaged by every
    ``reduce()`` so far (one per step that was not skipped); the span's own share is
    recovered with equal elements per step: ``(s_last · n_last − s_first · n_first) /
    (n_last − n_first)``, ``n`` = step − skipped steps. ``intra``: the link inside a node,
    which times the records' ``intra_bytes`` and ``intra_messages`` apart (hierarchical runs).
    The bytes between nodes count ``inter_share`` times (the record's: that many ranks of a
    node share its link), so ``bytes`` is what the node's link carries for this rank's share."""
    steps = last["step"] - first["step"]
    if steps <= 0:
        raise ValueError(f"records at steps {first['step']} and {last['step']} span no steps")

    def end(key: str) -> float:
        """``last``'s counter, before the run's end-of-run work where the record gives it (the
        averages a method lands or syncs in finish() belong to no step of the span)."""
        before = last.get(f"{key}_before_finish")
        return float(before if before is not None else last.get(key) or 0.0)

    def delta(key: str) -> float:
        return end(key) - (first.get(key) or 0.0)

    n_first = first["step"] - (first.get("skipped_steps") or 0)
    n_last = last["step"] - (last.get("skipped_steps") or 0)
    s_first, s_last = first.get("overlap_early_share") or 0.0, last.get("overlap_early_share") or 0.0
    share = clamp_share((s_last * n_last - s_first * n_first) / (n_last - n_first)) if n_last > n_first else 0.0
    nic = int(last.get("inter_share") or 1)  # a node's ranks share its link between nodes
    intra_bytes, intra_messages = delta("intra_bytes") / steps, delta("intra_messages") / steps
    inter_bytes = nic * (delta("bytes_sent") / steps - intra_bytes)
    messages = delta("messages") / steps
    if intra is not None:  # the collectives inside a node on their own link
        intra_s = intra_messages * intra.latency_s + intra_bytes / intra.bandwidth_Bps
        messages -= intra_messages
    else:  # one link for everything
        intra_s, inter_bytes = 0.0, inter_bytes + intra_bytes
    return StepCost(method=method, compute_s=(last["compute_seconds"] - first["compute_seconds"]) / steps,
                    codec_s=(last["codec_seconds"] - first["codec_seconds"]) / steps,
                    bytes=inter_bytes, messages=messages, intra_s=intra_s,
                    wait_s=(last["comm_seconds"] - first["comm_seconds"]) / steps,
                    window_s=max(delta("overlap_window_seconds"), 0.0) / steps,
                    early_share=share,
                    leads=tuple((float(a), float(b))
                                for a, b in last.get("overlap_lead_seconds_and_shares") or ()),
                    peak_bytes=last.get("peak_bytes_per_sync"), probe_steps=steps)


def _steady(spec: str) -> str:
    """``spec`` as a probe runs it: the DiLoCo family without its end-of-run sync
    (``final_sync=false``), which is no step's cost; one whose rounds' averages run behind the
    next round (``sync=eager|delayed``) needs its final sync and keeps it."""
    from thinwire.algorithms.methods import resolve_method

    try:
        resolved = resolve_method(spec)
    except ValueError:
        return spec  # the probe itself names what is wrong with it
    if re.search(r"(^|[:,])sync=(eager|delayed)(,|$)", resolved):
        return resolved
    return resolved.replace("final_sync=true", "final_sync=false")


class ProbeInterrupted(KeyboardInterrupt):
    """A signal stopped ``thinwire cost``: ``signal`` names it (``SIGINT``, ``SIGTERM``)."""

    def __init__(self, signal: str | None = None) -> None:
        super().__init__(signal or "SIGINT")
        self.signal = signal or "SIGINT"


FIRST_PROBE_MARGIN = 1.5  # ranks side by side cost more than their share of the cores (memory, collectives)


@dataclass
class Pace:
    """The probes' budget: ``seconds`` of training steps per probe (None: no bound), and
    ``step_s``, the seconds a training step is taken to last: :func:`estimate_step_seconds`
    before the first probe, then what the last probe measured (its rank 0's training seconds
    per step, its warm-up included)."""

    seconds: float | None = None
    step_s: float | None = None

    @classmethod
    def first(cls, base: TrainConfig, seconds: float | None) -> Pace:
        """The pace of a first probe: ``seconds`` (None or ``inf``: no bound) at the step time
        :func:`estimate_step_seconds` gives (none where that step fails here: the probe then
        runs whole, and reports the failure as its own)."""
        if seconds is None or not math.isfinite(seconds):
            return cls(None, None)
        try:
            return cls(seconds, estimate_step_seconds(base))
        except Exception:  # noqa: BLE001  (the probe's ranks meet it again and say what it is)
            return cls(seconds, None)

    def budget_steps(self) -> int | None:
        """Training steps that fit in the budget (at least 2), or None: no bound."""
        if self.seconds is None or not math.isfinite(self.seconds) or not self.step_s or self.step_s <= 0:
            return None
        return max(2, int(self.seconds / self.step_s))

    def measured(self, rows: list[dict[str, Any]]) -> None:
        """Take the step time of a probe's metrics rows (its last: cumulative training seconds)."""
        last = rows[-1] if rows else {}
        wall, step = last.get("wall_seconds"), last.get("step")
        if isinstance(wall, (int, float)) and wall > 0 and isinstance(step, int) and step > 0:
            self.step_s = wall / step


def estimate_step_seconds(cfg: TrainConfig) -> float:
    """About how long a probe's training step lasts on this machine, before any probe ran:
    one training step (forward, backward, the optimizer) of rank 0's first batch, timed in
    this process with a rank's torch threads, times ``workers · threads / cores`` where the
    ranks' threads outnumber the cores, times :data:`FIRST_PROBE_MARGIN`. ``cfg`` resolved
    (batch size, optimizer and learning rate filled)."""
    import os
    import time

    import torch

    from thinwire.run.trainer import build_optimizer
    from thinwire.tasks import get as get_task

    cores = os.cpu_count() or 1
    threads = cfg.threads or max(1, cores // cfg.workers)  # as a spawned rank sets them
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        task = get_task(cfg.task)(seed=cfg.seed, data_dir=cfg.data_dir, **cfg.task_options)
        model = task.build_model()
        try:  # an optimizer that needs the model's layers (Muon) takes it
            optimizer = build_optimizer(cfg.optimizer or "sgd", list(model.parameters()), cfg.lr or 0.0, model=model)
        except TypeError:
            optimizer = build_optimizer(cfg.optimizer or "sgd", list(model.parameters()), cfg.lr or 0.0)
        x, y = next(task.train_batches(0, cfg.workers, cfg.batch_size or 1))
        t0 = time.perf_counter()
        loss = task.loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)
    return seconds * max(1.0, cfg.workers * threads / cores) * FIRST_PROBE_MARGIN


def _span(rows: list[dict[str, Any]], warm: int, total: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The records at the end of the warm-up and at the end (the last two where not found)."""
    at = {r.get("step"): r for r in rows}
    if warm in at and total in at:
        return at[warm], at[total]
    return rows[-2], rows[-1]


Result = Callable[[str, StepCost | str], None]  # (spec, its per-step costs, or the error of its failed probe)


def probe(base: TrainConfig, specs: list[str], steps: int, *, seconds: float | None = None,
          pace: Pace | None = None, launch: Callable[..., Any] | None = None, say: Callable[[str], None] = print,
          on_result: Result | None = None) -> tuple[dict[str, StepCost], dict[str, str]]:
    """Run the warm-up and timed training steps of every method's probe (:func:`probe_plan`:
    ``steps`` of each, whole periods for a periodic method, fewer where ``seconds`` of steps
    per probe would not hold them, at ``pace``'s step time); per-step costs of the timed steps
    by spec, and the error of each probe that failed (the others still run). ``on_result``
    hears each probe's costs (or error) as soon as it ends. A probe that a signal stopped
    raises :class:`ProbeInterrupted`."""
    from thinwire.run.config import for_method

    if launch is None:
        from thinwire.run.launch import launch as default_launch

        launch = default_launch
    if pace is None:
        pace = Pace.first(base, seconds)
    out: dict[str, StepCost] = {}
    failed: dict[str, str] = {}
    intra = Link.parse(base.intra_link) if base.intra_link else None
    for i, spec in enumerate(specs, 1):
        result: StepCost | str
        try:
            budget = pace.budget_steps()
            warm, timed = probe_plan(spec, steps, budget)
        except ValueError as e:
            failed[spec] = result = str(e).splitlines()[0][:300]
            if on_result is not None:
                on_result(spec, result)
            continue
        bound = (f" ({pace.seconds:g} s of steps at about {pace.step_s:.3g} s a step)"
                 if (warm, timed) != probe_plan(spec, steps) else "")
        say(f"[{i}/{len(specs)}] probing {spec.split(':')[0]}: {warm} + {timed} steps on {base.workers} "
            f"workers{bound}")
        with tempfile.TemporaryDirectory(prefix="thinwire-probe-") as tmp:
            # the steady state: the DiLoCo family's end-of-run sync (finish()) is no step's cost
            cfg = for_method(base, _steady(spec), steps=warm + timed, eval_every=math.gcd(warm, timed), out=tmp,
                             overwrite=True, tensorboard=False, evaluate=False)
            try:
                summary: Any = launch(cfg, show_progress=False)  # None off rank 0: from_summary fails on it
                if summary is not None and summary.stopped_at is not None:
                    raise ProbeInterrupted(summary.signal)  # a signal stopped the probe: so does cost
                rows = _rows(Path(tmp) / "metrics.jsonl")
                pace.measured(rows)
                result = (from_rows(spec, *_span(rows, warm, warm + timed), intra) if len(rows) >= 2
                          else from_summary(spec, summary, intra))
                out[spec] = result
            except Exception as e:  # noqa: BLE001  (a failed probe is reported; the others go on)
                failed[spec] = result = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if on_result is not None:
            on_result(spec, result)
    return out, failed


def probe_repeats(base: TrainConfig, specs: list[str], steps: int, repeats: int, *, seconds: float | None = None,
                  pace: Pace | None = None, launch: Callable[..., Any] | None = None,
                  say: Callable[[str], None] = print,
                  on_result: Result | None = None) -> tuple[dict[str, list[StepCost]], dict[str, str]]:
    """:func:`probe` ``repeats`` times, in rounds (every method once a round, in order): per spec
    its per-step costs, one per repeat, and the error of each spec whose probe failed in any
    repeat (it is not probed again, and has no costs). One ``pace`` for every round."""
    if pace is None:
        pace = Pace.first(base, seconds)
    out: dict[str, list[StepCost]] = {spec: [] for spec in specs}
    failed: dict[str, str] = {}
    for r in range(1, repeats + 1):
        left = [spec for spec in specs if spec not in failed]
        tell = say if repeats == 1 else (lambda line, r=r: say(f"{line} (repeat {r}/{repeats})"))
        costs, errors = probe(base, left, steps, pace=pace, launch=launch, say=tell, on_result=on_result)
        failed.update(errors)
        for spec, c in costs.items():
            out[spec].append(c)
    return {spec: cs for spec, cs in out.items() if spec not in failed}, failed


def median_cost(costs: list[StepCost]) -> StepCost:
    """One method's per-step figures over repeats: the median of each (bucket leads bucket by
    bucket when every repeat launched as many buckets, else the leads of the repeat with the
    median compute time)."""
    if not costs:
        raise ValueError("no repeat to take the median of")

    def med(name: str) -> float:
        return float(statistics.median(getattr(c, name) for c in costs))

    leads = costs[0].leads
    if all(len(c.leads) == len(leads) for c in costs):
        leads = tuple((float(statistics.median(c.leads[i][0] for c in costs)),
                       float(statistics.median(c.leads[i][1] for c in costs))) for i in range(len(leads)))
    else:
        leads = sorted(costs, key=lambda c: c.compute_s)[(len(costs) - 1) // 2].leads
    peaks = [c.peak_bytes for c in costs]
    return StepCost(method=costs[0].method, compute_s=med("compute_s"), codec_s=med("codec_s"), bytes=med("bytes"),
                    messages=med("messages"), wait_s=med("wait_s"), window_s=med("window_s"),
                    early_share=med("early_share"), leads=leads,
                    peak_bytes=None if None in peaks else float(statistics.median(p for p in peaks if p is not None)),
                    probe_steps=costs[0].probe_steps, intra_s=med("intra_s"))


def bound_ranges(ms: list[StepCost], refs: list[StepCost], latency_s: float) -> list[tuple[float, float]] | None:
    """The range over the repeats of each bandwidth (bytes/s) where the median method and the
    median reference cross (:func:`crossings_Bps` of :func:`median_cost`'s): per crossing, the
    lowest and highest of that crossing in each repeat, repeat i of the method against repeat i
    of the reference. None when a repeat crosses another number of times than the medians do
    (its verdict has another shape: :func:`bounds_text` lists them)."""
    if len(ms) != len(refs):
        raise ValueError(f"{len(ms)} repeats of the method against {len(refs)} of the reference")
    roots = crossings_Bps(median_cost(ms), median_cost(refs), latency_s)
    each = [crossings_Bps(m, ref, latency_s) for m, ref in zip(ms, refs, strict=True)]
    if any(len(r) != len(roots) for r in each):
        return None
    return [(min(r[k] for r in each), max(r[k] for r in each)) for k in range(len(roots))]


def bounds_text(ms: list[StepCost], refs: list[StepCost], latency_s: float) -> str:
    """The verdict's bandwidths over the repeats, in words: ``98.1 Mbit/s–130 Mbit/s`` per
    bandwidth (``; `` between two), ``-`` when the verdict has none and every repeat agrees, or
    ``repeats: <verdict>; <verdict>...`` (each repeat's) when the repeats disagree on its shape."""
    if ms[0].method == refs[0].method:
        return "-"
    ranges = bound_ranges(ms, refs, latency_s)
    if ranges is None:
        return "repeats: " + "; ".join(verdict(m, ref, latency_s) for m, ref in zip(ms, refs, strict=True))
    if not ranges:
        shapes = {verdict(m, ref, latency_s) for m, ref in zip(ms, refs, strict=True)}
        return "-" if len(shapes) == 1 else "repeats: " + "; ".join(sorted(shapes))
    return "; ".join(f"{_rate(lo)}–{_rate(hi)}" for lo, hi in ranges)


# -- one compute figure ------------------------------------------------------------------------
def shares_compute(spec: str) -> bool:
    """Whether ``spec``'s steps run the task's plain forward, backward and optimizer step, and
    so share the one compute figure (not :func:`thinwire.algorithms.methods.own_compute`)."""
    from thinwire.algorithms.methods import own_compute

    return not own_compute(spec)


def shared_compute(runs: dict[str, list[StepCost]],
                   shares: Callable[[str], bool] = shares_compute) -> SharedCompute | None:
    """The compute figure of the methods of ``runs`` that share it (``shares(spec)``): every
    probe's per-step compute over its timed span is a block, every repeat's too, and
    :func:`thinwire.lab.compute.summarize` gives their median and range; None where no such
    method was probed."""
    from thinwire.lab.compute import summarize

    sharing = [spec for spec in runs if shares(spec)]
    return summarize([c.compute_s for spec in sharing for c in runs[spec]], tuple(sharing))


def with_compute(c: StepCost, compute_s: float) -> StepCost:
    """``c`` with ``compute_s`` seconds of compute a step in place of its own, its overlap
    window and its buckets' leads (parts of its backward pass) scaled by the same factor."""
    import dataclasses

    scale = compute_s / c.compute_s if c.compute_s > 0 else 1.0
    return dataclasses.replace(c, compute_s=compute_s, window_s=c.window_s * scale,
                               leads=tuple((lead * scale, share) for lead, share in c.leads))


def at_compute(c: StepCost, shares: bool, shared: SharedCompute | None, given_s: float | None = None) -> StepCost:
    """``c`` as the prediction takes it: a method that shares the compute with the shared
    figure in place of its own, or with ``given_s`` (``--compute-ms``) where given; a method
    with its own compute with its own, scaled by ``given_s`` over the shared figure where a
    compute is given (:func:`with_compute` either way)."""
    if shares:
        figure = given_s if given_s is not None else (shared.per_step if shared is not None else None)
        return c if figure is None else with_compute(c, figure)
    if given_s is not None and shared is not None and shared.per_step > 0:
        return with_compute(c, c.compute_s * given_s / shared.per_step)
    return c


_BANDWIDTH = re.compile(r"[\d.]+ [GM]bit/s")


def ranged_verdict(m: StepCost, ref: StepCost, latency_s: float, shared: SharedCompute | None, *,
                   m_shares: bool = True, ref_shares: bool = True) -> str:
    """:func:`verdict` of ``m`` against ``ref`` (both as measured) at the shared compute figure,
    checked at both ends of its range, the figure put in place of the compute of each of them
    that shares it (``m_shares``, ``ref_shares``; :func:`with_compute`). The same verdict at
    both ends: that verdict (with each bandwidth's range over the compute range, where a
    bandwidth moves: ``below 1.78 Gbit/s (1.52 Gbit/s–2.05 Gbit/s within the compute
    range)``); another verdict at either end: ``tie with bf16 within the measured compute range
    (at 46.0 ms: below 1.2 Gbit/s; at 51.2 ms: never)``. No shared figure: the verdict as
    measured."""
    if m.method == ref.method:
        return "(the reference)"
    if shared is None:
        return verdict(m, ref, latency_s)

    def pair(x: float) -> tuple[StepCost, StepCost]:
        return with_compute(m, x) if m_shares else m, with_compute(ref, x) if ref_shares else ref

    at = {x: pair(x) for x in (shared.lo, shared.per_step, shared.hi)}
    words = {x: verdict(*costs, latency_s) for x, costs in at.items()}
    mid = words[shared.per_step]
    if len({_BANDWIDTH.sub("X", w) for w in words.values()}) > 1:
        return (f"tie with {REFERENCE} within the measured compute range (at {1e3 * shared.lo:.1f} ms: "
                f"{words[shared.lo]}; at {1e3 * shared.hi:.1f} ms: {words[shared.hi]})")
    roots = [crossings_Bps(*costs, latency_s) for costs in at.values()]
    if len({len(r) for r in roots}) > 1:  # a crossing where the two only touch, at one end: the same words
        return mid
    moved = [(min(r[k] for r in roots), max(r[k] for r in roots)) for k in range(len(roots[0]))]
    if all(_rate(lo) == _rate(hi) for lo, hi in moved):
        return mid
    return f"{mid} ({' and '.join(f'{_rate(lo)}–{_rate(hi)}' for lo, hi in moved)} within the compute range)"


def compute_from_run(path: str) -> tuple[float, Summary]:
    """Seconds of compute per step of a finished run (its folder or its ``summary.json``):
    ``compute_seconds`` / ``steps`` (a resumed run's ``compute_seconds`` holds every part of
    it, so ``steps``, not ``steps_run``), and the summary. Raises ValueError, in one line,
    for a missing or unreadable file or one without those figures."""
    import json

    file = Path(path)
    if file.is_dir():
        file = file / "summary.json"
    if not file.is_file():
        raise ValueError(f"--compute-from {path}: no {file.name if file.suffix else 'summary.json'} there "
                         "(thinwire train writes one at the end of a run)")
    try:
        summary = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--compute-from {file}: not a readable summary: {str(e).splitlines()[0]}") from None
    if not isinstance(summary, dict):
        raise ValueError(f"--compute-from {file}: not a run summary (a JSON object)")
    seconds, steps = summary.get("compute_seconds"), summary.get("steps")
    if (not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds)
            or seconds <= 0 or not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ValueError(f"--compute-from {file}: no compute_seconds > 0 and steps >= 1 in it "
                         f"(got {seconds!r} and {steps!r})")
    try:
        return seconds / steps, Summary.from_json(summary)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--compute-from {file}: {str(e).splitlines()[0]}") from None


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return jsonfile.read_lines(path)

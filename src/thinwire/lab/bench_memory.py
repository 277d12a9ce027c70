"""``thinwire bench memory``: the memory each method keeps, and its peak beside identity's.

Every method trains the same model (the synthetic MLP at a size where one fp32 copy of the
model is tens of megabytes) for a few steps on spawned ranks. Two figures per method, in
copies of the fp32 model, rank 0's:

* **state**: the tensors the method keeps across steps (its state dict: error-feedback
  residuals, DaSGD's snapshot and buffer, factors, per-edge state) plus what it added to the
  model (AB-training's factors). Exact; checked against the documented figure (PASS/MISS).
* **peak**: the process's peak resident memory minus ``identity``'s, which also holds one
  step's working buffers (identity's own fused bucket copies among them, so a method can
  come out below identity). Reported, no target: it moves with the allocator.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

# Documented overhead per rank, in fp32 model copies, by method name: (figure, what it is).
DOCUMENTED: dict[str, tuple[float, str]] = {
    "identity": (0.0, "nothing across steps"),
    "bf16": (0.0, "nothing across steps"),
    "fp16": (0.0, "nothing across steps"),
    "topk": (1.0, "error-feedback residual"),
    "randomk": (1.0, "error-feedback residual"),
    "qsgd": (0.0, "no error feedback by default"),
    "signsgd": (1.0, "error-feedback residual"),
    "terngrad": (0.0, "no error feedback by default"),
    "powersgd": (1.1, "error-feedback residual (1) + the warm-start Q of each matrix"),
    "rangefloat": (0.0, "no error feedback by default"),
    "fft": (0.0, "no error feedback by default (the theta schedule is a few numbers)"),
    "kernels": (1.0, "error-feedback residual"),
    "twobit": (1.0, "error-feedback residual"),
    "hylo": (1.0, "error-feedback residuals of the compressed layers"),
    "localsgd": (0.0, "counters only"),
    "dasgd": (2.0, "snapshot and in-flight average buffer"),
    "diloco": (2.0, "the outer parameters and outer SGD's momentum (outer Adam: two moments, 3 copies)"),
    "streaming-diloco": (2.0, "as diloco: the fragments' outer parameters and momentum cover the model once"),
    "sparseloco": (2.0, "the outer parameters and the error-feedback buffer (no outer momentum)"),
    "dpsgd": (0.0, "nothing across steps (each exchange is done within its step)"),
    "powergossip": (0.1, "per-edge P and Q of rank 1: (m + n) per matrix and neighbour"),
    "ab": (2.0, "the factors A and B beside W (at most A + B = 2 copies for a square layer at full rank)"),
    "torch-ddp": (0.0, "nothing across steps"),
    "torch-fp16": (0.0, "nothing across steps"),
    "torch-powersgd": (1.1, "PowerSGD's error dict (1) + P and Q"),
    "torch-postlocalsgd": (0.0, "counters only"),
}
# warm-ups short enough that the state exists within the run (DaSGD's first average at step 12)
SPECS = {"ab": "ab:warmup=4", "dasgd": "dasgd:warmup=4", "diloco": "diloco:period=4",
         "streaming-diloco": "streaming-diloco:period=4", "sparseloco": "sparseloco:period=4"}
TASK_OPTIONS: dict[str, Any] = {"dim": 512, "hidden": 2048, "depth": 2, "classes": 10, "samples": 4096,
                                "test_samples": 256}
DEFAULT_STEPS = 12


def measure(specs: list[str], *, workers: int = 2, steps: int = DEFAULT_STEPS, launch: Callable[..., Any] | None = None,
            say: Callable[[str], None] = print) -> tuple[list[dict[str, Any]], int]:
    """Peak RSS of each method's run; returns (rows, parameters). ``identity`` runs first."""
    from thinwire.run.config import TrainConfig
    from thinwire.tasks import get as get_task

    if launch is None:
        from thinwire.run.launch import launch as default_launch

        launch = default_launch
    model = get_task("synthetic")(seed=0, **TASK_OPTIONS).build_model()
    params = sum(p.numel() for p in model.parameters())
    base = TrainConfig(task="synthetic", workers=workers, steps=steps, eval_every=steps, batch_size=32,
                       task_options=dict(TASK_OPTIONS))
    order = ["identity"] + [s for s in specs if s.split(":")[0] != "identity"]
    rows, reference = [], None
    for i, spec in enumerate(order, 1):
        say(f"[{i}/{len(order)}] {spec.split(':')[0]}: {steps} steps on {workers} workers")
        t0 = time.perf_counter()
        try:
            cfg = dataclasses.replace(base, method=spec).resolve()
            summary: Any = launch(cfg, show_progress=False)  # None (off rank 0) fails here like any error
            peak, state, error = summary.peak_rss_bytes, summary.method_state_bytes, ""
        except Exception as e:  # noqa: BLE001  (reported in the table; the others still run)
            peak, state, error = None, None, f"{type(e).__name__}: {e}".splitlines()[0][:200]
        if spec == "identity":
            reference = peak
        name = spec.split(":")[0]
        copies = None if state is None else state / (4 * params)
        peak_copies = None if peak is None or reference is None else (peak - reference) / (4 * params)
        figure, what = DOCUMENTED.get(name, (None, "not documented"))
        rows.append({"method": name, "spec": spec, "peak_rss_bytes": peak, "state_bytes": state,
                     "state_copies": copies, "peak_copies": peak_copies, "documented_copies": figure, "what": what,
                     "error": error, "passed": None if copies is None or figure is None else copies <= figure,
                     "seconds": time.perf_counter() - t0})
    return rows, params


def table_md(rows: list[dict[str, Any]], params: int) -> str:
    lines = [f"Model: synthetic MLP {TASK_OPTIONS['dim']}-{TASK_OPTIONS['hidden']}x{TASK_OPTIONS['depth']}-"
             f"{TASK_OPTIONS['classes']}, {params:,} parameters; one fp32 copy = {4 * params / 1e6:.1f} MB.", "",
             "| method | state (model copies) | documented | verdict | what it is | peak RSS MB | peak vs identity "
             "(model copies) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 1e6:.0f}"
        state = r["error"] or ("-" if r["state_copies"] is None else f"{r['state_copies']:.3f}")
        doc = "-" if r["documented_copies"] is None else f"<= {r['documented_copies']:g}"
        verdict = "-" if r["passed"] is None else ("PASS" if r["passed"] else "MISS")
        rel = "-" if r["peak_copies"] is None else f"{r['peak_copies']:+.2f}"
        lines.append(f"| {r['method']} | {state} | {doc} | {verdict} | {r['what']} | {peak} | {rel} |")
    return "\n".join(lines)


def main(methods: str | None = None, workers: int = 2, steps: int = DEFAULT_STEPS, out: str | None = None) -> int:
    from thinwire.algorithms.methods import method_names
    from thinwire.run import outdir

    if out:
        outdir.new_file(out)  # before measuring: an existing file is refused, never replaced
    specs = [s.strip() for s in methods.split(",") if s.strip()] if methods else [
        SPECS.get(n, n) for n in method_names() if n != "torch-bf16"]  # torch-bf16 needs CUDA + NCCL
    rows, params = measure(specs, workers=workers, steps=steps, say=lambda line: print(line, flush=True))
    text = table_md(rows, params)
    print(text)
    if out:
        outdir.write_new(out, "# thinwire bench memory\n\n"
                         + f"`thinwire bench memory --workers {workers} --steps {steps}`\n\n" + text + "\n")
    return 0 if all(r["passed"] is not False for r in rows) else 1

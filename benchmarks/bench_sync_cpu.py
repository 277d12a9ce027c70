"""The CPU seconds of one outer sync of the slow-link methods on the GPT, against the compute of a round.

When every core computes (``bench_real_models.py``: 2 ranks on 2 cores), overlapping a sync with
the next round hides its wire time, not its CPU time: the sync's encode, decode and outer step
take their seconds out of the compute. A method can then run within ``t`` times the compute
step only if one round's sync costs at most ``(t - 1)`` of the round's compute (``H`` steps):
a necessary condition, measured here without a network, so that it shows the CPU work alone.

**Setting.** One rank of 2 in one process, its peer mirrored (``_common.mirror``: the peer
sends what this rank sends), 1 torch
thread (a rank of 2 on 2 cores), the GPT of ``bench_real_models.py`` (the ``charlm`` task's
``gpt-small``, 25.4M parameters, batch 8x64, AdamW). Every arm runs ``sync=blocking`` with every
step a sync (``period=1``), the parameters moved by a little noise
before each ``after_step``. The figures, alternated in one run: the median over rounds of the
seconds of ``after_step`` (the whole sync, on this thread) and of a compute step (forward,
backward, AdamW step). ``sync=eager`` does the same work on its background thread, plus a
preview of the outer step (a few passes over the model) on the training thread.

**Arms and targets** (the speed bounds of the overlapped methods on the GPT at H = 30 and
10 Mbit/s, ``bench_real_models.py``; a sync may take their margin at most):

- ``sparseloco``: its defaults (chunked top-64 of 64x64 blocks, 2 bits), 1.02x: at most 2% of
  a round's compute;
- ``diloco-4bit``: ``codec=rangefloat:bits=4;exp_bits=3;ef=true,scatter=true``, 1.05x: at most 5%.

Streaming DiLoCo syncs one fragment at a time on a staggered schedule; it is not an arm here.
"""

from __future__ import annotations

import sys
import time

from _common import Figure, Report, load_note, median, mirror, parser, table

H = 30
ARMS = {  # name: (method, knobs, target share)
    "sparseloco": ("sparseloco", {"period": 1}, 0.02),
    "diloco-4bit": ("diloco", {"period": 1, "codec": "rangefloat:bits=4;exp_bits=3;ef=true", "scatter": True}, 0.05),
}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--arms", default=",".join(ARMS), help=f"arms, of {', '.join(ARMS)}")
    p.add_argument("--rounds", type=int, default=0, help="timed rounds (default 9; --quick 4)")
    args = p.parse_args(argv)
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        p.error(f"unknown arm(s) {', '.join(unknown)}; of {', '.join(ARMS)}")
    import torch

    import thinwire
    from bench_real_models import build, make_batches

    torch.set_num_threads(1)
    rounds = args.rounds or (4 if args.quick else 9)
    report = Report("The CPU seconds of one outer sync against a round's compute (GPT, one rank of 2)",
                    "PYTHONPATH=benchmarks python benchmarks/bench_sync_cpu.py" + (" --quick" if args.quick else ""))
    report.add(f"1 torch thread, median of {rounds} alternated rounds after 2 warm-up; {load_note()}")
    batches = make_batches("gpt-small", 0)
    gen = torch.Generator().manual_seed(0)

    def compute_arm():
        torch.manual_seed(0)
        model, loss_fn = build("gpt-small")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def run() -> float:
            x, y = batches[0]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            return time.perf_counter() - t0

        return run

    def sync_arm(method: str, knobs: dict):
        torch.manual_seed(0)
        model, _ = build("gpt-small")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        kind = {"sparseloco": thinwire.SparseLoCo, "diloco": thinwire.DiLoCo}[method]
        wrapped = kind(model, opt, comm=mirror(2), **knobs)

        def run() -> float:
            with torch.no_grad():
                for q in model.parameters():
                    q.add_(torch.randn(q.shape, generator=gen), alpha=1e-3)
            t0 = time.perf_counter()
            wrapped.after_step()
            return time.perf_counter() - t0

        return run

    runs = {"compute": compute_arm()}
    for a in arms:
        method, knobs, _ = ARMS[a]
        runs[a] = sync_arm(method, knobs)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds + 2):
        for k, run in runs.items():
            dt = run()
            if r >= 2:
                times[k].append(dt)
        print(f"  round {r + 1}/{rounds + 2}: " + ", ".join(f"{k} {times[k][-1] * 1e3:.0f} ms" for k in runs
                                                            if times[k]), flush=True)
    step = median(times["compute"])
    rows = [["compute step", f"{step * 1e3:.0f}", f"{H * step:.2f} s a round of {H}", "-", "-"]]
    for a in arms:
        sync = median(times[a])
        share = sync / (H * step)
        target = ARMS[a][2]
        rows.append([a, f"{sync * 1e3:.0f}", f"{100 * share:.2f}%", f"<= {100 * target:.0f}%",
                     "PASS" if share <= target else "MISS"])
        report.figures.append(Figure(f"sync_cpu_share_{a}", 100 * share, "<=", 100 * target, "%",
                                     f"sync {sync * 1e3:.0f} ms, compute step {step * 1e3:.0f} ms, H = {H}"))
    report.add(table(["arm", "ms (median)", "share of a round's compute", "target", "verdict"], rows))
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

"""The dct codec: relative error against top-k at equal wire bytes, and its cost against the
bare chunked DCT it is built on.

1. Error at equal bytes, on real gradients: one gradient of the mnist1d CNN and one of the
   charlm transformer (seed 0, batch 64; ``thinwire.lab.bench_codecs.model_gradient``), sent
   the way the aggregator sends them (a tensor the codecs decline, 1-D or under 1,024 values,
   travels as fp32 in every row). One shot, no error feedback, at step 0:
   ``||g - decode(encode(g))|| / ||g||`` over the whole set. Budgets: the bytes ``dct`` sends at
   chunk 64 with ``topk`` 8, 32 and 128 per block and bf16 values; top-k gets the largest
   ``ratio`` whose bytes fit (bisection, as ``bench_error_at_bytes.py``), and the seed FFT
   method (8-bit range floats) the smallest constant theta that fits, where one does. dct's
   other value formats (fp32, 8-bit range floats, 1 bit) at the same ``topk`` are listed
   beside it with their own bytes. Target per input and budget: dct's error <= top-k's.

2. Speed: encode + decode of one tensor through ``dct`` (forward transform, top-k per block,
   values, positions; then the scatter and the inverse transform) against the bare chunked
   DCT and its inverse of the same tensor (``thinwire.numerics.dct_basis.forward`` + ``inverse``),
   alternating in one process, median of >= 5 rounds after a warm-up: a 2048 x 2048 matrix
   (4.2M values, 1,024 blocks of 64 x 64) and charlm's whole gradient set (every tensor, one
   call per tensor, as the aggregator makes them). Target: time(bare) / time(dct) >= 0.75.

A full run (not ``--quick``) also writes benchmarks/results/dct_codec.md. ``--quick``: the
mnist1d gradient and the matrix only, fewer rounds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from _common import Figure, Report, load_note, median, paired_ratio, parser, table
from bench_error_at_bytes import largest_ratio, measure, predicted_bytes, ratio_spec

TASKS, QUICK_TASKS = ("mnist1d", "charlm"), ("mnist1d",)
TOPKS = (8, 32, 128)
VALUES = ("bf16", "fp32", "rangefloat", "sign")
THETAS = tuple(round(0.5 + 0.005 * i, 3) for i in range(100))  # fft's constant theta, 0.5 .. 0.995
TARGET_SPEED = 0.75
RESULTS = Path(__file__).resolve().parent / "results" / "dct_codec.md"
SPEED_NOTE = ("On one large matrix the two transforms dominate the codec's time. On a model's many small tensors "
              "(charlm: 29 of 128 to 49,152 values) each call's fixed costs (top-k, the payload's checks on decode, "
              "a dozen small torch ops) weigh more than two small matrix products, so the ratio there is well "
              "below the matrix's.")


def dct_spec(topk: int, values: str = "bf16") -> str:
    return f"dct:chunk=64,topk={topk},values={values},ef=false"


def fft_spec(theta: float) -> str:
    return f"fft:theta={theta},bits=8,schedule=constant,ef=false"


def smallest_theta(items, budget: int) -> float | None:
    """The smallest constant theta whose fft bytes fit ``budget`` (the most bins), or None."""
    fits = [t for t in THETAS if predicted_bytes(fft_spec(t), items) <= budget]
    return min(fits) if fits else None


def error_at_bytes(task: str, items, report: Report) -> None:
    fp32 = sum(4 * x.numel() for _, x in items)
    rows = []
    for k in TOPKS:
        dct = measure(dct_spec(k), items)
        budget = dct["wire"]
        ratio = largest_ratio("topk", items, budget)
        entries = [("dct", dct)]
        if ratio is not None:
            entries.append(("topk", measure(ratio_spec("topk", ratio), items)))
        theta = smallest_theta(items, budget)
        if theta is not None:
            entries.append(("fft", measure(fft_spec(theta), items)))
        entries += [(f"dct ({v})", measure(dct_spec(k, v), items)) for v in VALUES[1:]]
        for name, m in entries:
            rows.append([f"topk={k}: {budget:,}", name, m["spec"], f"{m['wire']:,}", f"{100 * m['wire'] / budget:.0f}%",
                         f"{fp32 / m['wire']:.1f}x", f"{m['error']:.4f}"])
        top = dict(entries).get("topk")
        value = top["error"] / dct["error"] if top is not None and dct["error"] > 0 else 0.0
        detail = ", ".join(f"{name} {m['error']:.4f} at {m['wire']:,} B" for name, m in entries[:3])
        report.figures.append(Figure(f"top-k's error over dct's at equal bytes [{task}, topk={k} budget]", value,
                                     ">=", 1.0, "x", detail))
        print(f"{task} topk={k}: budget {budget:,} B; {detail}", flush=True)
    report.add(f"{task} gradient: {len(items)} tensors, {fp32:,} B as fp32\n\n" + table(
        ["budget (dct topk: bytes)", "codec", "spec", "wire bytes", "of budget", "compression", "rel error"], rows))


def speed(name: str, items, rounds: int, report: Report) -> None:
    import torch

    from thinwire.codecs.specs import build_codec
    from thinwire.numerics import dct_basis

    codec = build_codec(dct_spec(32))
    tilings = [codec.tiling(x.shape) for _, x in items]
    outs = [torch.empty_like(x) for _, x in items]

    def bare() -> None:
        for (_, x), t in zip(items, tilings):
            dct_basis.inverse(dct_basis.forward(x, t), t)

    def codec_round() -> None:
        for (_, x), out in zip(items, outs):
            codec.decode_sum([codec.encode(x)], out)

    arms = {"bare": bare, "dct": codec_round}
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds + 1):  # round 0 warms up
        for arm, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[arm].append(time.perf_counter() - t0)
    ratio = paired_ratio(times["bare"], times["dct"])
    numel = sum(x.numel() for _, x in items)
    report.add(table(["input", "values", "bare DCT + inverse (ms)", "dct encode + decode (ms)", "bare / dct"],
                     [[name, f"{numel:,}", f"{1e3 * median(times['bare']):.1f}", f"{1e3 * median(times['dct']):.1f}",
                       f"{ratio:.2f}"]]))
    report.figures.append(Figure(f"bare chunked DCT / dct codec time [{name}]", ratio, ">=", TARGET_SPEED, "",
                                 f"median of {rounds} alternating rounds"))


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    import torch

    from thinwire.lab.bench_codecs import model_gradient

    tasks = QUICK_TASKS if args.quick else TASKS
    command = "python benchmarks/bench_dct.py" + (" --quick" if args.quick else "")
    report = Report("dct codec: error at equal bytes and cost against the bare transform", command)
    report.add(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {load_note()}")
    for task in tasks:
        error_at_bytes(task, model_gradient(task), report)
    rounds = 5 if args.quick else 11
    matrix = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(0))
    speed("2048 x 2048 matrix", [("w", matrix)], rounds, report)
    if not args.quick:
        speed("charlm gradient set", model_gradient("charlm"), rounds, report)
        report.add(SPEED_NOTE)
    code = report.finish(args.json)
    if not args.quick:
        RESULTS.write_text("\n\n".join([f"# {report.title}", f"`{command}`", *report.sections, "## Figures",
                                        "\n".join(f"- {f.line()}" for f in report.figures)]) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())

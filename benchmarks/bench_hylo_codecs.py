"""Hylo's codecs against the plain operations they replace: twobit vs a copy, kernels vs topk.

Arms alternate in one process (A B A B ...), median of the paired per-round ratios after a
warm-up round:

- twobit: ``encode`` + ``decode_sum`` (one payload, into a preallocated fp32 output: what the
  aggregator does with a gathered payload) of a 4096 x 4096 fp32 tensor (16.8M values, the
  size of VGG-16's fc7 weight), against ``out.copy_(x)`` into a preallocated tensor of the
  same size. Target: time(copy) / time(twobit) >= 0.25.
- kernels: ``encode`` + ``decode_sum`` of a 512 x 512 x 3 x 3 conv gradient (2.4M values,
  VGG-16's biggest conv) at its default rate, against exact element-wise ``torch.topk`` of
  ``|x|`` keeping the same number of values (k units x 9 values). Target:
  time(topk) / time(kernels) >= 5.

``--quick``: smaller tensors (1024 x 1024 and 256 x 256 x 3 x 3).
"""

from __future__ import annotations

import sys
import time

from _common import Figure, Report, load_note, paired_ratio, parser, table

TWOBIT_SHAPE, KERNELS_SHAPE = (4096, 4096), (512, 512, 3, 3)
QUICK_TWOBIT, QUICK_KERNELS = (1024, 1024), (256, 256, 3, 3)
TWOBIT_TARGET, KERNELS_TARGET = 0.25, 5.0


def timed_rounds(arms: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each arm, arms alternating, one untimed warm-up round first."""
    out: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds + 1):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            if r:
                out[name].append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    import torch

    from thinwire.codecs.specs import build_codec

    twobit_shape = QUICK_TWOBIT if args.quick else TWOBIT_SHAPE
    kernels_shape = QUICK_KERNELS if args.quick else KERNELS_SHAPE
    rounds = 7 if args.quick else 11
    report = Report("Hylo codecs vs copy and topk",
                    "python benchmarks/bench_hylo_codecs.py" + (" --quick" if args.quick else ""))
    report.add(f"{torch.get_num_threads()} torch threads, median of {rounds} paired alternating rounds after 1 "
               f"warm-up; {load_note()}")
    g = torch.Generator().manual_seed(0)
    rows = []

    # twobit vs a preallocated copy
    x = torch.randn(twobit_shape, generator=g)
    out, copy_out = torch.empty_like(x), torch.empty_like(x)
    twobit = build_codec("twobit")

    def twobit_arm():
        twobit.decode_sum([twobit.encode(x, key="fc")], out)

    times = timed_rounds({"copy": lambda: copy_out.copy_(x), "twobit": twobit_arm}, rounds)
    ratio = paired_ratio(times["copy"], times["twobit"])
    tc, tt = sorted(times["copy"])[rounds // 2], sorted(times["twobit"])[rounds // 2]
    rows.append(["twobit", "x".join(map(str, twobit_shape)), "copy_", f"{tc * 1e3:.1f}", f"{tt * 1e3:.1f}",
                 f"{ratio:.3f}"])
    report.figures.append(Figure("twobit encode+decode vs copy_ (time copy / time twobit)", ratio, ">=", TWOBIT_TARGET,
                                 "x", f"copy_ {tc * 1e3:.1f} ms, twobit {tt * 1e3:.1f} ms, {x.numel():,} floats"))

    # kernels vs exact element-wise topk of the same kept count
    w = torch.randn(kernels_shape, generator=g)
    kernels = build_codec("kernels")
    kept = kernels.k(w.shape) * kernels.units(w.shape)[1]
    dense = torch.empty_like(w)

    def kernels_arm():
        kernels.decode_sum([kernels.encode(w, key="conv")], dense)

    def topk_arm():
        torch.topk(w.reshape(-1).abs(), kept, sorted=False)

    times = timed_rounds({"topk": topk_arm, "kernels": kernels_arm}, rounds)
    ratio = paired_ratio(times["topk"], times["kernels"])
    tk, tp = sorted(times["kernels"])[rounds // 2], sorted(times["topk"])[rounds // 2]
    rows.append(["kernels", "x".join(map(str, kernels_shape)), f"torch.topk (k = {kept:,})", f"{tp * 1e3:.1f}",
                 f"{tk * 1e3:.1f}", f"{ratio:.3f}"])
    report.figures.append(Figure("kernels encode+decode vs element-wise torch.topk (time topk / time kernels)", ratio,
                                 ">=", KERNELS_TARGET, "x", f"topk {tp * 1e3:.1f} ms, kernels {tk * 1e3:.1f} ms, "
                                 f"{kernels.k(w.shape):,} of {kernels.units(w.shape)[0]:,} kernels"))
    report.add(table(["codec", "tensor", "reference", "reference ms", "codec ms", "paired ratio"], rows))
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

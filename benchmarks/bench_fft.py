"""FFT codec throughput against the bare FFTs it is built on, 25M floats.

Arms, alternating in one process, median of >= 5 rounds after a warm-up:
- bare: ``irfft(rfft(x, n=L), n=L)[:N]`` at the codec's padded length L (the transforms alone);
- fft: the ``fft`` codec's ``encode`` + ``decode`` (rfft, bin selection, range-float
  quantization, position packing, then unpacking, dequantization and irfft), theta held
  constant at 0.9 and at 0.5.

Target: time(bare) / time(fft) >= 0.75, i.e. selection, quantization and packing cost at
most a third of the FFTs themselves.
"""

from __future__ import annotations

import sys
import time

from _common import Figure, Report, load_note, median, parser, table

N = 25_000_000
TARGET = 0.75


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    import torch

    from thinwire.codecs.fft import fast_length
    from thinwire.codecs.registry import build_codec

    n = 2_000_000 if args.quick else N
    rounds = 5 if args.quick else 7
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    length = fast_length(n)
    report = Report("FFT codec vs bare rfft+irfft", "python benchmarks/bench_fft.py" + (" --quick" if args.quick else ""))
    report.add(f"N = {n:,} floats (padded to {length:,}), {torch.get_num_threads()} torch threads, "
               f"median of {rounds} alternating rounds after 1 warm-up; {load_note()}")

    def bare():
        return torch.fft.irfft(torch.fft.rfft(x, n=length), n=length)[:n]

    rows = []
    for theta in (0.9, 0.5):
        codec = build_codec(f"fft:theta={theta},schedule=constant")

        def ours(codec=codec):
            return codec.decode(codec.encode(x, key="x"))

        times = {"bare": [], "fft": []}
        for r in range(rounds + 1):
            for name, fn in (("bare", bare), ("fft", ours)):
                t0 = time.perf_counter()
                fn()
                if r:
                    times[name].append(time.perf_counter() - t0)
        tb, tf = median(times["bare"]), median(times["fft"])
        err = ((ours() - x).norm() / x.norm()).item()
        rows.append([theta, f"{tb * 1e3:.0f}", f"{tf * 1e3:.0f}", f"{tb / tf:.3f}", f"{err:.4f}",
                     f"{4 * n / codec.nbytes(x.shape, x.dtype):.1f}x"])
        report.figures.append(Figure(f"fft_vs_bare_fft_time[theta={theta}]", tb / tf, ">=", TARGET, "x",
                                     f"bare rfft+irfft {tb * 1e3:.0f} ms, fft encode+decode {tf * 1e3:.0f} ms"))
    report.add(table(["theta", "bare ms", "fft ms", "bare/fft", "rel err", "compression"], rows))
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

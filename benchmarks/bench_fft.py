"""FFT codec throughput against the bare FFTs it is built on: 25M floats, and ResNet-18's gradients.

1. One 25M-float vector. Arms, alternating in one process, median of >= 5 rounds after a
   warm-up:
   - bare: ``irfft(rfft(x, n=L), n=L)[:N]`` at the codec's padded length L (the transforms alone);
   - fft: the ``fft`` codec's ``encode`` + ``decode`` (rfft, bin selection, range-float
     quantization, position packing, then unpacking, dequantization and irfft), theta held
     constant at 0.9 and at 0.5.

2. A real model's gradients: the 62 gradient tensors of ResNet-18 at CIFAR shape (11.2M
   parameters, the model of ``bench_real_models.py``), from one forward/backward pass on a
   random batch of 32. Every tensor goes through, the 41 small ones too (BatchNorm weights
   and biases of 64-512 floats, the classifier's bias), one codec call per tensor as the
   aggregator makes it for 2 ranks: ``encode``, then ``decode_sum`` of [payload, payload] into
   an output tensor. Arms, alternating, median of >= 5 rounds after a warm-up:
   - bare: ``rfft`` + ``irfft`` of every tensor at the codec's padded length (what the codec
     transforms: one FFT per tensor, the default, no bucketing);
   - fft at theta 0.9 and 0.5 (constant);
   - topk at ratio 0.01 (``encode`` + ``decode_sum`` of 2 payloads): the reference, no target.

Targets: time(bare) / time(fft) >= 0.75, i.e. selection, quantization and packing cost at
most a third of the FFTs themselves, for the vector (median over median) and for the
gradient set (median of the per-round ratios: the rounds alternate, so each pair shares
its noise). A full run (not ``--quick``) also writes benchmarks/results/fft_codec.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from _common import Figure, Report, load_note, median, paired_ratio, parser, table

N = 25_000_000
TARGET = 0.75
BATCH = 32
RESULTS = Path(__file__).resolve().parent / "results" / "fft_codec.md"


def vector(report: Report, quick: bool) -> None:
    import torch

    from thinwire.codecs.fft import fast_length
    from thinwire.codecs.specs import build_codec

    n = 2_000_000 if quick else N
    rounds = 5 if quick else 7
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    length = fast_length(n)
    report.add(f"### One vector\n\nN = {n:,} floats (padded to {length:,}), {torch.get_num_threads()} torch threads, "
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


def resnet18_gradients() -> list:
    """(name, gradient) of every parameter of ResNet-18 at CIFAR shape after one
    forward/backward pass on a random batch (the values matter little: the layout and the
    spectra's spread do)."""
    import torch

    from bench_real_models import resnet18

    torch.manual_seed(0)
    model = resnet18()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [(name, p.grad.detach().clone()) for name, p in model.named_parameters()]


def gradient_set(report: Report, quick: bool) -> None:
    import torch

    from thinwire.codecs.fft import fast_length
    from thinwire.codecs.specs import build_codec

    rounds = 7 if quick else 15
    grads = resnet18_gradients()
    small = sum(g.numel() < 1024 or g.dim() < 2 for _, g in grads)
    lengths = [fast_length(g.numel()) for _, g in grads]
    outs = [torch.empty_like(g) for _, g in grads]
    report.add(f"### ResNet-18 gradients\n\n{len(grads)} tensors, {sum(g.numel() for _, g in grads):,} floats "
               f"({small} of them 1-D or under 1,024 floats), one codec call per tensor, decode_sum of 2 payloads; "
               f"{torch.get_num_threads()} torch threads, median of {rounds} alternating rounds after 1 warm-up; "
               f"{load_note()}")

    def bare():
        for (_, g), length in zip(grads, lengths):
            torch.fft.irfft(torch.fft.rfft(g.reshape(-1), n=length), n=length)

    def arm(spec: str):
        codec = build_codec(spec)

        def run():
            for (name, g), out in zip(grads, outs):
                p = codec.encode(g, key=name)
                codec.decode_sum([p, p], out)

        return run

    specs = ["fft:theta=0.9,schedule=constant", "fft:theta=0.5,schedule=constant", "topk:ratio=0.01"]
    arms = {"bare": bare} | {s: arm(s) for s in specs}
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds + 1):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            if r:
                times[name].append(time.perf_counter() - t0)
    tb, ttop = median(times["bare"]), median(times["topk:ratio=0.01"])
    floats = sum(g.numel() for _, g in grads)
    rows = [["bare rfft+irfft", f"{tb * 1e3:.1f}", "1.000", "-", "-"]]
    for s in specs:
        codec = build_codec(s)
        ts, ratio = median(times[s]), paired_ratio(times["bare"], times[s])
        rows.append([s, f"{ts * 1e3:.1f}", f"{ratio:.3f}", f"{paired_ratio(times[s], times['topk:ratio=0.01']):.2f}",
                     f"{4 * floats / sum(codec.nbytes(g.shape, g.dtype) for _, g in grads):.1f}x"])
        if s.startswith("fft"):
            theta = s.split("theta=")[1].split(",")[0]
            report.figures.append(Figure(f"fft_vs_bare_fft_time_resnet18[theta={theta}]", ratio, ">=", TARGET, "x",
                                         f"bare rfft+irfft {tb * 1e3:.1f} ms, fft encode+decode_sum "
                                         f"{ts * 1e3:.1f} ms per step; topk:ratio=0.01 {ttop * 1e3:.1f} ms"))
    report.add(table(["arm", "ms per step (median)", "bare / arm (paired)", "arm / topk (paired)", "compression"],
                     rows))


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    command = "python benchmarks/bench_fft.py" + (" --quick" if args.quick else "")
    report = Report("FFT codec vs bare rfft+irfft", command)
    vector(report, args.quick)
    gradient_set(report, args.quick)
    code = report.finish(args.json)
    if not args.quick:
        write_results(report)
    return code


def write_results(report: Report) -> None:
    import torch

    from _training import dirty
    from run_all import cpu_model, git_commit

    commit = f"`{git_commit()}`" + (" (working tree has uncommitted changes)" if dirty() else "")
    lines = [f"# {report.title}", "", f"- command: `{report.command}`", f"- git commit: {commit}",
             f"- torch {torch.__version__}, {cpu_model()}, {torch.get_num_threads()} torch threads",
             f"- {load_note()} at the end", "", "## Figures", ""]
    lines += [f"- `{f.line()}`" for f in report.figures]
    lines += [""] + [s + "\n" for s in report.sections]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS.relative_to(RESULTS.parent.parent.parent)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

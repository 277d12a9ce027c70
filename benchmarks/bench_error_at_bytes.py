"""Relative error of fft, topk, randomk and qsgd at equal wire bytes, on real gradients.

Inputs: one gradient of the mnist1d CNN and one of the charlm transformer (seed 0, first
batch; ``thinwire.lab.bench_codecs.model_gradient``). Every tensor goes the way the aggregator
sends it: a tensor the codec declines (1-D, or under ``min_numel`` = 1,024 elements; the rule
is the same for all four codecs) travels as fp32, so those bytes and their zero error are
common to every row. Errors are one shot, no error feedback (``ef=false``), at step 0:
``||g - decode(encode(g))|| / ||g||`` over the whole set.

Budgets: the wire bytes fft sends with 8-bit range floats at a constant theta of 0.9, 0.7
and 0.5. Each other codec gets the setting whose bytes come closest to a budget without
passing it: topk and randomk the largest ``ratio`` (found by bisection), qsgd the most
``levels`` (1, 3, 7, ... 127 fill 2 to 8 bits per value; 32767 takes 16-bit words; ``bucket``
stays 0, one norm per tensor). A codec whose smallest setting is over a budget is listed as
such and left out of that budget's comparison. randomk keeps ``rescale=false`` (the biased,
lower-error form); randomk and qsgd draw from seed 0, so their error is one draw.

Figure per input and budget: 1 when fft has the smallest error of the codecs within the
budget, else 0; target >= 1 (fft smallest at equal bytes).

``--quick``: the mnist1d gradient only.
"""

from __future__ import annotations

import math
import sys
import time

from _common import Figure, Report, load_note, parser, table

TASKS, QUICK_TASKS = ("mnist1d", "charlm"), ("mnist1d",)
THETAS = (0.9, 0.7, 0.5)
QSGD_LEVELS = (1, 3, 7, 15, 31, 63, 127, 32767)  # 2..8 bits per value (sign + level), then 16-bit words
BISECT_STEPS = 60


def fft_spec(theta: float) -> str:
    return f"fft:theta={theta},bits=8,schedule=constant,ef=false"


def ratio_spec(name: str, ratio: float) -> str:
    return f"{name}:ratio={ratio!r},ef=false"


def qsgd_spec(levels: int) -> str:
    return f"qsgd:levels={levels},ef=false"


# -- bytes and error -------------------------------------------------------------------------------
def predicted_bytes(spec: str, items) -> int:
    """Wire bytes the codec's ``nbytes`` predicts for the whole set (declined tensors as fp32)."""
    from thinwire.codecs.specs import build_codec
    from thinwire.lab.bench_codecs import codec_for_each

    codecs = codec_for_each(build_codec(spec), items)
    return sum(c.nbytes(x.shape, x.dtype) for c, (_, x) in zip(codecs, items))


def measure(spec: str, items) -> dict:
    """One-shot roundtrip of a fresh codec: measured wire bytes and relative error."""
    import torch

    from thinwire.codecs.specs import build_codec
    from thinwire.lab.bench_codecs import codec_for_each, rel_error, roundtrip

    codec = build_codec(spec)
    codecs = codec_for_each(codec, items)
    with torch.no_grad():
        outs, wire = roundtrip(codecs, items, update=False)
    return {"spec": spec, "wire": wire, "error": rel_error(items, outs), "compressed": sum(c is codec for c in codecs)}


# -- matching a budget -----------------------------------------------------------------------------
def largest_ratio(name: str, items, budget: int) -> float | None:
    """The largest ratio in (0, 1] whose predicted bytes are <= ``budget`` (None: even the
    smallest, one value per compressed tensor, is over), in as few digits as keep its bytes."""
    nbytes = lambda r: predicted_bytes(ratio_spec(name, r), items)  # noqa: E731
    if nbytes(1.0) <= budget:
        return 1.0
    lo, hi = 0.0, 1.0  # invariant: nbytes(hi) > budget; nbytes(lo) <= budget once lo > 0
    for _ in range(BISECT_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if nbytes(mid) <= budget else (lo, mid)
    if lo == 0.0:
        return None
    return shortest(lo, nbytes)


def shortest(ratio: float, nbytes) -> float:
    """``ratio`` rounded down to the fewest significant digits that send the same bytes."""
    want = nbytes(ratio)
    for digits in range(1, 17):
        scale = 10.0 ** (digits - 1 - math.floor(math.log10(ratio)))
        short = math.floor(ratio * scale) / scale
        if short > 0 and nbytes(short) == want:
            return short
    return ratio


def most_levels(items, budget: int) -> tuple[int, bool]:
    """qsgd's levels with the most bytes <= ``budget``; (1, False) when even levels=1 is over."""
    fits = [s for s in QSGD_LEVELS if predicted_bytes(qsgd_spec(s), items) <= budget]
    return (max(fits), True) if fits else (QSGD_LEVELS[0], False)


def contenders(items, budget: int) -> list[tuple[str, str, bool]]:
    """(codec, spec, within budget) for topk, randomk and qsgd at ``budget`` bytes."""
    out = []
    for name in ("topk", "randomk"):
        r = largest_ratio(name, items, budget)
        out.append((name, ratio_spec(name, r), True) if r is not None else (name, ratio_spec(name, 1e-9), False))
    levels, fits = most_levels(items, budget)
    out.append(("qsgd", qsgd_spec(levels), fits))
    return out


# -- one input -------------------------------------------------------------------------------------
def compare(task: str, items, report: Report) -> None:
    fp32 = sum(4 * x.numel() for _, x in items)
    rows, verdicts = [], []
    for theta in THETAS:
        t0 = time.perf_counter()
        fft = measure(fft_spec(theta), items)
        budget = fft["wire"]
        entries = [("fft", fft, True)] + [(name, measure(spec, items), fits)
                                          for name, spec, fits in contenders(items, budget)]
        within = [(name, m) for name, m, fits in entries if fits and m["wire"] <= budget]
        best_name = min(within, key=lambda e: e[1]["error"])[0]
        for name, m, fits in entries:
            if not fits or m["wire"] > budget:
                note = "over budget: smallest setting sends more"
            else:
                note = "smallest error" if name == best_name else ""
            rows.append([f"theta={theta}: {budget:,}", name, m["spec"], f"{m['wire']:,}",
                         f"{100 * m['wire'] / budget:.1f}%", f"{fp32 / m['wire']:.1f}x", f"{m['error']:.4f}", note])
        verdicts.append(verdict(theta, budget, within))
        detail = "; ".join(f"{name} {m['error']:.4f} at {m['wire']:,} B" + ("" if (name, m) in within else " (over)")
                           for name, m, _ in entries)
        report.figures.append(Figure(f"fft has the smallest error at equal bytes [{task}, theta={theta} budget]",
                                     1.0 if best_name == "fft" else 0.0, ">=", 1.0, "", detail))
        print(f"{task} theta={theta}: budget {budget:,} B, smallest error {best_name} "
              f"({1e3 * (time.perf_counter() - t0):.0f} ms)", flush=True)
    head = (f"{task} gradient: {len(items)} tensors, {fp32:,} B as fp32; {fft['compressed']} tensors compressed, "
            f"the rest ({fp32_fallback(items):,} B) travel as fp32 in every row")
    report.add(head + "\n\n" + table(
        ["budget (fft theta: bytes)", "codec", "spec", "wire bytes", "of budget", "compression", "rel error", "note"],
        rows) + "\n\n" + "\n".join(f"- {v}" for v in verdicts))


def verdict(theta: float, budget: int, within: list[tuple[str, dict]]) -> str:
    """One line: the codecs within a budget, smallest error first, each as a multiple of the best."""
    ranked = sorted(within, key=lambda e: e[1]["error"])
    best = ranked[0][1]["error"]
    order = ", ".join(f"{name} {m['error']:.4f}" + ("" if i == 0 else f" ({m['error'] / best:.2f}x)")
                      for i, (name, m) in enumerate(ranked))
    return f"theta={theta} budget ({budget:,} B), smallest error first: {order}"


def fp32_fallback(items) -> int:
    """Bytes of the tensors every codec here declines (1-D or under 1,024 elements)."""
    from thinwire.codecs.specs import build_codec

    codec = build_codec(fft_spec(THETAS[0]))
    return sum(4 * x.numel() for _, x in items if not codec.compresses(x.shape))


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__).parse_args(argv)
    import torch

    from thinwire.lab.bench_codecs import model_gradient

    tasks = QUICK_TASKS if args.quick else TASKS
    report = Report("Relative error at equal wire bytes (real gradients)",
                    "python benchmarks/bench_error_at_bytes.py" + (" --quick" if args.quick else ""))
    report.add(f"inputs: {', '.join(tasks)} gradients (seed 0, batch 64); budgets: fft at theta {THETAS}; "
               f"torch {torch.__version__}; {load_note()}")
    for task in tasks:
        items = model_gradient(task)
        compare(task, items, report)
    return report.finish(args.json)


if __name__ == "__main__":
    sys.exit(main())

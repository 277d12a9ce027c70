"""``thinwire bench codecs``: encode+decode speed, error and wire bytes of every codec.

For each codec spec and each input set it reports time, error and bytes together:

* encode+decode GB/s of fp32 input and the ratio of that time to a same-size ``copy_`` into a
  preallocated buffer, timed in the same run, alternating (copy, codec, copy, codec, ...),
  median of ``repeats`` pairs after a warm-up (``x copy_`` = codec seconds / copy seconds);
* the relative error ``||g - ĝ|| / ||g||`` over the whole input set, one shot, no error
  feedback (a fresh codec at step 0: PowerSGD from its random start, not a warm start);
* wire bytes (measured on the payloads, every round) and the compression ratio.

Inputs: one real gradient of the mnist1d CNN and of the charlm transformer (one batch, seed 0),
and a large gaussian N(0, 1) matrix (25M floats as 5000x5000; 2M with ``quick``), 2-D so that
matrix codecs (PowerSGD) compress it too. Tensors go through the per-tensor path the way
:class:`~thinwire.aggregate.Aggregator` sends them: a tensor the codec declines
(``codec.compresses(shape)`` false) travels as fp32 identity. Multi-round codecs
(``rounds > 1``) simulate one rank: ``encode``, then ``encode_next`` with the payload itself as
the "reduced" one (world size 1), then ``decode``; the timed loop also calls ``update`` (the
warm start), as the aggregator does each step.

Specs (``methods``): separated by ``;`` (``"topk:ratio=0.01,ef=false;qsgd"``), or by commas,
where a comma-separated piece with ``=`` and no ``:`` continues the previous spec's knobs
(``"identity,topk:ratio=0.01,ef=false,powersgd:rank=4"`` is three specs).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from thinwire.lab.load import high_load, load_text

if TYPE_CHECKING:
    from thinwire.codecs.base import Codec

FLAT_NUMEL = 25_000_000  # large input, full run (5000 x 5000)
FLAT_NUMEL_QUICK = 2_000_000  # large input with quick (1414 x 1414)
VARIANTS = ("topk:ratio=0.001", "topk:select=exact", "powersgd:rank=4")  # besides every codec's defaults
INPUTS = ("mnist1d", "charlm", "large")
REPEATS, REPEATS_QUICK = 7, 5  # timed (copy, codec) pairs; the median is reported
MIN_SAMPLE_S, MIN_SAMPLE_S_QUICK = 0.05, 0.01  # each timed sample loops until at least this long

Item = tuple[str, torch.Tensor]  # (key, tensor)


@dataclass
class Row:
    spec: str  # the codec as built (describe()), e.g. topk:ef=true,ratio=0.01,...
    method: str  # the spec as asked, e.g. topk:ratio=0.001
    input: str  # input set name
    tensors: int  # tensors in the set
    compressed: int  # tensors the codec compressed (the rest went as fp32 identity)
    fp32_bytes: int  # input bytes as fp32
    wire_bytes: int  # bytes of the payloads actually produced, all rounds
    nbytes: int  # what the codecs' nbytes() predict for the same tensors
    compression: float  # fp32_bytes / wire_bytes
    rel_error: float  # ||g - ĝ|| / ||g|| over the whole set, one shot
    seconds: float  # median encode+decode seconds for the whole set
    copy_seconds: float  # median copy_ seconds, same bytes, same run
    gbps: float  # fp32 GB/s through encode+decode
    copy_gbps: float  # GB/s of the copy_
    x_copy: float  # median of (codec seconds / copy seconds) over the alternating pairs
    repeats: int


# -- specs -----------------------------------------------------------------------------------------
def split_specs(text: str) -> list[str]:
    """Split a ``--methods`` value into codec specs (see the module doc for the rules)."""
    if ";" in text:
        parts = [p.strip() for p in text.split(";")]
        return [p for p in parts if p]
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if specs and "=" in piece and ":" not in piece:
            specs[-1] = f"{specs[-1]},{piece}"  # a knob of the previous spec
        else:
            specs.append(piece)
    return specs


def default_specs() -> list[str]:
    from thinwire.codecs.specs import available

    names = list(available())
    specs = list(names)
    for variant in VARIANTS:  # each variant right after its codec's defaults
        base = variant.split(":")[0]
        at = max(i for i, s in enumerate(specs) if s.split(":")[0] == base) + 1 if base in names else len(specs)
        specs.insert(at, variant)
    return specs


# -- inputs ----------------------------------------------------------------------------------------
def model_gradient(task_name: str, batch: int = 64) -> list[Item]:
    """One real gradient of a bundled task's model (seed 0, rank 0 of 1, first batch)."""
    from thinwire.tasks import get

    task = get(task_name)(seed=0)
    model = task.build_model()
    x, y = next(iter(task.train_batches(0, 1, batch)))
    with torch.enable_grad():
        task.loss(model(x), y).backward()
    return [(n, p.grad.detach().clone()) for n, p in model.named_parameters() if p.grad is not None]


def large_matrix(numel: int) -> list[Item]:
    """A gaussian N(0, 1) matrix of about ``numel`` floats, as square as possible."""
    rows = max(1, math.isqrt(numel))
    g = torch.Generator().manual_seed(0)
    return [("large", torch.randn(rows, numel // rows, generator=g))]  # (rows, cols)


def build_inputs(names: Sequence[str], numel: int) -> dict[str, list[Item]]:
    out = {}
    for name in names:
        if name == "large":
            items = large_matrix(numel)
            rows, cols = items[0][1].shape
            out[f"gaussian {rows}x{cols}"] = items
        else:
            out[f"{name} grad"] = model_gradient(name)
    return out


# -- work ------------------------------------------------------------------------------------------
def codec_for_each(codec: Codec, items: list[Item]) -> list[Codec]:
    """The codec each tensor travels with: the codec, or fp32 identity where it declines."""
    from thinwire.codecs.identity import Identity, IdentityConfig

    fallback = Identity(IdentityConfig())
    return [codec if codec.compresses(x.shape) else fallback for _, x in items]


def roundtrip(codecs: list[Codec], items: list[Item], *, update: bool) -> tuple[list[torch.Tensor], int]:
    """Encode (all rounds, world size 1) and decode every tensor; returns (decoded, wire bytes)."""
    outs, wire = [], 0
    for c, (key, x) in zip(codecs, items, strict=True):
        p = c.encode(x, key=key)
        wire += p.nbytes
        for _ in range(1, c.rounds):
            p = c.encode_next(p, key=key)  # one rank: its own payload is the "reduced" one
            wire += p.nbytes
        outs.append(c.decode(p))
        if update:
            c.update(key, p)
    return outs, wire


def rel_error(items: list[Item], outs: list[torch.Tensor]) -> float:
    num = sum(float((x.double() - y.double()).pow(2).sum()) for (_, x), y in zip(items, outs, strict=True))
    den = sum(float(x.double().pow(2).sum()) for _, x in items)
    return math.sqrt(num / den) if den > 0 else 0.0


def timed(fn: Callable[[], object], inner: int) -> float:
    """Seconds per call of ``fn``, over ``inner`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def calibrate(fn: Callable[[], object], min_s: float) -> int:
    """Calls per timed sample so that one sample lasts at least ``min_s`` (after one warm-up call)."""
    one = timed(fn, 1)
    return max(1, min(10_000, math.ceil(min_s / max(one, 1e-7))))


def measure(spec: str, items: list[Item], input_name: str, repeats: int, min_s: float) -> Row:
    from thinwire.codecs.specs import build_codec

    codec = build_codec(spec)  # fresh: the error is a one-shot figure at step 0
    codecs = codec_for_each(codec, items)
    outs, wire = roundtrip(codecs, items, update=False)
    err = rel_error(items, outs)
    predicted = sum(c.nbytes(x.shape, x.dtype) for c, (_, x) in zip(codecs, items, strict=True))
    del outs

    fp32_bytes = sum(4 * x.numel() for _, x in items)
    src = torch.randn(fp32_bytes // 4)
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    work = lambda: roundtrip(codecs, items, update=True)  # noqa: E731
    n_copy, n_work = calibrate(copy, min_s), calibrate(work, min_s)
    timed(copy, n_copy), timed(work, n_work)  # warm-up at the timed sizes
    copies, works = [], []
    for _ in range(repeats):  # A B A B: both see the same machine noise
        copies.append(timed(copy, n_copy))
        works.append(timed(work, n_work))
    sec, copy_sec = statistics.median(works), statistics.median(copies)
    return Row(
        spec=codec.describe(), method=spec, input=input_name, tensors=len(items),
        compressed=sum(c is codec for c in codecs), fp32_bytes=fp32_bytes, wire_bytes=wire, nbytes=predicted,
        compression=fp32_bytes / max(1, wire), rel_error=err, seconds=sec, copy_seconds=copy_sec,
        gbps=fp32_bytes / sec / 1e9, copy_gbps=fp32_bytes / copy_sec / 1e9,
        x_copy=statistics.median(w / c for w, c in zip(works, copies, strict=True)), repeats=repeats,
    )


# -- output ----------------------------------------------------------------------------------------
COLUMNS = ("method", "input", "compressed", "fp32 MB", "wire KB", "ratio", "rel err", "ms", "GB/s", "x copy_",
           "copy_ GB/s")


def cells(r: Row) -> tuple[str, ...]:
    flag = "" if r.wire_bytes == r.nbytes else f" (nbytes says {r.nbytes})"
    return (
        r.method, r.input, f"{r.compressed}/{r.tensors}", f"{r.fp32_bytes / 1e6:.2f}",
        f"{r.wire_bytes / 1e3:.1f}{flag}", f"{r.compression:.1f}x", f"{r.rel_error:.4f}", f"{r.seconds * 1e3:.3f}",
        f"{r.gbps:.3f}", f"{r.x_copy:.1f}x", f"{r.copy_gbps:.2f}",
    )


def header(quick: bool, repeats: int) -> str:
    alloc = " ".join(f"{k}={os.environ[k]}" for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ)
    text = load_text()
    load = f"; {text}" if text else ""
    threads = torch.get_num_threads()
    return (
        f"thinwire bench codecs{' --quick' if quick else ''}: torch {torch.__version__}, "
        f"{threads} thread{'s' if threads > 1 else ''}, median of {repeats} alternating (copy_, codec) pairs; "
        f"allocator: {alloc or 'glibc defaults'}{load}"
    )


NOTES = (
    "ms: encode+decode of the whole set (every round; the timed loop also runs update()). "
    "x copy_: that time / a copy_ of the same bytes into a preallocated buffer, same run. "
    "rel err: ||g-ĝ||/||g||, one shot, no error feedback, step 0 (PowerSGD from a random Q). "
    "compressed k/n: tensors the codec compressed; the rest travel as fp32. "
    "wire KB: measured payload bytes per rank, all rounds."
)


def to_markdown(rows: list[Row], title: str) -> str:
    lines = [f"{title}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in rows]
    return "\n".join(lines + ["", NOTES, ""])


OUT_FILES = ("codecs.md", "codecs.csv", "codecs.json")  # what --out DIR receives


def write_out(out: str, rows: list[Row], title: str) -> list[Path]:
    """``out`` is a directory: writes codecs.md, codecs.csv and codecs.json into it."""
    from thinwire.run import outdir

    d = Path(out)
    outdir.claim(d, *OUT_FILES)  # only thinwire's own files are replaced
    (d / "codecs.md").write_text(to_markdown(rows, title))
    with open(d / "codecs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])) if rows else list(Row.__dataclass_fields__))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    (d / "codecs.json").write_text(json.dumps({"title": title, "rows": [asdict(r) for r in rows]}, indent=1))
    return [d / "codecs.md", d / "codecs.csv", d / "codecs.json"]


def print_table(rows: list[Row], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("method", "input") else "right")
    last = None
    for r in rows:
        if last is not None and r.method != last:
            table.add_section()
        table.add_row(*cells(r))
        last = r.method
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # logs and pipes: no squeezed columns
    console.print(table)
    console.print(NOTES, style="dim")


# -- entry -----------------------------------------------------------------------------------------
def main(
    quick: bool = False,
    methods: str | None = None,
    repeats: int | None = None,
    *,
    out: str | None = None,
    size: int | None = None,
    inputs: Sequence[str] | None = None,
    threads: int | None = None,
) -> int:
    """Run the codec benchmark; returns an exit code (0 ok, 2 bad input).

    ``out``: a directory to write codecs.md/.csv/.json into. ``size``: floats in the large
    gaussian input (default 25M, 2M with ``quick``). ``inputs``: a subset of
    mnist1d, charlm, large. ``threads``: torch threads for the run (default: torch's; the
    setting is process-wide and stays in force afterwards).
    """
    try:
        specs, repeats, inputs, numel = _checked(quick, methods, repeats, size, inputs, threads)
        if out:
            from thinwire.run import outdir

            outdir.claim(out, *OUT_FILES)  # before measuring: a file of anyone else's there is refused
    except ValueError as e:
        _note(f"thinwire: error: {e}")
        return 2

    if threads is not None:
        torch.set_num_threads(threads)
    title = header(quick, repeats)
    if repeats < 5:
        _note(f"note: median of {repeats} repeats; thinwire's benchmarks take at least 5")
    load = high_load()
    if torch.get_num_threads() > 1 and load is not None:
        _note(f"note: load average {load:.1f} on {os.cpu_count()} cores: multi-threaded timings are dominated by "
              "OpenMP wake-up stalls on a busy machine; OMP_NUM_THREADS=1 gives steadier figures")
    t_start = time.perf_counter()
    with torch.no_grad():
        data = build_inputs(inputs, numel)
    with torch.no_grad():
        rows = []
        min_s = MIN_SAMPLE_S_QUICK if quick else MIN_SAMPLE_S
        for i, spec in enumerate(specs, 1):
            t0 = time.perf_counter()
            for name, items in data.items():
                rows.append(measure(spec, items, name, repeats, min_s))
            _note(f"[{i}/{len(specs)}] {spec}: {time.perf_counter() - t0:.1f} s")
    print_table(rows, title)
    if out:
        paths = write_out(out, rows, title)
        _note(f"wrote {', '.join(map(str, paths))}")
    _note(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


def _checked(quick: bool, methods: str | None, repeats: int | None, size: int | None,
             inputs: Sequence[str] | None, threads: int | None) -> tuple[list[str], int, tuple[str, ...], int]:
    """``main``'s arguments checked, defaults filled in: (specs, repeats, inputs, floats in the
    large input). Raises ``ValueError`` naming the first bad one."""
    from thinwire.codecs.specs import build_codec

    specs = split_specs(methods) if methods else default_specs()
    if not specs:
        raise ValueError("--methods gave no codec spec")
    for s in specs:
        build_codec(s)  # validate every spec before any work
    repeats = repeats if repeats is not None else (REPEATS_QUICK if quick else REPEATS)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = tuple(inputs) if inputs else INPUTS
    unknown = [i for i in names if i not in INPUTS]
    if unknown:
        raise ValueError(f"unknown input {unknown[0]!r}; inputs: {', '.join(INPUTS)}")
    numel = size if size is not None else (FLAT_NUMEL_QUICK if quick else FLAT_NUMEL)
    if numel < 1:
        raise ValueError(f"size must be >= 1, got {numel}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return specs, repeats, names, numel


def _note(text: str) -> None:
    """One line on stderr (progress, notes, errors): never wrapped."""
    print(text, file=sys.stderr, flush=True)


def _cli(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m thinwire.lab.bench_codecs", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2M-float large input, 5 repeats, short samples")
    p.add_argument("--methods", help="codec specs separated by ';' (or by ',' between specs; see module doc)")
    p.add_argument("--repeats", type=int, help="timed (copy_, codec) pairs per row; the median is reported")
    p.add_argument("--out", help="directory to write codecs.md, codecs.csv and codecs.json")
    p.add_argument("--size", type=int, help="floats in the large gaussian input")
    p.add_argument("--inputs", help="comma-separated subset of mnist1d,charlm,large")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's default)")
    a = p.parse_args(argv)
    inputs = [s.strip() for s in a.inputs.split(",") if s.strip()] if a.inputs else None
    return main(quick=a.quick, methods=a.methods, repeats=a.repeats, out=a.out, size=a.size, inputs=inputs,
                threads=a.threads)


if __name__ == "__main__":
    sys.exit(_cli())

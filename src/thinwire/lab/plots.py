"""PNG plots of a comparison (matplotlib, no display needed).

- ``accuracy_vs_step.png``: test accuracy at each evaluation (``loss_vs_*`` instead, test
  loss, for a race judged by the loss: a language model).
- ``accuracy_vs_bytes.png``: against the megabytes rank 0 had sent (log scale).
- ``accuracy_vs_time_<link>.png``: against the modeled seconds at that link.
- ``time_breakdown_<link>.png``, one per link: per method, stacked compute / codec /
  communication seconds (communication modeled at that link, what overlap hid left out;
  ``time_breakdown.png`` with measured communication when there is no link).

A dashed line marks the target. Failed runs are left out of the plots (the report lists
them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
STYLES = ("-", "--", "-.", ":")


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training node
    import matplotlib.pyplot as plt

    return plt


def link_slug(link: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", link).strip("_")


def plot_names(links: tuple[str, ...], figure: str = "accuracy") -> list[str]:
    """The files :func:`plot_all` writes for ``links``, in its order (``figure``: ``accuracy``
    or ``loss``, what the race is judged by)."""
    breakdowns = [f"time_breakdown_{link_slug(link)}.png" for link in links] or ["time_breakdown.png"]
    return ([f"{figure}_vs_step.png", f"{figure}_vs_bytes.png"]
            + [f"{figure}_vs_time_{link_slug(link)}.png" for link in links] + breakdowns)


def plot_all(out: Path, results: list[dict[str, Any]], links: tuple[str, ...], target: float | None,
             figure: str = "accuracy") -> list[str]:
    """Write every plot into ``out``; returns their paths."""
    ok = [r for r in results if r["status"] == "ok" and r["rows"]]
    name = "test accuracy" if figure == "accuracy" else "test loss"
    paths = [
        _curves(out / f"{figure}_vs_step.png", ok, lambda row: row["step"], "step", f"{name} vs step", target, figure),
        _curves(out / f"{figure}_vs_bytes.png", ok, lambda row: row["bytes_sent"] / 1e6, "MB sent by rank 0 (log)",
                f"{name} vs bytes sent", target, figure, log=True),
    ]
    for link in links:
        key = f"modeled_seconds@{link}"
        paths.append(_curves(out / f"{figure}_vs_time_{link_slug(link)}.png", ok, lambda row, k=key: row.get(k),
                             f"modeled seconds at {link}", f"{name} vs modeled time at {link}", target, figure))
    for link in links:
        paths.append(_breakdown(out / f"time_breakdown_{link_slug(link)}.png", ok, link))
    if not links:
        paths.append(_breakdown(out / "time_breakdown.png", ok, None))
    return [str(p) for p in paths]


def _curves(path: Path, runs: list[dict[str, Any]], x_of: Callable[..., Any], xlabel: str, title: str,
            target: float | None, figure: str = "accuracy", log: bool = False) -> Path:
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for i, r in enumerate(runs):
        points = [(x_of(row), row.get(f"test_{figure}")) for row in r["rows"]]
        points = [(x, y) for x, y in points if x is not None and y is not None and (not log or x > 0)]
        if points:
            xs, ys = zip(*points, strict=True)
            # styles cycle too, so that methods with identical curves (torch-ddp, identity) stay visible
            ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], markersize=4, linewidth=1.5,
                    linestyle=STYLES[i % len(STYLES)], label=r["label"])
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
    if log:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"test {figure}")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # runs without this figure draw nothing
        ax.legend(fontsize=8, loc="lower right" if figure == "accuracy" else "upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _breakdown(path: Path, runs: list[dict[str, Any]], link: str | None) -> Path:
    plt = _pyplot()
    labels, compute, codec, comm = [], [], [], []
    for r in runs:
        s = r["summary"]
        labels.append(r["label"])
        compute.append(s.compute_seconds)
        codec.append(s.codec_seconds)
        modeled = s.modeled_seconds_by_link.get(link) if link else None
        comm.append(max(0.0, modeled - s.compute_seconds - s.codec_seconds) if modeled is not None else s.comm_seconds)
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(labels) + 2.2), dpi=110, layout="constrained")
    ys = range(len(labels))
    ax.barh(ys, compute, label="compute")
    ax.barh(ys, codec, left=compute, label="codec (measured)")
    ax.barh(ys, comm, left=[a + b for a, b in zip(compute, codec, strict=True)],
            label=f"communication ({'modeled at ' + link if link else 'measured'})")
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per worker, whole run")
    ax.set_title("where the time goes" + (f" at {link}" if link else ""))
    ax.grid(True, axis="x", alpha=0.3)
    fig.legend(fontsize=8, loc="outside lower center", ncol=3, frameon=False)
    fig.savefig(path)
    plt.close(fig)
    return path

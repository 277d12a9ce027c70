"""What a finished run prints on the terminal: its figures, and with a policy the codec and bytes
of every parameter (rich tables whose labels never split)."""

from __future__ import annotations

import re
import sys
from typing import Any

from thinwire.run.summary import Summary


def print_summary(s: Summary, out: str | None, console: Any = None) -> None:
    from rich.console import Console

    console = console or Console()
    for table in summary_tables(s):
        console.print(table)
    for warning in s.warnings:
        print(f"thinwire: warning: {warning}", file=sys.stderr)
    if out:
        console.print(f"wrote {out}/summary.json and {out}/metrics.jsonl", markup=False, overflow="fold")


def summary_tables(s: Summary) -> list[Any]:
    """The run's figures, and with a policy the per-parameter table: labels never split."""
    from rich.markup import escape
    from rich.table import Table

    from thinwire.run.labels import short

    label = short(s.label)
    sharded = ", sharded" if s.shard else ""
    nodes = "" if s.ranks_per_node == 1 else f" ({s.workers // s.ranks_per_node} groups of {s.ranks_per_node}{sharded})"
    table = Table(title=escape(f"{s.task} · {label} · {s.workers} workers{nodes} · {s.steps} steps"))
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("method", escape(label))
    table.add_row("resolved", escape(spaced(s.method)))
    for key in ("final_accuracy", "final_bpc", "final_loss"):
        value = getattr(s, key)
        if value is not None:
            name = FIGURE_NAMES[key]
            if (s.config.get("task_options") or {}).get("eval_split") == "valid":  # the text task's validation windows
                name = name.replace("test", "validation")
            table.add_row(name, f"{value:.4f}")
    table.add_row("bytes sent per worker", size_text(s.bytes_sent_per_worker))
    by_link = s.bytes_by_link_per_worker
    if s.ranks_per_node > 1:
        inside = "FSDP2" if s.shard else s.intra_dtype or "fp32"
        table.add_row(f"of which inside ({inside}) / between groups",
                      f"{size_text(by_link.get('intra', 0))} / {size_text(by_link.get('inter', 0))}")
    table.add_row("fp32 all_reduce would send", size_text(s.fp32_bytes_per_worker))
    if s.compression_ratio:
        table.add_row("compression ratio", f"{s.compression_ratio:.1f}x")
    table.add_row("wall / compute / codec / comm s",
                  f"{s.wall_seconds:.1f} / {s.compute_seconds:.1f} / {s.codec_seconds:.1f} / {s.comm_seconds:.1f}")
    for link, sec in s.modeled_seconds_by_link.items():
        table.add_row(f"modeled time at {link}", f"{sec:.1f} s")
    tables = [table]
    if s.method_report.get("policy") and s.per_parameter:
        tables.append(_per_parameter_table(s.per_parameter))
    return tables


FIGURE_NAMES = {"final_accuracy": "final test accuracy", "final_bpc": "final test bpc",
                "final_loss": "final test loss"}  # summary.json's final_* are the last evaluation's test figures


def spaced(spec: str) -> str:
    """A resolved spec with a space after each ``,`` and ``;`` (between knobs and rules), so
    a narrow table wraps it between knobs, never inside one."""
    return re.sub(r"([,;])(?=\S)", r"\1 ", spec)


def _per_parameter_table(rows: list[dict[str, Any]]):
    """The codec each parameter got and the bytes it cost (runs with a policy)."""
    from rich.table import Table

    from thinwire.run.labels import short

    table = Table(title="per parameter: codec and bytes sent per worker over the run")
    for col, right in (("parameter", False), ("shape", False), ("codec", False), ("sent", True), ("vs fp32", True)):
        table.add_column(col, justify="right" if right else "left", no_wrap=True, overflow="ellipsis")
    for r in rows:
        ratio = r["fp32_bytes_per_worker"] / r["bytes_sent_per_worker"] if r["bytes_sent_per_worker"] else 0.0
        table.add_row(short(r["name"]), "x".join(map(str, r["shape"])), r["codec"].split(":")[0],
                      size_text(r["bytes_sent_per_worker"]), f"{ratio:.1f}x" if ratio else "-")
    return table


def size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"

"""The table every `bench attention` and `bench decode` report is printed as, whatever the runtime."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from .common import traffic_text

# Piped output (CI logs, files) gets room for the wide tables instead of the 80-column default.
_console = Console(width=None if sys.stdout.isatty() else 160)


def print_report(what: str, runtime: str, request, report: dict, contestants: dict[str, tuple[str, str | None]]) -> None:
    """contestants: result-key prefix -> (label, the key of OSCAR's speed-up over it, or None for OSCAR itself)."""
    if what == "attention":
        title = (f"decode attention, one layer of {request.model} ({report['q_heads']} q heads, {report['kv_heads']} "
                 f"KV heads, head_dim {report['head_dim']}), threads {report['threads']}, {runtime}; copy bandwidth "
                 f"{report['copy_GBps']:.1f} GB/s (read + write)")
    else:
        title = (f"greedy decode of {request.model}, weights {report['weights']}, median of {report['steps']} steps, "
                 f"threads {report['threads']}, {runtime}")
    table = Table(title=title, title_justify="left")
    table.add_column("context", justify="right")
    for prefix, (label, speedup) in contestants.items():
        table.add_column(f"{label} {'ms' if what == 'attention' else 'tok/s'}", justify="right")
        if speedup:
            table.add_column("OSCAR speed-up", justify="right")
    for prefix, (label, _) in contestants.items():
        table.add_column(f"{label} {'reads' if what == 'attention' else 'cache'}", justify="right")
    for r in report["results"]:
        cells = [str(r["context"])]
        for prefix, (_, speedup) in contestants.items():
            cells.append(f"{r[f'{prefix}_ms']:.3f}" if what == "attention" else f"{r[f'{prefix}_tokens_per_s']:.1f}")
            if speedup:
                cells.append(f"{r[speedup]:.2f}x")
        for prefix in contestants:
            if what == "attention":
                cells.append(traffic_text(r, prefix))
            else:
                cache = r.get(f"{prefix}_cache_bytes")
                cells.append("-" if cache is None else f"{cache / 2**20:.2f} MiB")
        table.add_row(*cells)
    _console.print(table)

"""The evaluation's result as a table and a plot."""

from __future__ import annotations

from pathlib import Path


from ..config import OscarInputError


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(result: dict, console=None) -> None:
    """One row per method: bits per element, perplexity per context and mean, attention error, needle accuracy."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cfg = result["config"]
    contexts = result["settings"]["contexts"] if "perplexity" in result["settings"]["metrics"] else []
    table = Table(title=f"Quality of {result['model']} at {result['bits']} bits: cluster_dim {cfg['cluster_dim']}, "
                        f"sink {cfg['sink']}, recent {cfg['recent']}")
    table.add_column("method")
    table.add_column("rotation")
    table.add_column("bits/elem", justify="right")
    for c in contexts:
        table.add_column(f"ppl@{c}", justify="right")
    table.add_column("ppl mean", justify="right")
    table.add_column("attn err", justify="right")
    table.add_column("needle acc", justify="right")
    for name, r in result["methods"].items():
        table.add_row(
            name,
            r["rotation"],
            _fmt(r["bits_per_element"], ".3f"),
            *(_fmt(r["perplexity_by_context"].get(str(c)), ".3f") for c in contexts),
            _fmt(r["perplexity"], ".3f"),
            _fmt(r["attention_error"], ".4f"),
            _fmt(r["needle_accuracy"], ".3f"),
        )
    console.print(table)
    if result.get("needle_control_accuracy") is not None:
        console.print(f"needle control (fp16, needles not in the haystack): {result['needle_control_accuracy']:.3f} "
                      "accuracy; only the excess over it is retrieval")
    for name, r in result["methods"].items():
        for line in r["notes"]:
            console.print(f"[yellow]note ({name}):[/yellow] {line}")


def plot(result: dict, path: str | Path) -> Path:
    """One PNG, three panels: perplexity by context, attention error by layer, needle accuracy by depth."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise OscarInputError("plot: matplotlib is not installed: expected `pip install matplotlib`") from None
    path = Path(path)
    if path.is_dir() or not path.parent.is_dir():
        raise OscarInputError(f"plot file {str(path)!r}: expected a file path in an existing directory")
    fig = Figure(figsize=(16, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_ppl, ax_err, ax_needle = fig.subplots(1, 3)
    for name, r in result["methods"].items():
        label = f"{name} ({r['bits_per_element']:.2f} b)" if r["bits_per_element"] is not None else name
        if r["perplexity_by_context"]:
            xs = sorted(r["perplexity_by_context"], key=int)
            ax_ppl.plot([int(x) for x in xs], [r["perplexity_by_context"][x] for x in xs], marker="o", label=label)
        if r["attention_error_by_layer"]:
            ax_err.plot(range(len(r["attention_error_by_layer"])), r["attention_error_by_layer"], marker="o", label=label)
        if r["needle_by_depth"]:
            xs = sorted(r["needle_by_depth"], key=float)
            ax_needle.plot([float(x) for x in xs], [r["needle_by_depth"][x] for x in xs], marker="o", label=label)
    if result.get("needle_control_accuracy") is not None:
        ax_needle.axhline(result["needle_control_accuracy"], color="gray", linestyle="--", label="control (no needle)")
    contexts = sorted({int(c) for r in result["methods"].values() for c in r["perplexity_by_context"]})
    if contexts:
        ax_ppl.set_xticks(contexts)
    ax_err.xaxis.get_major_locator().set_params(integer=True)
    ax_ppl.set(title="perplexity by context", xlabel="context (tokens)", ylabel="perplexity")
    ax_err.set(title="decode attention-output relative error", xlabel="layer", ylabel="relative error", yscale="log")
    ax_needle.set(title="needle retrieval accuracy", xlabel="needle depth", ylabel="accuracy", ylim=(-0.02, 1.02))
    for ax in (ax_ppl, ax_err, ax_needle):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(f"{Path(result['model']).name}: {result['bits']}-bit KV cache, sink {result['config']['sink']}, "
                 f"recent {result['config']['recent']}, cluster_dim {result['config']['cluster_dim']}")
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise OscarInputError(f"plot file {str(path)!r}: cannot write ({err.strerror}): expected a writable path") from None
    return path

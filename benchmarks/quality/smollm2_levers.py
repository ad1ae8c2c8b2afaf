"""Quality per bit on SmolLM2-135M-Instruct: each lever of the cache format against fp16, at the bits
per element it costs at 8K, and the Pareto front (perplexity and retrieval against bits).

    .venv/bin/python -m benchmarks.quality.smollm2_levers --split validation    # the sweep, every lever
    .venv/bin/python -m benchmarks.quality.smollm2_levers --split test --only oscar-2/g64,oscar-k3v2/g128-s16-r128

The bundled public-domain text is cut in two at a line break near its middle: the validation split
(the second half) chooses, the test split (the first half) reports; neither sees the other. Each
split's own first 4,624 tokens calibrate (eval's rule), the next 8,192 give perplexity at 2K/4K/8K
(one window, shorter contexts its prefix), and needles (5 x 24 tokens at depths 0.1..0.9 in a
4,096-token haystack, one seed) give retrieval. Results: benchmarks/results/quality/levers_<split>.json,
a table in .md and a plot in .png beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from oscar_export.config import OscarConfig
from oscar_export.evaluate.driver import evaluate
from oscar_export.models import load_model

from benchmarks.common import CONTEXTS, split_text

ROOT = Path(__file__).resolve().parents[2]

# Lever groups: one calibration each (its rotation fit serves every bit width in it). SmolLM2's head_dim is
# 64, so 64 is its largest group.
GROUPS = {
    "g64": (dict(cluster_dim=64), ("oscar-2", "oscar-k3v2", "oscar-k2v3", "oscar-3", "kivi-2", "online-2")),
    "g32": (dict(cluster_dim=32), ("oscar-2",)),
    "g64-s16-r128": (dict(cluster_dim=64, sink=16, recent=128), ("oscar-2", "oscar-k3v2")),
    "g64-s128-r512": (dict(cluster_dim=64, sink=128, recent=512), ("oscar-2",)),
    "g64-lloydmax": (dict(cluster_dim=64, codebook="lloyd-max"), ("oscar-2", "oscar-k3v2")),
    "g64-perhead": (dict(cluster_dim=64, per_head=True), ("oscar-2", "oscar-k3v2")),
    # K rounded with error feedback (calibrate's default), at today's windows and at smaller ones
    "g64-perhead-feedback": (dict(cluster_dim=64, per_head=True, k_rounding="feedback"), ("oscar-2", "oscar-k3v2")),
    "g64-s16-r128-perhead-feedback": (dict(cluster_dim=64, sink=16, recent=128, per_head=True, k_rounding="feedback"),
                                      ("oscar-2", "oscar-k3v2")),
}


def pareto(points: list[dict], key: str, higher_is_better: bool) -> list[str]:
    """Names of the points no other point beats on both bits and `key`."""
    front = []
    for p in points:
        better = (lambda a, b: a >= b) if higher_is_better else (lambda a, b: a <= b)
        if not any(q is not p and q["bits"] <= p["bits"] and better(q[key], p[key])
                   and (q["bits"] < p["bits"] or q[key] != p[key]) for q in points):
            front.append(p["name"])
    return front


def plot(rows: list[dict], fp16: dict, path: Path, split: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label, higher in ((axes[0], "ppl_increase_8k", "perplexity at 8K, % over fp16", False),
                                   (axes[1], "needle", "needle retrieval at 4K", True)):
        front = set(pareto(rows, key, higher))
        for r in rows:
            ax.scatter(r["bits"], r[key], color="C3" if r["name"] in front else "C0", s=24)
            ax.annotate(r["name"], (r["bits"], r[key]), fontsize=6, xytext=(3, 2), textcoords="offset points")
        line = sorted((r["bits"], r[key]) for r in rows if r["name"] in front)
        ax.plot(*zip(*line), color="C3", lw=1)
        if key == "needle":
            ax.axhline(fp16["needle"], color="gray", ls="--", lw=1, label="fp16")
            ax.legend(fontsize=7)
        if key == "ppl_increase_8k" and all(r[key] > 0 for r in rows):
            ax.set_yscale("log")  # the baselines sit far above the front: keep the front readable
        ax.set_xlabel("bits per K/V element at 8K")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"SmolLM2-135M-Instruct, {split} text: levers of the OSCAR cache (red: Pareto front)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", choices=("validation", "test"), default="validation")
    p.add_argument("--only", help="comma-separated METHOD/GROUP names to run (default: every lever)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quality")
    args = p.parse_args()
    gguf = ROOT / ".cache/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        sys.exit("fetch the model first: bash scripts/fetch_smollm2.sh")
    model, tokenizer = load_model(str(gguf))
    text = split_text(args.split)
    only = set(args.only.split(",")) if args.only else None
    started, results, fp16 = time.perf_counter(), {}, None
    for group, (fields, specs) in GROUPS.items():
        fields = dict(fields)
        per_head = fields.pop("per_head", False)
        specs = [s for s in specs if only is None or f"{s}/{group}" in only]
        if not specs:
            continue
        methods = ([] if fp16 else ["fp16"]) + specs
        config = replace(OscarConfig(), **fields)
        # Each group's result is kept as it finishes: a rerun reuses it (delete the file to redo a group).
        done = args.out / f"levers_{args.split}.{group}.json"
        if done.is_file() and set(methods) <= set(json.loads(done.read_text())["methods"]):
            result = json.loads(done.read_text())
        else:
            result = evaluate(str(gguf), methods=methods, config=config, contexts=CONTEXTS, text=text,
                              metrics=("perplexity", "needle"), per_head=per_head, model=model, tokenizer=tokenizer)
            args.out.mkdir(parents=True, exist_ok=True)
            done.write_text(json.dumps(result))
        for name, r in result["methods"].items():
            if name == "fp16":
                fp16 = r
                continue
            results[f"{name}/{group}"] = r
        print(f"{group}: done at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    base = {c: fp16["perplexity_by_context"][str(c)] for c in CONTEXTS}
    rows = []
    for name, r in results.items():
        ppl = {c: r["perplexity_by_context"][str(c)] for c in CONTEXTS}
        rows.append({"name": name, "bits": r["bits_per_element_by_context"]["8192"],
                     "ppl": ppl, "ppl_increase": {c: 100 * (ppl[c] / base[c] - 1) for c in CONTEXTS},
                     "ppl_increase_8k": 100 * (ppl[8192] / base[8192] - 1), "needle": r["needle_accuracy"],
                     "config": r["config"], "notes": r["notes"]})
    fp16_row = {"ppl": base, "needle": fp16["needle_accuracy"]}
    report = {"split": args.split, "model": gguf.name, "contexts": CONTEXTS, "fp16": fp16_row, "levers": rows,
              "pareto_perplexity": pareto(rows, "ppl_increase_8k", False),
              "pareto_needle": pareto(rows, "needle", True),
              "needle_control": result["needle_control_accuracy"], "wall_s": round(time.perf_counter() - started, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"levers_{args.split}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"SmolLM2-135M-Instruct, {args.split} split; fp16 ppl " + " / ".join(f"{base[c]:.2f}" for c in CONTEXTS)
             + f" (2K/4K/8K), needle {fp16_row['needle']:.3f}; wall {report['wall_s']:.0f} s", "",
             "| lever | bits/elem at 8K | ppl 2K | ppl 4K | ppl 8K | needle 4K | front |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["bits"]):
        front = "/".join(k for k, names in (("ppl", report["pareto_perplexity"]), ("needle", report["pareto_needle"]))
                         if r["name"] in names)
        lines.append(f"| {r['name']} | {r['bits']:.2f} | "
                     + " | ".join(f"{r['ppl'][c]:.2f} ({r['ppl_increase'][c]:+.1f}%)" for c in CONTEXTS)
                     + f" | {r['needle']:.3f} | {front} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, fp16_row, stem.with_suffix(".png"), args.split)


if __name__ == "__main__":
    main()

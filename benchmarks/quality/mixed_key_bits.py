"""Mixed key bits on SmolLM2-135M-Instruct: 3-bit K in the layers where it helps most, 2-bit K elsewhere,
2-bit V everywhere, and windows small enough that the whole cache costs <= 3.0 bits per element at 8K
(issue 19's budget). Measured against fp16, today's oscar-2 (g64, sink 64, recent 256: 3.03 bits, per-layer
rotations) and 3-bit K in every layer at the same windows (the mix's upper bound, over the budget).

    nice -n 10 .venv/bin/python -m benchmarks.quality.mixed_key_bits                    # validation, every row
    nice -n 10 .venv/bin/python -m benchmarks.quality.mixed_key_bits --split test --rows mixed-nll16/s16-r128

The two took 17 and 9 minutes on 2 CPU cores with one needle sequence (each 8K window plus needle about a
minute; the "nll" sensitivity, 31 passes of 2,048 tokens, most of the rest).

Same split, calibration and perplexity as benchmarks/quality/smollm2_levers.py (one 8K window for perplexity at
2K/4K/8K); retrieval over --needle-seeds needle sequences (default 4, 320 scored tokens), each row's gap to
fp16 paired per token with its standard error. Rotations are fitted per KV head (the best 2-bit lever
there); each bit width keeps its own clip ratio, searched on the held-out calibration tokens.

Which layers get 3 bits is chosen on calibration tokens only, by one of two rules:
- "nll": the drop in calibration NLL (the split's first 2,048 calibration tokens, one pass through the
  cache) when that layer alone has 3-bit K and every other layer 2-bit;
- "err": the drop in that layer's attention-output relative error with only K quantized (2 -> 3 bits) on
  the held-out calibration tokens (budget.key_error_gains, the ranking `calibrate --budget-bits` uses since
  its search became cheap enough for every export; it ranked with "nll" before).
Rows are named mixed-<rule><n>/s<sink>-r<recent>: n layers with 3-bit K, the cache format's k_bits_by_layer.
--budget B adds the row
budget-B: the format `calibrate --budget-bits B --context 8192 --per-head` chooses from the split's calibration
text alone, by the CLI's own path:

    nice -n 10 .venv/bin/python -m benchmarks.quality.mixed_key_bits --split test --rows "" --budget 3.0

(29 minutes with four needle sequences; the choice alone, probe scoring at K3 and K4 included, 18.)
--k4-ceiling adds 4-bit K in every layer at today's windows, a bit per element over the budget: how much
retrieval K precision alone buys at 2-bit V (results in mixed_key_bits_<split>_k4_ceiling.* when it runs alone;
10 minutes); with --k-rounding feedback the ceiling's K is rounded with error feedback too:

    nice -n 10 .venv/bin/python -m benchmarks.quality.mixed_key_bits --split test --rows "" --k4-ceiling

--k-rounding feedback chooses the --budget format with K's error-feedback rounding (calibrate --k-rounding
feedback), written to mixed_key_bits_<split>_budget_feedback.*:

    nice -n 10 .venv/bin/python -m benchmarks.quality.mixed_key_bits --split test --rows "" --budget 3.0 --k-rounding feedback

--budget-context N sizes the budget at another context. The long-context budget of 2.4 bits per element at 32K
needs groups of 128, which SmolLM2's head_dim of 64 does not have: its cheapest format there (K2/V2, group 64,
the smallest windows) costs 2.513, and calibrate refuses 2.4 saying so. 2.6 at 32K is the nearest budget it can
meet. SmolLM2 is scored at 2K/4K/8K as always (its trained context); the row also records its bits at 32K, and
the one-width format at the same group and windows is measured beside it (33 minutes here):

    nice -n 10 .venv/bin/python -m benchmarks.quality.mixed_key_bits --split test --rows "" --budget 2.6 --budget-context 32768

--scale-dtype float8_e4m3fn chooses the --budget format with fp8 scales and zeros (a quarter bit per element less
at group 64), written to mixed_key_bits_<split>_budget[_<N>][_feedback]_fp8.*: 3.0 bits at 8K, and 2.4 at 32K, which
fp16 scales cannot reach:

    nice -n 10 .venv/bin/python -m benchmarks.quality.mixed_key_bits --split test --rows "" --budget 3.0 --k-rounding feedback \
        --scale-dtype float8_e4m3fn
    nice -n 10 .venv/bin/python -m benchmarks.quality.mixed_key_bits --split test --rows "" --budget 2.4 --budget-context 32768 \
        --k-rounding feedback --scale-dtype float8_e4m3fn

Results: benchmarks/results/quality/mixed_key_bits_<split>.json and .md (--budget-only runs:
mixed_key_bits_<split>_budget.*, or mixed_key_bits_<split>_budget_<N>.* at another budget context).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from oscar_export.calibration.fit import clip_candidates, clip_errors
from oscar_export.sizes import bits_per_element
from oscar_export.calibration.cached import run_calibration
from oscar_export.config import OscarConfig
from oscar_export.evaluate.baselines import EvalOscarKVCache, Fp16Cache
from oscar_export.evaluate.methods import oscar_method
from oscar_export.config import config_for
from oscar_export.hf_cache import attention_shape
from oscar_export.evaluate.budget import cache_nll, format_chooser, key_error_gains

from benchmarks.common import (
    BITS_CONTEXT,
    CONTEXTS,
    CALIB_HELDOUT,
    CALIB_TOKENS,
    GGUF,
    gaps_to_fp16,
    load_split,
    log,
    measure,
    quality_cells,
)

ROOT = Path(__file__).resolve().parents[2]

SENSITIVITY_TOKENS = 2048
# One needle sequence scores 80 tokens: a standard error near 5 points, the size of the goal's margin.
NEEDLE_SEEDS = 4
# name -> (rule, layers with 3-bit K, sink, recent); each mixed row costs <= 3.0 bits per element at 8K.
ROWS = {
    "mixed-nll16/s16-r128": ("nll", 16, 16, 128),
    "mixed-err16/s16-r128": ("err", 16, 16, 128),
    "mixed-nll22/s16-r64": ("nll", 22, 16, 64),
}


def mixed(cfg2: OscarConfig, cfg3: OscarConfig, wide: list[int], layers: int) -> OscarConfig:
    """cfg2 with cfg3's K width and clip in the `wide` layers (k_bits_by_layer)."""
    return replace(cfg2, k_bits_by_layer=tuple(cfg3.k_bits if i in wide else cfg2.k_bits for i in range(layers)),
                   k_clip_by_layer=tuple(cfg3.k_clip if i in wide else cfg2.k_clip for i in range(layers)))


def layer_gains(model, ids, fitted: dict, cfg2: OscarConfig, cfg3: OscarConfig, quantizer: dict) -> list[float]:
    """Per layer: calibration NLL of `ids` (nats, summed over tokens) with every layer at cfg2's K, less that with
    this layer alone at cfg3's K width and clip."""
    layers = fitted["layers"]

    def total(wide):
        config = mixed(cfg2, cfg3, wide, layers) if wide else cfg2
        return float(cache_nll(model, ids, config, quantizer, fitted).sum())

    everywhere = total([])
    return [everywhere - total([layer]) for layer in range(layers)]


def budget_row(budget: float, context: int, model, tokenizer, calibration_text: str, head_dim: int,
               k_rounding: str = "nearest", scale_dtype: str = "float16"):
    """(name, config, wider-K layers, rotations) of the format `calibrate --budget-bits B --context N --per-head
    [--k-rounding feedback] [--scale-dtype D]` chooses from this split's calibration text (tokens and held-out tokens
    as the rows above), through the CLI's own path: run_calibration, then the config export and eval take from the
    file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "calibration.txt"
        path.write_text(calibration_text)
        rotation_set, seconds = run_calibration(GGUF, OscarConfig(k_rounding=k_rounding, scale_dtype=scale_dtype),
                                                path, CALIB_TOKENS, CALIB_HELDOUT, per_head=True, model=model,
                                                tokenizer=tokenizer,
                                                choose=format_chooser(budget, context, head_dim, False, k_rounding,
                                                                      scale_dtype))
    config = config_for(rotation_set.metadata, head_dim)
    log(f"budget {budget} at {context}: chose {config.describe()} sink {config.sink} recent {config.recent} "
        f"in {seconds} s")
    wide = [i for i, b in enumerate(config.k_bits_by_layer) if b > config.k_bits] or None
    name = (f"budget-{budget:g}" + ("" if context == BITS_CONTEXT else f"@{context // 1024}K")
            + ("/feedback" if k_rounding == "feedback" else "") + ("/fp8" if scale_dtype == "float8_e4m3fn" else ""))
    return name, config, wide, {"k": rotation_set.k, "v": rotation_set.v, "k_feedback": rotation_set.k_feedback}


def write_report(args, rows, gains, started, final: bool) -> None:
    gaps_to_fp16(rows)
    wall = round(time.perf_counter() - started, 1)
    report = {"split": args.split, "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "contexts": CONTEXTS,
              "complete": final, "rows": rows, "layer_gains": gains, "wall_s": wall}
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = ("" if args.rows else "_k4_ceiling" if args.budget is None
              else "_budget" + ("" if args.budget_context == BITS_CONTEXT else f"_{args.budget_context}")
              + ("_feedback" if args.k_rounding == "feedback" else "")
              + ("_fp8" if args.scale_dtype == "float8_e4m3fn" else ""))
    stem = args.out / f"mixed_key_bits_{args.split}{suffix}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    if not final:
        return
    scored = len(rows["fp16"]["needle_hits"])
    lines = [f"SmolLM2-135M-Instruct, {args.split} split; per-KV-head rotations except oscar-2/g64 (today's "
             f"default, per layer). One 8K window; {args.needle_seeds} needle sequence(s), {scored} scored tokens, "
             f"each row's difference to fp16 paired on the same tokens (+- one standard error); wall {wall:.0f} s "
             f"(command in benchmarks/quality/mixed_key_bits.py).", "",
             f"| config | bits/elem at 8K | at {args.budget_context // 1024}K | ppl 2K | ppl 4K | ppl 8K | needle 4K "
             "| vs fp16 | wider K layers (bits) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in sorted(rows.items(), key=lambda item: -item[1]["bits"]):
        layers = "-"
        if r.get("wider_k_layers") is not None:
            widths = r["config"].get("k_bits_by_layer") or [r["config"]["k_bits"]] * (max(r["wider_k_layers"]) + 1)
            layers = " ".join(f"{i}({widths[i]})" for i in r["wider_k_layers"])
        lines.append(f"| {name} | {r['bits']:.3f} | {r['bits_at_budget_context']:.3f} | {quality_cells(r)} | {layers} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", choices=("validation", "test"), default="validation")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated mixed rows, of {list(ROWS)} "
                                                           "(empty: none)")
    p.add_argument("--budget", type=float, metavar="B",
                   help="also measure the format calibrate --budget-bits B --context 8192 --per-head chooses")
    p.add_argument("--budget-context", type=int, default=BITS_CONTEXT, metavar="N",
                   help=f"context the --budget is sized at (default {BITS_CONTEXT})")
    p.add_argument("--k4-ceiling", action="store_true",
                   help="also measure 4-bit K in every layer at today's windows (3.99 bits at 8K): how much retrieval "
                        "K precision alone can buy at 2-bit V")
    p.add_argument("--k-rounding", choices=("nearest", "feedback"), default="nearest",
                   help="K rounding the --budget format is chosen with and the --k4-ceiling row uses (calibrate "
                        "--k-rounding; default nearest)")
    p.add_argument("--scale-dtype", choices=("float16", "float8_e4m3fn"), default="float16",
                   help="scale dtype the --budget format is chosen with (calibrate --scale-dtype; default float16)")
    p.add_argument("--needle-seeds", type=int, default=NEEDLE_SEEDS, metavar="N",
                   help=f"needle sequences (each 5 x 16 scored tokens; default {NEEDLE_SEEDS})")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quality")
    args = p.parse_args()
    unknown = sorted(set(filter(None, args.rows.split(","))) - set(ROWS))
    if unknown:
        sys.exit(f"--rows: unknown {unknown}: expected some of {list(ROWS)}")
    started = time.perf_counter()
    model, tokenizer, calibration_text, window, cases, needle_length = load_split(args.split, needle_seeds=args.needle_seeds)
    shape = attention_shape(model)
    layers, kv_heads, head_dim, _ = shape
    calibration_ids = torch.tensor(tokenizer(calibration_text, verbose=False)["input_ids"][:SENSITIVITY_TOKENS])

    calibration = (calibration_text, CALIB_TOKENS, CALIB_HELDOUT)
    default = oscar_method(model, tokenizer, "oscar-2", OscarConfig(), shape, None, calibration, {})
    fitted = {}
    perhead = oscar_method(model, tokenizer, "oscar-2", OscarConfig(), shape, None, calibration, fitted,
                            per_head=True)
    rotations, heldout = fitted["rotations"], fitted["heldout"]
    cfg2 = perhead.config
    k3_errors = clip_errors(heldout, rotations, replace(cfg2, k_bits=3), "k")
    cfg3 = replace(cfg2, k_bits=3, k_clip=min(k3_errors, key=k3_errors.get))
    log(f"clip K: 2-bit {cfg2.k_clip}, 3-bit {cfg3.k_clip}; V {cfg2.v_clip}")

    sizes = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    quantizer = {"k_rotation": rotations["k"], "v_rotation": rotations["v"]}

    def run(name, config, wider_k_layers=None, rot=rotations):
        def make(n):
            return EvalOscarKVCache(config, layers, kv_heads, head_dim, n, rot["k"], rot["v"],
                                    k_feedback=rot["k_feedback"] if config.k_rounding == "feedback" else None)

        rows[name] = measure(model, make, config, window, cases, needle_length, head_dim)
        rows[name].update(wider_k_layers=wider_k_layers, config=config.to_dict(),
                          bits_at_budget_context=bits_per_element(config, head_dim, args.budget_context))
        log(f"{name}: {rows[name]}")
        write_report(args, rows, gains, started, final=False)

    rows, gains = {}, {}
    rows["fp16"] = measure(model, lambda n: Fp16Cache(layers, kv_heads, head_dim, n), None, window, cases,
                           needle_length, head_dim)
    rows["fp16"]["bits_at_budget_context"] = 16.0
    rows["oscar-2/g64"] = measure(model, default.make, default.config, window, cases, needle_length, head_dim)
    rows["oscar-2/g64"]["bits_at_budget_context"] = bits_per_element(default.config, head_dim, args.budget_context)
    windows = sorted({ROWS[name][2:] for name in args.rows.split(",") if name})
    for sink, recent in windows:
        run(f"oscar-k3v2/s{sink}-r{recent}", replace(cfg3, sink=sink, recent=recent), list(range(layers)))
    for name in filter(None, args.rows.split(",")):
        rule, count, sink, recent = ROWS[name]
        w2, w3 = replace(cfg2, sink=sink, recent=recent), replace(cfg3, sink=sink, recent=recent)
        key = f"{rule}/s{sink}-r{recent}"
        if key not in gains:
            gains[key] = (key_error_gains(fitted, w2, w3.k_bits, w3.k_clip) if rule == "err"
                          else layer_gains(model, calibration_ids, sizes, w2, w3, quantizer))
        chosen = sorted(sorted(range(layers), key=lambda i: -gains[key][i])[:count])
        run(name, mixed(w2, w3, chosen, layers), chosen)
        if rows[name]["bits"] > 3.0 + 1e-9:
            raise SystemExit(f"{name} costs {rows[name]['bits']:.4f} bits per element: over the 3.0 budget")
    if args.k4_ceiling:
        k4 = replace(cfg2, k_bits=4, k_rounding=args.k_rounding)
        weights = fitted["k_feedback"] if args.k_rounding == "feedback" else None
        k4_errors = clip_errors(heldout, rotations, k4, "k", clip_candidates("k", args.k_rounding), weights)
        run("oscar-k4v2/s64-r256" + ("/feedback" if weights is not None else ""),
            replace(k4, k_clip=min(k4_errors, key=k4_errors.get)), list(range(layers)),
            {**rotations, "k_feedback": weights})
    if args.budget is not None:
        name, config, wide, rot = budget_row(args.budget, args.budget_context, model, tokenizer, calibration_text,
                                             head_dim, args.k_rounding, args.scale_dtype)
        run(name, config, wide, rot)
        if wide:  # the same group, windows and rotations at one K width: what the wider layers buy
            one_width = replace(config, k_bits_by_layer=(), k_clip_by_layer=())
            run(f"{name}/one-width", one_width, None, rot)
    write_report(args, rows, gains, started, final=True)
    log(f"wall {math.ceil(time.perf_counter() - started)} s")


if __name__ == "__main__":
    main()

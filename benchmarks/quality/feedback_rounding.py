"""K rounding with error feedback against nearest rounding, format for format (SmolLM2-135M-Instruct).

    nice -n 10 .venv/bin/python -m benchmarks.quality.feedback_rounding --split test     # about 9 minutes on 2 cores

Each format is measured twice on the same calibration (per-KV-head rotations, windows spread over the model's
context): K codes to the nearest level (k_rounding 'nearest', the format's own K clips) and with error feedback
(k_rounding 'feedback', the calibration's k_feedback weights, K clip 0.85 for 2-bit K and 0.92 for wider; the clip
search's attention error picked 0.75 with feedback, which retrieves worse, before the search stopped at
calibrate.FEEDBACK_K_CLIP_FLOOR; the default format is also measured at the searched clip, as `calibrate` writes it,
where that differs). V's clip is the calibration's. The formats: today's default (K2/V2,
group 64, sink 64, recent 256) and the format `calibrate --budget-bits 3.0` chose for the split at an earlier
commit with nearest rounding (mixed_key_bits_<split>_budget.json), so every pair costs the same bits. Scoring as
benchmarks/quality/mixed_key_bits.py: perplexity of one 8K window at 2K/4K/8K and four needle sequences, each row's gap to
fp16 paired per token.

Results: benchmarks/results/quality/feedback_rounding_<split>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

from oscar_export.calibration.fit import fit_quantizer, fit_rotations
from oscar_export.config import OscarConfig
from oscar_export.evaluate.baselines import EvalOscarKVCache, Fp16Cache
from oscar_export.hf_cache import attention_shape

from benchmarks.common import (
    CALIB_HELDOUT,
    CALIB_TOKENS,
    gaps_to_fp16,
    load_split,
    log,
    measure,
    quality_cells,
)

ROOT = Path(__file__).resolve().parents[2]

NEEDLE_SEEDS = 4
FEEDBACK_CLIP = {2: 0.85, 3: 0.92, 4: 0.92}  # K clip with feedback, by K width


def feedback_format(config: OscarConfig) -> OscarConfig:
    """`config` with K rounded by error feedback at FEEDBACK_CLIP (per layer where K's width is)."""
    out = replace(config, k_rounding="feedback", k_clip=FEEDBACK_CLIP[config.k_bits])
    if config.mixed:
        out = replace(out, k_clip_by_layer=tuple(FEEDBACK_CLIP[b] for b in config.k_bits_by_layer))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", choices=("validation", "test"), default="validation")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quality")
    args = p.parse_args()
    started = time.perf_counter()
    model, tokenizer, calibration_text, window, cases, needle_length = load_split(args.split, needle_seeds=NEEDLE_SEEDS)
    layers, kv_heads, head_dim, _ = attention_shape(model)
    fitted = fit_rotations(model, tokenizer, calibration_text, CALIB_TOKENS, CALIB_HELDOUT, per_head=True)
    rotations = fitted["rotations"]
    searched = fit_quantizer(fitted, OscarConfig())
    default = OscarConfig(k_clip=searched["k_clip"], v_clip=searched["v_clip"])
    # What `calibrate` writes by default: feedback rounding at the clip its own search picks.
    searched_fb = fit_quantizer(fitted, OscarConfig(k_rounding="feedback"))
    calibrated = replace(default, k_rounding="feedback", k_clip=searched_fb["k_clip"])
    earlier = json.loads((ROOT / f"benchmarks/results/quality/mixed_key_bits_{args.split}_budget.json").read_text())
    budget = OscarConfig.from_dict(earlier["rows"]["budget-3"]["config"])
    formats = {"K2/V2 s64 r256": default, "earlier budget-3 format": replace(budget, v_clip=searched["v_clip"])}

    rows = {"fp16": measure(model, lambda n: Fp16Cache(layers, kv_heads, head_dim, n), None, window, cases,
                            needle_length, head_dim)}
    for label, config in formats.items():
        variants = [("nearest", config), ("feedback", feedback_format(config))]
        if config is default and calibrated != feedback_format(config):
            variants.append((f"feedback at the searched K clip {calibrated.k_clip}", calibrated))
        for rounding, cfg in variants:
            weights = fitted["k_feedback"] if cfg.k_rounding == "feedback" else None

            def make(n, cfg=cfg, weights=weights):
                return EvalOscarKVCache(cfg, layers, kv_heads, head_dim, n, rotations["k"], rotations["v"],
                                        k_feedback=weights)

            name = f"{label}, {rounding}"
            rows[name] = measure(model, make, cfg, window, cases, needle_length, head_dim)
            rows[name].update(config=cfg.to_dict(), format=cfg.describe())
            log(f"{name}: {rows[name]['ppl']} needle {rows[name]['needle']}")
    gaps_to_fp16(rows)
    fp16 = rows["fp16"]
    wall = round(time.perf_counter() - started)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"feedback_rounding_{args.split}"
    stem.with_suffix(".json").write_text(json.dumps({"split": args.split, "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
                                                     "calibration_positions": fitted["positions"], "rows": rows,
                                                     "wall_s": wall}, indent=1) + "\n")
    lines = [f"SmolLM2-135M-Instruct, {args.split} split; per-KV-head rotations, calibration windows spread over "
             f"{fitted['positions']} positions. One 8K window; {NEEDLE_SEEDS} needle sequences, "
             f"{len(fp16['needle_hits'])} scored tokens, gaps to fp16 paired per token (+- one standard error); "
             f"wall {wall} s (benchmarks/quality/feedback_rounding.py).", "",
             "| format | K rounding | bits/elem at 8K | ppl 2K | ppl 4K | ppl 8K | needle 4K | vs fp16 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        label, _, rounding = name.rpartition(", ")
        lines.append(f"| {label or name} ({r.get('format', 'fp16')}) | {rounding if label else '-'} | {r['bits']:.3f} | "
                     f"{quality_cells(r)} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    log(f"wall {math.ceil(time.perf_counter() - started)} s")


if __name__ == "__main__":
    main()

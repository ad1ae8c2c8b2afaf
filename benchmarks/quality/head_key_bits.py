"""Wider K by KV head or by layer, at equal bits (SmolLM2-135M-Instruct): 4-bit K in the 3n KV heads that
help retrieval most against 4-bit K in the n layers that help most (3 KV heads each), 2-bit K and V elsewhere,
K2/V2 group 64 with per-KV-head rotations, sink 0 and recent 32 (the windows `calibrate --budget-bits 3.0`
chose on the validation split). Both rows of a count store the same number of 4-bit K bodies, so they cost the
same bits per element.

    nice -n 10 .venv/bin/python -m benchmarks.quality.head_key_bits                 # validation, n = 2, 6, 13

(about 30 minutes on 2 CPU cores: 120 ranking passes of 2,048 tokens, then 8 rows.)

The format has one K width per layer (k_bits_by_layer): the layer rows run it as it is. A width per KV head is
not in the format; its rows run the reference codec (codec.quantize / dequantize) on each wide head's rotated
fp16 K at 4 bits and the K2 format's clip search at 4 bits, in the evaluation's one-pass cache.

Ranking, on the split's calibration text only: its first 2,048 tokens with the budget tuner's retrieval probe in
them (budget.retrieval_probe), NLL summed over tokens with every K at 2 bits, less that with one layer (or one KV
head) alone at 4 bits. Scoring as benchmarks/quality/mixed_key_bits.py: perplexity of one 8K window at 2K/4K/8K and
four needle sequences, each row's gap to fp16 paired per token.

Results: benchmarks/results/quality/head_key_bits_<split>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from oscar_export.calibration.fit import clip_errors
from oscar_export.sizes import bits_per_element
from oscar_export.codec import dequantize, quantize
from oscar_export.config import OscarConfig
from oscar_export.evaluate.baselines import EvalOscarKVCache, Fp16Cache
from oscar_export.evaluate.methods import oscar_method
from oscar_export.evaluate.metrics import token_nll
from oscar_export.hf_cache import attention_shape
from oscar_export.evaluate.budget import CHUNK, retrieval_probe

from benchmarks.common import (
    BITS_CONTEXT,
    CALIB_HELDOUT,
    CALIB_TOKENS,
    gaps_to_fp16,
    load_split,
    log,
    measure,
    quality_cells,
)

ROOT = Path(__file__).resolve().parents[2]

RANKING_TOKENS = 2048
WIDE_BITS = 4
NEEDLE_SEEDS = 4


class HeadKeyCache(EvalOscarKVCache):
    """The evaluation cache with K of the KV heads in `wide` ({layer: heads}) stored at `bits` with `clip`."""

    def __init__(self, *args, wide: dict[int, tuple[int, ...]], bits: int, clip: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.wide, self.wide_bits, self.wide_clip = wide, bits, clip

    def sequence(self, layer, q, k, v, first):
        seq = super().sequence(layer, q, k, v, first)
        heads = self.wide.get(layer, ())
        if heads:
            cfg, body = self.layer_configs[layer], seq.body["k"].clone()
            for h in heads:
                codes = quantize(seq.window["k"][h:h + 1], self.wide_bits, cfg.cluster_dim, self.wide_clip, None,
                                 cfg.scale_dtype)
                body[h] = dequantize(*codes, self.wide_bits, cfg.cluster_dim, None)[0]
            seq.body["k"] = body
        return seq


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", choices=("validation", "test"), default="validation")
    p.add_argument("--layers", default="2,6,13", help="counts n of wide layers; each also gives a row of 3n heads")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quality")
    args = p.parse_args()
    try:
        counts = [int(n) for n in args.layers.split(",")]
    except ValueError:
        sys.exit(f"--layers {args.layers!r}: expected comma-separated layer counts")
    started = time.perf_counter()
    model, tokenizer, calibration_text, window, cases, needle_length = load_split(args.split, needle_seeds=NEEDLE_SEEDS)
    shape = attention_shape(model)
    layers, kv_heads, head_dim, _ = shape
    if not all(0 < n < layers for n in counts):
        sys.exit(f"--layers {args.layers!r}: expected counts between 1 and {layers - 1}")
    fitted = {}
    calibration = (calibration_text, CALIB_TOKENS, CALIB_HELDOUT)
    perhead = oscar_method(model, tokenizer, "oscar-2", OscarConfig(), shape, None, calibration, fitted, per_head=True)
    rotations, heldout = fitted["rotations"], fitted["heldout"]
    base = replace(perhead.config, sink=0, recent=32)
    errors = clip_errors(heldout, rotations, replace(base, k_bits=WIDE_BITS), "k")
    wide_clip = min(errors, key=errors.get)
    log(f"clip K2 {base.k_clip}, K{WIDE_BITS} {wide_clip}, V {base.v_clip}")

    def layer_format(wide_layers) -> OscarConfig:
        return replace(base, k_bits_by_layer=tuple(WIDE_BITS if i in wide_layers else base.k_bits for i in range(layers)),
                       k_clip_by_layer=tuple(wide_clip if i in wide_layers else base.k_clip for i in range(layers)))

    def maker(config, wide_heads=None):
        def make(n):
            if wide_heads is None:
                return EvalOscarKVCache(config, layers, kv_heads, head_dim, n, rotations["k"], rotations["v"])
            return HeadKeyCache(config, layers, kv_heads, head_dim, n, rotations["k"], rotations["v"],
                                wide=wide_heads, bits=WIDE_BITS, clip=wide_clip)
        return make

    probe = retrieval_probe(torch.tensor(tokenizer(calibration_text, verbose=False)["input_ids"][:RANKING_TOKENS]))

    def probe_nll(make) -> float:
        with torch.no_grad():
            return float(token_nll(model, probe, make(len(probe)), CHUNK, max(base.sink + base.recent, CHUNK)).sum())

    narrow = probe_nll(maker(base))
    layer_gain = [narrow - probe_nll(maker(layer_format({i}))) for i in range(layers)]
    head_gain = {(i, h): narrow - probe_nll(maker(base, {i: (h,)})) for i in range(layers) for h in range(kv_heads)}
    ranking_s = round(time.perf_counter() - started)
    log(f"ranked {layers} layers and {len(head_gain)} heads by {ranking_s} s")
    layer_order = sorted(range(layers), key=lambda i: -layer_gain[i])
    head_order = sorted(head_gain, key=lambda lh: -head_gain[lh])

    rows = {}

    def run(name, config, bits, wide_heads=None, wide_layers=None):
        rows[name] = measure(model, maker(config, wide_heads), config, window, cases, needle_length, head_dim)
        rows[name].update(bits=bits, wide_layers=wide_layers,
                          wide_heads=None if wide_heads is None else [f"{i}.{h}" for i, hs in sorted(wide_heads.items())
                                                                            for h in sorted(hs)])
        log(f"{name}: {rows[name]}")

    rows["fp16"] = measure(model, lambda n: Fp16Cache(layers, kv_heads, head_dim, n), None, window, cases,
                           needle_length, head_dim)
    run("k2", base, bits_per_element(base, head_dim, BITS_CONTEXT))
    for n in counts:
        wide_layers = sorted(layer_order[:n])
        config = layer_format(set(wide_layers))
        bits = bits_per_element(config, head_dim, BITS_CONTEXT)
        run(f"layers-{n}", config, bits, wide_layers=wide_layers)
        heads = {}
        for i, h in head_order[:n * kv_heads]:
            heads.setdefault(i, []).append(h)
        run(f"heads-{n * kv_heads}", base, bits, wide_heads={i: tuple(hs) for i, hs in heads.items()})

    gaps_to_fp16(rows)
    fp16 = rows["fp16"]
    wall = round(time.perf_counter() - started)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"head_key_bits_{args.split}"
    report = {"split": args.split, "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "base": base.to_dict(),
              "wide_bits": WIDE_BITS, "wide_clip": wide_clip, "layer_gain": layer_gain,
              "head_gain": {f"{i}.{h}": g for (i, h), g in head_gain.items()}, "rows": rows,
              "ranking_s": ranking_s, "wall_s": wall}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"SmolLM2-135M-Instruct, {args.split} split; K2/V2 group 64, per-KV-head rotations, sink 0, recent 32; "
             f"4-bit K (clip {wide_clip:g}) in the layers or KV heads named. One 8K window; {NEEDLE_SEEDS} needle "
             f"sequences, {len(fp16['needle_hits'])} scored tokens, gaps to fp16 paired per token (+- one standard "
             f"error); wall {wall} s (benchmarks/quality/head_key_bits.py).", "",
             "| config | bits/elem at 8K | ppl 2K | ppl 4K | ppl 8K | needle 4K | vs fp16 | 4-bit K in |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        where = ("-" if r.get("wide_layers") is None and r.get("wide_heads") is None
                 else "layers " + " ".join(map(str, r["wide_layers"])) if r.get("wide_layers")
                 else "heads (layer.head) " + " ".join(r["wide_heads"]))
        lines.append(f"| {name} | {r['bits']:.3f} | {quality_cells(r)} | {where} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    log(f"wall {math.ceil(time.perf_counter() - started)} s")


if __name__ == "__main__":
    main()

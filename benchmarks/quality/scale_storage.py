"""Narrower scale and zero storage (SmolLM2-135M-Instruct): what 8-bit scales and zeros cost in quality, and
what the bits they free buy.

    nice -n 10 .venv/bin/python -m benchmarks.quality.scale_storage --split validation     # about 10 minutes on 2 cores

With head_dim 64 and group 64, a 2-bit body vector is 128 bits of codes plus 32 of fp16 scale and zero: the
scale and zero are a fifth of the body, and they set the format's floor (2.5 bits per element; docs/calibration.md).
This measures one 8-bit encoding, not in the format: the scale as fp8 E4M3 (round to nearest even; the OCP
float8_e4m3fn torch and ONNX both have), and instead of the zero the group's midpoint (lo + hi) / 2 as an int8
count m of sixteenths of that stored scale (rounded, saturating at -128 and 127), so
zero = scale * (m / 16 - (L - 1) / 2). A rotated vector's channels sit around 0, so the midpoint is a few scales
at most and a sixteenth of a step is small beside the step itself. Codes come from the stored scale and zero as
the format's steps 5-6 say (with K's error feedback where the row has it). Both stored in fp8 alone (zero as
E4M3 too) is the other row: its zero's 2^-4 relative rounding is about a tenth of a 2-bit step.

Rows (per-KV-head rotations, the calibrated K clip with feedback, V's searched clip, sink 16, recent 128: the windows
`calibrate --budget-bits 3.0` chose on both splits): K2/V2 and K3/V2 each with fp16 scales and with the 8-bit
encodings. Scoring as benchmarks/quality/mixed_key_bits.py: perplexity of one 8K window at 2K/4K/8K and four needle
sequences, each row's gap to fp16 paired per token; bits per element at 8K and at 32K.

Results: benchmarks/results/quality/scale_storage_<split>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch


from benchmarks.quality.feedback_rounding import FEEDBACK_CLIP

from oscar_export.sizes import bits_per_element
from oscar_export.calibration.fit import fit_quantizer, fit_rotations
from oscar_export.codec import _groups, check_finite, encode, encode_feedback, group_scale_zero, uniform_levels
from oscar_export.config import OscarConfig
from oscar_export.evaluate.baselines import EvalOscarKVCache, Fp16Cache
from oscar_export.evaluate.one_pass import SequenceKV
from oscar_export.hf_cache import attention_shape

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

NEEDLE_SEEDS = 4
LONG_CONTEXT = 32768
MID_STEPS = 16  # the int8 midpoint counts sixteenths of the stored scale


def fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).to(torch.float32)


def fp8_scale_mid8_zero(scale: torch.Tensor, lo: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored fp8 scale and the zero an int8 midpoint gives back, both as fp32."""
    s = fp8(scale)
    mid = lo + scale * ((levels - 1) / 2)
    m = torch.where(s > 0, torch.round(mid / torch.where(s > 0, s, 1) * MID_STEPS), 0).clamp(-128, 127)
    return s, s * (m / MID_STEPS - (levels - 1) / 2)


ENCODINGS = {
    "fp8 scale, int8 midpoint": fp8_scale_mid8_zero,
    "fp8 scale and zero": lambda scale, lo, levels: (fp8(scale), fp8(lo)),
}


def roundtrip(x: torch.Tensor, bits: int, cluster_dim: int, clip: float, encoding: str,
              feedback: torch.Tensor | None) -> torch.Tensor:
    """x [..., D] quantized with an 8-bit scale/zero encoding and dequantized (uniform levels)."""
    groups = _groups(x, cluster_dim)
    scale, lo = group_scale_zero(groups, bits, clip, "float32")
    scale, zero = ENCODINGS[encoding](scale, lo, 2**bits)
    levels = uniform_levels(bits)
    codes = encode(groups, scale, zero, levels).flatten(-2) if feedback is None else \
        encode_feedback(x, scale, zero, levels, feedback)
    return (zero.unsqueeze(-1) + scale.unsqueeze(-1) * _groups(codes.to(torch.float32), cluster_dim)).flatten(-2)


class ScaleStorageCache(EvalOscarKVCache):
    """The evaluation cache with the body's scales and zeros stored by `encoding`."""

    def __init__(self, *args, encoding: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.encoding = encoding

    def sequence(self, layer, q, k, v, first):
        window = self._rotated_chunks(layer, k, v)
        check_finite("q", q)
        cfg = self.layer_configs[layer]
        body = {kind: roundtrip(x.float(), cfg.bits(kind), cfg.cluster_dim, cfg.clip(kind), self.encoding,
                                self.feedback_for(kind, layer)) for kind, x in window.items()}
        return SequenceKV(self.rotate("k", layer, q), {kind: x.float() for kind, x in window.items()}, body,
                          cfg.sink, lambda out: self.unrotate_values(layer, out))


def eight_bit_bits(config: OscarConfig, head_dim: int, context: int) -> float:
    """bits_per_element with one byte each for a group's scale and zero instead of two."""
    body = max(context - config.sink - config.recent, 0)
    saved = body * 2 * (head_dim // config.cluster_dim) * 2 * 8  # K and V: two bytes fewer per group
    return bits_per_element(config, head_dim, context) - saved / (context * 2 * head_dim)


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
    v_clip = fit_quantizer(fitted, OscarConfig())["v_clip"]
    formats = {f"K{kb}/V2": OscarConfig(k_bits=kb, k_clip=FEEDBACK_CLIP[kb], v_clip=v_clip, sink=16, recent=128,
                                        k_rounding="feedback") for kb in (2, 3)}

    rows = {"fp16": measure(model, lambda n: Fp16Cache(layers, kv_heads, head_dim, n), None, window, cases,
                            needle_length, head_dim)}
    rows["fp16"]["bits_32k"] = 16.0
    for label, cfg in formats.items():
        for encoding in ("fp16 scale and zero", *ENCODINGS):
            def make(n, cfg=cfg, encoding=encoding):
                args_ = (cfg, layers, kv_heads, head_dim, n, rotations["k"], rotations["v"])
                if encoding in ENCODINGS:
                    return ScaleStorageCache(*args_, k_feedback=fitted["k_feedback"], encoding=encoding)
                return EvalOscarKVCache(*args_, k_feedback=fitted["k_feedback"])

            name = f"{label}, {encoding}"
            rows[name] = measure(model, make, cfg, window, cases, needle_length, head_dim)
            bits = eight_bit_bits if encoding in ENCODINGS else bits_per_element
            rows[name].update(config=cfg.to_dict(), format=cfg.describe(), bits=bits(cfg, head_dim, BITS_CONTEXT),
                              bits_32k=bits(cfg, head_dim, LONG_CONTEXT))
            log(f"{name}: {rows[name]['ppl']} needle {rows[name]['needle']}")
    gaps_to_fp16(rows)
    fp16 = rows["fp16"]
    wall = round(time.perf_counter() - started)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"scale_storage_{args.split}"
    stem.with_suffix(".json").write_text(json.dumps({"split": args.split, "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
                                                     "mid_steps": MID_STEPS, "rows": rows, "wall_s": wall},
                                                    indent=1) + "\n")
    lines = [f"SmolLM2-135M-Instruct, {args.split} split; per-KV-head rotations, K rounding with feedback, sink 16, "
             f"recent 128, group 64. One 8K window; {NEEDLE_SEEDS} needle sequences, {len(fp16['needle_hits'])} scored "
             f"tokens, gaps to fp16 paired per token (+- one standard error); wall {wall} s "
             "(benchmarks/quality/scale_storage.py).", "",
             "| format | scale and zero | bits/elem at 8K | at 32K | ppl 2K | ppl 4K | ppl 8K | needle 4K | vs fp16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        label, _, encoding = name.partition(", ")
        lines.append(f"| {label} | {encoding or '-'} | {r['bits']:.3f} | {r['bits_32k']:.3f} | {quality_cells(r)} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    log(f"wall {math.ceil(time.perf_counter() - started)} s")


if __name__ == "__main__":
    main()

"""Write the golden vectors every backend is tested against (see docs/format.md, section 8).

Run from the repo root: .venv/bin/python tests/vectors/make_vectors.py [OUT_DIR] [--redraw]

Every tensor has a role, recorded per case in index.json:
- "input": drawn once from a seeded RNG (the originals, rotations, codec inputs) or computed once
  in floating point (the rotated q/k/v each kernel consumes, the Lloyd-Max levels). Their last
  bits depend on the CPU, so a rebuild never recomputes them: it reads them from the committed
  files. Only a new case, or --redraw, draws and computes them afresh.
- "normative": codes, scales, zeros and the cache state, a function of the inputs that every
  machine and every backend reproduces bit for bit.
- "float": attention outputs and dequantized values, which go through float sums or may fuse a
  multiply-add; compared with a tolerance.
So a rebuild on any machine gives the committed normative tensors exactly (tests/test_vectors.py).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from oscar_export.cache import OscarKVCache
from oscar_export.sizes import KINDS
from oscar_export.calibration.fit import ObjectiveAccumulators, feedback_weights
from oscar_export.codec import dequantize, fit_lloyd_max_levels, normalized_codes, quantize
from oscar_export.config import OscarConfig

HERE = Path(__file__).parent
LAYERS, Q_HEADS, KV_HEADS, TOKENS, PREFILL = 1, 4, 2, 29, 13
SMALL_WINDOWS = dict(sink=4, recent=8)
REGIONS = ("sink", "recent", "codes", "scale", "zero")

# name -> (head_dim, per-KV-head rotations, config)
CASES: dict[str, tuple[int, bool, OscarConfig]] = {
    "b2_g32": (64, False, OscarConfig(k_bits=2, v_bits=2, cluster_dim=32, **SMALL_WINDOWS)),
    "b3_g32": (64, False, OscarConfig(k_bits=3, v_bits=3, cluster_dim=32, **SMALL_WINDOWS)),
    "b4_g32": (64, False, OscarConfig(k_bits=4, v_bits=4, cluster_dim=32, **SMALL_WINDOWS)),
    "b2_g64": (64, False, OscarConfig(k_bits=2, v_bits=2, cluster_dim=64, **SMALL_WINDOWS)),
    "b3_g64": (64, False, OscarConfig(k_bits=3, v_bits=3, cluster_dim=64, **SMALL_WINDOWS)),
    "b4_g64": (64, False, OscarConfig(k_bits=4, v_bits=4, cluster_dim=64, **SMALL_WINDOWS)),
    "b2_g64_clip": (64, False, OscarConfig(k_clip=0.96, v_clip=0.92, **SMALL_WINDOWS)),
    "b3_g32_clip": (64, False, OscarConfig(k_bits=3, v_bits=3, cluster_dim=32, k_clip=0.9, v_clip=0.8,
                                           **SMALL_WINDOWS)),
    "b4_g64_clip": (64, False, OscarConfig(k_bits=4, v_bits=4, k_clip=0.96, v_clip=0.92, **SMALL_WINDOWS)),
    "b2_g64_lloyd": (64, False, OscarConfig(codebook="lloyd-max", **SMALL_WINDOWS)),
    "b3_g32_lloyd_clip": (64, False, OscarConfig(k_bits=3, v_bits=3, cluster_dim=32, codebook="lloyd-max",
                                                 k_clip=0.96, v_clip=0.92, **SMALL_WINDOWS)),
    "b4_g64_lloyd": (64, False, OscarConfig(k_bits=4, v_bits=4, codebook="lloyd-max", **SMALL_WINDOWS)),
    "k2v4_g64_perhead": (64, True, OscarConfig(k_bits=2, v_bits=4, **SMALL_WINDOWS)),
    "b2_g128_d128": (128, False, OscarConfig(cluster_dim=128, **SMALL_WINDOWS)),
    "b2_g32_nowindows_fp32scale": (64, False, OscarConfig(cluster_dim=32, sink=0, recent=0, scale_dtype="float32")),
    # K rounding with error feedback (format.md section 3, step 5): weights from the case's own queries.
    "b2_g64_feedback": (64, False, OscarConfig(k_rounding="feedback", k_clip=0.85, **SMALL_WINDOWS)),
    "k3v2_g32_feedback_perhead": (64, True, OscarConfig(k_bits=3, cluster_dim=32, k_rounding="feedback",
                                                        **SMALL_WINDOWS)),
    "b4_g64_feedback": (64, False, OscarConfig(k_bits=4, v_bits=4, k_rounding="feedback", **SMALL_WINDOWS)),
    "b2_g64_d128_feedback": (128, False, OscarConfig(k_rounding="feedback", k_clip=0.9, **SMALL_WINDOWS)),
    # fp8 E4M3 scales and zeros (the reference codec's; the native op and Triton take fp16 / fp16, bf16, fp32)
    "b2_g64_clip_fp8scale": (64, False, OscarConfig(k_clip=0.96, v_clip=0.92, scale_dtype="float8_e4m3fn",
                                                    **SMALL_WINDOWS)),
    "k3v2_g32_feedback_fp8scale": (64, False, OscarConfig(k_bits=3, cluster_dim=32, k_rounding="feedback", k_clip=0.92,
                                                          scale_dtype="float8_e4m3fn", **SMALL_WINDOWS)),
}

# The chunks of every case's sequence: one prefill, then single-token decode steps.
CHUNKS = [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, TOKENS)]
ORIGINALS = ("cache.q", "cache.k", "cache.v", "cache.k_rotation", "cache.v_rotation", "codec.input")
ROTATED = ("cache.q_rot", "cache.k_rot", "cache.v_rot")
LEVELS = ("cache.k_levels", "cache.v_levels")
FEEDBACK = "cache.k_feedback"  # [layers, kv_heads, D, D]; codec.* use layer 0, KV head 0
FLOAT_OUTPUTS = ("codec.dequant", "cache.prefill_out", "cache.decode_out", "cache.prefill_out_rot",
                 "cache.decode_out_rot")


def random_orthogonal(gen: torch.Generator, *shape: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(*shape, shape[-1], generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).to(torch.float32)


def activations(gen: torch.Generator, heads: int, d: int) -> torch.Tensor:
    """Gaussian vectors with a few outlier channels, like real K/V."""
    channel_scale = torch.ones(d)
    channel_scale[torch.randperm(d, generator=gen)[:4]] = 8.0
    return torch.randn(heads, TOKENS, d, generator=gen) * channel_scale


def codec_inputs(gen: torch.Generator, d: int, bits: int, cluster_dim: int, fp8: bool = False) -> torch.Tensor:
    """64 vectors: varied scales, constant groups, huge and tiny magnitudes, exact threshold ties. fp8: magnitudes
    inside E4M3's range (448) and tiny ones for its subnormal (below 2^-6) and zero scales."""
    scales = torch.logspace(-4, 1.5, 48) if fp8 else torch.logspace(-3, 3, 48)
    rows = [torch.randn(48, d, generator=gen) * scales.unsqueeze(-1)]
    big = 300.0 if fp8 else 1000.0
    rows.append(torch.full((4, d), 1.0) * torch.tensor([[0.0], [1.0], [-2.5], [big]]))  # constant vectors
    near = 400.0 if fp8 else 6e4
    rows.append(torch.rand(4, d, generator=gen) * 2 * near - near)  # near the scale dtype's limit
    rows.append(torch.randn(4, d, generator=gen) * (1e-3 if fp8 else 1e-6))  # subnormal or 0 scales
    mixed = torch.randn(2, d, generator=gen)
    mixed[:, :cluster_dim] = 0.75  # one constant group beside random ones
    rows.append(mixed)
    # Group spans exactly [0, L-1] so scale == 1 and the values sit on the thresholds c + 0.5.
    levels = 2**bits - 1
    tie = torch.arange(d, dtype=torch.float32).remainder(2 * levels) * 0.5
    tie = tie.reshape(-1, cluster_dim)
    tie[:, 0], tie[:, 1] = 0.0, float(levels)
    rows.append(tie.reshape(1, d).expand(2, d))
    return torch.cat(rows)


def draw_originals(d: int, per_head: bool, cfg: OscarConfig, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rot_shape = (LAYERS, KV_HEADS, d) if per_head else (LAYERS, d)
    k_rot, v_rot = random_orthogonal(gen, *rot_shape), random_orthogonal(gen, *rot_shape)
    q, k, v = activations(gen, Q_HEADS, d), activations(gen, KV_HEADS, d), activations(gen, KV_HEADS, d)
    x = codec_inputs(gen, d, cfg.k_bits, cfg.cluster_dim, fp8=cfg.scale_dtype == "float8_e4m3fn")
    return dict(zip(ORIGINALS, (q, k, v, k_rot, v_rot, x)))


def rotate_originals(t: dict[str, torch.Tensor], cfg: OscarConfig, d: int) -> dict[str, torch.Tensor]:
    """The rotated q (fp32) and k/v (fp16) a kernel consumes, chunk by chunk as OscarKVCache.attend rotates."""
    # Only the rotations matter here; a uniform codebook and nearest rounding need no levels or weights yet.
    cache = OscarKVCache(replace(cfg, codebook="uniform", k_rounding="nearest"), LAYERS, KV_HEADS, d, TOKENS,
                         t["cache.k_rotation"],
                         t["cache.v_rotation"])
    rotated = {key: [] for key in ROTATED}
    for a, b in CHUNKS:
        rotated["cache.q_rot"].append(cache.rotate("k", 0, t["cache.q"][:, a:b]))
        rotated["cache.k_rot"].append(cache.rotate("k", 0, t["cache.k"][:, a:b]).half())
        rotated["cache.v_rot"].append(cache.rotate("v", 0, t["cache.v"][:, a:b]).half())
    return {key: torch.cat(parts, dim=1) for key, parts in rotated.items()}


def fit_levels(t: dict[str, torch.Tensor], cfg: OscarConfig) -> dict[str, torch.Tensor]:
    """Lloyd-Max levels [1, 2**bits] per kind, fitted on the rotated fp16 K/V with the uniform codec."""
    out = {}
    for kind in KINDS:
        u = normalized_codes(t[f"cache.{kind}_rot"].float(), cfg.bits(kind), cfg.cluster_dim, cfg.clip(kind),
                             cfg.scale_dtype)
        out[f"cache.{kind}_levels"] = fit_lloyd_max_levels(u, cfg.bits(kind)).unsqueeze(0)
    return out


def inputs(d: int, per_head: bool, cfg: OscarConfig, seed: int, kept: dict[str, torch.Tensor]) -> dict:
    """The case's inputs: the kept (committed) ones, and any missing ones drawn or computed here."""
    t = dict(kept)
    if any(key not in t for key in ORIGINALS):
        t.update(draw_originals(d, per_head, cfg, seed))
    if any(key not in t for key in ROTATED):
        t.update(rotate_originals(t, cfg, d))
    if cfg.codebook == "lloyd-max" and any(key not in t for key in LEVELS):
        t.update(fit_levels(t, cfg))
    if cfg.k_rounding == "feedback" and FEEDBACK not in t:
        t[FEEDBACK] = fit_feedback(t["cache.q_rot"])
    return t


def fit_feedback(q_rot: torch.Tensor) -> torch.Tensor:
    """Error-feedback weights [1, kv_heads, D, D] from the case's rotated queries, as calibration fits them."""
    acc = ObjectiveAccumulators(KV_HEADS, q_rot.shape[-1])
    acc.add_queries(q_rot)
    return feedback_weights(acc.q_cov, torch.eye(q_rot.shape[-1])).unsqueeze(0)


def outputs(t: dict[str, torch.Tensor], cfg: OscarConfig, d: int) -> dict[str, torch.Tensor]:
    """Everything computed from the inputs: codec results, attention outputs, the final cache state."""
    levels = {kind: t.get(f"cache.{kind}_levels") for kind in KINDS}
    feedback = t.get(FEEDBACK)
    out = {}
    k_levels0 = None if levels["k"] is None else levels["k"][0]
    packed = quantize(t["codec.input"], cfg.k_bits, cfg.cluster_dim, cfg.k_clip, k_levels0, cfg.scale_dtype,
                      None if feedback is None else feedback[0, 0])
    out.update({"codec.codes": packed.codes, "codec.scale": packed.scale, "codec.zero": packed.zero,
                "codec.dequant": dequantize(*packed, cfg.k_bits, cfg.cluster_dim, k_levels0)})

    # The kernel's view: the stored rotated inputs through an identity-rotation cache. From the
    # fp16 K/V on everything is normative, so this is the state every backend must reach.
    rotated = OscarKVCache(cfg, LAYERS, KV_HEADS, d, TOKENS, None, None, levels["k"], levels["v"], k_feedback=feedback)
    outs = [rotated.attend(0, t["cache.q_rot"][:, a:b], t["cache.k_rot"][:, a:b].float(),
                           t["cache.v_rot"][:, a:b].float()) for a, b in CHUNKS]
    out["cache.prefill_out_rot"] = outs[0]
    out["cache.decode_out_rot"] = torch.stack([o[:, 0] for o in outs[1:]])
    for kind in KINDS:
        for region in REGIONS:
            # [layers, ...]: the codes are held as a list per layer, one width here
            out[f"cache.final.{kind}.{region}"] = torch.stack(list(getattr(rotated, region)[kind]))

    # End to end from the originals, in the model's space: float work, for end-to-end checks.
    full = OscarKVCache(cfg, LAYERS, KV_HEADS, d, TOKENS, t["cache.k_rotation"], t["cache.v_rotation"],
                        levels["k"], levels["v"], k_feedback=feedback)
    outs = [full.attend(0, t["cache.q"][:, a:b], t["cache.k"][:, a:b], t["cache.v"][:, a:b]) for a, b in CHUNKS]
    out["cache.prefill_out"] = outs[0]
    out["cache.decode_out"] = torch.stack([o[:, 0] for o in outs[1:]])
    return out


def role(key: str) -> str:
    if key in ORIGINALS or key in ROTATED or key in LEVELS or key == FEEDBACK:
        return "input"
    return "float" if key in FLOAT_OUTPUTS else "normative"


def make_case(name: str, d: int, per_head: bool, cfg: OscarConfig, seed: int,
              kept: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    t = inputs(d, per_head, cfg, seed, kept)
    tensors = {key: t[key] for key in t if role(key) == "input"}
    tensors.update(outputs(t, cfg, d))
    meta = {
        "file": f"{name}.safetensors",
        "config": cfg.to_dict(),
        "head_dim": d,
        "layers": LAYERS,
        "q_heads": Q_HEADS,
        "kv_heads": KV_HEADS,
        "tokens": TOKENS,
        "prefill": PREFILL,
        "rotation": "per_kv_head" if per_head else "per_layer",
        "codec_bits": cfg.k_bits,
        "codec_clip": cfg.k_clip,
        "tensors": {key: role(key) for key in sorted(tensors)},
    }
    return meta, {key: x.contiguous() for key, x in tensors.items()}


def kept_inputs(source: Path | None, name: str) -> dict[str, torch.Tensor]:
    path = None if source is None else source / f"{name}.safetensors"
    if path is None or not path.exists():
        return {}
    return {key: x for key, x in load_file(str(path)).items() if role(key) == "input"}


def build(out_dir: Path, inputs_from: Path | None = HERE) -> None:
    """Write every case to out_dir, keeping the inputs found in inputs_from (None draws them all)."""
    index = {"format_version": 1, "cases": {}}
    for seed, (name, (d, per_head, cfg)) in enumerate(CASES.items()):
        meta, tensors = make_case(name, d, per_head, cfg, seed, kept_inputs(inputs_from, name))
        save_file(tensors, str(out_dir / meta["file"]))
        index["cases"][name] = meta
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--redraw"]
    build(Path(args[0]) if args else HERE, None if "--redraw" in sys.argv[1:] else HERE)

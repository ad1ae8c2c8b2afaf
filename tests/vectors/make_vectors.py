"""Write the golden vectors every backend is tested against (see docs/format.md, section 7).

Run from the repo root: .venv/bin/python tests/vectors/make_vectors.py
The output is deterministic; tests/test_vectors.py checks the committed files still match.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from oscar_export.cache import KINDS, OscarKVCache
from oscar_export.codec import dequantize, fit_lloyd_max_levels, normalized_codes, quantize
from oscar_export.config import OscarConfig

HERE = Path(__file__).parent
LAYERS, Q_HEADS, KV_HEADS, TOKENS, PREFILL = 1, 4, 2, 29, 13
SMALL_WINDOWS = dict(sink=4, recent=8)

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
}


def random_orthogonal(gen: torch.Generator, *shape: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(*shape, shape[-1], generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).to(torch.float32)


def activations(gen: torch.Generator, heads: int, d: int) -> torch.Tensor:
    """Gaussian vectors with a few outlier channels, like real K/V."""
    channel_scale = torch.ones(d)
    channel_scale[torch.randperm(d, generator=gen)[:4]] = 8.0
    return torch.randn(heads, TOKENS, d, generator=gen) * channel_scale


def codec_inputs(gen: torch.Generator, d: int, bits: int, cluster_dim: int) -> torch.Tensor:
    """64 vectors: varied scales, constant groups, huge and tiny magnitudes, exact threshold ties."""
    scales = torch.logspace(-3, 3, 48).unsqueeze(-1)
    rows = [torch.randn(48, d, generator=gen) * scales]
    rows.append(torch.full((4, d), 1.0) * torch.tensor([[0.0], [1.0], [-2.5], [1000.0]]))  # constant vectors
    rows.append(torch.rand(4, d, generator=gen) * 1.2e5 - 6e4)  # near the fp16 limit
    rows.append(torch.randn(4, d, generator=gen) * 1e-6)  # ranges whose fp16 scale is subnormal or 0
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


def make_case(name: str, d: int, per_head: bool, cfg: OscarConfig, seed: int) -> tuple[dict, dict]:
    gen = torch.Generator().manual_seed(seed)
    rot_shape = (LAYERS, KV_HEADS, d) if per_head else (LAYERS, d)
    k_rot, v_rot = random_orthogonal(gen, *rot_shape), random_orthogonal(gen, *rot_shape)
    q = activations(gen, Q_HEADS, d)
    k = activations(gen, KV_HEADS, d)
    v = activations(gen, KV_HEADS, d)
    tensors = {"cache.q": q, "cache.k": k, "cache.v": v, "cache.k_rotation": k_rot, "cache.v_rotation": v_rot}

    levels = {"k": None, "v": None}
    if cfg.codebook == "lloyd-max":
        probe = OscarKVCache(replace(cfg, codebook="uniform"), LAYERS, KV_HEADS, d, TOKENS, k_rot, v_rot)
        for kind, x in (("k", k), ("v", v)):
            u = normalized_codes(probe.rotate(kind, 0, x).to(torch.float16).float(), cfg.bits(kind),
                                 cfg.cluster_dim, cfg.clip(kind), cfg.scale_dtype)
            levels[kind] = fit_lloyd_max_levels(u, cfg.bits(kind)).unsqueeze(0)
            tensors[f"cache.{kind}_levels"] = levels[kind]

    x = codec_inputs(gen, d, cfg.k_bits, cfg.cluster_dim)
    k_levels0 = None if levels["k"] is None else levels["k"][0]
    packed = quantize(x, cfg.k_bits, cfg.cluster_dim, cfg.k_clip, k_levels0, cfg.scale_dtype)
    tensors.update({
        "codec.input": x,
        "codec.codes": packed.codes,
        "codec.scale": packed.scale,
        "codec.zero": packed.zero,
        "codec.dequant": dequantize(*packed, cfg.k_bits, cfg.cluster_dim, k_levels0),
    })

    cache = OscarKVCache(cfg, LAYERS, KV_HEADS, d, TOKENS, k_rot, v_rot, levels["k"], levels["v"])
    tensors["cache.prefill_out"] = cache.attend(0, q[:, :PREFILL], k[:, :PREFILL], v[:, :PREFILL])
    tensors["cache.decode_out"] = torch.stack(
        [cache.attend(0, q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])[:, 0] for t in range(PREFILL, TOKENS)]
    )
    for kind in KINDS:
        for region in ("sink", "recent", "codes", "scale", "zero"):
            tensors[f"cache.final.{kind}.{region}"] = getattr(cache, region)[kind]
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
    }
    return meta, {key: t.contiguous() for key, t in tensors.items()}


def build(out_dir: Path) -> None:
    index = {"format_version": 1, "cases": {}}
    for seed, (name, (d, per_head, cfg)) in enumerate(CASES.items()):
        meta, tensors = make_case(name, d, per_head, cfg, seed)
        save_file(tensors, str(out_dir / meta["file"]))
        index["cases"][name] = meta
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)

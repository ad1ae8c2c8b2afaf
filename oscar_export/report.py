"""Codec report: bits per element and reconstruction error of the packed cache on a model's real K/V."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from .cache import OscarKVCache
from .sizes import bits_per_element
from .calibration.capture import collect_qkv
from .codec import dequantize, quantize
from .config import OscarConfig, OscarInputError
from .models import BUNDLED_TEXT, load_model
from .progress import progress
from .calibration.rotations import hadamard_rotations



def _rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm().clamp(min=1e-30))


def read_tokens(tokenizer, text_path: Path | None, tokens: int) -> torch.Tensor:
    path = Path(text_path) if text_path else BUNDLED_TEXT
    if not path.is_file():
        raise OscarInputError(f"text file {str(path)!r} does not exist: expected a UTF-8 text file")
    ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"), verbose=False)["input_ids"]
    if len(ids) < tokens:
        raise OscarInputError(f"text file {str(path)!r} has {len(ids)} tokens: expected at least {tokens}")
    return torch.tensor([ids[:tokens]])


def codec_report(
    model_name: str = "bundled",
    config: OscarConfig | None = None,
    text: Path | None = None,
    tokens: int = 1024,
    bit_widths: tuple[int, ...] = (2, 3, 4),
) -> dict:
    """Quantize a model's captured post-RoPE K/V at each bit width, with and without a Hadamard rotation."""
    config = config or OscarConfig()
    if tokens <= 0:
        raise OscarInputError(f"tokens={tokens}: expected a positive token count")
    model, tokenizer = load_model(model_name)
    qkv = collect_qkv(model, read_tokens(tokenizer, text, tokens))
    layers = len(qkv)
    q0, k0, _ = qkv[0]
    kv_heads, head_dim = k0.shape[0], k0.shape[2]
    config.check_head_dim(head_dim)
    rotations = {"none": None, "hadamard": hadamard_rotations(layers, head_dim)}
    exact = {
        layer: torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
        for layer, (q, k, v) in qkv.items()
    }
    rows = []
    cases = [(bits, name) for bits in bit_widths for name in rotations]
    for bits, name in progress(cases, "codec report"):
        cfg = replace(config, k_bits=bits, v_bits=bits)
        rot = rotations[name]
        cache = OscarKVCache(cfg, layers, kv_heads, head_dim, tokens, k_rotation=rot, v_rotation=rot)
        errors = {"k": [], "v": [], "attn": []}
        for layer, (q, k, v) in qkv.items():
            for kind, x in (("k", k), ("v", v)):
                x_rot = cache.rotate(kind, layer, x)
                packed = quantize(x_rot, bits, cfg.cluster_dim, cfg.clip(kind), None, cfg.scale_dtype)
                approx = dequantize(*packed, bits, cfg.cluster_dim)
                errors[kind].append(_rel_error(approx, x_rot))
            # Prefill the cache, then decode the last tokens one at a time so they read the packed body.
            split = max(tokens - 16, 1)
            out = [cache.attend(layer, q[:, :split], k[:, :split], v[:, :split])]
            for t in range(split, tokens):
                out.append(cache.attend(layer, q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1]))
            errors["attn"].append(_rel_error(torch.cat(out, 1)[:, split:], exact[layer][:, split:]))
        rows.append(
            {
                "bits": bits,
                "rotation": name,
                "bits_per_element": bits_per_element(cfg, head_dim, tokens),
                "bits_per_element_at_128k": bits_per_element(cfg, head_dim, 131072),
                "k_rel_error": sum(errors["k"]) / layers,
                "v_rel_error": sum(errors["v"]) / layers,
                "decode_attn_rel_error": sum(errors["attn"]) / layers,
                "worst_layer_k_rel_error": max(errors["k"]),
                "worst_layer_v_rel_error": max(errors["v"]),
            }
        )
    return {
        "model": model_name,
        "tokens": tokens,
        "layers": layers,
        "kv_heads": kv_heads,
        "q_heads": q0.shape[0],
        "head_dim": head_dim,
        "config": config.to_dict(),
        "rows": rows,
    }

"""Seeded random checkpoints with real models' shapes, for memory and speed at full size.

No real weights of a 7-8B model can be fetched here, and memory, artifact bytes and decode speed
depend on the shapes only. write_checkpoint makes a Hugging Face checkpoint directory with a
preset's architecture (models.PRESETS), optionally fewer layers or a width divided by `shrink`
(same head ratios), as sharded bf16 safetensors: one shard per decoder layer, written and freed
before the next, so even the 16 GB Llama-3-8B never exists in memory. The tokenizer is the bundled
model's (its ids fit any vocabulary here). The text such a model writes is noise: it measures
bytes, memory and time, never quality.

    python -m oscar_export.models.random_checkpoint --out ckpt/llama-3-8b
    python -m oscar_export.models.random_checkpoint --out ckpt/llama-3-8b-4l --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch

from ..config import OscarInputError
from . import BUNDLED_MODEL_DIR, FAMILIES, PRESETS

# Llama 3.1 ships the Llama-3-8B shape with a 128K context through this RoPE scaling (its published config).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
BUNDLED_VOCAB = 4096  # the bundled tokenizer's ids are below this


def checkpoint_config(preset: str = "llama-3-8b", layers: int | None = None, shrink: int = 1,
                      vocab: int | None = None) -> dict:
    """config.json of the checkpoint: the preset's fields, `layers` decoder layers, hidden, FFN width and head
    counts divided by `shrink` (head_dim kept), `vocab` tokens (at least the bundled tokenizer's)."""
    if preset not in PRESETS:
        raise OscarInputError(f"--preset {preset!r}: expected one of {', '.join(PRESETS)}")
    base = dict(PRESETS[preset])
    heads, kv = base["num_attention_heads"], base["num_key_value_heads"]
    head_dim = base["hidden_size"] // heads
    if shrink < 1 or kv % shrink or heads % shrink:
        raise OscarInputError(f"--shrink {shrink}: expected a divisor of the KV head count {kv}")
    if layers is not None and layers < 1:
        raise OscarInputError(f"--layers {layers}: expected at least 1")
    if vocab is not None and vocab < BUNDLED_VOCAB:
        raise OscarInputError(f"--vocab {vocab}: expected at least {BUNDLED_VOCAB}, the tokenizer's vocabulary")
    cfg = {**base, "architectures": [FAMILIES[base["model_type"]].architecture],
           "num_hidden_layers": layers or base["num_hidden_layers"], "num_attention_heads": heads // shrink,
           "num_key_value_heads": kv // shrink, "head_dim": head_dim, "hidden_size": base["hidden_size"] // shrink,
           "intermediate_size": base["intermediate_size"] // shrink, "vocab_size": vocab or base["vocab_size"],
           "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "initializer_range": 0.02}
    if preset == "llama-3-8b":
        cfg.update(max_position_embeddings=131072, rope_parameters=dict(LLAMA3_ROPE))
    return cfg


def _tensors(cfg: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one decoder layer's weights (prefix 'model.layers.i.')."""
    h, ffn, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
              "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (ffn, h), "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn)}
    if cfg.get("attention_bias"):
        shapes.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    return {prefix + name: shape for name, shape in shapes.items()}


def _values(shapes: dict[str, tuple[int, ...]], generator: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    """Norm weights 1, everything else N(0, std), in bf16."""
    out = {}
    for name, shape in shapes.items():
        if "norm" in name:
            out[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            out[name] = (torch.randn(shape, generator=generator) * std).to(torch.bfloat16)
    return out


def write_checkpoint(out, preset: str = "llama-3-8b", layers: int | None = None, shrink: int = 1,
                     vocab: int | None = None, seed: int = 0) -> Path:
    """Write the checkpoint directory `out` (must not exist; written beside it, then renamed) and return it."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists():
        raise OscarInputError(f"--out {str(out)!r} exists: expected a new directory")
    cfg = checkpoint_config(preset, layers, shrink, vocab)
    temp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    try:
        h, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        shards = [{"model.embed_tokens.weight": (vocab, h)}]
        shards += [_tensors(cfg, f"model.layers.{i}.") for i in range(n)]
        shards.append({"model.norm.weight": (h,), **({} if cfg["tie_word_embeddings"] else
                                                      {"lm_head.weight": (vocab, h)})})
        weight_map, total = {}, 0
        for i, shapes in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            generator = torch.Generator().manual_seed(seed * 100_003 + i)  # one stream per shard: any shard alone
            values = _values(shapes, generator, cfg["initializer_range"])
            save_file(values, temp / file, metadata={"format": "pt"})
            total += sum(v.numel() * v.element_size() for v in values.values())
            weight_map.update(dict.fromkeys(values, file))
            del values
        (temp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (temp / "config.json").write_text(json.dumps(cfg, indent=2))
        (temp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}))
        for name in TOKENIZER_FILES:
            shutil.copy2(BUNDLED_MODEL_DIR / name, temp / name)
        temp.rename(out)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oscar_export.models.random_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the new checkpoint directory")
    parser.add_argument("--preset", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    parser.add_argument("--shrink", type=int, default=1, help="divide hidden, FFN and head counts by this")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        path = write_checkpoint(args.out, args.preset, args.layers, args.shrink, args.vocab, args.seed)
    except OscarInputError as err:
        parser.error(str(err))
    size = sum(p.stat().st_size for p in path.iterdir())
    print(f"wrote {path}: {size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

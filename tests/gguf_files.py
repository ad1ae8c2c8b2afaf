"""GGUF files for the tests, written with the gguf package as llama.cpp's converter lays them out: the bundled
model (F32 or F16 tensors, its byte-level BPE tokenizer), so that GGUF input is checked without a download."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from oscar_export.models import BUNDLED_MODEL_DIR


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of q/k rows (rotary halves interleaved per head); transformers undoes it on load."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_bundled_gguf(path: Path, arch: str = "llama", half: bool = False) -> Path:
    import gguf

    cfg = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    tok = json.loads((BUNDLED_MODEL_DIR / "tokenizer.json").read_text())
    weights = load_file(BUNDLED_MODEL_DIR / "model.safetensors")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda item: item[1])
    special = {a["id"] for a in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if i in special else 1 for _, i in vocab])  # 3: control
    writer.add_token_merges([" ".join(pair) for pair in tok["model"]["merges"]])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_add_bos_token(False)

    def add(name, array):
        array = np.ascontiguousarray(array, dtype=np.float16 if half and array.ndim == 2 else np.float32)
        writer.add_tensor(name, array)

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    names = {"self_attn.o_proj": "attn_output", "self_attn.v_proj": "attn_v", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for i in range(cfg["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        add(f"blk.{i}.attn_q.weight", _permute(weights[layer + "self_attn.q_proj.weight"], cfg["num_attention_heads"]))
        add(f"blk.{i}.attn_k.weight", _permute(weights[layer + "self_attn.k_proj.weight"],
                                               cfg["num_key_value_heads"]))
        for hf, ours in names.items():
            add(f"blk.{i}.{ours}.weight", weights[layer + hf + ".weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

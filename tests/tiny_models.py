"""Tiny random-weight models of each supported family, for fast tests."""

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def tiny_model(family: str = "llama", seed: int = 0, layers: int = 2, head_dim: int = 64):
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = config_cls(
        hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, intermediate_size=256, vocab_size=120, max_position_embeddings=512,
    )
    return model_cls(cfg).eval()


class ByteTokenizer:
    """Enough of a tokenizer for calibration: one id per byte, folded into the tiny vocab."""

    def __call__(self, text, **kwargs):
        return {"input_ids": [b % 120 for b in text.encode()]}

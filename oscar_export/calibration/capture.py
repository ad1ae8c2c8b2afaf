"""Capture post-RoPE Q, K, V from a Hugging Face causal LM through its attention interface."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

CAPTURE_IMPLEMENTATION = "oscar_capture"
_sinks: list[Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]] = []


def _capturing_attention(module, query, key, value, attention_mask, **kwargs):
    # query [B, Hq, T, D], key/value [B, Hkv, T, D], after RoPE (and q/k norms where a family has them).
    for sink in _sinks:
        sink(module.layer_idx, query, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capturing_attention)


@contextmanager
def capture_qkv(model, sink: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> Iterator[None]:
    """Within the block, every attention call of `model` passes (layer, q, k, v) to `sink`."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    _sinks.append(sink)
    try:
        yield
    finally:
        _sinks.remove(sink)
        model.set_attn_implementation(previous)


@torch.no_grad()
def collect_qkv(model, input_ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One forward pass without a cache; returns {layer: (q, k, v)} for batch item 0, fp32 [heads, T, D]."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def keep(layer, q, k, v):
        captured[layer] = tuple(x[0].detach().to(torch.float32) for x in (q, k, v))

    with capture_qkv(model, keep):
        model(input_ids=input_ids, use_cache=False)
    return captured

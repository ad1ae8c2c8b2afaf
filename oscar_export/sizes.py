"""The packed format's sizes, in plain integers: the slots and bytes a cache allocates and its bits per element.

Torch-free, so the planner and the commands that only count bytes start without loading a tensor library.
"""

from __future__ import annotations

from .config import OscarConfig, OscarInputError

KINDS = ("k", "v")
# One layer's cache buffers, in the op's input order (after q, k_new, v_new).
CACHE_NAMES = ("k_sink", "v_sink", "k_recent", "v_recent", "k_codes", "k_scale", "k_zero",
               "v_codes", "v_scale", "v_zero")
# The element type of the scale and zero buffers for each scale_dtype: fp8 is held as its bits, in uint8, since
# every runtime has uint8 tensors and not every one has fp8 ones.
SCALE_BUFFER_DTYPES = {"float16": "float16", "float8_e4m3fn": "uint8"}
# The longest cache a manifest or a flag may ask for: far past any model here (a 1M-token cache of an 8B model
# is already ~60 GB at 2 bits), and a bound that keeps a hand-edited value from becoming an allocation.
MAX_CONTEXT = 1 << 20
# The most greedy steps one run or parity check takes (each keeps a vocabulary of logits).
MAX_STEPS = 4096


def packed_bytes(head_dim: int, bits: int) -> int:
    return head_dim * bits // 8


def body_bytes_per_vector(head_dim: int, bits: int, cluster_dim: int, scale_bytes: int) -> int:
    """Bytes one quantized K or V vector takes in the packed body: codes + scale + zero per group."""
    return packed_bytes(head_dim, bits) + (head_dim // cluster_dim) * 2 * scale_bytes


def capacities(config: OscarConfig, max_context: int) -> tuple[int, int, int]:
    """(sink, recent, body) slots allocated for a cache that holds max_context tokens."""
    sink = min(config.sink, max_context)
    recent = min(config.recent, max(max_context - config.sink, 0))
    body = max(max_context - config.sink - config.recent, 0)
    return sink, recent, body


def cache_layout(config: OscarConfig, layers: int, kv_heads: int, head_dim: int,
                 max_context: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, element type) of every cache buffer, layer{i}.k_sink ..., layer by layer in the op's order:
    what every target's program holds for a cache of max_context tokens."""
    s, w, b = capacities(config, max_context)
    groups = head_dim // config.cluster_dim
    scales = SCALE_BUFFER_DTYPES[config.scale_dtype]
    layout = []
    for i, cfg in enumerate(config.layers(layers)):
        one = {}
        for kind in KINDS:
            one[f"{kind}_sink"] = ((kv_heads, s, head_dim), "float16")
            one[f"{kind}_recent"] = ((kv_heads, w, head_dim), "float16")
            one[f"{kind}_codes"] = ((kv_heads, b, packed_bytes(head_dim, cfg.bits(kind))), "uint8")
            one[f"{kind}_scale"] = one[f"{kind}_zero"] = ((kv_heads, b, groups), scales)
        layout += [(f"layer{i}.{name}", *one[name]) for name in CACHE_NAMES]
    return layout


def cache_bytes(config: OscarConfig, layers: int, kv_heads: int, head_dim: int, max_context: int) -> int:
    """Bytes a cache of max_context tokens allocates: fp16 windows plus packed K and V bodies."""
    sink, recent, body = capacities(config, max_context)
    window = (sink + recent) * head_dim * 2 * 2  # K and V, 2 bytes each
    packed = body * sum(_body_bytes_per_token(c, head_dim) for c in config.layers(layers))
    return kv_heads * (layers * window + packed)


def _body_bytes_per_token(config: OscarConfig, head_dim: int) -> int:
    """Packed K plus V bytes of one body token in one KV head, for a one-width (per-layer) config."""
    return sum(
        body_bytes_per_vector(head_dim, config.bits(kind), config.cluster_dim, config.scale_bytes) for kind in KINDS
    )


def bits_per_element(config: OscarConfig, head_dim: int, context: int) -> float:
    """Average stored bits per K/V element once `context` tokens are cached."""
    if context <= 0:
        raise OscarInputError(f"context={context}: expected a positive token count")
    windows = min(context, config.sink + config.recent)
    body = context - windows
    layers = config.layers(len(config.k_bits_by_layer) or 1)
    per_body_token = sum(_body_bytes_per_token(c, head_dim) for c in layers) / len(layers)
    bits = windows * 2 * head_dim * 16 + body * per_body_token * 8
    return bits / (context * 2 * head_dim)

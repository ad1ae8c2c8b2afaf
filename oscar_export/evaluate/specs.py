"""The method specs eval takes (``oscar``, ``oscar-3``, ``kivi-k3v2``, ...) and the metric names, without loading torch:
the command line builds its flags from them."""

from __future__ import annotations

import re
from dataclasses import replace


from ..config import OscarConfig, OscarInputError


METHODS = ("fp16", "naive", "hadamard", "kivi", "oscar", "online")
DEFAULT_METHODS = ("fp16", "naive", "hadamard", "kivi", "oscar", "online", "oscar-3", "oscar-k3v2")
# Default contexts reach the model's max_position_embeddings up to this many tokens.
DEFAULT_LONGEST_CONTEXT = 8192
METRICS = ("perplexity", "attention", "needle")


def method_config(spec: str, config: OscarConfig) -> tuple[str, OscarConfig]:
    """A method spec -> (method, its cache config): 'oscar' keeps `config`'s bits, 'oscar-3' has 3-bit K and V,
    'oscar-k3v2' 3-bit K and 2-bit V."""
    name, dash, bits = spec.partition("-")
    match = re.fullmatch(r"([234])|k([234])v([234])", bits)
    if name not in METHODS or (dash and (name == "fp16" or not match)):
        raise OscarInputError(f"methods: {spec!r} is not a method: expected one of {list(METHODS)}, a quantized "
                              f"one optionally with its bits: NAME-B or NAME-kBvB, B in 2, 3, 4 (e.g. oscar-3, kivi-k3v2)")
    if not bits:
        return name, config
    k_bits, v_bits = (int(match[1]),) * 2 if match[1] else (int(match[2]), int(match[3]))
    return name, replace(config, k_bits=k_bits, v_bits=v_bits, k_bits_by_layer=(), k_clip_by_layer=())

"""oscar-export: OSCAR 2-bit KV cache for on-device language models."""

import importlib

from .config import OscarConfig, OscarInputError
from .sizes import bits_per_element, cache_bytes

__version__ = "0.1.0"

# Loaded on first use: torch (and, for the transformers integration, transformers) take seconds to import, and the
# commands that only count bytes (plan, --help) need neither.
_LAZY = {"OscarKVCache": "cache", "dequantize": "codec", "quantize": "codec", "OscarCache": "hf_cache",
         "patch_model_for_kv_quant": "hf_cache"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'oscar_export' has no attribute {name!r}")


__all__ = [
    "OscarCache",
    "OscarConfig",
    "OscarInputError",
    "OscarKVCache",
    "bits_per_element",
    "cache_bytes",
    "dequantize",
    "patch_model_for_kv_quant",
    "quantize",
]

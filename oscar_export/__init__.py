"""oscar-export: OSCAR 2-bit KV cache for on-device language models."""

from .cache import OscarKVCache, bits_per_element, cache_bytes
from .codec import dequantize, quantize
from .config import OscarConfig, OscarInputError

__version__ = "0.1.0"


def __getattr__(name: str):
    # The transformers integration loads transformers, which is slow: only on first use.
    if name in ("OscarCache", "patch_model_for_kv_quant"):
        from . import hf_cache

        return getattr(hf_cache, name)
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

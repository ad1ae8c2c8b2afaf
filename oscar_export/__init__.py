"""oscar-export: OSCAR 2-bit KV cache for on-device language models."""

from .cache import OscarKVCache, bits_per_element, cache_bytes
from .codec import dequantize, quantize
from .config import OscarConfig, OscarInputError

__version__ = "0.1.0"
__all__ = [
    "OscarConfig",
    "OscarInputError",
    "OscarKVCache",
    "bits_per_element",
    "cache_bytes",
    "dequantize",
    "quantize",
]

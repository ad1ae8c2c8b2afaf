"""Memory planner: does a model with an OSCAR KV cache fit a device at a given context?"""

from __future__ import annotations

import re

from .sizes import bits_per_element, cache_bytes
from .config import OscarConfig, OscarInputError
from .models import ModelShape

_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}
DEFAULT_RESERVE_FRACTION = 0.20
DEFAULT_WEIGHT_GROUP = 32  # quantized weights: one fp16 scale and one fp16 zero per 32 input channels


def parse_bytes(text: str, name: str = "memory") -> int:
    """'8GB', '6.5GiB', '512MB' -> bytes. Device memory is sold in binary units, so GB means 2**30."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match and match.group(2).upper()
    if not match or unit not in _UNITS:
        raise OscarInputError(f"{name}={text!r}: expected a size like 8GB, 6.5GiB or 512MB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise OscarInputError(f"{name}={text!r}: expected a positive size")
    return value


def weight_bytes(
    shape: ModelShape, weight_bits: int, embedding_bits: int = 16, group: int = DEFAULT_WEIGHT_GROUP,
    zero_points: bool = True, head_bits: int | None = None, k_feedback: bool = False,
) -> dict[str, int]:
    """Bytes of each part of the weights; linear layers at weight_bits and the lm_head at head_bits (default
    weight_bits), with an fp16 scale per group of input channels and, unless the quantization is symmetric
    (zero_points=False), an fp16 zero. k_feedback counts K's error-feedback weights (k_rounding feedback)."""
    head_bits = weight_bits if head_bits is None else head_bits

    def _matrix_bytes(params: int, bits: int) -> int:
        return params * 2 if bits >= 16 else params * bits // 8 + -(-params // group) * (4 if zero_points else 2)

    parts = {
        "linear": shape.layers * _matrix_bytes(shape.layer_params, weight_bits),
        "embeddings": _matrix_bytes(shape.vocab * shape.hidden, embedding_bits),
        # A tied lm_head shares the embedding table only at the same precision; a quantized
        # matmul cannot read a 16-bit lookup table, so exports store a quantized copy.
        "lm_head": 0 if shape.tied_embeddings and head_bits == embedding_bits
        else _matrix_bytes(shape.vocab * shape.hidden, head_bits),
        # The K rotation per layer and KV head, fp32 (the V rotation is folded into the weights), and
        # with feedback rounding K's [D, D] feedback weights beside it, fp32 too.
        "rotations": 4 * shape.layers * shape.kv_heads * shape.head_dim**2 * (2 if k_feedback else 1),
        # Norm weights and q/k/v biases stay in fp16.
        "norms_and_biases": 2 * ((2 * shape.layers + 1) * shape.hidden
                                 + (shape.layers * shape.head_dim * (shape.q_heads + 2 * shape.kv_heads)
                                    if shape.qkv_bias else 0)),
    }
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes_per_token(config: OscarConfig, shape: ModelShape) -> int:
    """Bytes one more token adds to the packed body (past the sink and recent windows)."""
    return cache_bytes(config, shape.layers, shape.kv_heads, shape.head_dim, config.sink + config.recent + 1) - (
        cache_bytes(config, shape.layers, shape.kv_heads, shape.head_dim, config.sink + config.recent)
    )


def fp16_kv_bytes_per_token(shape: ModelShape) -> int:
    return shape.layers * shape.kv_heads * shape.head_dim * 2 * 2


def _largest_context(budget: int, kv_bytes) -> int:
    """Largest n >= 0 with kv_bytes(n) <= budget (kv_bytes is non-decreasing)."""
    if budget < kv_bytes(1):
        return 0
    lo, hi = 1, 2
    while kv_bytes(hi) <= budget and hi < 2**40:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv_bytes(mid) <= budget else (lo, mid)
    return lo


def cache_budget_bits(shape: ModelShape, device_memory: int, context: int, reserve: int | None = None,
                      k_feedback: bool = False, weight_bits: int = 4, embedding_bits: int = 16,
                      weight_group: int = DEFAULT_WEIGHT_GROUP, weight_zero_points: bool = True,
                      head_bits: int | None = None) -> float:
    """Bits per K/V element a cache of `context` tokens may take on a device of `device_memory` bytes once the
    weights (plan's weight arguments) and the reserve are counted: a format within it is one plan(...) fits.
    Negative when the weights and reserve alone exceed the device."""
    if not isinstance(context, int) or context <= 0:
        raise OscarInputError(f"context={context!r}: expected a positive token count")
    reserve = int(device_memory * DEFAULT_RESERVE_FRACTION) if reserve is None else reserve
    weights = weight_bytes(shape, weight_bits, embedding_bits, weight_group, weight_zero_points, head_bits, k_feedback)
    return _bits_per_element(device_memory - reserve - weights["total"], shape, context)


def _bits_per_element(cache_bytes_: int, shape: ModelShape, context: int) -> float:
    return cache_bytes_ * 8 / (context * shape.layers * shape.kv_heads * shape.head_dim * 2)


def plan(
    shape: ModelShape,
    config: OscarConfig,
    device_memory: int,
    context: int,
    weight_bits: int = 4,
    embedding_bits: int = 16,
    reserve: int | None = None,
    weight_group: int = DEFAULT_WEIGHT_GROUP,
    weight_zero_points: bool = True,
    head_bits: int | None = None,
) -> dict:
    config.check_head_dim(shape.head_dim)
    if not isinstance(context, int) or context <= 0:
        raise OscarInputError(f"context={context!r}: expected a positive token count")
    if weight_bits not in (4, 8, 16):
        raise OscarInputError(f"weight_bits={weight_bits!r}: expected 4, 8 or 16")
    if embedding_bits not in (4, 8, 16):
        raise OscarInputError(f"embedding_bits={embedding_bits!r}: expected 4, 8 or 16")
    if head_bits not in (None, 4, 8, 16):
        raise OscarInputError(f"head_bits={head_bits!r}: expected 4, 8 or 16")
    reserve = int(device_memory * DEFAULT_RESERVE_FRACTION) if reserve is None else reserve
    if reserve < 0 or reserve >= device_memory:
        raise OscarInputError(f"reserve={reserve} bytes: expected 0 <= reserve < device memory ({device_memory})")
    if not isinstance(weight_group, int) or weight_group <= 0:
        raise OscarInputError(f"weight_group={weight_group!r}: expected a positive channel count")
    weights = weight_bytes(shape, weight_bits, embedding_bits, weight_group, weight_zero_points, head_bits,
                           k_feedback=config.k_rounding == "feedback")

    def oscar(n: int) -> int:
        return cache_bytes(config, shape.layers, shape.kv_heads, shape.head_dim, n)

    def fp16(n: int) -> int:
        return n * fp16_kv_bytes_per_token(shape)

    warnings = []
    if shape.max_position_embeddings and context > shape.max_position_embeddings:
        warnings.append(
            f"context {context} exceeds the model's max_position_embeddings "
            f"({shape.max_position_embeddings}): quality past it is not guaranteed"
        )
    budget = device_memory - reserve - weights["total"]
    kv = oscar(context)
    return {
        "model": shape.name,
        "layers": shape.layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "device_memory_bytes": device_memory,
        "reserve_bytes": reserve,
        "context": context,
        "weight_bits": weight_bits,
        "embedding_bits": embedding_bits,
        "head_bits": weight_bits if head_bits is None else head_bits,
        "weight_group": weight_group,
        "weight_zero_points": weight_zero_points,
        "weights_bytes": weights["total"],
        "weights_breakdown": weights,
        "kv_bytes_per_token": kv_bytes_per_token(config, shape),
        "kv_bytes_per_token_fp16": fp16_kv_bytes_per_token(shape),
        "kv_bytes": kv,
        "kv_bytes_fp16": fp16(context),
        "bits_per_element": bits_per_element(config, shape.head_dim, context),
        "cache_budget_bits": _bits_per_element(budget, shape, context),
        "total_bytes": weights["total"] + kv + reserve,
        "max_context": _largest_context(budget, oscar),
        "max_context_fp16": _largest_context(budget, fp16),
        "model_max_position_embeddings": shape.max_position_embeddings,
        "fits": weights["total"] + kv + reserve <= device_memory,
        "fits_fp16": weights["total"] + fp16(context) + reserve <= device_memory,
        "config": config.to_dict(),
        "warnings": warnings,
    }

"""The normative OSCAR-KV codec: per-group asymmetric quantization and bit packing.

Every backend (C++, Triton, ONNX, Core ML) reproduces these functions bit for bit;
docs/format.md states the same rules in prose. Inputs are already rotated vectors.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .config import SUPPORTED_BITS, OscarInputError

_TORCH_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                       "float8_e4m3fn": torch.float8_e4m3fn}
# Every 8 codes of b bits form one b-byte little-endian word (2-bit: 4 codes a byte,
# 3-bit: 8 codes in 3 bytes, 4-bit: 2 codes a byte).
CODES_PER_WORD = 8


class Quantized(NamedTuple):
    codes: torch.Tensor  # uint8 [..., head_dim * bits // 8], packed
    scale: torch.Tensor  # scale_dtype [..., head_dim // cluster_dim]
    zero: torch.Tensor  # scale_dtype [..., head_dim // cluster_dim]


def torch_scale_dtype(name: str) -> torch.dtype:
    return _TORCH_SCALE_DTYPES[name]


def check_finite(name: str, x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = "NaN" if bool(torch.isnan(x).any()) else "inf"
        raise OscarInputError(f"{name} contains {bad}: expected finite values")


def uniform_levels(bits: int) -> torch.Tensor:
    return torch.arange(2**bits, dtype=torch.float32)


def check_levels(levels: torch.Tensor, bits: int, name: str = "levels") -> torch.Tensor:
    """Levels are in code units: 2**bits ascending values inside [0, 2**bits - 1]."""
    n = 2**bits
    levels = torch.as_tensor(levels, dtype=torch.float32)
    if levels.shape != (n,):
        raise OscarInputError(f"{name} has shape {tuple(levels.shape)}: expected ({n},) for {bits}-bit codes")
    check_finite(name, levels)
    if not bool((levels[1:] > levels[:-1]).all()) or levels[0] < 0 or levels[-1] > n - 1:
        raise OscarInputError(f"{name}={levels.tolist()}: expected strictly ascending values in [0, {n - 1}]")
    return levels


def thresholds(levels: torch.Tensor) -> torch.Tensor:
    """Decision boundaries: fp32 midpoints of consecutive levels."""
    return (levels[:-1] + levels[1:]) * 0.5


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] (n a multiple of 8) -> packed uint8 [..., n * bits // 8]."""
    *lead, n = codes.shape
    words = codes.to(torch.int64).reshape(*lead, n // CODES_PER_WORD, CODES_PER_WORD)
    shifts = torch.arange(CODES_PER_WORD, dtype=torch.int64, device=codes.device) * bits
    word = (words << shifts).sum(-1, keepdim=True)
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=codes.device) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8).reshape(*lead, n * bits // 8)


def _byte_codes(bits: int, device) -> torch.Tensor:
    """[256, 8 // bits]: the codes each byte holds, lowest bits first, for widths that divide a byte."""
    shifts = torch.arange(8 // bits, dtype=torch.int64, device=device) * bits
    return (torch.arange(256, dtype=torch.int64, device=device)[:, None] >> shifts) & (2**bits - 1)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: packed uint8 [..., m] -> uint8 codes [..., m * 8 // bits]."""
    *lead, m = packed.shape
    if 8 % bits == 0:  # a code never straddles a byte: one table lookup per byte
        return _byte_codes(bits, packed.device).to(torch.uint8)[packed.to(torch.int64)].reshape(*lead, m * 8 // bits)
    chunks = packed.to(torch.int64).reshape(*lead, m // bits, bits)
    word = (chunks << (torch.arange(bits, dtype=torch.int64, device=packed.device) * 8)).sum(-1, keepdim=True)
    shifts = torch.arange(CODES_PER_WORD, dtype=torch.int64, device=packed.device) * bits
    return ((word >> shifts) & (2**bits - 1)).to(torch.uint8).reshape(*lead, m * 8 // bits)


def _groups(x: torch.Tensor, cluster_dim: int) -> torch.Tensor:
    *lead, d = x.shape
    if d % cluster_dim:
        raise OscarInputError(f"last dimension {d} is not a multiple of cluster_dim={cluster_dim}")
    return x.reshape(*lead, d // cluster_dim, cluster_dim)


def group_scale_zero(
    groups: torch.Tensor, bits: int, clip: float, scale_dtype: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group (scale, zero) in scale_dtype from fp32 groups [..., G, cluster_dim]."""
    lo = groups.amin(-1)
    hi = groups.amax(-1)
    if clip < 1.0:
        mid = (hi + lo) * 0.5
        half = (hi - lo) * torch.tensor(0.5 * clip, dtype=torch.float32)
        lo, hi = mid - half, mid + half
    dtype = torch_scale_dtype(scale_dtype)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, which can
    # round differently from the true division every other backend does.
    scale = (hi - lo) / torch.full_like(hi, float(2**bits - 1))
    if dtype == torch.float8_e4m3fn:
        # fp8 has no inf and torch's cast saturates: a magnitude past the largest finite value is refused here.
        limit = torch.finfo(dtype).max
        if bool((scale > limit).any()) or bool((lo.abs() > limit).any()):
            raise scale_range_error(scale_dtype)
    scale, zero = scale.to(dtype), lo.to(dtype)
    if not (bool(torch.isfinite(scale.float()).all()) and bool(torch.isfinite(zero.float()).all())):
        raise scale_range_error(scale_dtype)
    return scale, zero


def scale_range_error(scale_dtype: str) -> OscarInputError:
    """The error for a group whose scale or zero scale_dtype cannot hold, as every backend words it."""
    wider = "float16" if scale_dtype == "float8_e4m3fn" else "float32"
    return OscarInputError(f"values exceed the range of scale_dtype={scale_dtype} "
                           f"(max {torch.finfo(torch_scale_dtype(scale_dtype)).max:g}): expected smaller magnitudes "
                           f"or scale_dtype='{wider}'")


def encode(groups: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Code of each element: the number of thresholds that u = (x - zero) / scale exceeds."""
    s = scale.to(torch.float32).unsqueeze(-1)
    u = (groups - zero.to(torch.float32).unsqueeze(-1)) / s
    codes = (u.unsqueeze(-1) > thresholds(levels.to(u.device))).sum(-1)
    # A zero scale (constant group) has no defined u: its codes are 0 by definition.
    return torch.where(s == 0, torch.zeros_like(codes), codes).to(torch.uint8)


# Feedback weights are the strict upper triangle of a row-normalized Cholesky factor of a damped inverse
# covariance (calibrate.feedback_weights): about 1 in magnitude. A file's larger values are refused rather
# than let the running values overflow.
FEEDBACK_LIMIT = 64.0


def check_feedback(feedback: torch.Tensor, head_dim: int, name: str = "k_feedback") -> torch.Tensor:
    """Error-feedback weights: fp32 [..., head_dim, head_dim], finite, |w| <= FEEDBACK_LIMIT. Only the strict upper
    triangle is read (entry [i, j], j > i: how much of channel i's rounding error channel j takes)."""
    feedback = torch.as_tensor(feedback)
    if feedback.dtype != torch.float32 or feedback.dim() < 2 or feedback.shape[-2:] != (head_dim, head_dim):
        raise OscarInputError(f"{name} is {feedback.dtype} {tuple(feedback.shape)}: expected float32 "
                              f"[..., {head_dim}, {head_dim}]")
    check_finite(name, feedback)
    if feedback.numel() and float(feedback.abs().max()) > FEEDBACK_LIMIT:
        raise OscarInputError(f"{name} holds {float(feedback.abs().max()):g}: expected |weights| <= {FEEDBACK_LIMIT:g}")
    return feedback


def encode_feedback(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: torch.Tensor,
                    feedback: torch.Tensor) -> torch.Tensor:
    """Codes [..., D] of vectors x [..., D] (groups' scale and zero [..., G]) with error feedback: channel by
    channel in order, the code of the running value w_i as encode() picks it, then every later channel takes
    w_j = w_j - (w_i - x_hat_i) * feedback[..., i, j], x_hat_i = zero + scale * level[code] (fp32, each product
    and difference rounded on its own). feedback broadcasts against x's leading dimensions."""
    *lead, d = x.shape
    cd = d // scale.shape[-1]
    s = scale.to(torch.float32).repeat_interleave(cd, -1)
    z = zero.to(torch.float32).repeat_interleave(cd, -1)
    levels = levels.to(x.device)
    thr = thresholds(levels)
    w = x.to(torch.float32).clone()
    if x.device.type == "cpu":  # the same fp32 operations in numpy, whose per-call cost is a third of torch's
        return torch.from_numpy(_feedback_codes_numpy(w.numpy(), s.numpy(), z.numpy(), levels.numpy(), thr.numpy(),
                                                      feedback.expand(*lead, d, d).numpy()))
    return _feedback_codes(w, s, z, levels, thr, feedback)


def _feedback_codes(w, s, z, levels, thr, feedback):
    """encode_feedback's loop on fp32 tensors of one device (w is updated in place)."""
    d = w.shape[-1]
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    for i in range(d):
        si, zi = s[..., i], z[..., i]
        u = (w[..., i] - zi) / si
        code = torch.where(si == 0, 0, (u.unsqueeze(-1) > thr).sum(-1))
        codes[..., i] = code.to(torch.uint8)
        if i + 1 < d:
            error = w[..., i] - (zi + si * levels[code])
            w[..., i + 1:] = w[..., i + 1:] - error.unsqueeze(-1) * feedback[..., i, i + 1:]
    return codes


def _feedback_codes_numpy(w, s, z, levels, thr, feedback):
    """_feedback_codes on fp32 numpy arrays."""
    codes = np.empty(w.shape, np.uint8)
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero scale's group is all code 0
        for i in range(w.shape[-1]):
            si, zi = s[..., i], z[..., i]
            u = (w[..., i] - zi) / si
            code = np.where(si == 0, 0, (u[..., None] > thr).sum(-1))
            codes[..., i] = code
            if i + 1 < w.shape[-1]:
                error = w[..., i] - (zi + si * levels[code])
                w[..., i + 1:] -= error[..., None] * feedback[..., i, i + 1:]
    return codes


def quantize(
    x: torch.Tensor,
    bits: int,
    cluster_dim: int,
    clip: float = 1.0,
    levels: torch.Tensor | None = None,
    scale_dtype: str = "float16",
    feedback: torch.Tensor | None = None,
) -> Quantized:
    """Quantize fp32 vectors [..., head_dim] group by group and pack the codes. feedback ([..., head_dim, head_dim],
    broadcasting against x's leading dimensions): codes chosen with error feedback (encode_feedback), scales and
    zeros as without it."""
    if bits not in SUPPORTED_BITS:
        raise OscarInputError(f"bits={bits!r}: expected one of {SUPPORTED_BITS}")
    check_finite("input", x)
    levels = uniform_levels(bits) if levels is None else check_levels(levels, bits)
    groups = _groups(x.to(torch.float32), cluster_dim)
    scale, zero = group_scale_zero(groups, bits, clip, scale_dtype)
    if feedback is None:
        codes = encode(groups, scale, zero, levels).flatten(-2)
    else:
        codes = encode_feedback(x, scale, zero, levels, check_feedback(feedback, x.shape[-1]))
    return Quantized(pack_codes(codes, bits), scale, zero)


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    cluster_dim: int,
    levels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed codes and per-group scale/zero -> fp32 [..., head_dim]: zero + scale * level[code]."""
    levels = uniform_levels(bits) if levels is None else check_levels(levels, bits)
    levels = levels.to(device=codes.device, dtype=torch.float32)
    if 8 % bits == 0:  # each byte straight to its levels
        *lead, m = codes.shape
        values = levels[_byte_codes(bits, codes.device)][codes.to(torch.int64)].reshape(*lead, m * 8 // bits)
    else:
        values = levels[unpack_codes(codes, bits).to(torch.int64)]
    values = _groups(values, cluster_dim)
    out = zero.to(torch.float32).unsqueeze(-1) + scale.to(torch.float32).unsqueeze(-1) * values
    return out.flatten(-2)


def normalized_codes(x: torch.Tensor, bits: int, cluster_dim: int, clip: float, scale_dtype: str) -> torch.Tensor:
    """Each element in code units u = (x - zero) / scale, clamped to [0, 2**bits - 1] (for Lloyd-Max fitting)."""
    groups = _groups(x.to(torch.float32), cluster_dim)
    scale, zero = group_scale_zero(groups, bits, clip, scale_dtype)
    s = scale.to(torch.float32).unsqueeze(-1)
    u = (groups - zero.to(torch.float32).unsqueeze(-1)) / torch.where(s == 0, torch.ones_like(s), s)
    return u[(s != 0).expand_as(u)].clamp(0, 2**bits - 1)


def fit_lloyd_max_levels(samples: torch.Tensor, bits: int, iterations: int = 50) -> torch.Tensor:
    """Lloyd-Max levels in code units for samples u in [0, 2**bits - 1], starting from uniform levels."""
    n = 2**bits
    u = samples.reshape(-1).to(torch.float32)
    levels = uniform_levels(bits)
    for _ in range(iterations):
        idx = (u.unsqueeze(-1) > thresholds(levels)).sum(-1)
        sums = torch.zeros(n).index_add_(0, idx, u)
        counts = torch.bincount(idx, minlength=n).to(torch.float32)
        # An empty cell keeps its level, so the codebook stays strictly ascending.
        levels = torch.where(counts > 0, sums / counts.clamp(min=1), levels)
    levels = levels.clamp(0, n - 1)
    for i in range(1, n):  # keep strictly ascending even if two cells collapsed
        if levels[i] <= levels[i - 1]:
            levels[i] = torch.nextafter(levels[i - 1], torch.tensor(float(n)))
    return check_levels(levels, bits)

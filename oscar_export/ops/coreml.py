"""oscar::attention as a composition of standard ops that Core ML can run, packed words in int32.

Core ML ML programs have no custom kernels, so each layer's attention is traced as plain tensor
ops (`attention_rows`). Two Core ML constraints shape it (../docs/ios.md):

- Packed codes travel as int32 words (the format's little-endian bytes, 4 to a word): uint8 is not
  a Core ML input type, and every op on them stays integer. coremltools converts `torch.div(...,
  rounding_mode="floor")` through fp32 (and its fp16 pass then makes it fp16, exact only below
  2048), so the one integer division used here is the custom op `oscar::int_floor_div`, which
  `register_coreml_ops` maps to MIL `floor_div` on int32. Operands are kept non-negative, so
  floor and truncating division agree.
- fp8 E4M3 scales and zeros travel as int32 words too (their bytes in the format's [H, B, G] order, 4 to a
  word, the last word zero-padded), so one byte each stays one byte. They are decoded by a 256-entry table and
  encoded by counting the midpoints between E4M3 values that a magnitude passes, since Core ML has no bitcast.
- A Core ML model cannot write its inputs and its states are fp16 only. So the cache is an input
  and the outputs are the rows a chunk adds: its fp16 K/V (for the sink and the recent ring) and
  the packed body rows of the positions that leave the ring. The host writes them into its buffers
  by the placement rule (`apply_rows`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ..config import OscarInputError
from ..sizes import KINDS
from ..codec import scale_range_error
from .attention import ATTRIBUTES, E4M3_MAX_BYTE, E4M3_MIDPOINTS, E4M3_TIE_UP, E4M3_VALUES, attribute_config

INT32_MIN = -(2**31)
# The scale dtypes the rows store: fp16 as itself, fp8 E4M3 as bytes in int32 words.
SCALE_DTYPES = ("float16", "float8_e4m3fn")
# Per layer and kind, the outputs of attention_rows after `out`, in order.
ROW_NAMES = ("k_new", "v_new", "k_body_codes", "k_body_scale", "k_body_zero", "v_body_codes", "v_body_scale",
             "v_body_zero")

_lib = torch.library.Library("oscar", "FRAGMENT")
_lib.define("int_floor_div(Tensor x, Tensor divisor) -> Tensor")


def _int_floor_div(x, divisor):
    return torch.div(x, divisor, rounding_mode="floor")


_lib.impl("int_floor_div", _int_floor_div, "CompositeExplicitAutograd")


@torch.library.register_fake("oscar::int_floor_div")
def _(x, divisor):
    return torch.empty(torch.broadcast_shapes(x.shape, divisor.shape), dtype=x.dtype, device=x.device)


def register_coreml_ops() -> None:
    """Teach coremltools' torch frontend oscar::int_floor_div: MIL floor_div on int32, no float cast."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch.ops import _get_inputs
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY, register_torch_op

    if _TORCH_OPS_REGISTRY.get_func("oscar::int_floor_div") is not None:
        return

    @register_torch_op(torch_alias=["oscar::int_floor_div"])
    def oscar_int_floor_div(context, node):
        x, divisor = _get_inputs(context, node, expected=2)
        context.add(mb.floor_div(x=x, y=divisor, name=node.name))


def _i32(values) -> torch.Tensor:
    # Integer constants as int32 tensors: coremltools turns zeros_like/full_like and scalar
    # operands of integer ops into fp32 fills.
    return torch.tensor(values, dtype=torch.int32)


def _div(x: torch.Tensor, divisors) -> torch.Tensor:
    return torch.ops.oscar.int_floor_div(x, _i32(divisors))


# -- packing: format.md section 4, on int32 words -------------------------------------------------


def words_to_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] -> their little-endian bytes as int32 0..255 [..., n, 4], without negative operands."""
    neg = (words < 0).to(torch.int32)
    low31 = words - neg * INT32_MIN  # bits 0..30, >= 0 (w + 2^31 for negative w: no overflow)
    byte = torch.remainder(_div(low31.unsqueeze(-1), [1, 2**8, 2**16, 2**24]), 256)
    return byte + neg.unsqueeze(-1) * _i32([0, 0, 0, 128])  # bit 31 is the top bit of byte 3


def bytes_to_words(byte: torch.Tensor) -> torch.Tensor:
    """int32 bytes 0..255 [..., 4n] -> int32 little-endian words [..., n] (two's complement, no overflow)."""
    b = byte.reshape(*byte.shape[:-1], byte.shape[-1] // 4, 4)
    top = b[..., 3] - (b[..., 3] >= 128).to(torch.int32) * 256  # -128..127
    return b[..., 0] + b[..., 1] * 2**8 + b[..., 2] * 2**16 + top * 2**24


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., D*bits/32] -> int32 codes [..., D]."""
    byte = words_to_bytes(words).flatten(-2)
    if bits == 3:  # 8 codes in 3 bytes: a 24-bit word, exact in int32
        b = byte.reshape(*byte.shape[:-1], byte.shape[-1] // 3, 3)
        word = (b[..., 0] + b[..., 1] * 2**8 + b[..., 2] * 2**16).unsqueeze(-1)
        codes = torch.remainder(_div(word, [8**j for j in range(8)]), 8)
    else:  # 2 and 4 bits: whole codes inside each byte, low bits first
        codes = torch.remainder(_div(byte.unsqueeze(-1), [2 ** (bits * j) for j in range(8 // bits)]), 2**bits)
    return codes.flatten(-2)


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 codes [..., D] -> int32 words [..., D*bits/32]."""
    if bits == 3:
        c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 8, 8)
        word = c[..., 0]
        for j in range(1, 8):
            word = word + c[..., j] * 8**j
        byte = torch.remainder(_div(word.unsqueeze(-1), [1, 2**8, 2**16]), 256).flatten(-2)
    else:
        per = 8 // bits
        c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
        byte = c[..., 0]
        for j in range(1, per):
            byte = byte + c[..., j] * 2 ** (bits * j)
    return bytes_to_words(byte)


# -- fp8 E4M3 scales and zeros: each byte an int32 0..255 in the rows, 4 to an int32 word in the cache --------

FP8_MAX = float(E4M3_VALUES[E4M3_MAX_BYTE])
FP8_NAN = (0x7F, 0xFF)


def fp8_word_count(rows: int, groups: int) -> int:
    """int32 words holding rows x groups fp8 bytes (the last word zero-padded)."""
    return -(-rows * groups // 4)


def fp8_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> each value's E4M3FN byte as int32 0..255, rounded to nearest even as torch's cast rounds. A magnitude
    past FP8_MAX gives a NaN byte, which the host refuses (apply_rows), as the codec refuses the value."""
    magnitude = torch.abs(x)
    m = magnitude.unsqueeze(-1)
    passed = torch.where(E4M3_TIE_UP, m >= E4M3_MIDPOINTS, m > E4M3_MIDPOINTS).to(torch.int32)
    code = passed.sum(-1, dtype=torch.int32) + (magnitude > FP8_MAX).to(torch.int32)
    # 1/x keeps the sign of a zero, which torch's cast stores (0x80 for -0.0). A tensor numerator: torch turns
    # 1/x into reciprocal, which coremltools converts with an epsilon added to x.
    negative = (torch.tensor(1.0) / x < 0).to(torch.int32)
    return code + negative * 128


def fp8_values(byte: torch.Tensor) -> torch.Tensor:
    """int32 bytes 0..255 -> their E4M3FN values in fp32, same shape."""
    return E4M3_VALUES[byte.flatten()].reshape(byte.shape)


def fp8_from_words(words: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """int32 words [..., fp8_word_count(rows, groups)] -> fp32 [..., rows, groups]."""
    byte = words_to_bytes(words).flatten(-2)
    if byte.shape[-1] != rows * groups:  # a slice of every byte decomposes to aten.alias, which Core ML lacks
        byte = byte[..., :rows * groups]
    return fp8_values(byte).reshape(*words.shape[:-1], rows, groups)


# -- codec: format.md section 3 --------------------------------------------------------------------


def dequantize(words, scale, zero, levels, bits: int, cluster_dim: int, scale_dtype: str) -> torch.Tensor:
    """Body rows -> fp32 [H, rows, D]: zero + scale * level[code]. scale, zero: fp16 [H, rows, G], or for fp8 int32
    words (fp8_from_words)."""
    codes = unpack_words(words, bits)
    rows, groups = codes.shape[-2], codes.shape[-1] // cluster_dim
    values = levels[codes.flatten()].reshape(*codes.shape[:-1], groups, cluster_dim)
    if scale_dtype == "float8_e4m3fn":
        scale, zero = (fp8_from_words(w, rows, groups) for w in (scale, zero))
    out = zero.float().unsqueeze(-1) + scale.float().unsqueeze(-1) * values
    return out.flatten(-2)


def quantize(x: torch.Tensor, levels, bits: int, cluster_dim: int, clip: float, scale_dtype: str, feedback=None):
    """fp32 [H, n, D] -> (int32 words, scale, zero), bit-exact with codec.quantize; scale and zero [H, n, G] are fp16,
    or for fp8 their bytes as int32. feedback [H, D, D]: the codes with error feedback (format.md section 3,
    step 5), unrolled over the channels."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // cluster_dim, cluster_dim)
    lo, hi = g.amin(-1), g.amax(-1)
    if clip < 1.0:
        mid = (hi + lo) * 0.5
        half = (hi - lo) * torch.tensor(0.5 * clip, dtype=torch.float32)
        lo, hi = mid - half, mid + half
    scale = (hi - lo) / float(2**bits - 1)
    if scale_dtype == "float8_e4m3fn":
        scale, zero = fp8_bytes(scale), fp8_bytes(lo)
        s, z = fp8_values(scale).unsqueeze(-1), fp8_values(zero).unsqueeze(-1)
    else:
        scale, zero = scale.half(), lo.half()
        s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    thresholds = (levels[:-1] + levels[1:]) * 0.5

    def codes_of(value, s, z):
        u = (value - z) / s
        code = (u > thresholds[0]).to(torch.int32)
        for j in range(1, 2**bits - 1):  # count of thresholds exceeded, in int32
            code = code + (u > thresholds[j]).to(torch.int32)
        return torch.where(s == 0, _i32(0), code)  # a zero scale has codes 0

    if feedback is None:
        return pack_words(codes_of(g, s, z).flatten(-2), bits), scale, zero
    d = x.shape[-1]
    s_ch, z_ch = (v.expand(g.shape).reshape(x.shape) for v in (s, z))
    # Row i of the strict upper triangle, over the whole width: channels up to i take w - 0 = w (exact, and their
    # codes are already chosen), so each step is one multiply and one subtract, not a slice and concatenation.
    upper = torch.triu(feedback, diagonal=1).unsqueeze(1)
    w, codes = x, []
    for i in range(d):
        wi, si, zi = w[..., i:i + 1], s_ch[..., i:i + 1], z_ch[..., i:i + 1]
        ci = codes_of(wi, si, zi)
        codes.append(ci)
        if i + 1 < d:
            error = wi - (zi + si * levels[ci.flatten()].reshape(ci.shape))
            w = w - error * upper[:, :, i]
    return pack_words(torch.cat(codes, dim=-1), bits), scale, zero


# -- the op ----------------------------------------------------------------------------------------


def attention_rows(q, k_new, v_new, k_sink, v_sink, k_recent, v_recent, k_codes, k_scale, k_zero, v_codes, v_scale,
                   v_zero, k_levels, v_levels, k_feedback, length, k_bits, v_bits, cluster_dim, sink, recent, k_clip,
                   v_clip, scaling, codebook, k_rounding, scale_dtype):
    """oscar::attention over int32-word buffers, returning (out, *ROW_NAMES) instead of updated buffers.

    out is the reference attention (format.md section 6). The body rows are those of positions
    max(S, n0-W) + j for j < T; only the first max(S, n1-W) - max(S, n0-W) are real, the rest
    are computed from clamped indices and ignored by apply_rows.
    """
    config = attribute_config(dict(zip(ATTRIBUTES, (k_bits, v_bits, cluster_dim, sink, recent, k_clip, v_clip,
                                                    scaling, codebook, k_rounding, scale_dtype), strict=True)))
    if config.scale_dtype not in SCALE_DTYPES:
        raise OscarInputError(f"scale_dtype={config.scale_dtype!r}: expected one of {SCALE_DTYPES}, the scales the "
                              "Core ML rows store")
    # v_new arrives as a transposed view; contiguous copies keep the traced shapes free of stride guards.
    q, k_new, v_new = q.contiguous(), k_new.contiguous(), v_new.contiguous()
    heads, t, d = k_new.shape
    s_cap, w_cap, b_cap = k_sink.shape[1], k_recent.shape[1], k_codes.shape[1]
    n0 = length.reshape(1).to(torch.int32)
    cache = {"k": (k_sink, k_recent, k_codes, k_scale, k_zero), "v": (v_sink, v_recent, v_codes, v_scale, v_zero)}
    new, levels = {"k": k_new, "v": v_new}, {"k": k_levels, "v": v_levels}
    bits, clip = {"k": k_bits, "v": v_bits}, {"k": k_clip, "v": v_clip}

    # Every slot in position-independent order (sink, body, ring, chunk); visibility by rank.
    keys = {}
    for kind in KINDS:
        sink_buf, ring, words, scale, zero = cache[kind]
        body = dequantize(words, scale, zero, levels[kind], bits[kind], cluster_dim, config.scale_dtype)
        keys[kind] = torch.cat([sink_buf.float(), body, ring.float(), new[kind].float()], dim=1)
    chunk = torch.arange(t, dtype=torch.int32)
    filled, empty = _i32(-1), _i32(2**30)  # ranks: a filled slot is seen by every query, an empty one by none
    rank = torch.cat([
        torch.where(torch.arange(s_cap, dtype=torch.int32) < n0, filled, empty),
        torch.where(torch.arange(b_cap, dtype=torch.int32) < n0 - (sink + recent), filled, empty),
        torch.where(torch.arange(w_cap, dtype=torch.int32) < n0 - sink, filled, empty),
        chunk,
    ])
    visible = rank.unsqueeze(0) <= chunk.unsqueeze(1)  # [T, slots]
    group = q.shape[0] // heads
    scores = (q.reshape(heads, group * t, d) @ keys["k"].transpose(1, 2)) * scaling
    scores = torch.where(visible.repeat(group, 1), scores, torch.tensor(torch.finfo(torch.float32).min))
    out = (torch.softmax(scores, dim=-1) @ keys["v"]).reshape(q.shape)

    # Positions entering the body during this chunk: from the ring (p < n0) or from the chunk.
    first = torch.maximum(n0 - recent, _i32(sink))
    pos = first + chunk
    rows = {}
    for kind in KINDS:
        ring = cache[kind][1]
        if recent:
            src = torch.cat([ring, new[kind]], dim=1)
            idx = torch.where(pos < n0, torch.remainder(pos - sink, recent), pos - n0 + w_cap)
        else:
            src, idx = new[kind], pos - n0
        idx = torch.where(idx < src.shape[1], idx, _i32(0))  # rows past the real ones read any valid row
        values = torch.index_select(src, 1, idx).float()
        feedback = k_feedback if kind == "k" and config.k_rounding == "feedback" else None
        rows[kind] = quantize(values, levels[kind], bits[kind], cluster_dim, clip[kind], config.scale_dtype, feedback)
    return (out, k_new, v_new, *rows["k"], *rows["v"])


class RowsComposition(TorchFunctionMode):
    """While active, oscar::attention_functional calls run attention_rows: how the shared graph
    (graph.OscarCausalLM, functional=True) is traced for Core ML without a custom op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.oscar.attention_functional, torch.ops.oscar.attention_functional.default):
            return attention_rows(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


# -- the host side ---------------------------------------------------------------------------------


def apply_rows(cache: dict[str, np.ndarray], rows: dict[str, np.ndarray], n0: int, sink: int, recent: int) -> None:
    """Write one layer's chunk outputs into its buffers by the placement rule (format.md section 5).

    cache: k_sink ... v_zero of one layer (codes, and fp8 scales and zeros, as int32 words); rows: ROW_NAMES of
    that layer. A NaN fp8 scale or zero (a group the format cannot hold) is refused before anything is written.
    """
    t = rows["k_new"].shape[1]
    n1 = n0 + t
    first, last = max(sink, n0 - recent), max(sink, n1 - recent)
    # fp8 scale and zero buffers (int32 words) by name, with the row output that feeds each
    fp8 = {f"{kind}_{region}": f"{kind}_body_{region}" for kind in KINDS for region in ("scale", "zero")
           if cache[f"{kind}_{region}"].dtype == np.int32}
    if last > first and any(np.isin(rows[row][:, :last - first], FP8_NAN).any() for row in fp8.values()):
        raise scale_range_error("float8_e4m3fn")
    for kind in KINDS:
        chunk = rows[f"{kind}_new"]
        if n0 < min(sink, n1):
            cache[f"{kind}_sink"][:, n0:min(sink, n1)] = chunk[:, :min(sink, n1) - n0]
        if last > first:
            for region in ("codes", "scale", "zero"):
                name, new = f"{kind}_{region}", rows[f"{kind}_body_{region}"][:, :last - first]
                if name in fp8:  # bytes in the format's [H, B, G] order inside the words
                    g = new.shape[-1]
                    cache[name].view(np.uint8)[:, (first - sink) * g:(last - sink) * g] = new.reshape(len(new), -1)
                else:
                    cache[name][:, first - sink:last - sink] = new
        ring_from = max(sink, n1 - recent, n0)
        if recent and ring_from < n1:
            positions = np.arange(ring_from, n1)
            cache[f"{kind}_recent"][:, (positions - sink) % recent] = chunk[:, positions - n0]

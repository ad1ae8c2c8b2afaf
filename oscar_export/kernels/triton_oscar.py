"""Triton kernels for the OSCAR packed KV cache: quantize + pack, and split-K decode attention.

Laid out like Triton's fused-attention tutorial: the kernels, the host wrappers that launch
them, and a plain-PyTorch reference for each, together. `benchmarks/kernels/gpu.py` times them.

* `quantize_pack(x, bits, cluster_dim, clip, levels)` reproduces `oscar_export.codec.quantize`
  bit for bit (codes, scale, zero): fp32 arithmetic in the order docs/format.md section 3
  prescribes, correctly rounded divisions (`tl.math.div_rn`), and no FMA contraction
  (`enable_fp_fusion=False`), so the clipped range `mid - (hi - lo) * c` rounds twice as in
  PyTorch.
* `decode_attention(...)` is flash-decoding for one new token over one layer's cache: each
  program takes one KV head (and all its GQA query heads) and either the fp16 windows
  (sink, recent ring and the new token) or one slice of the packed body, which it unpacks and
  dequantizes on the fly; a second kernel merges the per-split softmax partials.
* `triton_decode_attend(cache, layer, q, k, v)` is `OscarKVCache.attend` for T = 1 on top of it;
  `triton_append(cache, layer, k, v)` is `OscarKVCache.append` with the body quantized here.

Only Triton features present in both triton 3.6 and 3.9 are used (tl.load/store, reductions,
tl.where, tl.reshape, tl.math.div_rn, static_range). Everything runs under the interpreter
(`TRITON_INTERPRET=1`, set before this module is imported) on CPU tensors, which is how the
tests run.

Exactness notes. Codes, scales and zeros are exact on the interpreter (numpy fp32 is IEEE).
On CUDA the same holds as long as fp32 subnormals (|x| < 1.2e-38) are not flushed to zero;
such inputs are far below anything fp16 windows can hold. One case the format leaves open:
a group whose minimum is zero and that holds both -0.0 and +0.0 may store `zero` with either
sign, depending on reduction order (PyTorch's own amin depends on where they sit); codes and
dequantized values are the same either way. Attention outputs are fp32 but sum in
a different order than the reference (online softmax, split-K, `tl.exp`): they agree to ~1e-6
relative, well inside the 1e-3 the format allows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..codec import (Quantized, check_finite, check_levels, dequantize, scale_range_error, thresholds,
                     torch_scale_dtype, uniform_levels)
from ..sizes import packed_bytes
from ..config import SCALE_DTYPES, SUPPORTED_BITS, SUPPORTED_CLUSTER_DIMS, OscarInputError

# Scale dtypes as the kernels see them. bf16 and fp8 are stored through their raw bits (int16, uint8) so the
# interpreter, whose numpy has neither, runs the same code as the GPU.
_SCALE_KIND = {"float16": 0, "bfloat16": 1, "float32": 2, "float8_e4m3fn": 3}
_RAW_BITS = {"bfloat16": torch.int16, "float8_e4m3fn": torch.uint8}
KERNEL_SCALE_DTYPES = tuple(_SCALE_KIND)


def interpreting() -> bool:
    """Whether these kernels run on Triton's interpreter (decided when this module was imported)."""
    return type(_quantize_pack_kernel).__name__ == "InterpretedFunction"


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


# ======================================================================================
# Shared device helpers
# ======================================================================================


@triton.jit
def _fp8_value(raw):
    """fp8 E4M3FN bits (any integer type) -> fp32 (0x7F, NaN, reads as 480: the host refuses it first)."""
    c = raw.to(tl.int32) & 0xFF
    e = (c >> 3) & 0xF
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def _round_to_scale_dtype(x, SCALE_KIND: tl.constexpr):
    """fp32 -> scale_dtype (round to nearest even) -> fp32; also returns what to store."""
    if SCALE_KIND == 0:
        stored = x.to(tl.float16)
        back = stored.to(tl.float32)
    elif SCALE_KIND == 1:
        # bf16 by hand on the fp32 bits: add 0x7FFF plus the lowest kept bit, truncate.
        # (Inputs are finite; a carry into the exponent is the correct overflow to inf.)
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        back = bits.to(tl.float32, bitcast=True)
        stored = (bits >> 16).to(tl.int16)  # stored into an int16 view of the bf16 tensor
    elif SCALE_KIND == 3:
        # fp8 E4M3FN by hand. Normals keep 3 mantissa bits, rounded half to even on the fp32 bits (a carry
        # moves into the exponent); below 2**-6 the steps are 2**-9, rounded half to even by adding and
        # subtracting 2**23 in fp32 (code 8 there is 2**-6, the smallest normal). A magnitude past 448, which
        # the codec refuses, is stored as NaN (0x7F) for the host to refuse.
        bits = x.to(tl.uint32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        r = mag + 0x7FFFF + ((mag >> 20) & 1)
        normal = ((((r >> 23) & 0xFF) - 120) << 3) | ((r >> 20) & 7)
        a = tl.abs(x)
        sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
        code = tl.where(a < 0.015625, sub, normal)
        code = tl.where(a > 448.0, 0x7F, code) | ((bits >> 24) & 0x80)
        stored = code.to(tl.uint8)
        back = _fp8_value(stored)
    else:
        stored = x
        back = x
    return stored, back


# ======================================================================================
# Kernel 1: quantize + pack
# ======================================================================================


@triton.jit
def _quantize_pack_kernel(
    x_ptr,  # [N, D] fp16 or fp32, rotated vectors
    codes_ptr,  # [N, D * BITS // 8] uint8
    scale_ptr,  # [N, G] scale dtype (raw bits for bf16 and fp8)
    zero_ptr,  # [N, G]
    params_ptr,  # fp32 [1 + 2**BITS - 1]: c = fp32(0.5 * clip), then the thresholds
    n_rows,
    D: tl.constexpr,
    CD: tl.constexpr,  # cluster_dim
    G_P2: tl.constexpr,  # groups per vector, padded to a power of two
    BITS: tl.constexpr,
    CLIP: tl.constexpr,  # clip < 1
    SCALE_KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    G: tl.constexpr = D // CD
    NB: tl.constexpr = D * BITS // 8
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    grp = tl.arange(0, G_P2)
    chan = tl.arange(0, CD)
    row_ok = rows < n_rows
    grp_ok = grp < G
    # One [rows, groups, cluster] tile; padding groups and rows are whole groups, so their
    # (meaningless) min/max never mix with real data.
    offs = rows[:, None, None] * D + grp[None, :, None] * CD + chan[None, None, :]
    mask = row_ok[:, None, None] & grp_ok[None, :, None] & (chan < CD)[None, None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    # Section 3, steps 1-3, in fp32 with the reference's operation order.
    lo = tl.min(x, axis=2)
    hi = tl.max(x, axis=2)
    if CLIP:
        c = tl.load(params_ptr)
        mid = (hi + lo) * 0.5
        half = (hi - lo) * c
        lo = mid - half
        hi = mid + half
    levels_m1 = tl.full(lo.shape, 2**BITS - 1, tl.float32)
    scale_st, scale = _round_to_scale_dtype(tl.math.div_rn(hi - lo, levels_m1), SCALE_KIND)
    zero_st, zero = _round_to_scale_dtype(lo, SCALE_KIND)
    so = rows[:, None] * G + grp[None, :]
    smask = row_ok[:, None] & grp_ok[None, :]
    tl.store(scale_ptr + so, scale_st, mask=smask)
    tl.store(zero_ptr + so, zero_st, mask=smask)

    # Steps 5-6: code = number of thresholds u strictly exceeds; a zero scale gives code 0.
    # The divisor is made 1 there only to keep the division finite.
    safe = tl.where(scale == 0.0, 1.0, scale)
    u = tl.math.div_rn(x - zero[:, :, None], safe[:, :, None])
    code = tl.zeros([BLOCK_N, G_P2, CD], dtype=tl.int32)
    for j in tl.static_range(2**BITS - 1):
        code += (u > tl.load(params_ptr + 1 + j)).to(tl.int32)
    code = tl.where(scale[:, :, None] == 0.0, 0, code)

    # Section 4: every 8 codes form one BITS-byte little-endian word (at most 24 bits).
    WORDS: tl.constexpr = G_P2 * CD // 8
    words = tl.reshape(code, [BLOCK_N, WORDS, 8])
    word = tl.sum(words << (tl.arange(0, 8) * BITS)[None, None, :], axis=2)
    w = tl.arange(0, WORDS)
    wmask = row_ok[:, None] & (w < D // 8)[None, :]
    base = codes_ptr + rows[:, None] * NB + w[None, :] * BITS
    for k in tl.static_range(BITS):
        tl.store(base + k, ((word >> (8 * k)) & 0xFF).to(tl.uint8), mask=wmask)


_PARAMS_CACHE: dict = {}


def _quant_params(bits: int, clip: float, levels: torch.Tensor | None, device) -> torch.Tensor:
    """fp32 [c, t_0 .. t_{L-2}] on `device`; thresholds exactly as codec.thresholds computes them."""
    lv = uniform_levels(bits) if levels is None else check_levels(torch.as_tensor(levels).cpu(), bits)
    key = (bits, float(clip), tuple(lv.tolist()), str(device))
    cached = _PARAMS_CACHE.get(key)
    if cached is None:
        c = torch.tensor([0.5 * clip], dtype=torch.float32)  # rounded once to fp32, as in the codec
        cached = torch.cat([c, thresholds(lv)]).to(device)
        if len(_PARAMS_CACHE) > 64:
            _PARAMS_CACHE.clear()
        _PARAMS_CACHE[key] = cached
    return cached


def _check_device(*tensors: torch.Tensor) -> None:
    if interpreting():
        return
    for t in tensors:
        if t.device.type != "cuda":
            raise OscarInputError(
                f"tensor on {t.device}: expected CUDA tensors (or set TRITON_INTERPRET=1 before importing "
                "oscar_export.kernels.triton_oscar to run the kernels on CPU through the interpreter)"
            )


def quantize_pack(
    x: torch.Tensor,
    bits: int,
    cluster_dim: int,
    clip: float = 1.0,
    levels: torch.Tensor | None = None,
    scale_dtype: str = "float16",
    *,
    check: bool = True,
    block_n: int | None = None,
) -> Quantized:
    """Quantize rotated vectors [..., D] (fp16 or fp32) and pack the codes, like codec.quantize.

    Returns (codes uint8 [..., D*bits/8], scale [..., G], zero [..., G]) in `scale_dtype`.
    `check=False` skips the finiteness checks (they synchronize the device).
    """
    if bits not in SUPPORTED_BITS:
        raise OscarInputError(f"bits={bits!r}: expected one of {SUPPORTED_BITS}")
    if cluster_dim not in SUPPORTED_CLUSTER_DIMS:
        raise OscarInputError(f"cluster_dim={cluster_dim!r}: expected one of {SUPPORTED_CLUSTER_DIMS}")
    if scale_dtype not in _SCALE_KIND:
        raise OscarInputError(f"scale_dtype={scale_dtype!r}: expected one of {KERNEL_SCALE_DTYPES} (the Triton "
                              f"kernels' scale dtypes; the reference codec takes {SCALE_DTYPES})")
    *lead, d = x.shape
    if d % cluster_dim:
        raise OscarInputError(f"last dimension {d} is not a multiple of cluster_dim={cluster_dim}")
    _check_device(x)
    if check:
        check_finite("input", x)
    rows = x.reshape(-1, d)
    if rows.dtype not in (torch.float16, torch.float32):
        rows = rows.to(torch.float32)  # exact for bf16; fp64 is rounded as codec.quantize does
    rows = rows.contiguous()
    n, groups = rows.shape[0], d // cluster_dim
    sdt = torch_scale_dtype(scale_dtype)
    store_dt = _RAW_BITS.get(scale_dtype, sdt)
    codes = torch.empty(n, packed_bytes(d, bits), dtype=torch.uint8, device=x.device)
    scale = torch.empty(n, groups, dtype=store_dt, device=x.device)
    zero = torch.empty(n, groups, dtype=store_dt, device=x.device)
    if n:
        g_p2 = _next_pow2(groups)
        block = block_n or max(1, 4096 // (g_p2 * cluster_dim))
        _quantize_pack_kernel[(triton.cdiv(n, block),)](
            rows, codes, scale, zero, _quant_params(bits, clip, levels, x.device), n,
            D=d, CD=cluster_dim, G_P2=g_p2, BITS=bits, CLIP=bool(clip < 1.0),
            SCALE_KIND=_SCALE_KIND[scale_dtype], BLOCK_N=block,
            num_warps=4, enable_fp_fusion=False,  # no FMA: the clipped range must round twice
        )
    scale, zero = scale.view(sdt), zero.view(sdt)
    if check and not (bool(torch.isfinite(scale.float()).all()) and bool(torch.isfinite(zero.float()).all())):
        raise scale_range_error(scale_dtype)
    return Quantized(
        codes.reshape(*lead, codes.shape[-1]), scale.reshape(*lead, groups), zero.reshape(*lead, groups)
    )


# ======================================================================================
# Kernel 2: split-K decode attention over sink + packed body + recent ring + new token
# ======================================================================================


@triton.jit
def _online_softmax_block(q, k, v, valid, m, l, acc, scaling):
    """Fold one block of keys/values into the running (max, sum, weighted values).

    q [GP, DP], k/v [BLOCK_N, DP], valid [BLOCK_N]; every block holds >= 1 valid key, so the
    running max stays finite after it and exp(-inf - m) = 0 wipes the empty start.
    """
    s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scaling  # [GP, BLOCK_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l, acc


@triton.jit
def _window_rows(k_sink, k_ring, k_new, r, n_sink, n_ring, d, d_ok, D: tl.constexpr):
    """fp16 window rows r of the virtual sequence [sink rows, ring slots, new token] -> fp32.

    Each row comes from exactly one of the three masked loads (the others give 0).
    """
    dm = d_ok[None, :]
    in_sink = (r < n_sink)[:, None] & dm
    ring_r = r - n_sink
    in_ring = ((ring_r >= 0) & (ring_r < n_ring))[:, None] & dm
    is_new = (ring_r == n_ring)[:, None] & dm
    x = tl.load(k_sink + r[:, None] * D + d[None, :], mask=in_sink, other=0.0)
    x += tl.load(k_ring + ring_r[:, None] * D + d[None, :], mask=in_ring, other=0.0)
    x += tl.load(k_new + (ring_r - n_ring)[:, None] * D + d[None, :], mask=is_new, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _dequant_rows(
    codes_ptr, scale_ptr, zero_ptr, lev_ptr, rows, ok, d, d_ok,
    D: tl.constexpr, CD: tl.constexpr, BITS: tl.constexpr, UNIFORM: tl.constexpr, SCALE_KIND: tl.constexpr,
):
    """Unpack and dequantize body rows -> fp32 [BLOCK_N, DP]: zero + scale * level[code]."""
    NB: tl.constexpr = D * BITS // 8
    G: tl.constexpr = D // CD
    mask = ok[:, None] & d_ok[None, :]
    # Code i sits at bits [BITS*i, BITS*i + BITS) of the row's little-endian bit stream.
    bit = d * BITS
    byte = bit // 8
    base = codes_ptr + rows[:, None] * NB + byte[None, :]
    raw = tl.load(base, mask=mask, other=0).to(tl.int32)
    if BITS == 3:
        # A 3-bit code may straddle two bytes; the next byte supplies its high bits.
        nxt = mask & (byte + 1 < NB)[None, :]
        raw = raw | (tl.load(base + 1, mask=nxt, other=0).to(tl.int32) << 8)
    code = (raw >> (bit % 8)[None, :]) & (2**BITS - 1)
    if UNIFORM:
        level = code.to(tl.float32)
    else:
        # Lloyd-Max: look the level up in the 2**BITS-entry table with a select chain.
        level = tl.zeros(code.shape, tl.float32) + tl.load(lev_ptr)
        for j in tl.static_range(1, 2**BITS):
            level = tl.where(code == j, tl.load(lev_ptr + j), level)
    so = rows[:, None] * G + (d // CD)[None, :]
    if SCALE_KIND == 1:  # bf16 arrives as int16 bits: widen them into the top of an fp32
        scale = ((tl.load(scale_ptr + so, mask=mask, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        zero = ((tl.load(zero_ptr + so, mask=mask, other=0).to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    elif SCALE_KIND == 3:  # fp8 arrives as uint8 bits
        scale = _fp8_value(tl.load(scale_ptr + so, mask=mask, other=0))
        zero = _fp8_value(tl.load(zero_ptr + so, mask=mask, other=0))
    else:
        scale = tl.load(scale_ptr + so, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + so, mask=mask, other=0.0).to(tl.float32)
    return zero + scale * level


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [Hq, D] fp32, rotated with R_k
    ks_ptr, vs_ptr,  # sink [Hkv, s_cap, D] fp16
    kr_ptr, vr_ptr,  # recent ring [Hkv, w_cap, D] fp16
    kn_ptr, vn_ptr,  # the new token [Hkv, D] fp16
    kc_ptr, ksc_ptr, kz_ptr,  # K body: codes [Hkv, b_cap, D*K_BITS/8] u8, scale/zero [Hkv, b_cap, G]
    vc_ptr, vsc_ptr, vz_ptr,  # V body (or, with BODY_FP16, fp16 rows [Hkv, b_cap, D] in kc/vc)
    klev_ptr, vlev_ptr,  # fp32 levels [2**bits] (read only for Lloyd-Max)
    m_ptr, l_ptr, acc_ptr,  # partials [splits, Hq] and [splits, Hq, D], fp32
    n_sink, n_ring, n_body, rows_per_split,
    s_cap, w_cap, b_cap,
    scaling,
    HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CD: tl.constexpr,
    GROUP: tl.constexpr, GP: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_UNIFORM: tl.constexpr, V_UNIFORM: tl.constexpr,
    SCALE_KIND: tl.constexpr, BODY_FP16: tl.constexpr, BLOCK_N: tl.constexpr,
):
    G: tl.constexpr = D // CD
    KNB: tl.constexpr = D * K_BITS // 8
    VNB: tl.constexpr = D * V_BITS // 8
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    g_ok = g < GROUP
    d_ok = d < D
    heads = kvh * GROUP + g  # GQA: query heads kvh*GROUP .. kvh*GROUP+GROUP-1 share this KV head
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)

    if split == 0:
        # Split 0: the fp16 windows, read as one sequence: sink rows, ring slots, new token.
        # Key order does not matter for T = 1 (no mask), so the ring is read in slot order:
        # its first n_ring slots are exactly the cached ring tokens.
        ks, vs = ks_ptr + kvh * s_cap * D, vs_ptr + kvh * s_cap * D
        kr, vr = kr_ptr + kvh * w_cap * D, vr_ptr + kvh * w_cap * D
        kn, vn = kn_ptr + kvh * D, vn_ptr + kvh * D
        n_win = n_sink + n_ring + 1
        for r0 in range(0, n_win, BLOCK_N):
            r = r0 + tl.arange(0, BLOCK_N)
            k = _window_rows(ks, kr, kn, r, n_sink, n_ring, d, d_ok, D)
            v = _window_rows(vs, vr, vn, r, n_sink, n_ring, d, d_ok, D)
            m, l, acc = _online_softmax_block(q, k, v, r < n_win, m, l, acc, scaling)
    else:
        # Splits 1..: one slice of the body each, unpacked and dequantized in registers.
        start = (split - 1) * rows_per_split
        end = tl.minimum(start + rows_per_split, n_body)
        for r0 in range(start, end, BLOCK_N):
            rows = r0 + tl.arange(0, BLOCK_N)
            ok = rows < end
            if BODY_FP16:  # baseline for benchmarks: the same kernel over an fp16 body
                offs = kvh * b_cap * D + rows[:, None] * D + d[None, :]
                mask = ok[:, None] & d_ok[None, :]
                k = tl.load(kc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                v = tl.load(vc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                k = _dequant_rows(kc_ptr + kvh * b_cap * KNB, ksc_ptr + kvh * b_cap * G, kz_ptr + kvh * b_cap * G,
                                  klev_ptr, rows, ok, d, d_ok, D, CD, K_BITS, K_UNIFORM, SCALE_KIND)
                v = _dequant_rows(vc_ptr + kvh * b_cap * VNB, vsc_ptr + kvh * b_cap * G, vz_ptr + kvh * b_cap * G,
                                  vlev_ptr, rows, ok, d, d_ok, D, CD, V_BITS, V_UNIFORM, SCALE_KIND)
            m, l, acc = _online_softmax_block(q, k, v, ok, m, l, acc, scaling)

    po = split * HQ + heads
    tl.store(m_ptr + po, m, mask=g_ok)
    tl.store(l_ptr + po, l, mask=g_ok)
    tl.store(acc_ptr + po[:, None] * D + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_reduce_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, n_splits,
    HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr, HB: tl.constexpr,
):
    """Merge the splits of HB query heads: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s."""
    h = tl.program_id(0) * HB + tl.arange(0, HB)
    s = tl.arange(0, SP)
    d = tl.arange(0, DP)
    ok = (s[None, :] < n_splits) & (h < HQ)[:, None]  # [HB, SP]
    po = s[None, :] * HQ + h[:, None]
    m = tl.load(m_ptr + po, mask=ok, other=float("-inf"))
    l = tl.load(l_ptr + po, mask=ok, other=0.0)
    mx = tl.max(m, axis=1)  # finite for real heads: split 0 always holds the new token
    mx = tl.where(h < HQ, mx, 0.0)
    w = tl.where(ok, tl.exp(m - mx[:, None]), 0.0)  # an empty split has m = -inf and weight 0
    acc_mask = ok[:, :, None] & (d < D)[None, None, :]
    acc = tl.load(acc_ptr + po[:, :, None] * D + d[None, None, :], mask=acc_mask, other=0.0)
    den = tl.sum(w * l, axis=1)
    den = tl.where(h < HQ, den, 1.0)
    out = tl.sum(w[:, :, None] * acc, axis=1) / den[:, None]
    tl.store(out_ptr + h[:, None] * D + d[None, :], out, mask=(h < HQ)[:, None] & (d < D)[None, :])


def _nonempty(t: torch.Tensor) -> torch.Tensor:
    """Triton needs a real pointer even for a region of capacity 0 (it is never read)."""
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


def _levels_arg(levels, bits, device):
    """(fp32 levels on `device`, uniform?) without a host sync when they already live there.

    Levels already on the kernel's device are taken as validated (checking them would
    synchronize, which also breaks CUDA-graph capture); host levels are checked, then cached.
    """
    if levels is not None and levels.device == torch.device(device) and levels.dtype == torch.float32 \
            and levels.device.type != "cpu":
        return levels.contiguous(), False
    lv = uniform_levels(bits) if levels is None else check_levels(torch.as_tensor(levels).cpu(), bits)
    key = ("levels", bits, tuple(lv.tolist()), str(device))
    cached = _PARAMS_CACHE.get(key)
    if cached is None:
        cached = _PARAMS_CACHE[key] = lv.to(device)
    return cached, levels is None


def default_num_splits(n_body: int, kv_heads: int, device, min_rows: int = 256) -> int:
    """Body splits: about 4 programs per SM in all (decode is bandwidth-bound and needs many
    loads in flight), but at least `min_rows` rows each so the partials stay small."""
    if n_body == 0:
        return 0
    sms = 4 if interpreting() else torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(4 * sms, kv_heads), triton.cdiv(n_body, min_rows)))


def decode_attention(
    q: torch.Tensor,
    k_sink: torch.Tensor,
    v_sink: torch.Tensor,
    k_ring: torch.Tensor,
    v_ring: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_body,
    v_body,
    n_sink: int,
    n_ring: int,
    n_body: int,
    *,
    k_bits: int = 2,
    v_bits: int = 2,
    cluster_dim: int = 64,
    k_levels: torch.Tensor | None = None,
    v_levels: torch.Tensor | None = None,
    scaling: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Attention of one new token over one layer's cache, in the rotated space: fp32 [Hq, D].

    q [Hq, D] rotated (fp32/fp16); k_sink/v_sink [Hkv, s_cap, D] fp16 with the first n_sink rows
    valid; k_ring/v_ring [Hkv, w_cap, D] fp16 with the first n_ring slots valid; k_new/v_new
    [Hkv, D] fp16 (the token itself); k_body/v_body either (codes, scale, zero) with
    [Hkv, b_cap, ...] shapes and the first n_body rows valid, or an fp16 [Hkv, b_cap, D]
    tensor (benchmark baseline). `num_splits` is the number of body splits (default: enough
    programs to fill the device).
    """
    hq, d = q.shape
    hkv = k_new.shape[0]
    if hq % hkv:
        raise OscarInputError(f"q has {hq} heads: expected a multiple of kv_heads={hkv}")
    body_fp16 = isinstance(k_body, torch.Tensor)
    if body_fp16:
        kc, vc = k_body, v_body
        ksc = kz = vsc = vz = k_new  # unused placeholders
        scale_kind = 0
        b_cap = k_body.shape[1]
    else:
        (kc, ksc, kz), (vc, vsc, vz) = k_body, v_body
        b_cap = kc.shape[1]
        scale_names = {torch_scale_dtype(name): name for name in _SCALE_KIND}
        if ksc.dtype not in scale_names:
            raise OscarInputError(f"body scales are {ksc.dtype}: expected one of {KERNEL_SCALE_DTYPES} (the "
                                  f"Triton kernels' scale dtypes)")
        name = scale_names[ksc.dtype]
        scale_kind = _SCALE_KIND[name]
        if name in _RAW_BITS:
            ksc, kz, vsc, vz = (t.view(_RAW_BITS[name]) for t in (ksc, kz, vsc, vz))
        if kc.shape[-1] != packed_bytes(d, k_bits) or vc.shape[-1] != packed_bytes(d, v_bits):
            raise OscarInputError("body codes do not match head_dim, k_bits and v_bits")
    _check_device(q, k_sink, k_ring, k_new, kc)
    group = hq // hkv
    dp = _next_pow2(d)
    gp = max(_next_pow2(group), 2)
    block = block_n or (16 if not interpreting() else 32)
    if num_splits is None:
        num_splits = default_num_splits(n_body, hkv, q.device)
    num_splits = min(num_splits, triton.cdiv(n_body, block)) if n_body else 0
    rows_per_split = triton.cdiv(triton.cdiv(n_body, num_splits), block) * block if num_splits else block
    if num_splits:
        num_splits = triton.cdiv(n_body, rows_per_split)
    total = num_splits + 1  # split 0 holds the fp16 windows and the new token
    dev = q.device
    m = torch.empty(total, hq, dtype=torch.float32, device=dev)
    l = torch.empty(total, hq, dtype=torch.float32, device=dev)
    acc = torch.empty(total, hq, d, dtype=torch.float32, device=dev)
    out = torch.empty(hq, d, dtype=torch.float32, device=dev)
    klev, k_uniform = _levels_arg(k_levels, k_bits, dev)
    vlev, v_uniform = _levels_arg(v_levels, v_bits, dev)
    scaling = d**-0.5 if scaling is None else float(scaling)
    c = lambda t: _nonempty(t.contiguous())  # noqa: E731
    _decode_split_kernel[(hkv, total)](
        q.contiguous(), c(k_sink), c(v_sink), c(k_ring), c(v_ring), c(k_new), c(v_new),
        c(kc), c(ksc), c(kz), c(vc), c(vsc), c(vz), klev, vlev, m, l, acc,
        n_sink, n_ring, n_body, rows_per_split, k_sink.shape[1], k_ring.shape[1], b_cap, scaling,
        HQ=hq, D=d, DP=dp, CD=cluster_dim, GROUP=group, GP=gp, K_BITS=k_bits, V_BITS=v_bits,
        K_UNIFORM=k_uniform, V_UNIFORM=v_uniform, SCALE_KIND=scale_kind, BODY_FP16=body_fp16,
        BLOCK_N=block, num_warps=num_warps,
    )
    # One head per program on a GPU; on the interpreter every program costs, so take them all.
    hb = max(_next_pow2(hq), 2) if interpreting() else 1
    _decode_reduce_kernel[(triton.cdiv(hq, hb),)](
        m, l, acc, out, total, HQ=hq, D=d, DP=dp, SP=max(_next_pow2(total), 2), HB=hb
    )
    return out


def reference_decode_attention(
    q, k_sink, v_sink, k_ring, v_ring, k_new, v_new, k_body, v_body, n_sink, n_ring, n_body,
    *, k_bits=2, v_bits=2, cluster_dim=64, k_levels=None, v_levels=None, scaling=None, **_,
) -> torch.Tensor:
    """decode_attention in plain PyTorch (fp32), from the same tensors: the correctness oracle."""
    hq, d = q.shape
    hkv = k_new.shape[0]

    def keys(sink, ring, new, body, bits, levels):
        parts = [sink[:, :n_sink].float()]
        if n_body:
            if isinstance(body, torch.Tensor):
                parts.append(body[:, :n_body].float())
            else:
                codes, scale, zero = (t[:, :n_body] for t in body)
                lv = None if levels is None else levels.cpu()
                parts.append(dequantize(codes.cpu(), scale.cpu(), zero.cpu(), bits, cluster_dim, lv).to(q.device))
        parts += [ring[:, :n_ring].float(), new[:, None].float()]
        return torch.cat(parts, 1).repeat_interleave(hq // hkv, dim=0)

    kk = keys(k_sink, k_ring, k_new, k_body, k_bits, k_levels)
    vv = keys(v_sink, v_ring, v_new, v_body, v_bits, v_levels)
    scale = d**-0.5 if scaling is None else scaling
    scores = (q.float()[:, None, :] @ kk.transpose(-1, -2))[:, 0] * scale
    return torch.softmax(scores, dim=-1)[:, None, :].matmul(vv)[:, 0]


# ======================================================================================
# OscarKVCache integration
# ======================================================================================


def cache_decode_inputs(cache, layer: int) -> dict:
    """The decode_attention arguments that describe `layer` of an OscarKVCache as it is now."""
    cfg = cache.layer_configs[layer]
    n = cache.length[layer]
    s, w = cfg.sink, cfg.recent
    args = {
        "k_sink": cache.sink["k"][layer], "v_sink": cache.sink["v"][layer],
        "k_ring": cache.recent["k"][layer], "v_ring": cache.recent["v"][layer],
        "k_body": (cache.codes["k"][layer], cache.scale["k"][layer], cache.zero["k"][layer]),
        "v_body": (cache.codes["v"][layer], cache.scale["v"][layer], cache.zero["v"][layer]),
        "n_sink": min(s, n), "n_ring": min(w, max(n - s, 0)), "n_body": max(n - s - w, 0),
        "k_bits": cfg.k_bits, "v_bits": cfg.v_bits, "cluster_dim": cfg.cluster_dim,
        "k_levels": cache.levels["k"][layer], "v_levels": cache.levels["v"][layer],
    }
    return args


def triton_decode_attend(cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scaling: float | None = None, *, num_splits: int | None = None,
                         append: str = "reference") -> torch.Tensor:
    """`cache.attend(layer, q, k, v, scaling)` for one token (T = 1) with the Triton decode kernel.

    q [q_heads, 1, D], k/v [kv_heads, 1, D] post-RoPE. Returns fp32 [q_heads, 1, D] in the model's
    space, then appends the token: with `append="reference"` through the reference storage
    path, with `append="triton"` through triton_append (identical bytes).
    """
    if q.dim() != 3 or q.shape[1] != 1 or k.dim() != 3 or k.shape[1] != 1:
        raise OscarInputError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}: expected one token, (heads, 1, {cache.head_dim})"
        )
    if append == "triton":
        _check_nearest(cache)
    # Validation, rotation and fp16 rounding exactly as cache.attend does them.
    chunks = cache._rotated_chunks(layer, k, v)
    if q.shape[0] % cache.kv_heads or q.shape[2] != cache.head_dim:
        raise OscarInputError(
            f"q has shape {tuple(q.shape)}: expected (q_heads, 1, {cache.head_dim}) "
            f"with q_heads a multiple of {cache.kv_heads}"
        )
    check_finite("q", q)
    q_rot = cache.rotate("k", layer, q)[:, 0]
    out = decode_attention(
        q_rot, k_new=chunks["k"][:, 0], v_new=chunks["v"][:, 0], scaling=scaling, num_splits=num_splits,
        **cache_decode_inputs(cache, layer),
    )
    if append == "triton":
        cache._store(layer, chunks, quantize_pack)
    else:
        cache._store(layer, chunks)
    return cache.unrotate_values(layer, out[:, None, :])


def _check_nearest(cache) -> None:
    if cache.config.k_rounding != "nearest":
        raise OscarInputError(f"k_rounding={cache.config.k_rounding!r}: the Triton quantize kernel rounds K to the "
                              f"nearest level only: expected the reference append (append='reference')")


def triton_append(cache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """`cache.append(layer, k, v)` with the packed body written by the Triton quantize kernel."""
    _check_nearest(cache)
    cache._store(layer, cache._rotated_chunks(layer, k, v), quantize_pack)


__all__ = [
    "cache_decode_inputs",
    "decode_attention",
    "default_num_splits",
    "interpreting",
    "quantize_pack",
    "reference_decode_attention",
    "triton_append",
    "triton_decode_attend",
]

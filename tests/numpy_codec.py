"""An independent, element-by-element numpy port of docs/format.md, used to check the torch codec."""

from __future__ import annotations

import numpy as np

E4M3_MAX = 448.0


def e4m3(v) -> np.float32:
    """fp32 -> OCP fp8 E4M3 (no inf, largest 448, subnormal step 2^-9), round to nearest even, as an fp32 value.
    The step at |v| in [2^e, 2^(e+1)) is 2^(e-3); below 2^-6 it is 2^-9. np.round rounds halves to even."""
    v = float(v)
    if abs(v) > E4M3_MAX:
        raise OverflowError(v)
    e = np.frexp(abs(v))[1] - 1 if v else -6
    step = 2.0 ** (max(e, -6) - 3)
    return np.float32(np.round(v / step) * step)


# numpy has no fp8: its scales and zeros are kept as the fp32 values of the fp8 ones.
NP_SCALE = {"float16": np.float16, "float32": np.float32, "float8_e4m3fn": e4m3}
NP_SCALE_ARRAY = {"float8_e4m3fn": np.float32}


def quantize_vector(x, bits: int, cluster_dim: int, clip: float, levels=None, scale_dtype: str = "float16",
                    feedback=None):
    """One vector -> (packed bytes, scales, zeros), following the written rules literally. feedback [D, D]: the
    codes with error feedback (format.md section 3, step 5), channel by channel."""
    x = np.asarray(x, dtype=np.float32)
    n_levels = 2**bits
    lv = np.arange(n_levels, dtype=np.float32) if levels is None else np.asarray(levels, dtype=np.float32)
    thr = [np.float32((lv[j] + lv[j + 1]) * np.float32(0.5)) for j in range(n_levels - 1)]
    sdt = NP_SCALE[scale_dtype]
    codes, scales, zeros = [], [], []
    for g in range(len(x) // cluster_dim):
        grp = x[g * cluster_dim : (g + 1) * cluster_dim]
        lo, hi = np.float32(grp.min()), np.float32(grp.max())
        if clip < 1.0:
            mid = np.float32((hi + lo) * np.float32(0.5))
            half = np.float32((hi - lo) * np.float32(0.5 * clip))
            lo, hi = np.float32(mid - half), np.float32(mid + half)
        scale = sdt(np.float32(hi - lo) / np.float32(n_levels - 1))
        zero = sdt(lo)
        s, z = np.float32(scale), np.float32(zero)
        for value in grp:
            if s == 0:
                codes.append(0)
                continue
            u = np.float32(np.float32(value - z) / s)
            codes.append(sum(1 for t in thr if u > t))
        scales.append(scale)
        zeros.append(zero)
    if feedback is not None:
        codes = _codes_with_feedback(x, scales, zeros, cluster_dim, lv, thr, np.asarray(feedback, dtype=np.float32))
    bitstream = 0
    for i, c in enumerate(codes):
        bitstream |= c << (bits * i)
    packed = bitstream.to_bytes(len(codes) * bits // 8, "little")
    adt = NP_SCALE_ARRAY.get(scale_dtype, sdt)
    return np.frombuffer(packed, dtype=np.uint8), np.array(scales, dtype=adt), np.array(zeros, dtype=adt)


def unpack_vector(packed, bits: int, count: int) -> list[int]:
    stream = int.from_bytes(bytes(np.asarray(packed, dtype=np.uint8)), "little")
    return [(stream >> (bits * i)) & (2**bits - 1) for i in range(count)]


def _codes_with_feedback(x, scales, zeros, cluster_dim, lv, thr, feedback):
    """Step 5 with feedback: the running value w_i gets its code as above; its error, times the weight [i, j],
    is taken off every later w_j."""
    w = [np.float32(v) for v in x]
    codes = []
    for i in range(len(w)):
        s, z = np.float32(scales[i // cluster_dim]), np.float32(zeros[i // cluster_dim])
        code = 0 if s == 0 else sum(1 for t in thr if np.float32(np.float32(w[i] - z) / s) > t)
        codes.append(code)
        error = np.float32(w[i] - np.float32(z + np.float32(s * lv[code])))
        for j in range(i + 1, len(w)):
            w[j] = np.float32(w[j] - np.float32(error * feedback[i, j]))
    return codes

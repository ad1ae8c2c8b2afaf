"""An independent, element-by-element numpy port of docs/format.md, used to check the torch codec."""

from __future__ import annotations

import numpy as np

NP_SCALE = {"float16": np.float16, "float32": np.float32}


def quantize_vector(x, bits: int, cluster_dim: int, clip: float, levels=None, scale_dtype: str = "float16"):
    """One vector -> (packed bytes, scales, zeros), following the written rules literally."""
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
    bitstream = 0
    for i, c in enumerate(codes):
        bitstream |= c << (bits * i)
    packed = bitstream.to_bytes(len(codes) * bits // 8, "little")
    return np.frombuffer(packed, dtype=np.uint8), np.array(scales, dtype=sdt), np.array(zeros, dtype=sdt)


def unpack_vector(packed, bits: int, count: int) -> list[int]:
    stream = int.from_bytes(bytes(np.asarray(packed, dtype=np.uint8)), "little")
    return [(stream >> (bits * i)) & (2**bits - 1) for i in range(count)]

"""ctypes view of the native core's C API (runtime_ops/core/oscar_c_api.h), shared by the core tests and the
fuzz harness."""

from __future__ import annotations

import ctypes

import numpy as np

from native_cases import SCALE_DTYPES, Case

KERNELS = {"auto": 0, "dense": 1, "scalar": 2, "simd": 3}


class OscarAttentionConfig(ctypes.Structure):
    _fields_ = [("k_bits", ctypes.c_int32), ("v_bits", ctypes.c_int32), ("cluster_dim", ctypes.c_int32),
                ("sink", ctypes.c_int64), ("recent", ctypes.c_int64), ("k_clip", ctypes.c_float),
                ("v_clip", ctypes.c_float), ("scaling", ctypes.c_float), ("threads", ctypes.c_int32),
                ("kernel", ctypes.c_int32), ("k_rounding", ctypes.c_int32), ("scale_dtype", ctypes.c_int32)]


class NativeError(Exception):
    pass


class Core:
    """ctypes view of runtime_ops/core/oscar_c_api.h."""

    def __init__(self, path):
        self.lib = ctypes.CDLL(str(path))
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
        self.lib.oscar_quantize_pack.argtypes = [p, i64, i64, i32, i32, f32, p, p, i64, p, i64, p, p, i64, i32,
                                                 ctypes.c_char_p, ctypes.c_size_t]
        self.lib.oscar_attention.argtypes = [ctypes.POINTER(OscarAttentionConfig), ctypes.POINTER(i64),
                                             ctypes.POINTER(p), ctypes.POINTER(i64), i64, ctypes.c_char_p,
                                             ctypes.c_size_t]
        self.lib.oscar_simd_kernel_sets.restype = ctypes.c_char_p

    def simd_kernel_sets(self) -> list[str]:
        """The fused kernel sets this CPU runs, fastest first."""
        return [name for name in self.lib.oscar_simd_kernel_sets().decode().split(",") if name]

    def _check(self, rc, err):
        if rc:
            raise NativeError(err.value.decode())

    def quantize_pack(self, x: np.ndarray, bits, cluster_dim, clip=1.0, levels=None, feedback=None,
                      scale_dtype="float16"):
        """codes, scale, zero; fp8 scales and zeros as their uint8 bits."""
        x = np.ascontiguousarray(x, np.float32)
        rows, d = x.shape
        number, element = SCALE_DTYPES[scale_dtype]
        codes = np.zeros((rows, d * bits // 8), np.uint8)
        scale = np.zeros((rows, d // cluster_dim), element)
        zero = np.zeros_like(scale)
        lv = None if levels is None else np.ascontiguousarray(levels, np.float32)
        fb = None if feedback is None else np.ascontiguousarray(feedback, np.float32)
        err = ctypes.create_string_buffer(512)
        rc = self.lib.oscar_quantize_pack(x.ctypes.data, rows, d, bits, cluster_dim, clip,
                                          None if lv is None else lv.ctypes.data,
                                          None if fb is None else fb.ctypes.data, 0 if fb is None else fb.size,
                                          codes.ctypes.data, codes.size, scale.ctypes.data, zero.ctypes.data,
                                          scale.size, number, err, len(err))
        self._check(rc, err)
        return codes, scale, zero

    def attention(self, case: Case, cache: dict, q, k, v, length, threads=1, kernel="auto", dims=None):
        """One op call; cache (Case.empty_cache layout) is updated in place. Returns out [Hq, T, D].

        kernel: a KERNELS name, or a raw number (to test how a bad one is refused).
        """
        cfg = case.config
        c = OscarAttentionConfig(cfg.k_bits, cfg.v_bits, cfg.cluster_dim, cfg.sink, cfg.recent, cfg.k_clip,
                                 cfg.v_clip, case.scaling, threads, KERNELS.get(kernel, kernel),
                                 int(cache["k_feedback"].size > 0), SCALE_DTYPES[cfg.scale_dtype][0])
        out = np.zeros(q.shape, np.float32)
        buffers = [q, k, v, *cache.values(), out]
        assert all(b.flags.c_contiguous for b in buffers)
        if dims is None:
            dims = (q.shape[0], k.shape[0], q.shape[1], q.shape[2], cache["k_sink"].shape[1],
                    cache["k_recent"].shape[1], cache["k_scale"].shape[1])
        err = ctypes.create_string_buffer(512)
        rc = self.lib.oscar_attention(ctypes.byref(c), (ctypes.c_int64 * 7)(*dims),
                                      (ctypes.c_void_p * 17)(*[b.ctypes.data for b in buffers]),
                                      (ctypes.c_int64 * 17)(*[b.size for b in buffers]), length, err, len(err))
        self._check(rc, err)
        return out

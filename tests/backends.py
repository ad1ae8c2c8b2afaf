"""Adapters that run a native_cases.Case through each implementation of oscar::attention.

A Backend's attend(case, cache, q, k, v, length, **options) runs one chunk (rotated q fp32, k/v fp16,
contiguous) at cache position `length` and returns the output [q_heads, T, head_dim] fp32; it updates
`cache` in place, or returns (out, new cache) where the implementation is functional. `replay` feeds a
whole case through it. tests/ops/test_conformance.py replays the golden vectors through every entry of
BACKENDS; the backends' own test files replay random cases and check errors through the same adapters.

Runtimes are imported and built lazily: `missing()` says why one is unavailable, so a test can skip.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from native_cases import CACHE_INPUTS, OP_GOLDEN, GOLDEN, INDEX, KINDS, REGIONS, Case, rel_err
from native_core_api import Core
from oscar_export import OscarKVCache
from oscar_export.native import (EXECUTORCH_INVOKE, build_native, core_library_path, executorch_dir,
                                 ort_include_dir, ort_library_path)
from oscar_export.ops.attention import CACHE_NAMES, SCALE_NAMES, op_attributes


@dataclass(frozen=True)
class Backend:
    """One implementation of oscar::attention and how the golden vectors check it."""

    name: str
    attend: Callable
    tolerance: float  # the largest rel_err of an output against the reference's
    cases: tuple[str, ...] = tuple(GOLDEN)  # the golden cases it replays: fp16 scales unless it says more
    missing: Callable[[], str | None] = lambda: None  # why its runtime is unavailable here, or None
    options: dict = field(default_factory=dict)  # passed to attend
    new_cache: Callable[[Case], object] = Case.empty_cache
    final: Callable[[object], dict] = dict  # the cache in Case.final's layout


def replay(backend: Backend, case: Case, **options) -> tuple[float, dict]:
    """Every chunk of a case through a backend; returns the worst output rel_err and the final cache."""
    cache, length, worst = backend.new_cache(case), 0, 0.0
    for (q, k, v), want in zip(case.chunks, case.outputs):
        out = backend.attend(case, cache, *(np.ascontiguousarray(x) for x in (q, k, v)), length,
                             **{**backend.options, **options})
        if isinstance(out, tuple):
            out, cache = out
        assert out.shape == want.shape and out.dtype == np.float32, f"{backend.name}: out {out.dtype} {out.shape}"
        worst = max(worst, rel_err(out, want))
        length += q.shape[1]
    return worst, backend.final(cache)


@functools.cache
def _build_tools_missing() -> str | None:
    missing = [tool for tool in ("cmake", "g++") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} missing (Debian: apt-get install cmake g++)" if missing else None


def _not_importable(*modules: str) -> str | None:
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # an installed but broken runtime skips as well
            return f"{module} is not importable ({exc})"
    return None


# -- the native core through its C API (tests/native_core_api.py) -------------------------------------


@functools.cache
def native_core() -> Core:
    return Core(core_library_path())  # a build error fails the tests


def _native_attend(case, cache, q, k, v, length, kernel="auto", threads=1):
    return native_core().attention(case, cache, q, k, v, length, threads=threads, kernel=kernel)


# -- ONNX Runtime: the OscarAttention custom op in a one-node model ------------------------------------

ORT_INPUTS = ("q", "k_new", "v_new", *CACHE_INPUTS, "length")
_ORT_TYPES = {"q": "FLOAT", "k_levels": "FLOAT", "v_levels": "FLOAT", "k_feedback": "FLOAT", "k_codes": "UINT8", "v_codes": "UINT8",
              "length": "INT64"}  # the rest FLOAT16


@functools.cache
def _ort_missing() -> str | None:
    why = _not_importable("onnxruntime", "onnx") or _build_tools_missing()
    if why is None and ort_include_dir()[0] is None:
        why = f"no ONNX Runtime headers to build liboscar_ort.so: {ort_include_dir()[1]}"
    return why


def ort_model(attrs: dict, types: dict | None = None) -> bytes:
    """One OscarAttention node; inputs declared without shapes so the op's own checks answer."""
    from onnx import TensorProto, helper

    types = {**{name: getattr(TensorProto, t) for name, t in _ORT_TYPES.items()}, **(types or {})}
    inputs = [helper.make_tensor_value_info(name, types.get(name, TensorProto.FLOAT16), None) for name in ORT_INPUTS]
    node = helper.make_node("OscarAttention", list(ORT_INPUTS), ["out"], domain="oscar", **attrs)
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "oscar_attention", inputs, [out])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("oscar", 1)])
    m.ir_version = 8  # well inside what onnxruntime 1.32 reads
    return m.SerializeToString()


def ort_attributes(case: Case, threads: int = 1) -> dict:
    return dict(op_attributes(case.config, case.scaling), threads=threads)


class Sessions:
    """One InferenceSession per attribute set (shapes are dynamic)."""

    def __init__(self, library: str):
        self.library, self.cache = library, {}

    def get(self, attrs: dict, types: dict | None = None):
        import onnxruntime as ort

        key = (tuple(sorted(attrs.items())), tuple(sorted((types or {}).items())))
        if key not in self.cache:
            so = ort.SessionOptions()
            so.register_custom_ops_library(self.library)
            so.intra_op_num_threads = 1
            so.log_severity_level = 4  # errors are asserted on, not logged
            self.cache[key] = ort.InferenceSession(ort_model(attrs, types), so, providers=["CPUExecutionProvider"])
        return self.cache[key]


@functools.cache
def ort_sessions() -> Sessions:
    return Sessions(str(ort_library_path()))  # a build error fails the tests


def ort_run(session, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Bind every input as an OrtValue over its numpy buffer (no copy), as a host binds its persistent cache."""
    import onnxruntime as ort

    binding = session.io_binding()
    for name in ORT_INPUTS:
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(feeds[name]))
    binding.bind_output("out", "cpu")
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


def _ort_attend(case, cache, q, k, v, length, threads=1):
    from onnx import TensorProto

    feeds = dict(cache, q=q, k_new=k, v_new=v, length=np.array([length], np.int64))
    # fp8 scales and zeros travel as their uint8 bits
    types = {name: TensorProto.UINT8 for name in SCALE_NAMES} if cache["k_scale"].dtype == np.uint8 else None
    return ort_run(ort_sessions().get(ort_attributes(case, threads), types), feeds)


# -- ExecuTorch: oscar::attention.out from the operator registry, through the test hook ----------------

ET_NAMES = ("q", "k_new", "v_new", *CACHE_INPUTS, "length", "out")
# ExecuTorch ScalarType codes.
SCALAR_TYPES = {np.dtype(np.uint8): 0, np.dtype(np.int64): 4, np.dtype(np.float16): 5, np.dtype(np.float32): 6}


@functools.cache
def _et_missing() -> str | None:
    why = _not_importable("executorch.extension.pybindings.portable_lib") or _build_tools_missing()
    if why is None and executorch_dir()[0] is None:
        why = f"liboscar_executorch.so cannot be built: {executorch_dir()[1]}"
    return why


class Kernel:
    """oscar::attention.out as registered in ExecuTorch, called through the test hook."""

    def __init__(self, build_dir: Path):
        from oscar_export.targets.android.runner import kernel_error, load_kernels

        load_kernels(build_dir / "liboscar_executorch.so")
        self.error = kernel_error
        self.hook = ctypes.CDLL(str(build_dir / EXECUTORCH_INVOKE))
        p = ctypes.POINTER
        self.hook.oscar_et_invoke.argtypes = [p(ctypes.c_void_p), p(ctypes.c_int32), p(ctypes.c_int32),
                                              p(ctypes.c_int64), p(ctypes.c_int64), p(ctypes.c_double)]

    def __call__(self, feeds: dict[str, np.ndarray], attrs: tuple) -> np.ndarray:
        """Run on the buffers in `feeds` (cache written in place); raises with the kernel's message."""
        q = feeds["q"]
        out = np.full(q.shape if q.ndim == 3 else (1,), np.nan, np.float32)
        arrays = [feeds[name] for name in ET_NAMES[:-1]] + [out]
        for a in arrays:
            assert a.flags.c_contiguous
        n = len(arrays)
        ptrs = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
        dtypes = (ctypes.c_int32 * n)(*[SCALAR_TYPES[a.dtype] for a in arrays])
        ranks = (ctypes.c_int32 * n)(*[a.ndim for a in arrays])
        dims = (ctypes.c_int64 * (3 * n))(*[d for a in arrays for d in (list(a.shape) + [1, 1, 1])[:3]])
        ints = (ctypes.c_int64 * 8)(*attrs[:5], *attrs[8:])  # the schema's ints, then its floats
        floats = (ctypes.c_double * 3)(*attrs[5:8])
        rc = self.hook.oscar_et_invoke(ptrs, dtypes, ranks, dims, ints, floats)
        if rc:
            raise RuntimeError(f"error 0x{rc:x}: {self.error()}")
        return out


def et_attributes(case: Case) -> tuple:
    """The op's attributes in schema order, the clips rounded to fp32 as a program stores them."""
    attrs = op_attributes(case.config, case.scaling)
    attrs.update(k_clip=float(np.float32(attrs["k_clip"])), v_clip=float(np.float32(attrs["v_clip"])))
    return tuple(attrs.values())


@functools.cache
def et_kernel() -> Kernel:
    return Kernel(build_native())


def _et_attend(case, cache, q, k, v, length, kernel=None):
    """kernel: a Kernel of another build (the sanitized one); the default build's otherwise."""
    feeds = dict(cache, q=q, k_new=k, v_new=v, length=np.array([length], np.int64))
    return (kernel or et_kernel())(feeds, et_attributes(case))


# -- the torch op (oscar_export/ops/attention.py): in place, .out and functional ------------------------


def _torch_attend(case, cache, q, k, v, length, variant="inplace"):
    buffers = {name: torch.from_numpy(a) for name, a in cache.items()}  # views: the in-place variants write `cache`
    args = (*(torch.from_numpy(x) for x in (q, k, v)), *(buffers[n] for n in CACHE_NAMES), buffers["k_levels"],
            buffers["v_levels"], buffers["k_feedback"], torch.tensor([length]),
            *op_attributes(case.config, case.scaling).values())
    if variant == "functional":
        before = {n: cache[n].copy() for n in CACHE_NAMES}
        out, *updated = torch.ops.oscar.attention_functional(*args)
        assert all(np.array_equal(before[n], cache[n]) for n in CACHE_NAMES), "functional variant wrote its inputs"
        return out.numpy(), dict(cache, **{n: t.numpy() for n, t in zip(CACHE_NAMES, updated)})
    if variant == "out":
        out = torch.empty(q.shape)
        assert torch.ops.oscar.attention.out(*args, out=out) is out
        return out.numpy()
    return torch.ops.oscar.attention(*args).numpy()


# -- Triton decode kernels (interpreted on CPU) on a reference OscarKVCache ----------------------------


@functools.cache
def _triton_missing() -> str | None:
    why = _not_importable("triton")
    if why is None:
        from oscar_export.kernels.triton_oscar import interpreting

        if not interpreting():
            why = ("oscar_export.kernels.triton_oscar was imported without TRITON_INTERPRET=1: its kernels "
                   "are compiled for a GPU, not interpreted on CPU")
    return why


def _triton_cache(case: Case) -> OscarKVCache:
    """The reference cache in the case's own scale dtype: the kernels take every one the format has."""
    levels = {kind: None if case.config.codebook == "uniform" else torch.from_numpy(case.levels[kind])[None]
              for kind in KINDS}
    return OscarKVCache(case.config, 1, case.kv_heads, case.head_dim, case.max_context,
                        k_levels=levels["k"], v_levels=levels["v"],
                        k_feedback=None if case.feedback is None else torch.from_numpy(case.feedback)[None])


def _triton_final(cache: OscarKVCache) -> dict:
    def array(t: torch.Tensor):  # fp8 scales and zeros as their uint8 bits, as the vectors hold them
        return (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).numpy()

    return {f"{kind}_{region}": array(getattr(cache, region)[kind][0]) for kind in KINDS for region in REGIONS}


def _triton_attend(case, cache, q, k, v, length, append="reference"):
    from oscar_export.kernels.triton_oscar import triton_decode_attend

    assert int(cache.length[0]) == length
    q, k, v = torch.from_numpy(q), torch.from_numpy(k).float(), torch.from_numpy(v).float()
    if q.shape[1] > 1:  # the kernels decode one token: a prefill goes through the reference
        return cache.attend(0, q, k, v).numpy()
    return triton_decode_attend(cache, 0, q, k, v, append=append).numpy()


# -- the Core ML composition (oscar_export/ops/coreml.py): attention_rows + apply_rows -----------------


def _coreml_attend(case, cache, q, k, v, length):
    from oscar_export.ops.coreml import ROW_NAMES, apply_rows, attention_rows, fp8_word_count

    cfg = case.config
    # Core ML holds the codes as int32 words: views, so apply_rows writes `cache`. fp8 scales and zeros are padded
    # to whole words, so they are copied in and back.
    fp8 = [name for name in SCALE_NAMES if cfg.scale_dtype == "float8_e4m3fn"]
    words = {name: a.view(np.int32) if name.endswith("_codes") else a for name, a in cache.items()}
    for name in fp8:
        words[name] = np.zeros((len(cache[name]), fp8_word_count(*cache[name].shape[1:])), np.int32)
        words[name].view(np.uint8)[:, :cache[name][0].size] = cache[name].reshape(len(cache[name]), -1)
    out, *rows = attention_rows(
        *(torch.from_numpy(x) for x in (q, k, v)), *(torch.from_numpy(words[name]) for name in CACHE_NAMES),
        torch.from_numpy(cache["k_levels"]), torch.from_numpy(cache["v_levels"]), torch.from_numpy(cache["k_feedback"]),
        torch.tensor([length], dtype=torch.int32), *op_attributes(cfg, case.scaling).values())
    apply_rows(words, {name: r.numpy() for name, r in zip(ROW_NAMES, rows)}, length, cfg.sink, cfg.recent)
    for name in fp8:
        cache[name][...] = words[name].view(np.uint8)[:, :cache[name][0].size].reshape(cache[name].shape)
    return out.numpy()


# -- the pure-ONNX fallback function (oscar_export/ops/onnx.py make_fallback) under ONNX Runtime -------


@functools.cache
def _fallback_missing() -> str | None:
    return _not_importable("onnxruntime", "onnx")


def op_model(case: Case):
    """One OscarAttention node for a case's cache layout, as the laptop export writes it."""
    from onnx import TensorProto, helper

    from oscar_export.ops.attention import INPUTS
    from oscar_export.ops.onnx import DOMAIN, OP

    cache = case.empty_cache()
    types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
             np.dtype(np.uint8): TensorProto.UINT8}
    inputs = [helper.make_tensor_value_info(name, types[cache[name].dtype], cache[name].shape) if name in cache
              else helper.make_tensor_value_info(name, {"q": TensorProto.FLOAT, "length": TensorProto.INT64}.get(
                  name, TensorProto.FLOAT16), None) for name in INPUTS]
    node = helper.make_node(OP, list(INPUTS), ["out"], domain=DOMAIN, **op_attributes(case.config, case.scaling))
    graph = helper.make_graph([node], "one", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)])


def _fallback_session(case: Case):
    """One OscarAttentionFunctional node (through make_fallback) for a case's cache layout."""
    import onnxruntime as ort

    from oscar_export.ops.onnx import make_fallback

    model = make_fallback(op_model(case))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


_fallback_sessions: dict = {}  # the session of the case being replayed


def _fallback_attend(case, cache, q, k, v, length):
    key = (case.config, case.kv_heads, case.head_dim, case.max_context)  # all the session's graph depends on
    if key not in _fallback_sessions:
        _fallback_sessions.clear()
        _fallback_sessions[key] = _fallback_session(case)
    out, *updated = _fallback_sessions[key].run(None, dict(cache, q=q, k_new=k, v_new=v,
                                                            length=np.array([length], np.int64)))
    return out, dict(cache, **dict(zip(CACHE_NAMES, updated)))


# The Triton quantize kernel rounds K to the nearest level only (tests/kernels/test_triton.py checks the refusal):
# every other nearest case appends through it, every remaining case through the reference.
TRITON_CASES = tuple(sorted(INDEX["cases"]))
NEAREST = tuple(name for name in TRITON_CASES if INDEX["cases"][name]["config"].get("k_rounding", "nearest") == "nearest")
TRITON_APPENDS = NEAREST[1::2]

BACKENDS = (
    # Tolerances as each backend's own tests had them. The native core (runtime_ops/core), also under the
    # ONNX Runtime and ExecuTorch adapters, sums in another order than the reference.
    *(Backend(f"native-{kernel}", _native_attend, 1e-3, cases=tuple(OP_GOLDEN), missing=_build_tools_missing,
              options=dict(kernel=kernel, threads=2 if kernel == "scalar" else 1))
      for kernel in ("dense", "scalar", "auto")),
    Backend("onnxruntime", _ort_attend, 1e-3, cases=tuple(OP_GOLDEN), missing=_ort_missing, options=dict(threads=0)),
    Backend("executorch", _et_attend, 1e-3, cases=tuple(OP_GOLDEN), missing=_et_missing),
    # The reference itself, wrapped around the caller's buffers.
    *(Backend(f"torch-{variant}", _torch_attend, 1e-5, cases=tuple(OP_GOLDEN), options=dict(variant=variant))
      for variant in ("inplace", "out", "functional")),
    # Every vector case once, through one of the two storage paths, as the interpreter takes seconds a case.
    *(Backend(f"triton-{append}-append", _triton_attend, 2e-4, cases=cases, missing=_triton_missing,
              options=dict(append=append), new_cache=_triton_cache, final=_triton_final)
      for append, cases in (("reference", tuple(c for c in TRITON_CASES if c not in TRITON_APPENDS)),
                            ("triton", TRITON_APPENDS))),
    Backend("coreml-rows", _coreml_attend, 1e-4, cases=tuple(OP_GOLDEN)),
    Backend("onnx-fallback", _fallback_attend, 1e-4, cases=tuple(OP_GOLDEN), missing=_fallback_missing),
)
BACKEND = {backend.name: backend for backend in BACKENDS}

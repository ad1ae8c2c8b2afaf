"""The ExecuTorch kernel oscar::attention.out (runtime_ops/executorch/oscar_et.cc).

liboscar_executorch.so is loaded into the ExecuTorch runtime of the pybindings (RTLD_GLOBAL), and
the test hook liboscar_et_invoke.so calls the kernel found in ExecuTorch's operator registry on
numpy buffers: the cache buffers must be updated in place, bit-exact with the reference. The
same replay runs against an AddressSanitizer + UBSan build in a child process.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from native_cases import CACHE_INPUTS, GOLDEN, Case, assert_final_cache, golden_case, random_case, rel_err, same_bits

pytest.importorskip("executorch.extension.pybindings.portable_lib")

from oscar_export.native import EXECUTORCH_INVOKE, build_native, executorch_dir  # noqa: E402

if shutil.which("cmake") is None or shutil.which("g++") is None:
    pytest.skip("liboscar_executorch.so needs cmake and g++ (Debian: apt-get install cmake g++)",
                allow_module_level=True)
if executorch_dir()[0] is None:
    pytest.skip(f"liboscar_executorch.so cannot be built: {executorch_dir()[1]}", allow_module_level=True)

RANDOM_CASES = 1000
NAMES = ("q", "k_new", "v_new", *CACHE_INPUTS, "length", "out")
# ExecuTorch ScalarType codes.
SCALAR_TYPES = {np.dtype(np.uint8): 0, np.dtype(np.int64): 4, np.dtype(np.float16): 5, np.dtype(np.float32): 6}


@pytest.fixture(autouse=True, scope="module")
def single_threaded_reference():
    """The reference works on tiny tensors: one torch thread avoids OpenMP spin-waits on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Kernel:
    """oscar::attention.out as registered in ExecuTorch, called through the test hook."""

    def __init__(self, build_dir: Path):
        from oscar_export.export.et_runner import kernel_error, load_kernels

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
        arrays = [feeds[name] for name in NAMES[:-1]] + [out]
        for a in arrays:
            assert a.flags.c_contiguous
        n = len(arrays)
        ptrs = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
        dtypes = (ctypes.c_int32 * n)(*[SCALAR_TYPES[a.dtype] for a in arrays])
        ranks = (ctypes.c_int32 * n)(*[a.ndim for a in arrays])
        dims = (ctypes.c_int64 * (3 * n))(*[d for a in arrays for d in (list(a.shape) + [1, 1, 1])[:3]])
        ints = (ctypes.c_int64 * 5)(*attrs[:5])
        floats = (ctypes.c_double * 3)(*attrs[5:])
        rc = self.hook.oscar_et_invoke(ptrs, dtypes, ranks, dims, ints, floats)
        if rc:
            raise RuntimeError(f"error 0x{rc:x}: {self.error()}")
        return out


def attributes(case: Case) -> tuple:
    cfg = case.config
    return (cfg.k_bits, cfg.v_bits, cfg.cluster_dim, cfg.sink, cfg.recent, float(np.float32(cfg.k_clip)),
            float(np.float32(cfg.v_clip)), case.scaling)


def replay(kernel: Kernel, case: Case) -> tuple[float, dict]:
    cache, length, worst = case.empty_cache(), 0, 0.0
    for (q, k, v), want in zip(case.chunks, case.outputs):
        feeds = dict(cache, q=np.ascontiguousarray(q), k_new=np.ascontiguousarray(k), v_new=np.ascontiguousarray(v),
                     length=np.array([length], np.int64))
        worst = max(worst, rel_err(kernel(feeds, attributes(case)), want))
        length += q.shape[1]
    return worst, cache


@pytest.fixture(scope="module")
def kernel():
    return Kernel(build_native())


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_replay(kernel, name):
    case = golden_case(name)
    worst, cache = replay(kernel, case)
    assert worst <= 1e-3, f"{name}: attention relative error {worst:.3g}"
    assert_final_cache(case, cache)


def test_random_cases_match_the_reference(kernel):
    rng = np.random.default_rng(2024)
    worst = 0.0
    for i in range(RANDOM_CASES):
        case = random_case(rng, i)
        err, cache = replay(kernel, case)
        assert err <= 1e-3, f"{case.name} ({case.config}): relative error {err:.3g}"
        assert_final_cache(case, cache)
        worst = max(worst, err)
    print(f"{RANDOM_CASES} random cases through the ExecuTorch kernel: max relative error {worst:.3g}")


# -- bad input: an error through the kernel context, never a crash or a write -------------------


@pytest.fixture
def golden_feeds():
    case = golden_case(GOLDEN[0])
    q, k, v = (np.ascontiguousarray(x) for x in case.chunks[0])
    return case, dict(case.empty_cache(), q=q, k_new=k, v_new=v, length=np.array([0], np.int64))


def expect_error(kernel, case, feeds, pattern):
    before = {name: a.copy() for name, a in feeds.items()}
    with pytest.raises(RuntimeError, match=pattern):
        kernel(feeds, attributes(case))
    for name in CACHE_INPUTS:  # nothing was written
        assert same_bits(feeds[name], before[name]), name


def test_capacity_exceeded(kernel, golden_feeds):
    case, feeds = golden_feeds
    feeds["length"] = np.array([case.max_context - 1], np.int64)
    expect_error(kernel, case, feeds, "cache capacity exceeded")


def test_wrong_shape_rank_and_dtype(kernel, golden_feeds):
    case, feeds = golden_feeds
    expect_error(kernel, case, dict(feeds, k_scale=feeds["k_scale"][:, 1:].copy()),
                 r"input 'k_scale' has shape .* expected")
    expect_error(kernel, case, dict(feeds, v_codes=feeds["v_codes"][0].copy()),
                 r"input 'v_codes' has shape .* expected")
    expect_error(kernel, case, dict(feeds, k_sink=feeds["k_sink"][0].copy()), r"input 'k_sink' .* expected rank 3")
    expect_error(kernel, case, dict(feeds, v_new=feeds["v_new"][:, :1].copy()), r"input 'v_new' has shape")
    expect_error(kernel, case, dict(feeds, length=np.array([0, 1], np.int64)), r"input 'length' has shape")
    expect_error(kernel, case, dict(feeds, k_levels=np.array([0, 2, 1, 3], np.float32)), "k_levels=.*ascending")
    expect_error(kernel, case, dict(feeds, k_scale=feeds["k_scale"].astype(np.float32)),
                 r"input 'k_scale' has dtype float32: expected float16")
    expect_error(kernel, case, dict(feeds, q=feeds["q"].astype(np.float16)), r"input 'q' has dtype float16")
    expect_error(kernel, case, dict(feeds, length=np.array([0], np.float32)), r"input 'length' has dtype")
    with pytest.raises(RuntimeError, match="cluster_dim=48"):
        kernel(feeds, (2, 2, 48, case.config.sink, case.config.recent, 1.0, 1.0, case.scaling))


# -- AddressSanitizer + UBSan: the same replays in a child process with libasan preloaded --------


def _runtime_library(name: str) -> str | None:
    out = subprocess.run(["g++", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return out if out and os.path.isabs(out) and os.path.exists(out) else None


SANITIZED_REPLAY = """
import json, sys
from pathlib import Path
import numpy as np
sys.path.insert(0, sys.argv[2])
from native_cases import GOLDEN, golden_case, random_case, assert_final_cache
from test_et_ops import Kernel, replay
kernel = Kernel(Path(sys.argv[1]))
worst = 0.0
cases = [golden_case(n) for n in GOLDEN]
rng = np.random.default_rng(5)
cases += [random_case(rng, i) for i in range(int(sys.argv[3]))]
for case in cases:
    err, cache = replay(kernel, case)
    assert err <= 1e-3, (case.name, err)
    assert_final_cache(case, cache)
    worst = max(worst, err)
print(json.dumps({"cases": len(cases), "worst": worst}))
"""


def test_sanitized_build_replays_cases():
    asan, cxx = _runtime_library("libasan.so"), _runtime_library("libstdc++.so")
    if asan is None or cxx is None:
        pytest.skip("no libasan.so or libstdc++.so next to g++: the sanitizer build cannot be preloaded into Python")
    build = build_native(sanitize=True)
    # libstdc++ too: Python does not link it, and ASan's exception interceptor needs it from the start.
    env = dict(os.environ, LD_PRELOAD=f"{asan} {cxx}", ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SANITIZED_REPLAY, str(build), str(Path(__file__).parent), "100"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["cases"] == len(GOLDEN) + 100 and result["worst"] <= 1e-3


def test_adapter_compiles_for_aarch64(tmp_path):
    """The wheel holds only x86-64 runtime libraries, so an arm64 build of the adapter cannot be linked or
    run here; its object file must still build (the core's NEON path runs under qemu in test_native_core)."""
    cxx = shutil.which("aarch64-linux-gnu-g++")
    if cxx is None:
        pytest.skip("aarch64-linux-gnu-g++ not found (Debian: g++-aarch64-linux-gnu)")
    include = executorch_dir()[0] / "include"
    source = Path(__file__).resolve().parent.parent / "runtime_ops" / "executorch" / "oscar_et.cc"
    proc = subprocess.run([cxx, "-std=c++17", "-O2", "-fPIC", "-Wall", "-Werror", "-c", str(source), "-o",
                           str(tmp_path / "oscar_et.o"), "-DC10_USING_CUSTOM_GENERATED_MACROS", f"-I{include}",
                           f"-I{include}/executorch/runtime/core/portable_type/c10"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "oscar_et.o").stat().st_size > 0

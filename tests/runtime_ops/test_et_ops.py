"""The ExecuTorch kernel oscar::attention.out (runtime_ops/executorch/oscar_et.cc).

liboscar_executorch.so is loaded into the ExecuTorch runtime of the pybindings (RTLD_GLOBAL), and
the test hook liboscar_et_invoke.so calls the kernel found in ExecuTorch's operator registry on
numpy buffers: the cache buffers must be updated in place, bit-exact with the reference. The
same replay runs against an AddressSanitizer + UBSan build in a child process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backends import BACKEND, et_attributes, et_kernel, replay
from native_cases import CACHE_INPUTS, GOLDEN, assert_final_cache, golden_case, random_case, same_bits

pytest.importorskip("executorch.extension.pybindings.portable_lib")

from oscar_export.native import build_native, executorch_dir  # noqa: E402
from oscar_export.ops.attention import ATTRIBUTES, SCALE_NAMES  # noqa: E402

if shutil.which("cmake") is None or shutil.which("g++") is None:
    pytest.skip("liboscar_executorch.so needs cmake and g++ (Debian: apt-get install cmake g++)",
                allow_module_level=True)
if executorch_dir()[0] is None:
    pytest.skip(f"liboscar_executorch.so cannot be built: {executorch_dir()[1]}", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("single_threaded")
RANDOM_CASES = 1000


@pytest.fixture(scope="module")
def kernel():
    return et_kernel()


def test_random_cases_match_the_reference(kernel):
    rng = np.random.default_rng(2024)
    worst = 0.0
    for i in range(RANDOM_CASES):
        case = random_case(rng, i)
        err, cache = replay(BACKEND["executorch"], case, kernel=kernel)
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
        kernel(feeds, et_attributes(case))
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
        attrs = et_attributes(case)
        kernel(feeds, (*attrs[:2], 48, *attrs[3:]))


def test_the_format_comes_from_the_arguments(kernel, golden_feeds):
    """Buffers that disagree with the codebook, k_rounding or scale_dtype argument are refused, not read as the
    format they look like."""
    case, feeds = golden_feeds
    h, d = case.kv_heads, case.head_dim
    attrs = dict(zip(ATTRIBUTES, et_attributes(case)))

    def refused(feeds, pattern, **wrong):
        before = {name: a.copy() for name, a in feeds.items()}
        with pytest.raises(RuntimeError, match=pattern):
            kernel(feeds, tuple(dict(attrs, **wrong).values()))
        assert all(same_bits(feeds[name], before[name]) for name in CACHE_INPUTS)

    refused(feeds, r"input 'k_scale' has dtype float16: expected uint8 \(fp8 E4M3 bits\), as argument scale_dtype=1",
            scale_dtype=1)
    refused(dict(feeds, **{name: np.zeros(feeds[name].shape, np.uint8) for name in SCALE_NAMES}),
            r"input 'k_scale' has dtype uint8: expected float16, as argument scale_dtype=0 says")
    refused(feeds, rf"input 'k_feedback' has shape \[0\]: expected \[{h}, {d}, {d}\]", k_rounding=1)
    refused(dict(feeds, k_feedback=np.zeros((h, d, d), np.float32)),
            rf"input 'k_feedback' has shape \[{h}, {d}, {d}\]: expected \[0\]")
    refused(dict(feeds, v_levels=np.array([0, 0.5, 2, 3], np.float32)),
            r"v_levels\[1\] is 0.5: expected the uniform levels 0 .. 3 with codebook 0")
    refused(feeds, "codebook=2: expected 0 \\(uniform\\) or 1", codebook=2)
    kernel(dict(feeds), tuple(dict(attrs, codebook=1).values()))  # Lloyd-Max: any ascending levels, these too


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
from backends import BACKEND, Kernel, replay
kernel = Kernel(Path(sys.argv[1]))
worst = 0.0
cases = [golden_case(n) for n in GOLDEN]
rng = np.random.default_rng(5)
cases += [random_case(rng, i) for i in range(int(sys.argv[3]))]
for case in cases:
    err, cache = replay(BACKEND["executorch"], case, kernel=kernel)
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
    tests = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", SANITIZED_REPLAY, str(build), str(tests), "100"],
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
    source = Path(__file__).resolve().parents[2] / "runtime_ops" / "executorch" / "oscar_et.cc"
    proc = subprocess.run([cxx, "-std=c++17", "-O2", "-fPIC", "-Wall", "-Werror", "-c", str(source), "-o",
                           str(tmp_path / "oscar_et.o"), "-DC10_USING_CUSTOM_GENERATED_MACROS", f"-I{include}",
                           f"-I{include}/executorch/runtime/core/portable_type/c10"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "oscar_et.o").stat().st_size > 0


THREAD_CAP = """
import ctypes, os, sys
import torch
from oscar_export.config import OscarConfig
from oscar_export.bench.et_attention import oscar_step
from oscar_export.targets.android.runner import load_kernels, set_threads

def tasks():
    return len(os.listdir("/proc/self/task"))

lib = load_kernels()
set_threads(1)
_, loaded, inputs = oscar_step(OscarConfig(), 16384, 4, 2, 64, torch.Generator().manual_seed(0))
method = loaded[-1]
method(inputs)
capped = tasks()
method(inputs)
assert tasks() == capped, ("capped at one thread, a decode step started threads", capped, tasks())
lib.oscar_executorch_set_threads(ctypes.c_int32(0))
method(inputs)
print("threads", capped, tasks())
assert tasks() > capped, ("uncapped, the same step should start the core's workers", capped, tasks())
"""


def test_thread_cap_keeps_the_kernel_on_the_hosts_threads():
    """A host that sizes ExecuTorch's pool to N caps the kernel at N too (targets.android.runner.set_threads): capped at one
    thread, a 16K-token decode step starts no thread; uncapped, the same step starts the core's workers. In a
    fresh process, since the workers start once per process."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the kernel starts no worker either way, so the cap cannot be observed")
    proc = subprocess.run([sys.executable, "-c", THREAD_CAP], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]

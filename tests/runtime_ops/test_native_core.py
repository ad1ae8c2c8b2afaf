"""The native C++ core (runtime_ops/core) against the reference, through its C ABI (ctypes).

Also runs runtime_ops/tests/core_test.cc three ways: natively, built with AddressSanitizer +
UndefinedBehaviorSanitizer, and cross-built for aarch64 under qemu-aarch64 (the NEON kernels).
Needs cmake and g++; the aarch64 test needs the Debian packages g++-aarch64-linux-gnu and qemu-user.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from backends import BACKEND, native_core, replay
from native_cases import (OP_GOLDEN, INDEX, VECTORS, assert_final_cache, as_numpy, export_for_core_test,
                          golden_case, random_case, same_bits)
from native_core_api import NativeError
from oscar_export.codec import quantize
from oscar_export.native import CORE_TEST, build_native

if shutil.which("cmake") is None or shutil.which("g++") is None:
    pytest.skip("the native core needs cmake and g++ (Debian: apt-get install cmake g++)", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("single_threaded")
RANDOM_CASES = 1000
NATIVE = BACKEND["native-auto"]


@pytest.fixture(scope="module")
def core():
    return native_core()


# -- golden vectors (the op's replays: tests/ops/test_conformance.py) --------------------------------


@pytest.mark.parametrize("name", OP_GOLDEN)
def test_quantize_pack_matches_golden_codec(core, name):
    meta = INDEX["cases"][name]
    t = load_file(str(VECTORS / meta["file"]))
    levels = t["cache.k_levels"][0].numpy() if meta["config"]["codebook"] == "lloyd-max" else None
    # The codec vectors of a feedback case use layer 0's weights of KV head 0 (tests/vectors/make_vectors.py).
    feedback = t["cache.k_feedback"][0, 0].numpy() if meta["config"].get("k_rounding") == "feedback" else None
    codes, scale, zero = core.quantize_pack(t["codec.input"].numpy(), meta["codec_bits"],
                                            meta["config"]["cluster_dim"], meta["codec_clip"], levels, feedback,
                                            meta["config"]["scale_dtype"])
    assert same_bits(codes, t["codec.codes"].numpy())
    assert same_bits(scale, as_numpy(t["codec.scale"]))
    assert same_bits(zero, as_numpy(t["codec.zero"]))


# -- randomized ---------------------------------------------------------------------------------


def test_quantize_pack_random_matches_codec(core):
    rng = np.random.default_rng(7)
    for _ in range(300):
        bits, cluster_dim = int(rng.choice([2, 3, 4])), int(rng.choice([32, 64, 128]))
        d = cluster_dim * int(rng.integers(1, 3))
        clip = float(rng.choice([1.0, 0.96, 0.5]))
        scale_dtype = str(rng.choice(["float16", "float8_e4m3fn"]))
        # |x| stays inside fp16's range; fp8's reaches its subnormals (below 2^-6) and stays under 448
        magnitude = np.float32(10.0 ** (rng.uniform(-4, 3.5) if scale_dtype == "float16" else rng.uniform(-4, 2)))
        x = rng.standard_normal((int(rng.integers(1, 9)), d), dtype=np.float32) * magnitude
        x = x.astype(np.float16).astype(np.float32) if rng.random() < 0.5 else x  # window values are fp16
        levels = np.sort(rng.uniform(0, 2**bits - 1, 2**bits)).astype(np.float32) if rng.random() < 0.3 else None
        if levels is not None and (np.diff(levels) <= 0).any():
            continue
        # Error-feedback weights of calibration's size (strictly upper, about 1) in a third of the draws.
        feedback = np.triu(rng.standard_normal((d, d), dtype=np.float32) * 0.3, 1) if rng.random() < 0.3 else None
        ref_levels = None if levels is None else torch.from_numpy(levels)
        want = quantize(torch.from_numpy(x), bits, cluster_dim, clip, ref_levels, scale_dtype,
                        feedback=None if feedback is None else torch.from_numpy(feedback))
        got = core.quantize_pack(x, bits, cluster_dim, clip, levels, feedback, scale_dtype)
        for g, w in zip(got, want):
            assert same_bits(g, as_numpy(w))


def test_random_cases_match_the_reference():
    """RANDOM_CASES small sequences: bits, groups, clip, Lloyd-Max, windows incl. 0, GQA, T = 1 and T > 1."""
    rng = np.random.default_rng(2024)
    start, worst, chunks = time.perf_counter(), 0.0, 0
    for i in range(RANDOM_CASES):
        case = random_case(rng, i, scale_dtypes=("float16", "float8_e4m3fn"))
        kernel = ("auto", "dense", "scalar", "simd")[i % 4]
        err, cache = replay(NATIVE, case, kernel=kernel, threads=1 + i % 2)
        assert err <= 1e-3, f"{case.name} ({case.config}, kernel {kernel}): relative error {err:.3g}"
        assert_final_cache(case, cache)
        worst, chunks = max(worst, err), chunks + len(case.chunks)
    print(f"{RANDOM_CASES} random cases, {chunks} op calls: max relative error {worst:.3g} "
          f"in {time.perf_counter() - start:.1f} s")


def test_long_chunks_cross_the_query_tiles():
    """Prefill chunks longer than the dense path's 64-token query tiles and key blocks."""
    rng = np.random.default_rng(5)
    for i in range(8):
        case = random_case(rng, i, max_context=200, max_chunk=150, scale_dtypes=("float16", "float8_e4m3fn"))
        err, cache = replay(NATIVE, case, threads=2)
        assert err <= 1e-3, f"{case.name} ({case.config}): relative error {err:.3g}"
        assert_final_cache(case, cache)


# -- bad input ------------------------------------------------------------------------------------


def test_bad_input_is_an_error_and_writes_nothing(core):
    case = golden_case(OP_GOLDEN[0])
    q, k, v = (np.ascontiguousarray(x) for x in case.chunks[0])
    cache = case.empty_cache()
    before = {name: a.copy() for name, a in cache.items()}
    with pytest.raises(NativeError, match="cache capacity exceeded"):
        core.attention(case, cache, q, k, v, length=case.max_context - 1)
    with pytest.raises(NativeError, match="k_codes has .* elements: expected"):
        bad = dict(cache, k_codes=np.zeros(cache["k_codes"].size - 1, np.uint8))
        core.attention(case, bad, q, k, v, length=0)
    with pytest.raises(NativeError, match="q contains NaN"):
        q_nan = q.copy()
        q_nan[0, 0, 0] = np.nan
        core.attention(case, cache, q_nan, k, v, length=0)
    with pytest.raises(NativeError, match="kernel=9"):
        core.attention(case, cache, q, k, v, length=0, kernel=9)
    weights = np.zeros((case.kv_heads, case.head_dim, case.head_dim), np.float32)
    with pytest.raises(NativeError, match=f"k_feedback has 10 elements: expected {weights.size}"):
        core.attention(case, dict(cache, k_feedback=weights.ravel()[:10].copy()), q, k, v, length=0)
    weights[1, 2, 3] = np.nan
    with pytest.raises(NativeError, match="k_feedback holds nan at .*: expected finite weights"):
        core.attention(case, dict(cache, k_feedback=weights), q, k, v, length=0)
    for name, a in cache.items():
        assert same_bits(a, before[name]), f"a failed call changed {name}"
    with pytest.raises(NativeError, match="cluster_dim=48"):
        core.quantize_pack(np.zeros((1, 96), np.float32), 2, 48)
    with pytest.raises(NativeError, match="scale_dtype=float16"):
        core.quantize_pack(np.full((1, 64), 1e30, np.float32) * np.arange(64, dtype=np.float32), 2, 64)
    with pytest.raises(NativeError, match=r"input row 1 exceeds the range of scale_dtype=float8_e4m3fn \(max 448\)"):
        core.quantize_pack(np.array([[0.0] * 63 + [1.0], [-449.0] + [0.0] * 63], np.float32), 2, 64,
                           scale_dtype="float8_e4m3fn")
    with pytest.raises(NativeError, match="feedback has 64 elements: expected 4096"):
        core.quantize_pack(np.zeros((1, 64), np.float32), 2, 64, feedback=np.zeros(64, np.float32))
    with pytest.raises(NativeError, match="k_feedback holds 100 at 5: expected finite weights"):
        weights = np.zeros((64, 64), np.float32)
        weights.flat[5] = 100
        core.quantize_pack(np.zeros((1, 64), np.float32), 2, 64, feedback=weights)


# -- the C++ test executable: native, sanitizers, aarch64 -------------------------------------


@pytest.fixture(scope="module")
def golden_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    return [str(export_for_core_test(golden_case(name), root / name)) for name in OP_GOLDEN]


def run_core_test(cmd: list[str], env=None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    print(output[-2000:])
    return output


def simd_sets() -> list[str]:
    """The fused kernel sets this CPU runs, fastest first (the core's own answer)."""
    return native_core().simd_kernel_sets()


def test_core_test_executable(golden_dirs):
    build = build_native()
    out = run_core_test([str(build / CORE_TEST), "--random", "300", *golden_dirs])
    assert "OK: 0 failure(s)" in out
    sets = simd_sets()
    if sets:
        assert f"(simd on: {sets[0]})" in out  # the fastest set runs unless OSCAR_SIMD says otherwise
    # The sets whose scores differ in structure from the AVX2 set's; the AVX-512 set's values are 16-bit fixed
    # point, held to their error bound (core_test.cc, fixed_point_bound).
    if "avxvnni" in sets:
        assert "kernel sets: avxvnni equals avx2 bit for bit on 300 random body blocks" in out
    if "avx512" in sets:
        assert re.search(r"kernel sets: avx512 equals avx2 bit for bit in scores and softmax, values within "
                         r"[0-9.e-]+ of the fixed-point bound, on 300 random body blocks", out)


def test_each_kernel_set_on_the_golden_vectors(golden_dirs):
    """OSCAR_SIMD picks each set this CPU runs (an AVX-512 machine may also run the AVX-VNNI and AVX2 sets: test
    every one)."""
    sets = simd_sets()
    if len(sets) < 2:
        pytest.skip(f"this CPU runs one fused kernel set ({sets[0] if sets else 'none'}): nothing to pick; the "
                    "AVX-VNNI set needs AVX-VNNI, the AVX-512 set AVX-512 F, BW, VL, DQ and VNNI")
    build = build_native()
    for name in sets[1:]:
        out = run_core_test([str(build / CORE_TEST), "--random", "100", *golden_dirs],
                            env=dict(os.environ, OSCAR_SIMD=name))
        assert f"(simd on: {name})" in out


def test_unknown_kernel_set_is_refused(golden_dirs):
    build = build_native()
    proc = subprocess.run([str(build / CORE_TEST), "--random", "2", golden_dirs[0]], capture_output=True, text=True,
                          env=dict(os.environ, OSCAR_SIMD="avx1024"))
    assert proc.returncode == 1
    sets = ", ".join(simd_sets()) or "none"
    assert f"OSCAR_SIMD=avx1024: expected a kernel set this CPU runs ({sets}) or no value" in proc.stderr


def test_core_under_address_and_ub_sanitizers(golden_dirs):
    build = build_native(sanitize=True)
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0", UBSAN_OPTIONS="print_stacktrace=1")
    run_core_test([str(build / CORE_TEST), "--random", "100", *golden_dirs], env=env)


QEMU = "qemu-aarch64"
CROSS = "aarch64-linux-gnu-g++"
SYSROOT = "/usr/aarch64-linux-gnu"


# qemu's CPU models: Cortex-A72 is ARMv8.0 (plain NEON); "max" has the ARMv8.2 dot-product extension.
@pytest.mark.parametrize("cpu, kernels", [("cortex-a72", "neon"), ("max", "neon+dotprod")])
def test_neon_kernels_under_qemu(golden_dirs, cpu, kernels):
    missing = [tool for tool in (CROSS, QEMU) if shutil.which(tool) is None]
    if missing or not os.path.isdir(SYSROOT):
        pytest.skip(f"{' and '.join(missing) or SYSROOT} missing: install the Debian packages "
                    "g++-aarch64-linux-gnu qemu-user to test the NEON kernels")
    build = build_native(target="aarch64")
    out = run_core_test([QEMU, "-cpu", cpu, "-L", SYSROOT, str(build / CORE_TEST), "--random", "100", *golden_dirs])
    assert f"(simd on: {kernels})" in out  # that kernel set ran, not only the scalar fallback

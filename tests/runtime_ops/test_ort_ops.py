"""The ONNX Runtime op OscarAttention (runtime_ops/onnxruntime) in a one-node model.

The cache tensors are bound as OrtValues over numpy buffers with IOBinding, as a host binds its
persistent cache: the op must update them in place, bit-exact with the reference.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from backends import BACKEND, ort_attributes, ort_run, ort_sessions, replay
from native_cases import CACHE_INPUTS, GOLDEN, assert_final_cache, golden_case, random_case, same_bits

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
from onnx import TensorProto  # noqa: E402

from oscar_export.native import ort_include_dir  # noqa: E402
from oscar_export.ops.attention import SCALE_NAMES  # noqa: E402

if shutil.which("cmake") is None or shutil.which("g++") is None:
    pytest.skip("liboscar_ort.so needs cmake and g++ (Debian: apt-get install cmake g++)", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("single_threaded")
RANDOM_CASES = 150


@pytest.fixture(scope="module")
def sessions():
    include, why = ort_include_dir()
    if include is None:
        pytest.skip(f"no ONNX Runtime headers to build liboscar_ort.so: {why}")
    return ort_sessions()


def test_random_cases_match_the_reference(sessions):
    rng = np.random.default_rng(99)
    worst = 0.0
    for i in range(RANDOM_CASES):
        case = random_case(rng, i)
        err, cache = replay(BACKEND["onnxruntime"], case, threads=1 + i % 2)
        assert err <= 1e-3, f"{case.name} ({case.config}): relative error {err:.3g}"
        assert_final_cache(case, cache)
        worst = max(worst, err)
    print(f"{RANDOM_CASES} random cases through onnxruntime: max relative error {worst:.3g}")


# -- bad input: a clear error from onnxruntime, never a crash ----------------------------------


@pytest.fixture
def golden_feeds(sessions):
    case = golden_case(GOLDEN[0])
    q, k, v = (np.ascontiguousarray(x) for x in case.chunks[0])
    feeds = dict(case.empty_cache(), q=q, k_new=k, v_new=v, length=np.array([0], np.int64))
    return case, sessions.get(ort_attributes(case)), feeds


def expect_error(session, feeds, pattern):
    before = {name: a.copy() for name, a in feeds.items()}
    with pytest.raises(Exception, match=pattern):
        ort_run(session, feeds)
    for name in CACHE_INPUTS:  # nothing was written
        assert same_bits(feeds[name], before[name]), name


def test_capacity_exceeded(golden_feeds):
    case, session, feeds = golden_feeds
    feeds["length"] = np.array([case.max_context - 1], np.int64)
    expect_error(session, feeds, "cache capacity exceeded")


def test_wrong_shape_and_rank(golden_feeds):
    _, session, feeds = golden_feeds
    expect_error(session, dict(feeds, k_scale=feeds["k_scale"][:, 1:].copy()), r"input 'k_scale' has shape .* expected")
    expect_error(session, dict(feeds, v_codes=feeds["v_codes"][0].copy()), r"input 'v_codes' has shape .* expected")
    expect_error(session, dict(feeds, k_sink=feeds["k_sink"][0].copy()), r"input 'k_sink' .* expected rank 3")
    expect_error(session, dict(feeds, v_new=feeds["v_new"][:, :1].copy()), r"input 'v_new' has shape")
    expect_error(session, dict(feeds, length=np.array([0, 1], np.int64)), r"input 'length' has shape")
    expect_error(session, dict(feeds, k_levels=np.array([0, 2, 1, 3], np.float32)), "k_levels=.*ascending")


def test_wrong_dtype(golden_feeds, sessions):
    case, session, feeds = golden_feeds
    # Fed at run time: onnxruntime checks it against the declared graph input type.
    expect_error(session, dict(feeds, k_scale=feeds["k_scale"].astype(np.float32)),
                 r"Unexpected input data type.*float\).*expected.*float16")
    # Declared in the graph: refused when the session is created.
    with pytest.raises(Exception, match="k_sink|[Tt]ype"):
        sessions.get(ort_attributes(case), {"k_sink": TensorProto.FLOAT})
    # The scales and zeros are declared as any type (float16, or uint8 for fp8 E4M3 bits): the op holds them to
    # its scale_dtype attribute.
    session = sessions.get(ort_attributes(case), {"k_scale": TensorProto.FLOAT})
    expect_error(session, dict(feeds, k_scale=feeds["k_scale"].astype(np.float32)),
                 r"input 'k_scale' has dtype float32: expected float16, as attribute scale_dtype=0 says")
    session = sessions.get(ort_attributes(case), {"v_zero": TensorProto.UINT8})
    expect_error(session, dict(feeds, v_zero=feeds["v_zero"].view(np.uint8)[..., ::2].copy()),
                 r"input 'v_zero' has dtype uint8: expected float16, as attribute scale_dtype=0 says")


def test_the_format_comes_from_the_attributes(golden_feeds, sessions):
    """Buffers that disagree with the codebook, k_rounding or scale_dtype attribute are refused, not read as the
    format they look like; a missing or unknown code fails the session."""
    case, _, feeds = golden_feeds
    h, d = case.kv_heads, case.head_dim
    fp8 = {name: TensorProto.UINT8 for name in SCALE_NAMES}
    expect_error(sessions.get(dict(ort_attributes(case), scale_dtype=1)), feeds, r"input 'k_scale' has dtype float16: "
                 r"expected uint8 \(fp8 E4M3 bits\), as attribute scale_dtype=1 says")
    expect_error(sessions.get(ort_attributes(case), fp8),
                 dict(feeds, **{name: np.zeros(feeds[name].shape, np.uint8) for name in SCALE_NAMES}),
                 r"input 'k_scale' has dtype uint8: expected float16, as attribute scale_dtype=0 says")
    expect_error(sessions.get(dict(ort_attributes(case), k_rounding=1)), feeds,
                 rf"input 'k_feedback' has shape \[0\]: expected \[{h}, {d}, {d}\]")
    expect_error(sessions.get(ort_attributes(case)), dict(feeds, k_feedback=np.zeros((h, d, d), np.float32)),
                 rf"input 'k_feedback' has shape \[{h}, {d}, {d}\]: expected \[0\]")
    expect_error(sessions.get(ort_attributes(case)), dict(feeds, v_levels=np.array([0, 0.5, 2, 3], np.float32)),
                 r"v_levels\[1\] is 0.5: expected the uniform levels 0 .. 3 with codebook 0")
    lloyd = sessions.get(dict(ort_attributes(case), codebook=1))  # any ascending levels: the same levels run
    ort_run(lloyd, dict(feeds))
    for name, code in (("scale_dtype", 2), ("k_rounding", -1), ("codebook", 2)):
        with pytest.raises(Exception, match=rf"attribute {name}={code}: expected 0 .. 1"):
            sessions.get(dict(ort_attributes(case), **{name: code}))
        attrs = ort_attributes(case)
        del attrs[name]
        with pytest.raises(Exception, match=f"attribute '{name}' is missing"):
            sessions.get(attrs)


def test_bad_attributes_fail_at_session_creation(golden_feeds, sessions):
    case, _, _ = golden_feeds
    with pytest.raises(Exception, match="cluster_dim=48"):
        sessions.get(dict(ort_attributes(case), cluster_dim=48))
    with pytest.raises(Exception, match="k_bits=5"):
        sessions.get(dict(ort_attributes(case), k_bits=5))
    with pytest.raises(Exception, match="v_clip"):
        sessions.get(dict(ort_attributes(case), v_clip=0.25))
    attrs = ort_attributes(case)
    del attrs["recent"]
    with pytest.raises(Exception, match="attribute 'recent' is missing"):
        sessions.get(attrs)

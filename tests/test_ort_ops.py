"""The ONNX Runtime op OscarAttention (runtime_ops/onnxruntime) in a one-node model.

The cache tensors are bound as OrtValues over numpy buffers with IOBinding, as a host binds its
persistent cache: the op must update them in place, bit-exact with the reference.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from native_cases import CACHE_INPUTS, GOLDEN, Case, assert_final_cache, golden_case, random_case, rel_err, same_bits

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from oscar_export.native import ort_include_dir, ort_library_path  # noqa: E402

if shutil.which("cmake") is None or shutil.which("g++") is None:
    pytest.skip("liboscar_ort.so needs cmake and g++ (Debian: apt-get install cmake g++)", allow_module_level=True)

INPUTS = ("q", "k_new", "v_new", *CACHE_INPUTS, "length")
TYPES = {"q": TensorProto.FLOAT, "k_levels": TensorProto.FLOAT, "v_levels": TensorProto.FLOAT,
         "k_codes": TensorProto.UINT8, "v_codes": TensorProto.UINT8, "length": TensorProto.INT64}
RANDOM_CASES = 150


@pytest.fixture(autouse=True, scope="module")
def single_threaded_reference():
    """The reference works on tiny tensors: one torch thread avoids OpenMP spin-waits on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def library():
    include, why = ort_include_dir()
    if include is None:
        pytest.skip(f"no ONNX Runtime headers to build liboscar_ort.so: {why}")
    return str(ort_library_path())  # a build error fails the tests


def model(attrs: dict, types: dict | None = None) -> bytes:
    """One OscarAttention node; inputs declared without shapes so the op's own checks answer."""
    types = {**TYPES, **(types or {})}
    inputs = [helper.make_tensor_value_info(name, types.get(name, TensorProto.FLOAT16), None) for name in INPUTS]
    node = helper.make_node("OscarAttention", list(INPUTS), ["out"], domain="oscar", **attrs)
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "oscar_attention", inputs, [out])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("oscar", 1)])
    m.ir_version = 8  # well inside what onnxruntime 1.32 reads
    return m.SerializeToString()


def attributes(case: Case, threads: int = 1) -> dict:
    cfg = case.config
    return dict(k_bits=cfg.k_bits, v_bits=cfg.v_bits, cluster_dim=cfg.cluster_dim, sink=cfg.sink,
                recent=cfg.recent, k_clip=cfg.k_clip, v_clip=cfg.v_clip, scaling=case.scaling, threads=threads)


class Sessions:
    """One InferenceSession per attribute set (shapes are dynamic)."""

    def __init__(self, library: str):
        self.library, self.cache = library, {}

    def get(self, attrs: dict, types: dict | None = None) -> ort.InferenceSession:
        key = (tuple(sorted(attrs.items())), tuple(sorted((types or {}).items())))
        if key not in self.cache:
            so = ort.SessionOptions()
            so.register_custom_ops_library(self.library)
            so.intra_op_num_threads = 1
            so.log_severity_level = 4  # errors are asserted on, not logged
            self.cache[key] = ort.InferenceSession(model(attrs, types), so, providers=["CPUExecutionProvider"])
        return self.cache[key]


@pytest.fixture(scope="module")
def sessions(library):
    return Sessions(library)


def run(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Bind every input as an OrtValue over its numpy buffer (no copy), run, return out."""
    binding = session.io_binding()
    for name in INPUTS:
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(feeds[name]))
    binding.bind_output("out", "cpu")
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


def replay(session, case: Case) -> tuple[float, dict]:
    cache, length, worst = case.empty_cache(), 0, 0.0
    for (q, k, v), want in zip(case.chunks, case.outputs):
        feeds = dict(cache, q=np.ascontiguousarray(q), k_new=np.ascontiguousarray(k), v_new=np.ascontiguousarray(v),
                     length=np.array([length], np.int64))
        worst = max(worst, rel_err(run(session, feeds), want))
        length += q.shape[1]
    return worst, cache


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_replay(sessions, name):
    case = golden_case(name)
    worst, cache = replay(sessions.get(attributes(case, threads=0)), case)
    assert worst <= 1e-3, f"{name}: attention relative error {worst:.3g}"
    assert_final_cache(case, cache)


def test_random_cases_match_the_reference(sessions):
    rng = np.random.default_rng(99)
    worst = 0.0
    for i in range(RANDOM_CASES):
        case = random_case(rng, i)
        err, cache = replay(sessions.get(attributes(case, threads=1 + i % 2)), case)
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
    return case, sessions.get(attributes(case)), feeds


def expect_error(session, feeds, pattern):
    before = {name: a.copy() for name, a in feeds.items()}
    with pytest.raises(Exception, match=pattern):
        run(session, feeds)
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
    with pytest.raises(Exception, match="k_scale|[Tt]ype"):
        sessions.get(attributes(case), {"k_scale": TensorProto.FLOAT})


def test_bad_attributes_fail_at_session_creation(golden_feeds, sessions):
    case, _, _ = golden_feeds
    with pytest.raises(Exception, match="cluster_dim=48"):
        sessions.get(dict(attributes(case), cluster_dim=48))
    with pytest.raises(Exception, match="k_bits=5"):
        sessions.get(dict(attributes(case), k_bits=5))
    with pytest.raises(Exception, match="v_clip"):
        sessions.get(dict(attributes(case), v_clip=0.25))
    attrs = attributes(case)
    del attrs["recent"]
    with pytest.raises(Exception, match="attribute 'recent' is missing"):
        sessions.get(attrs)

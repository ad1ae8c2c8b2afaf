"""Decode attention latency in ONNX Runtime: the OscarAttention op against ORT's own fp32 attention.

Both run one decode step (T = 1) of one layer over the same context, in the same process, with
the same thread count. The baseline is a MatMul-Softmax-MatMul graph over fp32 K (stored
transposed, as a decode cache would keep it) and V; the OSCAR op reads the packed 2-bit body
plus its fp16 windows. Every buffer is bound once over numpy memory: nothing is copied per run.
"""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from ..sizes import capacities
from ..sizes import packed_bytes
from ..config import OscarConfig
from .common import add_traffic, check_bench_args, copy_bandwidth, stored_scales
from ..ops.attention import CACHE_NAMES, INPUTS, op_attributes
from ..ops.onnx import DOMAIN, OP

MIN_SECONDS, MIN_RUNS = 0.5, 10
CONTESTANTS = {"oscar": ("OSCAR", None), "baseline": ("fp32 attention", "speedup")}


_ONNX = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.uint8: TensorProto.UINT8,
         np.int64: TensorProto.INT64}


def _model(nodes, feeds: dict, output: str) -> bytes:
    inputs = [helper.make_tensor_value_info(name, _ONNX[a.dtype.type], a.shape) for name, a in feeds.items()]
    graph = helper.make_graph(nodes, "bench", inputs, [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8
    return model.SerializeToString()


def _median_ms(session: ort.InferenceSession, feeds: dict, output: np.ndarray) -> float:
    binding = session.io_binding()
    for name, array in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    binding.bind_ortvalue_output(session.get_outputs()[0].name, ort.OrtValue.ortvalue_from_numpy(output))
    for _ in range(3):  # warm-up
        session.run_with_iobinding(binding)
    times, start = [], time.perf_counter()
    while len(times) < MIN_RUNS or time.perf_counter() - start < MIN_SECONDS:
        t0 = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def _session(model: bytes, threads: int, library: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library:
        options.register_custom_ops_library(library)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def bench_attention(contexts, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                    config: OscarConfig | None = None, threads: int | None = None) -> dict:
    """Median decode-step latency of both kernels at each context; speedup = baseline / oscar; the bytes each
    step reads and their rate against this machine's copy bandwidth (measured first, same threads)."""
    from ..native import ort_library_path

    config, threads = check_bench_args(contexts, q_heads, kv_heads, head_dim, config, threads)
    library = str(ort_library_path())
    rng = np.random.default_rng(0)
    scaling = float(np.float32(head_dim**-0.5))
    copy_gbps = copy_bandwidth(threads)
    results = []
    for context in contexts:
        # OSCAR: a cache of `context` slots holding context - 1 tokens; each run appends the last one.
        s, w, b = capacities(config, context)
        groups = head_dim // config.cluster_dim
        feeds = {"q": rng.standard_normal((q_heads, 1, head_dim), dtype=np.float32)}
        for name in ("k_new", "v_new"):
            feeds[name] = rng.standard_normal((kv_heads, 1, head_dim)).astype(np.float16)
        for name in CACHE_NAMES:
            kind, region = name.split("_")
            if region == "codes":
                size = (kv_heads, b, packed_bytes(head_dim, config.bits(kind)))
                feeds[name] = rng.integers(0, 256, size, dtype=np.uint8)
            elif region in ("sink", "recent"):
                rows = s if region == "sink" else w
                feeds[name] = (rng.standard_normal((kv_heads, rows, head_dim)) * 0.1).astype(np.float16)
            else:
                x = torch.from_numpy(rng.standard_normal((kv_heads, b, groups), dtype=np.float32) * 0.1)
                feeds[name] = stored_scales(x, config.scale_dtype).numpy()
        for kind in ("k", "v"):
            feeds[f"{kind}_levels"] = np.arange(2 ** config.bits(kind), dtype=np.float32)
        # K's error-feedback weights (the appended row's rounding), of calibration's size; empty: nearest.
        feeds["k_feedback"] = (np.triu(rng.standard_normal((kv_heads, head_dim, head_dim), dtype=np.float32) * 0.3, 1)
                               if config.k_rounding == "feedback" else np.zeros(0, np.float32))
        feeds["length"] = np.array([context - 1], np.int64)
        node = helper.make_node(OP, list(INPUTS), ["out"], domain=DOMAIN, **op_attributes(config, scaling))  # the session's pool
        out = np.empty((q_heads, 1, head_dim), np.float32)
        oscar_ms = _median_ms(_session(_model([node], feeds, "out"), threads, library), feeds, out)

        # Baseline: fp32 attention over the same number of keys, query heads grouped per KV head.
        group = q_heads // kv_heads
        base = {"q": rng.standard_normal((kv_heads, group, head_dim), dtype=np.float32),
                "k_t": rng.standard_normal((kv_heads, head_dim, context), dtype=np.float32),
                "v": rng.standard_normal((kv_heads, context, head_dim), dtype=np.float32),
                "scaling": np.array(scaling, np.float32)}
        nodes = [helper.make_node("MatMul", ["q", "k_t"], ["scores"]),
                 helper.make_node("Mul", ["scores", "scaling"], ["scaled"]),
                 helper.make_node("Softmax", ["scaled"], ["p"], axis=-1),
                 helper.make_node("MatMul", ["p", "v"], ["out"])]
        out = np.empty((kv_heads, group, head_dim), np.float32)
        baseline_ms = _median_ms(_session(_model(nodes, base, "out"), threads), base, out)
        row = {"context": context, "oscar_ms": round(oscar_ms, 4), "baseline_ms": round(baseline_ms, 4),
               "speedup": round(baseline_ms / oscar_ms, 3)}
        add_traffic(row, "oscar", sum(feeds[name].nbytes for name in CACHE_NAMES), copy_gbps)
        add_traffic(row, "baseline", base["k_t"].nbytes + base["v"].nbytes, copy_gbps)
        results.append(row)
    return {"results": results, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "threads": threads, "copy_GBps": round(copy_gbps, 3), "config": config.to_dict()}

def measure(request) -> dict:
    """`bench attention` on one layer of the request's model."""
    from ..models import model_shape

    shape = model_shape(request.model)
    return bench_attention(request.contexts, shape.q_heads, shape.kv_heads, shape.head_dim, request.config,
                           request.threads)

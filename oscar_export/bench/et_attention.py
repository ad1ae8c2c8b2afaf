"""Decode attention latency in ExecuTorch: the OSCAR kernel against ExecuTorch's own attention.

Three one-layer programs run one decode step (T = 1) over the same context, in the same
process, through the pybindings, each with its cache in mutable buffers (initialised with random
data, kept between calls):

- OSCAR: oscar::attention over the packed cache (appends the new token, attends over the fp16
  windows and the 2-bit body);
- fp32: ExecuTorch's LLM path, llama::update_cache for K and V then llama::custom_sdpa over an
  fp32 cache [1, context, kv_heads, head_dim];
- int8: ExecuTorch's quantized KV cache (int8 per token with fp32 scale and int8 zero point, as
  examples/models/llama/source_transformation/custom_kv_cache.py keeps it), llama::update_cache
  for values, scales and zero points, then llama::custom_quantized_sdpa. The new token and the
  query arrive already quantized, so this baseline is timed without its quantize step.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from ..config import OscarConfig
from .common import add_traffic, check_bench_args, copy_bandwidth, stored_scales
from ..ops.attention import CACHE_NAMES, op_attributes

MIN_SECONDS, MIN_RUNS = 0.5, 10


CONTESTANTS = {"oscar": ("OSCAR", None), "baseline": ("fp32 custom_sdpa", "speedup"),
               "int8": ("int8 custom_quantized_sdpa", "speedup_vs_int8")}


class _OscarStep(nn.Module):
    def __init__(self, cache: dict[str, torch.Tensor], levels: dict[str, torch.Tensor], feedback: torch.Tensor,
                 attrs: tuple):
        super().__init__()
        for name, value in cache.items():
            self.register_buffer(name, value)
        for kind, value in levels.items():
            self.register_buffer(f"{kind}_levels", value)
        self.register_buffer("k_feedback", feedback)
        self.attrs = attrs

    def forward(self, q, k_new, v_new, length):
        cache = [getattr(self, name) for name in CACHE_NAMES]
        return torch.ops.oscar.attention(q, k_new, v_new, *cache, self.k_levels, self.v_levels, self.k_feedback,
                                         length, *self.attrs)


class _Fp32Step(nn.Module):
    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        super().__init__()
        self.register_buffer("k_cache", k)
        self.register_buffer("v_cache", v)

    def forward(self, q, k_new, v_new, input_pos):
        start = input_pos[0].item()
        torch.ops.llama.update_cache(k_new, self.k_cache, start)
        torch.ops.llama.update_cache(v_new, self.v_cache, start)
        return torch.ops.llama.custom_sdpa(q, self.k_cache, self.v_cache, start, None, 0, True)


class _Int8Step(nn.Module):
    def __init__(self, caches: dict[str, torch.Tensor]):
        super().__init__()
        for name, value in caches.items():
            self.register_buffer(name, value)

    def forward(self, q, q_scale, q_zero, k_new, k_scale, k_zero, v_new, v_scale, v_zero, input_pos):
        start = input_pos[0].item()
        for value, name in ((k_new, "k"), (k_scale, "k_scales"), (k_zero, "k_zeros"), (v_new, "v"),
                            (v_scale, "v_scales"), (v_zero, "v_zeros")):
            torch.ops.llama.update_cache(value, getattr(self, name), start)
        return torch.ops.llama.custom_quantized_sdpa(q, self.k, self.v, start, None, 0, True, None, q_zero, q_scale,
                                                     self.k_zeros, self.k_scales, self.v_zeros, self.v_scales)


def _program(module: nn.Module, inputs: tuple):
    """(bytes, program, method): an ExecuTorch method whose buffers keep their (random) initial values and
    persist across calls. The loaded program reads the serialized bytes in place, so the caller keeps all three."""
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
    from executorch.extension.pybindings import portable_lib

    with torch.no_grad():
        exported = torch.export.export(module, inputs, strict=False)
    edge = to_edge_transform_and_lower(exported, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    names = [name for name, _ in module.named_buffers()]
    program = edge.to_executorch(ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(names)]))
    data = program.buffer
    loaded = portable_lib._load_program_from_buffer(data)
    return data, loaded, loaded.load_method("forward")


def _median_ms(loaded: tuple, inputs: list) -> float:
    method = loaded[-1]
    for _ in range(3):  # warm-up
        method(inputs)
    times, start = [], time.perf_counter()
    while len(times) < MIN_RUNS or time.perf_counter() - start < MIN_SECONDS:
        t0 = time.perf_counter()
        method(inputs)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def oscar_step(config: OscarConfig, context: int, q_heads: int, kv_heads: int, head_dim: int, gen):
    """(cache, loaded program, inputs): one decode step of oscar::attention over a cache of `context` slots
    holding context - 1 tokens of random codes and windows; each run appends the last one."""
    from ..sizes import capacities
    from ..sizes import packed_bytes

    s, w, b = capacities(config, context)
    groups = head_dim // config.cluster_dim
    cache = {}
    for name in CACHE_NAMES:
        kind, region = name.split("_")
        if region == "codes":
            size = (kv_heads, b, packed_bytes(head_dim, config.bits(kind)))
            cache[name] = torch.randint(0, 256, size, generator=gen, dtype=torch.uint8)
        elif region in ("sink", "recent"):
            cache[name] = (torch.randn(kv_heads, s if region == "sink" else w, head_dim, generator=gen) * 0.1).half()
        else:
            cache[name] = stored_scales(torch.randn(kv_heads, b, groups, generator=gen) * 0.1, config.scale_dtype)
    levels = {kind: torch.arange(2 ** config.bits(kind), dtype=torch.float32) for kind in ("k", "v")}
    # K's error-feedback weights (the appended row's rounding), of calibration's size; empty: nearest.
    feedback = (torch.triu(torch.randn(kv_heads, head_dim, head_dim, generator=gen) * 0.3, 1)
                if config.k_rounding == "feedback" else torch.zeros(0))
    attrs = tuple(op_attributes(config, np.float32(head_dim**-0.5)).values())
    new = [torch.randn(kv_heads, 1, head_dim, generator=gen).half() for _ in ("k", "v")]
    inputs = [torch.randn(q_heads, 1, head_dim, generator=gen), *new, torch.tensor([context - 1])]
    return cache, _program(_OscarStep(cache, levels, feedback, attrs), tuple(inputs)), inputs


def bench_attention(contexts, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
                    config: OscarConfig | None = None, threads: int | None = None) -> dict:
    """Median decode-step latency of the three at each context; speedup = fp32 / oscar,
    speedup_vs_int8 = int8 / oscar; the bytes each step reads and their rate against this machine's copy
    bandwidth (measured first, same threads)."""
    from ..targets.android.runner import load_executorch_llm_ops, load_kernels, set_threads

    config, threads = check_bench_args(contexts, q_heads, kv_heads, head_dim, config, threads)
    load_executorch_llm_ops()
    load_kernels()
    set_threads(threads)
    gen = torch.Generator().manual_seed(0)
    copy_gbps = copy_bandwidth(threads)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    results = []
    for context in contexts:
        cache, oscar, inputs = oscar_step(config, context, q_heads, kv_heads, head_dim, gen)
        oscar_ms = _median_ms(oscar, inputs)

        # fp32: the cache ExecuTorch's LLM export keeps ([batch, seq, kv_heads, head_dim]).
        base = _Fp32Step(randn(1, context, kv_heads, head_dim), randn(1, context, kv_heads, head_dim))
        inputs = [randn(1, 1, q_heads, head_dim), randn(1, 1, kv_heads, head_dim), randn(1, 1, kv_heads, head_dim),
                  torch.tensor([context - 1])]
        baseline_ms = _median_ms(_program(base, tuple(inputs)), inputs)

        def int8(*shape):
            return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)

        caches = {"k": int8(1, context, kv_heads, head_dim), "v": int8(1, context, kv_heads, head_dim)}
        for kind in ("k", "v"):
            caches[f"{kind}_scales"] = torch.rand(1, context, kv_heads, 1, generator=gen) * 0.02
            caches[f"{kind}_zeros"] = int8(1, context, kv_heads, 1)
        new = [int8(1, 1, kv_heads, head_dim), torch.rand(1, 1, kv_heads, 1, generator=gen) * 0.02,
               int8(1, 1, kv_heads, 1)]
        inputs = [int8(1, 1, q_heads, head_dim), torch.rand(1, 1, q_heads, 1, generator=gen) * 0.02,
                  int8(1, 1, q_heads, 1), *new, *[t.clone() for t in new], torch.tensor([context - 1])]
        int8_ms = _median_ms(_program(_Int8Step(caches), tuple(inputs)), inputs)
        row = {"context": context, "oscar_ms": round(oscar_ms, 4), "baseline_ms": round(baseline_ms, 4),
               "speedup": round(baseline_ms / oscar_ms, 3), "int8_ms": round(int8_ms, 4),
               "speedup_vs_int8": round(int8_ms / oscar_ms, 3)}
        add_traffic(row, "oscar", sum(t.nbytes for t in cache.values()), copy_gbps)
        add_traffic(row, "baseline", base.k_cache.nbytes + base.v_cache.nbytes, copy_gbps)
        add_traffic(row, "int8", sum(t.nbytes for t in caches.values()), copy_gbps)
        results.append(row)
    return {"results": results, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "threads": threads, "copy_GBps": round(copy_gbps, 3),
            "baseline": "llama::update_cache + llama::custom_sdpa, fp32 cache",
            "int8_baseline": "llama::update_cache + llama::custom_quantized_sdpa, int8 cache (inputs pre-quantized)",
            "config": config.to_dict()}

def measure(request) -> dict:
    """`bench attention` on one layer of the request's model."""
    from ..models import model_shape

    shape = model_shape(request.model)
    return bench_attention(request.contexts, shape.q_heads, shape.kv_heads, shape.head_dim, request.config,
                           request.threads)

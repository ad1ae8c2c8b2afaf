"""End-to-end decode tokens/s in ExecuTorch: the android artifact (OSCAR cache, native kernel) against the
same program with ExecuTorch's own KV caches, as its LLM export builds them.

All three programs come from the same graph (OscarCausalLM, the rotations folded into the weights) with the
same weights (torchao 4-bit, 8-bit dynamic activations, fp16 embeddings; or float32 with float_weights) and
are lowered alike (torch.export, XNNPACK for the dense layers, the cache in mutable buffers); only
attention differs:

- oscar: the android export itself, oscar::attention over the packed cache;
- fp32: ExecuTorch's CustomKVCache and SDPACustom (llama::update_cache, then llama::custom_sdpa over an
  fp32 cache [1, context, kv_heads, head_dim]), what its llama export builds with --use_sdpa_with_kv_cache;
- int8: its QuantizedKVCache (int8 per token and head, asymmetric, fp32 scales, int8 zero points) and
  QuantizedSDPA (the query quantized per token, llama::custom_quantized_sdpa), as --quantize_kv_cache
  builds them.

Each program is exported once, with the largest context's capacity; each context loads it afresh and
writes a synthetic state of that many tokens (decode cost does not depend on the values, and every
attention reads only the cached tokens, so unused capacity costs nothing). Then all decode greedily in
alternating turns (bench/artifact_decode.step_times); the median step gives tokens/s.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from ..config import OscarConfig, OscarInputError
from ..export.artifact import load_manifest
from .common import WARMUP, bench_setup, step_times
from ..export.graph import OscarCausalLM, OscarDecoderLayer
from ..targets import get
from ..targets.android import AndroidTarget
from ..targets.android.lower import lower, quantize_artifact_weights
from ..targets.android.runner import load_executorch_llm_ops

# fp32: custom_sdpa's cache; int8: ExecuTorch's quantized KV cache.
CONTESTANTS = {"oscar": ("OSCAR", None), "fp32": ("fp32", "speedup"), "int8": ("int8", "speedup_vs_int8")}


CACHES = ("fp32", "int8")  # ExecuTorch's own caches, by the names the report uses


class EtCacheLayer(OscarDecoderLayer):
    """The graph's decoder layer with ExecuTorch's own cache and SDPA modules in place of oscar::attention."""

    def use_executorch_cache(self, kind: str, max_context: int) -> None:
        from executorch.examples.models.llama.source_transformation.custom_kv_cache import (
            CustomKVCache, QuantizedCacheType, QuantizedKVCache)
        from executorch.examples.models.llama.source_transformation.sdpa import QuantizedSDPA, SDPACustom

        if abs(self.scaling - self.head_dim ** -0.5) > 1e-6 * self.head_dim ** -0.5:
            raise OscarInputError(f"attention scaling {self.scaling}: ExecuTorch's custom_sdpa scales by "
                                  f"head_dim ** -0.5 = {self.head_dim ** -0.5}")
        kv_heads, dim = self.k_proj.out_features // self.head_dim, self.q_proj.out_features
        if kind == "fp32":
            self.kv_cache = CustomKVCache(1, max_context, kv_heads, self.head_dim)
            self.sdpa = SDPACustom(dim)
        elif kind == "int8":
            # The settings of ExecuTorch's replace_kv_cache_with_quantized_kv_cache and
            # replace_sdpa_with_quantized_sdpa.
            self.kv_cache = QuantizedKVCache(1, max_context, kv_heads, self.head_dim,
                                             QuantizedCacheType.AffineAsymmetric, use_custom_update_cache_op=True,
                                             return_float_values=False)
            self.sdpa = QuantizedSDPA(dim, self.kv_cache)
            # Registered once (here, not under sdpa too): torch.export cannot lift a buffer reached by two names.
            del self.sdpa._modules["kv_cache"]
            object.__setattr__(self.sdpa, "kv_cache", self.kv_cache)
        else:
            raise OscarInputError(f"cache {kind!r}: expected one of {CACHES}")

    def attend(self, q, k, v, length, cache, functional):
        t = q.shape[1]
        keys, values = self.kv_cache.update(length, k[None], v[None])  # [1, H, T, D] in, as ExecuTorch's Attention
        out = self.sdpa(length, q[None], keys, values, 1, t, None)  # [1, T, Hq * D]
        return out.view(t, -1, self.head_dim).transpose(0, 1), []


class EtCacheLM(OscarCausalLM):
    """forward(tokens [1, T], input_pos int64[1]) -> logits: OscarCausalLM with ExecuTorch's cache of `kind` in
    every layer's buffers (layers.{i}.kv_cache.*)."""

    layer_class = EtCacheLayer

    def __init__(self, model, config: OscarConfig, kind: str, max_context: int, rotations="hadamard"):
        load_executorch_llm_ops()
        super().__init__(model, config, rotations)
        for layer in self.layers:
            layer.use_executorch_cache(kind, max_context)

    def cache_names(self) -> list[str]:
        return [name for name, _ in self.named_buffers() if ".kv_cache." in name]


def synthetic_state(names_and_arrays, length: int, rng: np.random.Generator) -> None:
    """Rows 0 .. length-1 of each ExecuTorch cache buffer [1, capacity, H, D or 1], in place: random values, int8
    codes, positive scales and int8 zero points, by the buffer's name and dtype."""
    for name, array in names_and_arrays:
        rows = array[:, :length]
        if array.dtype == np.int8:
            rows[...] = rng.integers(-128, 128, rows.shape, dtype=np.int8)
        elif name.endswith("_scales"):
            rows[...] = rng.uniform(0.005, 0.02, rows.shape).astype(np.float32)
        else:
            rows[...] = rng.standard_normal(rows.shape, dtype=np.float32)


class EtCacheProgram:
    """An EtCacheLM's program through the pybindings, stepped one token at a time from a synthetic state."""

    def __init__(self, path: Path, names: list[str]):
        from executorch.extension.pybindings import portable_lib

        load_executorch_llm_ops()
        self.program = portable_lib._load_program(str(path))
        self.method = self.program.load_method("forward")
        self.names, self.length = names, 0

    def writable_cache(self) -> dict[str, np.ndarray]:
        # get_attribute aliases the program's mutable buffers (emit_mutable_buffer_names in lower()).
        return {name: self.method.get_attribute(name).numpy() for name in self.names}

    def fill_synthetic(self, length: int, rng: np.random.Generator) -> None:
        synthetic_state(self.writable_cache().items(), length, rng)
        self.length = length

    def step(self, token: int) -> np.ndarray:
        (logits,) = self.method([torch.tensor([[token]]), torch.tensor([self.length])])
        self.length += 1
        return logits.numpy()[0, -1]


def export_et_cache(model_name: str, config: OscarConfig, kind: str, max_context: int, path: Path,
                    float_weights: bool) -> list[str]:
    """The program with ExecuTorch's cache of `kind`, lowered as the android target lowers its artifact; returns
    the names of its cache buffers."""
    from ..models import load_model

    options = AndroidTarget.options
    model, _ = load_model(model_name)  # its own copy: the graph shares the model's linears, which torchao replaces
    module = EtCacheLM(model, config, kind, max_context).eval()
    if not float_weights:
        quantize_artifact_weights(module, options.group_size)
    # ExecuTorch's LLM export removes the transposes its cache modules leave around update and SDPA; kept,
    # each step would copy every layer's whole cache.
    from executorch.extension.llm.export.export_passes import RemoveRedundantTransposes

    program = lower(module, max_context, options.max_chunk, {"get_max_context_len": max_context},
                    graph_passes=[RemoveRedundantTransposes()])
    with open(path, "wb") as f:
        program.write_to_file(f)
    return module.cache_names()


def bench_decode(contexts, steps: int = 64, threads: int | None = None, model_name: str = "bundled",
                 config: OscarConfig | None = None, work_dir=None, float_weights: bool = False) -> dict:
    """Decode tokens/s of the android artifact and of the same program with ExecuTorch's fp32 and int8 caches, at
    each context, in one run: speedup = fp32 / oscar, speedup_vs_int8 = int8 / oscar, per step.

    Each variant starts from a synthetic cache of context - WARMUP - steps - 1 tokens, so the timed steps end
    one token short of `context`. work_dir keeps the programs (default: a temporary directory).
    """
    from ..export.pipeline import export_artifact
    from ..targets.android.runner import EtLM

    config, contexts, threads, model, rng = bench_setup(contexts, config, steps, threads, model_name)
    capacity = max(contexts)
    with tempfile.TemporaryDirectory(prefix="oscar-et-decode-bench-") as temp:
        work = Path(work_dir or temp)
        work.mkdir(parents=True, exist_ok=True)
        oscar_dir = work / "oscar"
        export_artifact(get(AndroidTarget.name), model_name, oscar_dir, "hadamard", capacity, float_weights=float_weights,
                        config=config)
        names = {kind: export_et_cache(model_name, config, kind, capacity, work / f"{kind}.pte", float_weights)
                 for kind in CACHES}
        results = []
        for context in contexts:
            length = context - WARMUP - steps - 1
            oscar = EtLM(oscar_dir, threads)  # sizes ExecuTorch's pool and the OSCAR kernel's workers
            oscar.fill_synthetic(length, config, rng)
            baselines = {kind: EtCacheProgram(work / f"{kind}.pte", names[kind]) for kind in CACHES}
            for program in baselines.values():
                program.fill_synthetic(length, rng)
            times = step_times({"oscar": lambda t, lm=oscar: lm.step([t]),
                                **{kind: p.step for kind, p in baselines.items()}},
                               int(rng.integers(model.config.get_text_config().vocab_size)), steps)
            ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
            result = {"context": context}
            result.update({f"{name}_tokens_per_s": round(1e3 / value, 2) for name, value in ms.items()})
            result["speedup"] = round(ms["fp32"] / ms["oscar"], 3)
            result["speedup_vs_int8"] = round(ms["int8"] / ms["oscar"], 3)
            result.update({f"{name}_ms": round(value, 4) for name, value in ms.items()})
            # The bytes each cache holds at this context (the programs' buffers have the largest one's capacity).
            result["oscar_cache_bytes"] = _oscar_cache_bytes(model, config, context)
            for kind, program in baselines.items():
                result[f"{kind}_cache_bytes"] = sum(a.nbytes * context // a.shape[1]
                                                    for a in program.writable_cache().values())
            results.append(result)
            oscar = baselines = program = None  # this context's programs, freed before the next ones load
        weights = load_manifest(oscar_dir)["weights"]
    return {"results": results, "threads": threads, "steps": steps, "model": model_name, "config": config.to_dict(),
            "weights": f"{weights} in every variant", "capacity": capacity,
            "fp32": "ExecuTorch CustomKVCache + SDPACustom: llama::update_cache, llama::custom_sdpa, fp32 cache",
            "int8": "ExecuTorch QuantizedKVCache (int8 per token, asymmetric) + QuantizedSDPA: "
                    "llama::custom_quantized_sdpa",
            "state": f"synthetic: random fp16 windows and codec-quantized random body rows (OSCAR), random fp32 rows "
                     f"and random int8 codes, scales and zero points (ExecuTorch's caches); {WARMUP} untimed steps, "
                     f"then {steps} timed greedy steps ending at context - 1 tokens"}


def _oscar_cache_bytes(model, config: OscarConfig, context: int) -> int:
    from ..sizes import cache_bytes
    from ..hf_cache import attention_shape

    layers, kv_heads, head_dim, _ = attention_shape(model)
    return cache_bytes(config, layers, kv_heads, head_dim, context)

def measure(request) -> dict:
    """`bench decode` of the request's model."""
    return bench_decode(request.contexts, request.steps, request.threads, request.model, request.config,
                        float_weights=request.float_weights)

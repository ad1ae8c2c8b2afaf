"""The ios target: an artifact directory with a Core ML ML program (docs/ios.md).

Directory contents: model.mlpackage (the converted OscarCausalLM, 4-bit weights unless float),
the tokenizer files, the rotation file when one was used, and manifest.json (what was exported,
the cache I/O layout, sha256 of every file).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import OscarConfig
from .artifact import (check_export_args, config_for, default_context, eager_module, eager_trace,
                       finish_manifest, load_manifest, prompt_ids, save_inputs, staged)

MAX_CHUNK = 512  # prefill chunk: longer prompts run in several chunks
PACKAGES = ("oscar-export", "torch", "transformers", "coremltools")
LONG_CONTEXT = 32768  # the context at which the manifest states the cache's bits per element


def cache_bits_per_element(layout: list, layers: int, kv_heads: int, head_dim: int, context: int) -> float:
    """Bits per K/V element of the cache buffers as the app allocates them: windows, codes, scales, zeros."""
    stored = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, dtype in layout)
    return stored * 8 / (layers * kv_heads * 2 * head_dim * context)


def io_layout(module, max_context: int, max_chunk: int) -> dict:
    """The model's inputs and outputs as the app sees them (docs/ios.md)."""
    from .coreml import cache_inputs
    from .coreml_ops import ROW_NAMES

    h, d = module.kv_heads, module.head_dim
    words = {kind: d * module.config.bits(kind) // 32 for kind in ("k", "v")}
    groups = d // module.config.cluster_dim
    rows = {"k_new": ([h, "T", d], "float16"), "v_new": ([h, "T", d], "float16")}
    for kind in ("k", "v"):
        rows[f"{kind}_body_codes"] = ([h, "T", words[kind]], "int32")
        rows[f"{kind}_body_scale"] = ([h, "T", groups], "float16")
        rows[f"{kind}_body_zero"] = ([h, "T", groups], "float16")
    return {
        "inputs": [{"name": "input_ids", "shape": [1, "T"], "dtype": "int32"},
                   {"name": "length", "shape": [1], "dtype": "int32"},
                   *({"name": name, "shape": list(shape), "dtype": np.dtype(dtype).name}
                     for name, shape, dtype in cache_inputs(module, max_context))],
        "outputs": [{"name": "logits", "shape": [1, 1, module.lm_head.out_features], "dtype": "float32"},
                    *({"name": f"layer{i}_{name}", "shape": rows[name][0], "dtype": rows[name][1]}
                      for i in range(len(module.layers)) for name in ROW_NAMES)],
        "T": f"1 .. {max_chunk}",
    }


def build_module(model, config, resolved):
    from .graph import OscarCausalLM

    return OscarCausalLM(model, config, resolved).eval()


def export_ios(model_name: str, out, rotations: str = "hadamard", max_context: int | None = None,
               float_weights: bool = False, device_memory: str = "8GB", **config_fields) -> dict:
    """Export `model_name` ('bundled' or a local checkpoint) to the artifact directory `out`; returns the manifest."""
    from ..hf_cache import _resolve_rotations
    from ..models import load_model, model_shape
    from ..planner import plan
    from .coreml import MODEL_FILE, WEIGHT_BLOCK, cache_inputs, check_layout, convert

    memory = check_export_args(out, rotations, device_memory)
    shape = model_shape(model_name)
    max_context = default_context(shape, max_context)
    defaults = OscarConfig()
    check_layout(defaults.sink if config_fields.get("sink") is None else config_fields["sink"],
                 defaults.recent if config_fields.get("recent") is None else config_fields["recent"], max_context)
    model, tokenizer = load_model(model_name)
    max_chunk = min(MAX_CHUNK, max_context)
    resolved = _resolve_rotations(rotations, model)
    config = config_for(resolved, shape.head_dim, **config_fields)
    module = build_module(model, config, resolved)
    mlmodel = convert(module, max_context, max_chunk, float_weights)
    with staged(out) as temp:
        mlmodel.save(str(temp / MODEL_FILE))
        args = (len(module.layers), module.kv_heads, module.head_dim)
        manifest = finish_manifest(
            temp, "ios", "coreml", model_name, model, shape, save_inputs(temp, tokenizer, rotations, resolved),
            config, max_context, max_chunk,
            "float16" if float_weights else f"int4 (linear_symmetric, block {WEIGHT_BLOCK})",
            plan(shape, config, memory, max_context, weight_bits=16 if float_weights else 4, weight_group=WEIGHT_BLOCK),
            PACKAGES,
            deployment_target="iOS18 / macOS15",
            compute_precision="float32",
            io=io_layout(module, max_context, max_chunk),
            cache={
                "bytes": sum(int(np.prod(s)) * np.dtype(t).itemsize for _, s, t in cache_inputs(module, max_context)),
                "bits_per_element_at_max_context": cache_bits_per_element(cache_inputs(module, max_context), *args,
                                                                          max_context),
                f"bits_per_element_at_{LONG_CONTEXT}": cache_bits_per_element(
                    cache_inputs(module, LONG_CONTEXT), *args, LONG_CONTEXT),
            })
    return manifest


def _runner(directory, manifest, runtime: str):
    from .coreml_runner import CoreMLLM, load

    cfg = manifest["config"]
    return CoreMLLM(load(directory), runtime, manifest["model"]["layers"], cfg["sink"], cfg["recent"],
                    manifest["max_chunk"])


def run_artifact(directory, prompt: str, max_new_tokens: int, runtime: str = "coreml-mil", threads: int = 0) -> dict:
    """Greedy generation from an artifact: {"tokens": [...], "text": "..."}."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    manifest = load_manifest(directory, "ios")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = prompt_ids(tokenizer, prompt)
    if runtime == "reference":
        tokens = reference_trace(directory, ids, max_new_tokens, eos=manifest["eos_token_ids"])["tokens"]
    else:
        tokens = _runner(directory, manifest, runtime).generate(ids, max_new_tokens, manifest["eos_token_ids"])
    return {"tokens": tokens, "text": tokenizer.decode(tokens)}


# -- parity -----------------------------------------------------------------------------------------


def parity_runtimes() -> dict[str, str]:
    """Runtimes of this target that run here: name -> how."""
    from .coreml_runner import coreml_available

    runtimes = {"coreml-mil": "the converted MIL program executed in numpy (mil_eval)"}
    ok, why = coreml_available()
    runtimes["coreml"] = "MLModel.predict" if ok else None
    return {name: how for name, how in runtimes.items() if how is not None}


def unavailable_runtimes() -> dict[str, str]:
    from .coreml_runner import coreml_available

    ok, why = coreml_available()
    return {} if ok else {"coreml": why}


def trace(directory, runtime: str, ids: list[int], steps: int) -> dict:
    """Greedy run of the artifact: tokens, the logits of each step, and the packed body codes (uint8, by name)."""
    directory = Path(directory)
    manifest = load_manifest(directory, "ios")
    lm = _runner(directory, manifest, runtime)
    tokens, logits = lm.trace(ids, steps)
    codes = {name.replace("_", ".", 1): array for name, array in lm.body_codes().items()}
    return {"tokens": tokens, "logits": logits, "codes": codes}


def reference_trace(directory, ids: list[int], steps: int, eos=()) -> dict:
    """The same run through the eager OscarCausalLM (graph.py, in-place cache) with the artifact's config,
    rotations and weights as the artifact stores them (fp16, or 4-bit dequantized)."""
    import torch

    from .coreml_runner import load
    from .mil_eval import saved_program, weights

    directory = Path(directory)
    manifest = load_manifest(directory, "ios")
    module = eager_module(directory, manifest)
    state = module.state_dict()
    found = weights(saved_program(load(directory)))
    for key in state:
        name = "p_" + key.replace(".", "_")
        if name in found:
            state[key] = torch.from_numpy(found[name].astype(np.float32))
    module.load_state_dict(state)
    return eager_trace(module, ids, steps, manifest["max_context"], manifest["max_chunk"], eos)

"""The laptop target: an artifact directory that ONNX Runtime runs.

Directory contents: model.onnx + model.onnx.data (native OscarAttention op), model_fallback.onnx
(pure ONNX, same weights), liboscar_ort.so (the op library), the tokenizer files, the rotation
file when one was used, and manifest.json (what was exported, with sha256 of every file).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from ..config import OscarInputError
from .artifact import (check_export_args, config_for, default_context, eager_module, eager_trace,
                       finish_manifest, load_manifest, prompt_ids, reference_tokens,
                       save_inputs, staged)
from .onnx_export import MODEL_FILE
from .ort_runner import LIBRARY_FILE, RUNTIMES, OrtLM

MAX_CHUNK = 512  # prefill chunk: longer prompts run in several chunks
PACKAGES = ("oscar-export", "torch", "transformers", "onnx", "onnxscript", "onnxruntime")


def export_laptop(model_name: str, out, rotations: str = "hadamard", max_context: int | None = None,
                  float_weights: bool = False, device_memory: str = "16GB", **config_fields) -> dict:
    """Export `model_name` ('bundled' or a local checkpoint) to the artifact directory `out`; returns the manifest.

    config_fields: OscarConfig fields (k_bits, cluster_dim, sink, ...); None keeps the default, or the
    rotation file's value for clip ratios and codebook.
    """
    from ..hf_cache import _resolve_rotations
    from ..models import load_model, model_shape
    from ..native import ort_library_path
    from ..planner import plan
    from .graph import OscarCausalLM
    from .onnx_export import WEIGHT_BLOCK, export_onnx

    memory = check_export_args(out, rotations, device_memory)
    model, tokenizer = load_model(model_name)
    shape = model_shape(model_name)
    max_context = default_context(shape, max_context)
    max_chunk = min(MAX_CHUNK, max_context)
    resolved = _resolve_rotations(rotations, model)
    config = config_for(resolved, shape.head_dim, **config_fields)
    module = OscarCausalLM(model, config, resolved).eval()
    with staged(out) as temp:
        export_onnx(module, temp, max_context, max_chunk, float_weights)
        shutil.copy2(ort_library_path(), temp / LIBRARY_FILE)
        manifest = finish_manifest(
            temp, "laptop", "onnxruntime", model_name, model, shape, save_inputs(temp, tokenizer, rotations, resolved),
            config, max_context, max_chunk,
            "float32" if float_weights else f"int4 (MatMulNBits, block {WEIGHT_BLOCK}), fp16 embeddings",
            plan(shape, config, memory, max_context, weight_bits=16 if float_weights else 4, weight_group=WEIGHT_BLOCK),
            PACKAGES)
    return manifest


def run_artifact(directory, prompt: str, max_new_tokens: int, runtime: str = "onnxruntime",
                 threads: int = 0) -> dict:
    """Greedy generation from an artifact: {"tokens": [...], "text": "..."}."""
    from transformers import AutoTokenizer

    if runtime not in (*RUNTIMES, "reference"):
        raise OscarInputError(f"--runtime {runtime!r}: expected one of {(*RUNTIMES, 'reference')}")
    directory = Path(directory)
    manifest = load_manifest(directory, "laptop")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = prompt_ids(tokenizer, prompt)
    if runtime == "reference":
        tokens = reference_tokens(manifest, directory, ids, max_new_tokens)
    else:
        lm = OrtLM(directory, runtime, threads, manifest["max_chunk"])
        tokens = lm.generate(ids, max_new_tokens, manifest["eos_token_ids"])
    return {"tokens": tokens, "text": tokenizer.decode(tokens)}


# -- parity (oscar-export parity --artifact): traces of the artifact and of the eager graph ----------


def trace(directory, runtime: str, ids: list[int], steps: int) -> dict:
    """Greedy run of the artifact in ONNX Runtime: tokens, each step's logits, the packed body codes."""
    manifest = load_manifest(directory, "laptop")
    lm = OrtLM(directory, runtime, threads=0, max_chunk=manifest["max_chunk"])
    tokens, logits = lm.trace(ids, steps, manifest["eos_token_ids"])
    codes = {name: array.copy() for name, array in lm.cache_arrays().items() if name.endswith("_codes")}
    return {"tokens": tokens, "logits": logits, "codes": codes}


def _matmul_nbits_weights(model_path: Path) -> list[torch.Tensor]:
    """Each MatMulNBits node's weight [N, K], dequantized as ONNX Runtime does, in graph order."""
    model = onnx.load(model_path)
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weights = []
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attr = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        n, k, block = attr["N"], attr["K"], attr["block_size"]
        packed = init[node.input[1]].reshape(n, -1)  # [N, blocks * block / 2]: low nibble first
        q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, -1, block).astype(np.float32)
        scale = init[node.input[2]].reshape(n, -1, 1)
        zp = init[node.input[3]].reshape(n, -1) if len(node.input) > 3 and node.input[3] else None
        zero = (np.stack([zp & 15, zp >> 4], axis=-1).reshape(n, -1)[:, :q.shape[1], None].astype(np.float32)
                if zp is not None else 8.0)
        weights.append(torch.from_numpy(((q - zero) * scale).reshape(n, -1)[:, :k].copy()))
    return weights


def artifact_module(directory, manifest: dict):
    """The eager graph with the weights as the artifact stores them (4-bit ones dequantized, fp16 embeddings)."""
    directory = Path(directory)
    module = eager_module(directory, manifest)
    if manifest["weights"] == "float32":
        return module
    linears = []  # in call order, which is the exporter's node order
    hooks = [m.register_forward_hook(lambda m, *_: linears.append(m)) for m in module.modules()
             if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        module(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), *module.new_cache(1))
    for hook in hooks:
        hook.remove()
    weights = _matmul_nbits_weights(directory / MODEL_FILE)
    if len(weights) != len(linears):
        raise OscarInputError(f"artifact {str(directory)!r} has {len(weights)} 4-bit matmuls for {len(linears)} "
                              "linear layers: expected one per layer")
    for linear, weight in zip(linears, weights):
        linear.weight = torch.nn.Parameter(weight)  # a new parameter: unties a tied lm_head from the embeddings
    embed = module.embed_tokens
    embed.weight = torch.nn.Parameter(embed.weight.detach().half().float())
    return module


def reference_trace(directory, ids: list[int], steps: int) -> dict:
    manifest = load_manifest(directory, "laptop")
    module = artifact_module(directory, manifest)
    return eager_trace(module, ids, steps, manifest["max_context"], manifest["max_chunk"], manifest["eos_token_ids"])

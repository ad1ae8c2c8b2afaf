"""The laptop target: an artifact directory that ONNX Runtime runs.

Directory contents: model.onnx + model.onnx.data (native OscarAttention op), model_fallback.onnx
(pure ONNX, same weights), liboscar_ort.so (the op library), the tokenizer files, the rotation
file when one was used, and manifest.json (what was exported, with sha256 of every file).
"""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

from ..config import OscarInputError
from .artifact import (ROTATION_FILE, check_out, config_for, eos_ids, file_table, load_manifest, manifest_format,
                       prompt_ids, reference_tokens, staged, write_manifest)
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
    from ..planner import parse_bytes, plan
    from .graph import OscarCausalLM
    from .onnx_export import WEIGHT_BLOCK, export_onnx

    check_out(Path(out))
    memory = parse_bytes(device_memory, "--device-memory")
    if rotations == "online":
        raise OscarInputError("--rotations online estimates rotations from each prompt and cannot be exported: "
                              "expected hadamard, none or a rotation file (oscar-export calibrate)")
    model, tokenizer = load_model(model_name)
    shape = model_shape(model_name)
    max_context = max_context or min(4096, shape.max_position_embeddings or 4096)
    max_chunk = min(MAX_CHUNK, max_context)
    resolved = _resolve_rotations(rotations, model)
    config = config_for(resolved, **config_fields)
    module = OscarCausalLM(model, config, resolved).eval()
    with staged(out) as temp:
        export_onnx(module, temp, max_context, max_chunk, float_weights)
        shutil.copy2(ort_library_path(), temp / LIBRARY_FILE)
        tokenizer.save_pretrained(temp)
        if resolved not in ("hadamard", "none"):
            shutil.copy2(rotations, temp / ROTATION_FILE)
        manifest = {
            "format": manifest_format("laptop"),
            "target": "laptop",
            "runtime": "onnxruntime",
            "model": {"source": model_name if model_name == "bundled" else str(Path(model_name).resolve()),
                      "model_type": model.config.model_type, "layers": shape.layers, "q_heads": shape.q_heads,
                      "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "vocab": shape.vocab},
            "rotations": ROTATION_FILE if resolved not in ("hadamard", "none") else resolved,
            "config": config.to_dict(),
            "max_context": max_context,
            "max_chunk": max_chunk,
            "weights": "float32" if float_weights else f"int4 (MatMulNBits, block {WEIGHT_BLOCK})",
            "eos_token_ids": eos_ids(model),
            "files": file_table(temp),
            "plan": plan(shape, config, memory, max_context, weight_bits=16 if float_weights else 4,
                         weight_group=WEIGHT_BLOCK),
            "versions": {name: importlib.metadata.version(name) for name in PACKAGES},
        }
        write_manifest(temp, manifest)
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

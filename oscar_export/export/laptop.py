"""The laptop target: an artifact directory that ONNX Runtime runs.

Directory contents: model.onnx + model.onnx.data (native OscarAttention op), model_fallback.onnx
(pure ONNX, same weights), liboscar_ort.so (the op library), the tokenizer files, the rotation
file when one was used, and manifest.json (what was exported, with sha256 of every file).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import torch

from ..config import OscarConfig, OscarInputError
from .ort_runner import LIBRARY_FILE, RUNTIMES, OrtLM

MANIFEST = "manifest.json"
ROTATION_FILE = "rotations.safetensors"
FORMAT = "oscar-export/laptop/1"
MAX_CHUNK = 512  # prefill chunk: longer prompts run in several chunks
PACKAGES = ("oscar-export", "torch", "transformers", "onnx", "onnxscript", "onnxruntime")


def config_for(rotations, **fields) -> OscarConfig:
    """OscarConfig from the given fields; a rotation file's clip ratios and codebook fill in the rest."""
    meta = getattr(rotations, "metadata", {})
    for key in ("k_clip", "v_clip", "codebook"):
        if fields.get(key) is None and meta.get(key) is not None:
            fields[key] = meta[key]
    return OscarConfig(**{key: value for key, value in fields.items() if value is not None})


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_out(out: Path) -> None:
    """out may be new, empty, or a previous artifact (replaced); anything else is refused."""
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / MANIFEST).is_file())):
        raise OscarInputError(f"--out {str(out)!r} exists and is not an oscar-export artifact: "
                              "expected a new or empty directory, or a previous export to replace")
    if not out.parent.is_dir():
        raise OscarInputError(f"--out {str(out)!r}: parent directory does not exist")


def _replace_dir(temp: Path, out: Path) -> None:
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(temp, out)
        shutil.rmtree(old)
    else:
        os.replace(temp, out)


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

    out = Path(out)
    _check_out(out)
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
    temp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        export_onnx(module, temp, max_context, max_chunk, float_weights)
        shutil.copy2(ort_library_path(), temp / LIBRARY_FILE)
        tokenizer.save_pretrained(temp)
        if resolved not in ("hadamard", "none"):
            shutil.copy2(rotations, temp / ROTATION_FILE)
        eos = model.generation_config.eos_token_id
        manifest = {
            "format": FORMAT,
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
            "eos_token_ids": [] if eos is None else [eos] if isinstance(eos, int) else list(eos),
            "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(temp.iterdir())},
            "plan": plan(shape, config, memory, max_context, weight_bits=16 if float_weights else 4,
                         weight_group=WEIGHT_BLOCK),
            "versions": {name: importlib.metadata.version(name) for name in PACKAGES},
        }
        (temp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        _replace_dir(temp, out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return manifest


def load_manifest(directory) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise OscarInputError(f"--artifact {str(directory)!r}: no readable {MANIFEST} ({err}): "
                              "expected a directory written by 'oscar-export --target laptop'") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise OscarInputError(f"--artifact {str(directory)!r}: {MANIFEST} is not format {FORMAT!r}")
    return manifest


def _reference_tokens(manifest: dict, directory: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    """The same generation through transformers with the reference OscarCache (needs the source checkpoint)."""
    from ..hf_cache import patch_model_for_kv_quant
    from ..models import load_model

    model, _ = load_model(manifest["model"]["source"])
    rotations = manifest["rotations"]
    rotations = directory / rotations if rotations == ROTATION_FILE else rotations
    config = dict(manifest["config"])
    patch_model_for_kv_quant(model, rotations=rotations, max_context=manifest["max_context"],
                             cluster_dim=config.pop("cluster_dim"), **config)
    eos = manifest["eos_token_ids"] or None
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos)
    return out[0, len(ids):].tolist()


def run_artifact(directory, prompt: str, max_new_tokens: int, runtime: str = "onnxruntime",
                 threads: int = 0) -> dict:
    """Greedy generation from an artifact: {"tokens": [...], "text": "..."}."""
    from transformers import AutoTokenizer

    if runtime not in (*RUNTIMES, "reference"):
        raise OscarInputError(f"--runtime {runtime!r}: expected one of {(*RUNTIMES, 'reference')}")
    directory = Path(directory)
    manifest = load_manifest(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise OscarInputError("--prompt is empty after tokenization: expected some text")
    if runtime == "reference":
        tokens = _reference_tokens(manifest, directory, ids, max_new_tokens)
    else:
        lm = OrtLM(directory, runtime, threads, manifest["max_chunk"])
        tokens = lm.generate(ids, max_new_tokens, manifest["eos_token_ids"])
    return {"tokens": tokens, "text": tokenizer.decode(tokens)}

"""What every target's artifact directory shares: staging and atomic replace, file hashes,
manifest.json, and the reference generation an artifact is compared with.

An artifact is written into a temporary sibling directory and renamed into place, so a failed
export never leaves a half-written artifact behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from ..config import OscarConfig, OscarInputError, default_cluster_dim
from ..rotation_files import load_rotations

MANIFEST = "manifest.json"
ROTATION_FILE = "rotations.safetensors"


def manifest_format(target: str) -> str:
    return f"oscar-export/{target}/1"


def config_for(rotations, head_dim: int | None = None, **fields) -> OscarConfig:
    """OscarConfig from the given fields; a rotation file's clip ratios and codebook fill in the rest, and
    an unset cluster_dim is the default group for head_dim."""
    if fields.get("cluster_dim") is None:
        fields["cluster_dim"] = default_cluster_dim(head_dim)
    meta = getattr(rotations, "metadata", {})
    for key in ("k_clip", "v_clip", "codebook"):
        if fields.get(key) is None and meta.get(key) is not None:
            fields[key] = meta[key]
    return OscarConfig(**{key: value for key, value in fields.items() if value is not None})


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_table(directory: Path) -> dict:
    """{name: {bytes, sha256}} of every file in the directory, recursively (an .mlpackage is a folder)."""
    return {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
            for p in sorted(directory.rglob("*")) if p.is_file()}


def check_out(out: Path) -> None:
    """out may be new, empty, or a previous artifact (replaced); anything else is refused."""
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / MANIFEST).is_file())):
        raise OscarInputError(f"--out {str(out)!r} exists and is not an oscar-export artifact: "
                              "expected a new or empty directory, or a previous export to replace")
    if not out.parent.is_dir():
        raise OscarInputError(f"--out {str(out)!r}: parent directory does not exist")


def check_export_args(out, rotations, device_memory: str) -> int:
    """What every export refuses before loading a model; returns the device memory in bytes."""
    from ..planner import parse_bytes

    check_out(Path(out))
    memory = parse_bytes(device_memory, "--device-memory")
    if isinstance(rotations, str) and rotations == "online":
        raise OscarInputError("--rotations online estimates rotations from each prompt and cannot be exported: "
                              "expected hadamard, none or a rotation file (oscar-export calibrate)")
    return memory


def default_context(shape, max_context: int | None) -> int:
    """--context, or the model's max_position_embeddings capped at 4096."""
    return max_context or min(4096, shape.max_position_embeddings or 4096)


@contextlib.contextmanager
def staged(out: Path):
    """Yields an empty temporary directory next to `out`; on success it replaces `out` atomically."""
    out = Path(out)
    check_out(out)
    temp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        yield temp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(temp, out)
            shutil.rmtree(old)
        else:
            os.replace(temp, out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def write_manifest(directory: Path, manifest: dict) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def save_inputs(temp: Path, tokenizer, rotations, resolved) -> str:
    """The tokenizer and, when one was used, the rotation file; returns the manifest's `rotations` entry."""
    tokenizer.save_pretrained(temp)
    if resolved in ("hadamard", "none"):
        return resolved
    shutil.copy2(rotations, Path(temp) / ROTATION_FILE)
    return ROTATION_FILE


def finish_manifest(temp: Path, target: str, runtime: str, model_name: str, model, shape, rotations: str,
                    config: OscarConfig, max_context: int, max_chunk: int, weights: str, plan: dict,
                    packages: tuple[str, ...], **extra) -> dict:
    """Write manifest.json (what was exported, sha256 of every file written so far) and return it."""
    manifest = {
        "format": manifest_format(target),
        "target": target,
        "runtime": runtime,
        "model": {"source": model_name if model_name == "bundled" else str(Path(model_name).resolve()),
                  "model_type": model.config.model_type, "layers": shape.layers, "q_heads": shape.q_heads,
                  "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "vocab": shape.vocab},
        "rotations": rotations,
        # How the rotations were made (method, text and its hash, tokens, clips, time), from the file itself.
        "rotations_metadata": (load_rotations(Path(temp) / ROTATION_FILE).metadata if rotations == ROTATION_FILE
                               else {"method": rotations}),
        "config": config.to_dict(),
        "max_context": max_context,
        "max_chunk": max_chunk,
        "weights": weights,
        "eos_token_ids": eos_ids(model),
        **extra,
        "files": file_table(temp),
        "plan": plan,
        "versions": {name: importlib.metadata.version(name) for name in packages},
    }
    write_manifest(temp, manifest)
    return manifest


def load_manifest(directory, target: str | None = None) -> dict:
    """The artifact's manifest; with `target`, it must be that target's."""
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise OscarInputError(f"--artifact {str(directory)!r}: no readable {MANIFEST} ({err}): "
                              "expected a directory written by 'oscar-export --target ...'") from None
    found = manifest.get("target") if isinstance(manifest, dict) else None
    if found is None or manifest.get("format") != manifest_format(found) or target not in (None, found):
        want = manifest_format(target) if target else "oscar-export/<target>/1"
        raise OscarInputError(f"--artifact {str(directory)!r}: {MANIFEST} is not format {want!r}")
    return manifest


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def reference_tokens(manifest: dict, directory: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    """The same generation through transformers with the reference OscarCache (needs the source checkpoint)."""
    from ..hf_cache import patch_model_for_kv_quant
    from ..models import load_model

    model, _ = load_model(manifest["model"]["source"])
    rotations = manifest["rotations"]
    rotations = Path(directory) / rotations if rotations == ROTATION_FILE else rotations
    config = dict(manifest["config"])
    patch_model_for_kv_quant(model, rotations=rotations, max_context=manifest["max_context"],
                             cluster_dim=config.pop("cluster_dim"), **config)
    eos = manifest["eos_token_ids"] or None
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos)
    return out[0, len(ids):].tolist()


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise OscarInputError("--prompt is empty after tokenization: expected some text")
    return ids


def eager_module(directory, manifest: dict):
    """The eager graph (graph.OscarCausalLM) of the artifact's source model, config and rotations."""
    from ..hf_cache import _resolve_rotations
    from ..models import load_model
    from .graph import OscarCausalLM

    model, _ = load_model(manifest["model"]["source"])
    rotations = manifest["rotations"]
    resolved = _resolve_rotations(str(Path(directory) / rotations) if rotations == ROTATION_FILE else rotations, model)
    return OscarCausalLM(model, config_for(resolved, **manifest["config"]), resolved).eval()


def eager_trace(module, ids: list[int], steps: int, max_context: int, max_chunk: int, eos=()) -> dict:
    """Greedy run of the eager graph (graph.OscarCausalLM, in-place cache): the reference of parity.

    Returns the greedy `tokens`, the logits of each step (the prefill's last position, then each
    decode step's) and the packed body `codes` by cache name.
    """
    cache = module.new_cache(max_context)
    length, tokens, logits = torch.zeros(1, dtype=torch.int64), [], []
    with torch.no_grad():
        for start in range(0, len(ids), max_chunk):
            chunk = ids[start:start + max_chunk]
            step = module(torch.tensor([chunk]), length, *cache)
            length += len(chunk)
        for _ in range(steps):
            logits.append(step[0, -1].numpy().copy())
            tokens.append(int(step[0, -1].argmax()))
            if tokens[-1] in eos or len(tokens) == steps:
                break
            step = module(torch.tensor([[tokens[-1]]]), length, *cache)
            length += 1
    names = [name for name, _, _ in module.cache_spec(max_context)]
    return {"tokens": tokens, "logits": logits,
            "codes": {name: t.numpy() for name, t in zip(names, cache) if name.endswith("_codes")}}


class GreedyLM:
    """Greedy generation for a runtime's runner, which provides step(ids) -> the last position's logits
    (advancing its cache by len(ids) tokens) and max_chunk, the longest chunk one step takes."""

    max_chunk: int

    def step(self, ids) -> np.ndarray:
        raise NotImplementedError

    def prefill(self, ids) -> np.ndarray:
        ids = list(ids)
        if not ids:
            raise OscarInputError("prompt is empty: expected at least one token")
        for start in range(0, len(ids), self.max_chunk):
            logits = self.step(ids[start:start + self.max_chunk])
        return logits

    def trace(self, ids, steps: int, eos_token_ids=()) -> tuple[list[int], list[np.ndarray]]:
        """Greedy tokens after the prompt, stopping after an EOS token or `steps` tokens, and the logits
        each came from: the prefill's, then each decode step's."""
        logits, tokens, seen = self.prefill(ids), [], []
        while len(tokens) < steps:
            seen.append(logits)
            tokens.append(int(np.argmax(logits)))
            if tokens[-1] in eos_token_ids or len(tokens) == steps:
                break
            logits = self.step([tokens[-1]])
        return tokens, seen

    def generate(self, ids, max_new_tokens: int, eos_token_ids=()) -> list[int]:
        return self.trace(ids, max_new_tokens, eos_token_ids)[0]

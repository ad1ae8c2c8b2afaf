"""The android target: model.pte for ExecuTorch (XNNPACK for the dense layers, the native
oscar::attention kernel over a packed cache kept in the program's mutable buffers).

Directory contents: model.pte, liboscar_executorch.so (the kernel library for this machine),
native/ (the C++ sources of the kernel and core, a CMake snippet, for an app's NDK build), the
tokenizer files, the rotation file when one was used, and manifest.json.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from ..config import OscarInputError
from .artifact import (check_export_args, config_for, default_context, eos_ids, finish_manifest,
                       load_manifest, prompt_ids, reference_tokens, save_inputs, staged)
from .graph import CACHE_NAMES, OscarCausalLM

MODEL_FILE = "model.pte"
LIBRARY_FILE = "liboscar_executorch.so"
NATIVE_DIR = "native"
MAX_CHUNK = 256  # prefill chunk: the runner splits longer prompts into chunks of get_max_seq_len
DEFAULT_GROUP_SIZE = 32
PACKAGES = ("oscar-export", "torch", "transformers", "executorch", "torchao")


class _LayerCache(nn.Module):
    def __init__(self, spec):
        super().__init__()
        for name, shape, dtype in spec:
            # Not persistent: the program keeps the cache as planned memory, never as weights.
            self.register_buffer(name, torch.zeros(shape, dtype=dtype), persistent=False)


class ExecuTorchLM(nn.Module):
    """forward(tokens [1, T] int64, input_pos [1] int64) -> logits [1, 1, vocab]: the LLM runner's signature.

    The packed cache of every layer lives in this module's buffers (cache.{layer}.{k_sink ...}), which
    oscar::attention updates in place, so the exported program keeps them as mutable buffers.
    """

    def __init__(self, lm: OscarCausalLM, max_context: int):
        super().__init__()
        if lm.functional:
            raise OscarInputError("ExecuTorchLM updates the cache in place: expected OscarCausalLM(functional=False)")
        self.lm, n = lm, len(CACHE_NAMES)
        spec = [(name.split(".", 1)[1], shape, dtype) for name, shape, dtype in lm.cache_spec(max_context)]
        self.cache = nn.ModuleList(_LayerCache(spec[i * n:(i + 1) * n]) for i in range(len(lm.layers)))

    def cache_buffers(self) -> list[torch.Tensor]:
        return [getattr(layer, name) for layer in self.cache for name in CACHE_NAMES]

    def forward(self, tokens, input_pos):
        return self.lm(tokens, input_pos, *self.cache_buffers())


def quantize_weights(module: nn.Module, group_size: int) -> int:
    """torchao 8-bit dynamic activations, 4-bit grouped weights on every Linear whose inputs divide into
    groups (XNNPACK runs them); returns how many were quantized."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    chosen = [m for m in module.modules() if isinstance(m, nn.Linear) and m.in_features % group_size == 0]
    if not chosen:
        raise OscarInputError(f"--group-size {group_size}: no linear layer has a multiple of {group_size} inputs")
    quantize_(module, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                           weight_granularity=PerGroup(group_size)),
              filter_fn=lambda m, fqn: any(m is c for c in chosen))
    return len(chosen)


class HalfEmbedding(nn.Module):
    """An embedding table stored in fp16 (as the planner counts it in 4-bit exports), looked up then cast to fp32."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.weight = nn.Parameter(table.weight.detach().half(), requires_grad=False)

    def forward(self, ids):
        return nn.functional.embedding(ids, self.weight).float()


def runner_metadata(model, tokenizer, max_context: int, max_chunk: int) -> dict:
    """The constant methods ExecuTorch's LLM runner reads (extension/llm/runner/constants.h)."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else model.config.bos_token_id
    return {
        "get_max_seq_len": max_chunk,        # longest prefill chunk one forward call takes
        "get_max_context_len": max_context,  # cache capacity
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": False,
        "enable_dynamic_shape": True,        # a prompt is prefilled in one call, not token by token
        "get_bos_id": int(bos if bos is not None else -1),
        "get_eos_ids": eos_ids(model),
        "get_vocab_size": int(model.config.get_text_config().vocab_size),
    }


def lower(module: ExecuTorchLM, max_context: int, max_chunk: int, metadata: dict):
    """torch.export with a dynamic prefill length, XNNPACK for the dense layers, the cache as mutable
    buffers; returns the ExecutorchProgramManager."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from torch.export import Dim, export

    tokens = torch.zeros(1, min(2, max_chunk), dtype=torch.long)
    dims = ({1: Dim("tokens", min=1, max=max_chunk)}, None)
    with torch.no_grad():
        program = export(module, (tokens, torch.zeros(1, dtype=torch.long)), dynamic_shapes=dims, strict=False)
    edge = to_edge_transform_and_lower(
        program, partitioner=[XnnpackPartitioner()], constant_methods=metadata,
        # oscar::attention is opaque to the edge dialect checks (its kernel is ours, not ATen's).
        compile_config=EdgeCompileConfig(_check_ir_validity=False))
    # Buffer names let a host read the cache back (ExecuTorchMethod.get_attribute).
    return edge.to_executorch(ExecutorchBackendConfig(emit_mutable_buffer_names=True))


def copy_native_sources(dest: Path) -> None:
    """What an app's NDK build compiles: the core, the ExecuTorch adapter and the CMake snippet."""
    from ..native import SOURCES

    (dest / "core").mkdir(parents=True)
    (dest / "executorch").mkdir()
    for path in sorted((SOURCES / "core").iterdir()):
        if path.suffix in (".cc", ".h") and not path.name.startswith("oscar_c_api"):
            shutil.copy2(path, dest / "core" / path.name)
    for name in ("oscar_et.cc", "oscar_executorch.cmake"):
        shutil.copy2(SOURCES / "executorch" / name, dest / "executorch" / name)
    shutil.copy2(SOURCES / "executorch" / "android" / "CMakeLists.txt", dest / "CMakeLists.txt")


def export_android(model_name: str, out, rotations: str = "hadamard", max_context: int | None = None,
                   float_weights: bool = False, group_size: int = DEFAULT_GROUP_SIZE, device_memory: str = "8GB",
                   **config_fields) -> dict:
    """Export `model_name` ('bundled' or a local checkpoint) to the artifact directory `out`; returns the manifest.

    config_fields: OscarConfig fields (k_bits, cluster_dim, sink, ...); None keeps the default, or the
    rotation file's value for clip ratios and codebook.
    """
    from ..hf_cache import _resolve_rotations
    from ..models import load_model, model_shape
    from ..native import executorch_library_path
    from ..planner import plan

    memory = check_export_args(out, rotations, device_memory)
    if group_size <= 0:
        raise OscarInputError(f"--group-size {group_size}: expected a positive channel count")
    model, tokenizer = load_model(model_name)
    shape = model_shape(model_name)
    max_context = default_context(shape, max_context)
    max_chunk = min(MAX_CHUNK, max_context)
    resolved = _resolve_rotations(rotations, model)
    config = config_for(resolved, shape.head_dim, **config_fields)
    library = executorch_library_path()  # fail before minutes of lowering when the kernel cannot be built
    lm = OscarCausalLM(model, config, resolved).eval()
    if not float_weights:
        quantize_weights(lm, group_size)  # a tied lm_head becomes its own 4-bit copy first
        lm.embed_tokens = HalfEmbedding(lm.embed_tokens)
    module = ExecuTorchLM(lm, max_context).eval()
    program = lower(module, max_context, max_chunk, runner_metadata(model, tokenizer, max_context, max_chunk))
    with staged(out) as temp:
        program.write_to_file(open(temp / MODEL_FILE, "wb"))
        shutil.copy2(library, temp / LIBRARY_FILE)
        copy_native_sources(temp / NATIVE_DIR)
        manifest = finish_manifest(
            temp, "android", "executorch", model_name, model, shape, save_inputs(temp, tokenizer, rotations, resolved),
            config, max_context, max_chunk,
            "float32" if float_weights else
            f"int4 (torchao 8-bit dynamic activations, group {group_size}), fp16 embeddings",
            plan(shape, config, memory, max_context, weight_bits=16 if float_weights else 4, weight_group=group_size,
                 weight_zero_points=False),  # XNNPACK's 4-bit weights are symmetric: a scale, no zero
            PACKAGES)
    return manifest


def run_artifact(directory, prompt: str, max_new_tokens: int, runtime: str = "executorch", threads: int = 0) -> dict:
    """Greedy generation from an artifact: {"tokens": [...], "text": "..."}."""
    from transformers import AutoTokenizer

    from .et_runner import RUNTIMES, EtLM, stock_runner_generate

    if runtime not in (*RUNTIMES, "reference"):
        raise OscarInputError(f"--runtime {runtime!r}: expected one of {(*RUNTIMES, 'reference')}")
    directory = Path(directory)
    manifest = load_manifest(directory, "android")
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = prompt_ids(tokenizer, prompt)
    if runtime == "reference":
        tokens = reference_tokens(manifest, directory, ids, max_new_tokens)
    elif runtime == "stock-runner":
        return stock_runner_generate(directory, prompt, max_new_tokens, threads)
    else:
        lm = EtLM(directory, threads, manifest["max_chunk"])
        tokens = lm.generate(ids, max_new_tokens, manifest["eos_token_ids"])
    return {"tokens": tokens, "text": tokenizer.decode(tokens)}

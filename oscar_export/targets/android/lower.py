"""The android target's lowering: the exportable graph with its cache in mutable buffers, torchao's 4-bit weights,
torch.export and ExecuTorch's XNNPACK lowering, and the files the artifact holds beside the program."""

from __future__ import annotations

import copy
import ctypes
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...config import OscarInputError
from ...export.artifact import eos_ids
from ...ops.attention import CACHE_NAMES
from .. import Lowered

MODEL_FILE = "model.pte"
LIBRARY_FILE = "liboscar_executorch.so"
NATIVE_DIR = "native"


class _LayerCache(nn.Module):
    def __init__(self, spec):
        super().__init__()
        for name, shape, dtype in spec:
            # Not persistent: the program keeps the cache as planned memory, never as weights. Zeroed by calloc
            # (numpy's zeros), whose large blocks are fresh zero pages, resident only once written: exporting
            # reads shapes, so a 32K cache (4 GiB in fp16 at Llama-3-8B's shape) costs the export no memory.
            zeros = torch.from_numpy(np.zeros(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype))
            self.register_buffer(name, zeros, persistent=False)


class ExecuTorchLM(nn.Module):
    """forward(tokens [1, T] int64, input_pos [1] int64) -> logits [1, 1, vocab]: the LLM runner's signature.

    The packed cache of every layer lives in this module's buffers (cache.{layer}.{k_sink ...}), which
    oscar::attention updates in place, so the exported program keeps them as mutable buffers.
    """

    def __init__(self, lm, max_context: int):
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


def quantize_weights(module: nn.Module, group_size: int, linears: list[nn.Linear] | None = None) -> int:
    """torchao 8-bit dynamic activations, 4-bit grouped weights on the module's linears (`linears`: only these)
    whose inputs divide into groups (XNNPACK runs them); returns how many were quantized."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    candidates = linears if linears is not None else [m for m in module.modules() if isinstance(m, nn.Linear)]
    chosen = [m for m in candidates if m.in_features % group_size == 0]
    if chosen:
        quantize_(module, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                               weight_granularity=PerGroup(group_size)),
                  filter_fn=lambda m, fqn: any(m is c for c in chosen))
        # XNNPACK stores a group-wise weight's scales in bf16 (ExecuTorch's lowering casts them): round them
        # here, so the program and the eager reference hold the same weights (the cast is then exact).
        with torch.no_grad():
            for m in chosen:
                m.weight.scale.copy_(m.weight.scale.to(torch.bfloat16).float())
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


def return_freed_buffers_to_the_os() -> bool:
    """Keep every allocation over 128 KiB in its own mapping, unmapped when freed (glibc; elsewhere a no-op).

    glibc raises its mmap threshold after each large free, up to 32 MiB, and buffers under it then come from
    the heap, where freed ones stay resident. Weight quantization and ExecuTorch's XNNPACK lowering free many
    such temporaries: at Llama-3-8B's width the lowering kept 0.57 GiB more a layer with the moving threshold,
    0.17 GiB with this one (measured on 4 and 8 layers). Returns whether the setting took.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold = -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 128 * 1024))


def quantized_weight_storages(module: nn.Module) -> set[int]:
    """Data pointers of the storages behind the module's torchao-quantized linear weights (codes, scales, zero
    points): each belongs to one linear, so XNNPACK packs it into exactly one partition."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    ptrs = set()
    for m in module.modules():
        if isinstance(m, nn.Linear) and is_traceable_wrapper_subclass(m.weight):
            for name in m.weight.__tensor_flatten__()[0]:
                ptrs.add(getattr(m.weight, name).untyped_storage().data_ptr())
    return ptrs


@contextmanager
def xnnpack_packs_weights_once(release: set[int]):
    """While XNNPACK lowers: its per-partition copies of the program share the weight tensors, and the storages in
    `release` are freed as soon as their partition is packed.

    ExecuTorch deep-copies every partition's program, weights included, before packing any of them, so the
    lowering held the quantized weights twice (at Llama-3-8B's width and 32 layers, RSS went from 10.9 to 19.0
    GiB in the first seconds of the lowering). XNNPACK's preprocess reads the weights and writes packed copies; it
    changes the graph, never a weight in place, so sharing them is safe (tests/targets/
    test_android_lowering_memory.py: the program is byte-identical). Freeing them leaves the weights' owners (the
    module, the exported program) unusable: only for a module exported once.
    """
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    saved = {name: XnnpackBackend.__dict__.get(name) for name in ("copy_exported_program_for_preprocess", "preprocess")}
    preprocess = XnnpackBackend.preprocess

    def tensors(program):
        return [t for t in (*program.state_dict.values(), *program.constants.values()) if isinstance(t, torch.Tensor)]

    def copy_sharing_weights(cls, program, compile_specs):
        return copy.deepcopy(program, {id(t): t for t in tensors(program)})

    def preprocess_then_release(program, compile_specs):
        result = preprocess(program, compile_specs)
        for t in tensors(program):
            storage = t.untyped_storage()
            if storage.data_ptr() in release:
                release.discard(storage.data_ptr())  # a later allocation may reuse the address
                storage.resize_(0)
        return result

    XnnpackBackend.copy_exported_program_for_preprocess = classmethod(copy_sharing_weights)
    XnnpackBackend.preprocess = staticmethod(preprocess_then_release)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(XnnpackBackend, name)
            else:
                setattr(XnnpackBackend, name, value)


def lower(module: nn.Module, max_context: int, max_chunk: int, metadata: dict, graph_passes=(),
          spend_weights: bool = False):
    """torch.export with a dynamic prefill length, XNNPACK for the dense layers, the cache as mutable
    buffers; returns the ExecutorchProgramManager. graph_passes: run on the exported graph, which is then
    exported again (as ExecuTorch's LLM export runs its canonical passes). spend_weights: free each quantized
    linear's weights once XNNPACK has packed them (xnnpack_packs_weights_once), leaving `module` unusable."""
    from torch.export import Dim

    inputs = (torch.zeros(1, min(2, max_chunk), dtype=torch.long), torch.zeros(1, dtype=torch.long))
    dims = ({1: Dim("tokens", min=1, max=max_chunk)}, None)
    with warnings.catch_warnings():
        # Raised inside torch.export's and ExecuTorch's own pytree code, once per pass; nothing the user can change.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        # The cache buffers' initial bytes are never read: `length` says how much of them holds tokens.
        warnings.filterwarnings("ignore", message="Mutation on a buffer in the model is detected", category=UserWarning)
        return _lower(module, inputs, dims, metadata, graph_passes, spend_weights)


def _lower(module, inputs, dims, metadata, graph_passes, spend_weights):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from torch.export import export

    with torch.no_grad():
        program = export(module, inputs, dynamic_shapes=dims, strict=False)
        if graph_passes:
            graph = program.module()
            for graph_pass in graph_passes:
                graph = graph_pass(graph).graph_module
            program = export(graph, inputs, dynamic_shapes=dims, strict=False)
    with xnnpack_packs_weights_once(quantized_weight_storages(module) if spend_weights else set()):
        edge = to_edge_transform_and_lower(
            program, partitioner=[XnnpackPartitioner()], constant_methods=metadata,
            # oscar::attention is opaque to the edge dialect checks (its kernel is ours, not ATen's).
            compile_config=EdgeCompileConfig(_check_ir_validity=False))
    # Buffer names let a host read the cache back (ExecuTorchMethod.get_attribute).
    return edge.to_executorch(ExecutorchBackendConfig(emit_mutable_buffer_names=True))


def copy_native_sources(dest: Path) -> None:
    """What an app's NDK build compiles: the core, the ExecuTorch adapter and the CMake snippet."""
    from ...native import SOURCES

    (dest / "core").mkdir(parents=True)
    (dest / "executorch").mkdir()
    for path in sorted((SOURCES / "core").iterdir()):
        if path.suffix in (".cc", ".h") and not path.name.startswith("oscar_c_api"):
            shutil.copy2(path, dest / "core" / path.name)
    for name in ("oscar_et.cc", "oscar_executorch.cmake"):
        shutil.copy2(SOURCES / "executorch" / name, dest / "executorch" / name)
    shutil.copy2(SOURCES / "executorch" / "android" / "CMakeLists.txt", dest / "CMakeLists.txt")


def quantize_artifact_weights(module: nn.Module, group_size: int, weights=None) -> None:
    """4-bit linears and an fp16 embedding table. weights (a streamed export): the module is on the meta device
    and each part is quantized as soon as it is read, so the model never exists in fp32 as a whole."""
    count = 0

    def rest(root):
        nonlocal count
        count += quantize_weights(root, group_size, [root.lm_head])  # a tied lm_head becomes its own 4-bit copy
        root.embed_tokens = HalfEmbedding(root.embed_tokens)

    def layer(part):
        nonlocal count
        count += quantize_weights(part, group_size)

    if weights is None:
        for part in module.layers:
            layer(part)
        rest(module)
    else:
        weights.materialize(rest, layer)
    if not count:
        raise OscarInputError(f"--group-size {group_size}: no linear layer has a multiple of {group_size} inputs")


def lower_artifact(module, model, tokenizer, max_context: int, max_chunk: int, float_weights: bool, group_size: int,
                   weights=None) -> Lowered:
    """Target.lower: the program, its kernel library and the kernel's sources for an NDK build."""
    from ...native import executorch_library_path

    library = executorch_library_path()  # fail before minutes of lowering when the kernel cannot be built
    return_freed_buffers_to_the_os()  # before the weights are read: quantizing them frees temporaries too
    if not float_weights:
        quantize_artifact_weights(module, group_size, weights)
    elif weights is not None:
        weights.materialize(lambda root: None, lambda layer: None)
    # The module is exported once: its quantized weights are freed as XNNPACK packs them.
    program = lower(ExecuTorchLM(module, max_context).eval(), max_context, max_chunk,
                    runner_metadata(model, tokenizer, max_context, max_chunk), spend_weights=True)

    def write(temp: Path) -> None:
        with open(temp / MODEL_FILE, "wb") as f:
            program.write_to_file(f)
        shutil.copy2(library, temp / LIBRARY_FILE)
        copy_native_sources(temp / NATIVE_DIR)

    return Lowered(write, "float32" if float_weights else
                   f"int4 (torchao 8-bit dynamic activations, group {group_size}), fp16 embeddings",
                   {"group_size": group_size})

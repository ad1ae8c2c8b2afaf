"""Core ML conversion of OscarCausalLM (the ios target): an ML program for iOS 18 / macOS 15.

The shared module (graph.py, functional=True) is traced with torch.export while RowsComposition
turns each oscar op into standard ops (ops/coreml.py), then converted with coremltools.

Model I/O (docs/ios.md): inputs `input_ids` int32 [1, T] (T = 1 .. max_chunk), `length` int32 [1],
and per layer the cache `layer{i}_k_sink` ... `layer{i}_v_zero` (codes as int32 words, the rest
fp16, static shapes); outputs `logits` fp32 [1, 1, vocab] and per layer the rows the chunk adds,
`layer{i}_k_new` ... `layer{i}_v_body_zero`, which the host writes into its buffers.

The whole program computes in fp32: coremltools' fp16 pass would also reach the quantizer, whose
codes must be bit-exact (format.md section 3), and every op on packed words is integer
(`packed_float_ops` checks the converted program). Weights are stored in fp16 (float_weights) or
4-bit, and expanded to fp32 where they are read.
"""

from __future__ import annotations

import numpy as np
import torch

from ...sizes import KINDS
from ...config import OscarInputError
from ...ops.coreml import ROW_NAMES, RowsComposition, fp8_word_count, register_coreml_ops
from ...export.graph import OscarCausalLM

MODEL_FILE = "model.mlpackage"
_NUMPY = {torch.float16: np.float16, torch.int32: np.int32}


def cache_inputs(module: OscarCausalLM, max_context: int) -> list[tuple[str, tuple[int, ...], type]]:
    """(name, shape, numpy dtype) of every cache input: graph.py's layout with codes and fp8 scales and zeros as
    int32 words."""
    out = []
    for name, shape, dtype in module.cache_spec(max_context):
        if name.endswith("_codes"):  # D*bits/8 bytes, a multiple of 4 since cluster_dim >= 32 divides D
            shape, dtype = (*shape[:-1], shape[-1] // 4), torch.int32
        elif dtype == torch.uint8:  # fp8 scales or zeros, [H, B, G] bytes 4 to a word
            shape, dtype = (shape[0], fp8_word_count(*shape[1:])), torch.int32
        out.append((name.replace(".", "_"), shape, _NUMPY[dtype]))
    return out


def output_names(layers: int) -> list[str]:
    return ["logits", *(f"layer{i}_{name}" for i in range(layers) for name in ROW_NAMES)]


def check_layout(sink: int, recent: int, max_context: int) -> None:
    """Core ML cannot take zero-sized inputs: the packed body needs slots too (the windows' floor is
    Target.min_window, which Target.check holds)."""
    if max_context <= sink + recent:
        raise OscarInputError(f"--context {max_context} leaves no packed body: expected more than sink + recent = "
                              f"{sink + recent} tokens")


def trace(module: OscarCausalLM, max_context: int, max_chunk: int) -> torch.export.ExportedProgram:
    """torch.export of the module with the oscar ops composed of standard ops, T dynamic."""
    check_layout(module.config.sink, module.config.recent, max_context)
    cache = [torch.zeros(shape, dtype={np.float16: torch.float16, np.int32: torch.int32}[dtype])
             for _, shape, dtype in cache_inputs(module, max_context)]
    example = (torch.zeros(1, min(8, max_chunk), dtype=torch.int32), torch.zeros(1, dtype=torch.int32), *cache)
    chunk = torch.export.Dim("T", min=1, max=max_chunk)
    functional = module.functional
    module.functional = True
    try:
        with torch.no_grad(), RowsComposition():
            # Shape guards become runtime asserts instead of export errors: they only restate 1 <= T.
            program = torch.export.export(module, example, dynamic_shapes=({1: chunk}, None, (None,) * len(cache)),
                                          prefer_deferred_runtime_asserts_over_guards=True)
    finally:
        module.functional = functional
    program = program.run_decompositions({})
    graph = program.graph
    for node in list(graph.nodes):  # Core ML has no assert op; the asserts only check T >= 1
        if node.target is torch.ops.aten._assert_scalar.default:
            graph.erase_node(node)
    graph.eliminate_dead_code()
    program.graph_module.recompile()
    return program


def unsupported_ops(program: torch.export.ExportedProgram) -> list[str]:
    """'op (in module path)' for every node coremltools' torch frontend cannot convert."""
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

    register_coreml_ops()
    found = []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        kind = target.name() if hasattr(target, "name") else getattr(target, "__name__", str(target))
        if _TORCH_OPS_REGISTRY.get_func(kind) is not None:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        where = list(stack.values())[-1][0] if stack else "the model's top level"
        found.append(f"{kind} (in {where})")
    return list(dict.fromkeys(found))


def convert(module: OscarCausalLM, max_context: int, max_chunk: int, float_weights: bool = False,
            compute_precision=None, weight_block: int = 32):
    """The Core ML model (coremltools MLModel, not yet saved). compute_precision: fp32 unless given; 4-bit
    weights unless float_weights, a scale per weight_block input channels."""
    import coremltools as ct

    program = trace(module, max_context, max_chunk)
    bad = unsupported_ops(program)
    if bad:
        raise OscarInputError(f"the model has operations Core ML cannot convert: {', '.join(bad)}: expected a "
                              "Llama, Qwen2, Qwen3 or Mistral decoder built from standard layers")
    names = [name for name, _, _ in cache_inputs(module, max_context)]
    outputs = output_names(len(module.layers))
    precision = ct.precision.FLOAT32 if compute_precision is None else compute_precision
    mil = ct.convert(program, convert_to="milinternal", minimum_deployment_target=ct.target.iOS18,
                     compute_precision=precision, outputs=[ct.TensorType(name=name) for name in outputs])
    # Feature names the app uses: the frontend names inputs after forward's arguments (cache_0 ...).
    main = mil.functions["main"]
    renamed = dict(zip([f"cache_{i}" for i in range(len(names))], names))
    for old in list(main._input_dict):
        var = main._input_dict.pop(old)
        var.name = renamed.get(old, old)
        main._input_dict[var.name] = var
    _store_weights_fp16(main)
    model = ct.convert(mil, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                       compute_precision=precision, pass_pipeline=ct.PassPipeline.EMPTY, skip_model_load=True)
    if not float_weights:
        model = compress_weights(model, weight_block)
    return model


def _store_weights_fp16(main) -> None:
    """Weight matrices stored in fp16 and cast to fp32 where they are read: half the bytes, fp32 compute.

    Only the model's parameters (`p_*` constants of rank 2: projections, embeddings); rotations,
    levels and RoPE frequencies stay fp32.
    """
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types
    from coremltools.converters.mil.mil.scope import ScopeInfo

    for op in list(main.operations):
        var = op.outputs[0]
        if op.op_type != "const" or not var.name.startswith("p_") or var.dtype != types.fp32 or var.rank != 2:
            continue
        # The new ops keep the constant's scopes (its torch source), which the serializer requires.
        with main, mb.scope(*(ScopeInfo(source=source, data=data) for source, data in op.scopes.items())):
            half = mb.const(val=var.val.astype(np.float16), name=f"{var.name}_fp16", before_op=op)
            full = mb.cast(x=half, dtype="fp32", name=f"{var.name}_fp32", before_op=op)
        main.replace_uses_of_var_after_op(anchor_op=full.op, old_var=var, new_var=full)
        main.remove_ops([op])


def compress_weights(model, block: int):
    """4-bit weights: linear quantization per `block` input channels (iOS 18 blockwise ops).

    Only the model's parameters (`p_*` constants); rotations and other buffers keep their precision,
    since a quantized rotation is no longer orthogonal.
    """
    import coremltools.optimize.coreml as cto

    from .mil_eval import saved_program

    program = model._mil_program or saved_program(model)
    keep = {op.name: None for op in program.functions["main"].operations
            if op.op_type == "const" and not op.name.startswith("p_")}
    op = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                     block_size=block, weight_threshold=2048)
    return cto.linear_quantize_weights(model, cto.OptimizationConfig(global_config=op, op_name_configs=keep))


# -- the fp16 check ---------------------------------------------------------------------------------

_INTEGER = ("int32", "int16", "int8", "uint16", "uint8", "bool")
_DATA_INPUTS = ("x", "y", "a", "b", "values", "data")


def _dtype(var) -> str:
    from coremltools.converters.mil.mil import types

    return types.builtin_to_string(var.dtype)


def packed_path(mil_program, packed_inputs, packed_outputs) -> list:
    """The operations on packed data, in program order.

    Packed data: the packed-word inputs and everything derived from them up to the unpacked codes
    (a gather's indices: what it gathers is level values, no longer packed), and on the way out
    every op that the packed-word outputs are computed from, back to the threshold comparisons
    whose bool results start the codes.
    """
    main = mil_program.functions["main"]
    tainted, ops = {main.inputs[name].name for name in packed_inputs}, []
    for op in main.operations:
        uses = {key for key, var in op.inputs.items()
                if any(v.name in tainted for v in (var if isinstance(var, (list, tuple)) else [var]))}
        if uses and not (op.op_type == "gather" and uses == {"indices"}):
            ops.append(op)
            tainted.update(out.name for out in op.outputs)
    producers = {out.name: op for op in main.operations for out in op.outputs}
    wanted = {var.name for var in main.outputs if var.name in set(packed_outputs)}
    seen, stack = set(), [producers[name] for name in wanted if name in producers]
    while stack:
        op = stack.pop()
        if id(op) in seen:
            continue
        seen.add(id(op))
        ops.append(op)
        for key, var in op.inputs.items():
            if key not in _DATA_INPUTS:  # shapes, axes, slice bounds: not values of the packed data
                continue
            for v in var if isinstance(var, (list, tuple)) else [var]:
                if v.name in producers and _dtype(v) != "bool" and producers[v.name].op_type != "const":
                    stack.append(producers[v.name])
    order = {id(op): i for i, op in enumerate(main.operations)}
    return sorted({id(op): op for op in ops}.values(), key=lambda op: order[id(op)])


def packed_float_ops(mil_program, packed_inputs, packed_outputs) -> list[str]:
    """Operations on packed data (packed_path) that compute in floating point: 'op_type name (dtypes)'.

    fp16 holds integers exactly only below 2048 and fp32 below 2^24; a packed word has 32 bits, so
    any float op there corrupts codes.
    """
    found = []
    for op in packed_path(mil_program, packed_inputs, packed_outputs):
        dtypes = sorted(({_dtype(v) for var in op.inputs.values()
                          for v in (var if isinstance(var, (list, tuple)) else [var])}
                         | {_dtype(v) for v in op.outputs}) - {"string"})  # string: an attribute (cast's dtype)
        if any(d not in _INTEGER for d in dtypes):
            found.append(f"{op.op_type} {op.name} ({', '.join(dtypes)})")
    return found


def packed_names(layers: int, scale_dtype: str = "float16") -> tuple[list[str], list[str]]:
    """(packed-word input names, packed-word output names) of a converted model: the codes, and with fp8 scales
    their scale and zero words and bytes."""
    regions = ("codes", "scale", "zero") if scale_dtype == "float8_e4m3fn" else ("codes",)
    inputs = [f"layer{i}_{kind}_{region}" for i in range(layers) for kind in KINDS for region in regions]
    outputs = [f"layer{i}_{kind}_body_{region}" for i in range(layers) for kind in KINDS for region in regions]
    return inputs, outputs


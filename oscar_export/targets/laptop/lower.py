"""ONNX export of OscarCausalLM for ONNX Runtime (the laptop target).

model.onnx: each layer's attention is one `oscar.OscarAttention` node (runtime_ops/onnxruntime,
docs/onnx_ops.md) fed straight from graph inputs `layer{i}.k_sink` ... `layer{i}.v_zero`, which the
native op updates in place: the host binds persistent buffers once (runner.py). The graph's
only output is `logits`.

model_fallback.onnx: the same graph and weights (it reads model.onnx.data) for a stock ONNX
Runtime without the native library. Each node becomes `oscar.OscarAttentionFunctional`, an ONNX
function of standard ops (ops/onnx.py); standard ops cannot write their inputs, so it returns the updated
buffers as outputs `layer{i}.k_sink.next` ... and the host feeds them back. It stores the artifact's
scales: float16, or fp8 E4M3 bits as uint8 (scale_dtype float8_e4m3fn).

Weights are 4-bit by default (ONNX Runtime's MatMulNBits quantizer; the lm_head 8-bit; activations
quantized to int8 per block on the fly) with fp16 embedding tables, float with float_weights.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript
import torch

from ...config import OscarInputError
from ...export.graph import OscarCausalLM
from ...ops.onnx import make_fallback, register_schema, translate

MODEL_FILE, DATA_FILE, FALLBACK_FILE = "model.onnx", "model.onnx.data", "model_fallback.onnx"
LIBRARY_FILE = "liboscar_ort.so"


def export_onnx(module: OscarCausalLM, directory: Path, max_context: int, max_chunk: int = 512,
                float_weights: bool = False, weight_block: int = 32, weights=None) -> list[Path]:
    """Write model.onnx, model.onnx.data and model_fallback.onnx into an existing directory; 4-bit weights
    have a scale per weight_block input channels. weights: name -> tensor for a module built on the meta
    device (export/streamed.py), None when the module holds its weights.

    Every weight is written as a lazy tensor, computed (read, transposed, quantized) when the writer reaches
    it and dropped after: the graph never holds the model's float weights, so memory stays flat in depth."""
    register_schema()
    directory = Path(directory)
    if weights is not None:
        module.to("meta")  # its buffers too: `weights` has their values
    device = next(module.parameters()).device
    spec = module.cache_spec(max_context)
    names = ["input_ids", "length", *(name for name, _, _ in spec)]
    example = (torch.zeros(1, min(8, max_chunk), dtype=torch.int64, device=device),
               torch.zeros(1, dtype=torch.int64, device=device),
               *(torch.zeros(shape, dtype=dtype, device=device) for _, shape, dtype in spec))
    chunk = torch.export.Dim("T", min=1, max=max_chunk)
    functional = module.functional
    module.functional = True  # ONNX cannot mutate inputs: trace the functional form, then drop its cache outputs
    try:
        exported = torch.export.export(module, example, dynamic_shapes=({1: chunk}, None, (None,) * len(spec)))
    finally:
        module.functional = functional
    # The exporter's optimizer runs later (_optimize), with the weights hidden: it would fold and hold them all.
    program = torch.onnx.export(
        exported, dynamo=True, optimize=False, input_names=names,
        output_names=["logits", *(f"{name}.next" for name, _, _ in spec)],
        custom_translation_table={torch.ops.oscar.attention_functional.default: translate}, verbose=False,
    )
    model = program.model
    del model.graph.outputs[1:]  # the native op writes the cache inputs themselves
    for value, name in zip(model.graph.inputs, names):
        value.name = name  # unoptimized, an output that passes an input through renamed it
    _lazy_weights(model, weights)
    _optimize(model)
    _fold_weight_transposes(model)
    if float_weights:
        with _quiet():
            ir.passes.common.RemoveUnusedNodesPass()(model)
    else:
        _artifact_weights(model, weight_block)
    _strip_trace_metadata(model)
    model_path = directory / MODEL_FILE
    ir.save(model, model_path, external_data=DATA_FILE)
    fallback = make_fallback(onnx.load(model_path, load_external_data=False))
    onnx.save(fallback, directory / FALLBACK_FILE)  # initializers keep pointing at model.onnx.data
    return [model_path, directory / DATA_FILE, directory / FALLBACK_FILE]


def _strip_trace_metadata(model: ir.Model) -> None:
    """The exporter records on every node its Python stack trace and module path, which name the exporting
    machine's source files: an artifact carries neither, and the same export from another checkout is the same
    bytes."""
    for graph in (model.graph, *model.functions.values()):
        for node in ir.traversal.RecursiveGraphIterator(graph):
            node.metadata_props.clear()


def _optimize(model: ir.Model) -> None:
    """The exporter's own optimizer (constant folding, rewrite rules, dead code) with the weights hidden from it:
    its pattern matcher reads every constant it meets, which would compute each lazy weight and hold it (17.8 GB
    on two layers of Llama-3-8B's shape). Hidden: what the constant folder would not take anyway."""
    limit = onnxscript.optimizer._constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
    hidden = {value: value.const_value for value in model.graph.initializers.values()
              if value.const_value is not None and value.const_value.size > limit}
    try:
        for value in hidden:
            value.const_value = None
        with _quiet():
            onnxscript.optimizer.optimize_ir(model)
    finally:
        for value, tensor in hidden.items():
            value.const_value = tensor


@contextlib.contextmanager
def _quiet():
    """The IR passes log every initializer merged, node removed and rule tried at INFO, and each hidden weight
    (_optimize) at WARNING."""
    loggers = [logging.getLogger(name) for name in ("onnx_ir", "onnxscript")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def _lazy(func, dtype: ir.DataType, shape) -> ir.LazyTensor:
    return ir.LazyTensor(lambda: ir.tensor(func()), dtype=dtype, shape=ir.Shape(shape))


def _lazy_weights(model: ir.Model, weights) -> None:
    """Initializers traced from the meta device get their values from `weights`: small ones (norms, rotations)
    now, so the optimizer can fold them, the others on demand. The rest are real already."""
    limit = onnxscript.optimizer._constant_folding.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if not (isinstance(getattr(tensor, "raw", None), torch.Tensor) and tensor.raw.device.type == "meta"):
            continue
        if weights is None:
            raise OscarInputError(f"ONNX export: weight {value.name!r} has no data and no source was given")
        if tensor.size <= limit:
            value.const_value = ir.tensor(weights(value.name).numpy(), name=value.name)
        else:
            value.const_value = _lazy(lambda name=value.name: weights(name).numpy(), value.dtype, value.shape)


def _fold_weight_transposes(model: ir.Model) -> None:
    """MatMul(x, Transpose(W)) -> MatMul(x, W^T) with W^T a lazy initializer of its own, as constant folding
    would make it, without holding it."""
    graph = model.graph
    for node in list(graph):
        source = node.inputs[0] if node.op_type == "Transpose" and node.inputs else None
        perm = node.attributes.get_ints("perm", [1, 0]) if node.op_type == "Transpose" else None
        if source is None or not source.is_initializer() or len(source.shape) != 2 or list(perm) != [1, 0]:
            continue
        rows, cols = source.shape
        weight = source.const_value
        folded = ir.Value(name=f"{source.name}.T", shape=ir.Shape([cols, rows]), type=ir.TensorType(source.dtype),
                          const_value=_lazy(lambda w=weight: np.ascontiguousarray(w.numpy().T), source.dtype,
                                            [cols, rows]))
        graph.register_initializer(folded)
        node.outputs[0].replace_all_uses_with(folded)
        graph.remove(node, safe=True)


# MatMulNBits computes with activations quantized to int8 per block (MLAS CompInt8), as llama.cpp's q4 x q8 dots
# do: on SmolLM2-135M, 2 threads, decode runs at 168 tokens/s against 9 with fp32 activations (accuracy level 0).
ACCURACY_LEVEL = 4


def _quantize_weights(model: ir.Model, block: int) -> None:
    """MatMul weights with ONNX Runtime's own block quantizer (MatMulNBits, asymmetric, blocks of `block`, int8
    activations): 4-bit, except the lm_head at 8 bits. A 4-bit head flips a small model's answers (SmolLM2-135M:
    "La France, ..." for "Paris"), and llama.cpp's 4-bit files keep it at 8 bits too (Q8_0). Each weight is
    quantized when the writer asks for its codes; its scales and zero points come from the same run."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    graph = model.graph
    head = _lm_head(model)
    last: dict[str, tuple] = {}  # the weight quantized last: codes, scales and zero points are written in a row

    for node in list(graph):
        weight = node.inputs[1] if node.op_type == "MatMul" else None
        if weight is None or not weight.is_initializer() or len(weight.shape) != 2:
            continue
        bits = 8 if node is head else 4
        k, n = weight.shape
        quantizer = DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=False,
                                                                            bits=bits))

        def quantized(part: int, weight=weight, quantizer=quantizer):
            if weight.name not in last:
                last.clear()
                last[weight.name] = quantizer.qbits_block_quant(np.asarray(weight.const_value.numpy(), np.float32))
            return last[weight.name][part]

        blocks, pack = -(-k // block), 8 // bits
        shapes = ([n, blocks, -(-block // pack)], [n, blocks], [n, -(-blocks // pack)])
        dtypes = (ir.DataType.UINT8, ir.DataType.FLOAT, ir.DataType.UINT8)
        inputs = [node.inputs[0]]
        for part, (suffix, shape, dtype) in enumerate(zip((f"_Q{bits}", "_scales", "_zero_points"), shapes, dtypes)):
            value = ir.Value(name=weight.name + suffix, shape=ir.Shape(shape), type=ir.TensorType(dtype),
                             const_value=_lazy(lambda part=part, q=quantized: q(part), dtype, shape))
            graph.register_initializer(value)
            inputs.append(value)
        nbits = ir.node("MatMulNBits", inputs, domain="com.microsoft", name=f"{node.name}_Q{bits}",
                        attributes={"K": k, "N": n, "bits": bits, "block_size": block,
                                    "accuracy_level": ACCURACY_LEVEL})
        graph.insert_before(node, nbits)
        _replace(graph, node, nbits.outputs[0])


def _lm_head(model: ir.Model) -> ir.Node:
    """The MatMul that makes the logits: the one whose output reaches the graph's first output."""
    node = model.graph.outputs[0].producer()
    while node is not None and node.op_type != "MatMul":
        node = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    if node is None:
        raise OscarInputError("ONNX export: no MatMul produces the logits: expected an lm_head")
    return node


def _half_embeddings(model: ir.Model) -> None:
    """Embedding tables (Gather from a float initializer) stored as fp16 and cast back after the lookup,
    as the planner counts them: half the bytes of the largest tensor MatMulNBits leaves in fp32."""
    graph = model.graph
    for node in list(graph):
        table = node.inputs[0] if node.op_type == "Gather" else None
        if (table is None or not table.is_initializer() or table.dtype != ir.DataType.FLOAT
                or len(table.shape) != 2 or len(table.uses()) != 1):
            continue
        source = table.const_value
        half = ir.Value(name=f"{table.name}.fp16", shape=table.shape, type=ir.TensorType(ir.DataType.FLOAT16),
                        const_value=_lazy(lambda t=source: t.numpy().astype(np.float16), ir.DataType.FLOAT16,
                                          list(table.shape)))
        graph.register_initializer(half)
        gather = ir.node("Gather", [half, *node.inputs[1:]], attributes=node.attributes, name=node.name)
        cast = ir.node("Cast", gather.outputs, attributes={"to": ir.DataType.FLOAT}, name=f"{node.name}.cast")
        graph.insert_after(node, [gather, cast])
        _replace(graph, node, cast.outputs[0])


def _replace(graph: ir.Graph, node: ir.Node, value: ir.Value) -> None:
    """`value` takes the place of node's single output (its name, shape and type, every use); node goes."""
    out = node.outputs[0]
    value.shape, value.type = out.shape, out.type
    out.name, value.name = None, out.name
    out.replace_all_uses_with(value, replace_graph_outputs=True)
    graph.remove(node, safe=True)


def _artifact_weights(model: ir.Model, block: int) -> None:
    """MatMul weights and embedding tables as the laptop artifact stores them, the float ones dropped."""
    _quantize_weights(model, block)
    _half_embeddings(model)
    with _quiet():
        ir.passes.common.RemoveUnusedNodesPass()(model)


def quantize_file(src: Path, dst: Path, block: int) -> None:
    """An ONNX file's weights as the laptop artifact stores them, into another file (its data beside it)."""
    model = ir.load(src)
    _artifact_weights(model, block)
    ir.save(model, dst, external_data=Path(dst).name + ".data")


def load_stored_weights(module, directory: Path) -> None:
    """Give the eager graph's linears the weights the artifact's MatMulNBits nodes store (dequantized, with their
    int8 activation rounding) and its embedding table the fp16 rounding."""
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
    for linear, (weight, block, int8_activations) in zip(linears, weights):
        linear.weight = torch.nn.Parameter(weight)  # a new parameter: unties a tied lm_head from the embeddings
        if int8_activations:
            linear.register_forward_pre_hook(lambda m, args, block=block: (_int8_blocks(args[0], block),))
    embed = module.embed_tokens
    embed.weight = torch.nn.Parameter(embed.weight.detach().half().float())


def _int8_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x rounded as MatMulNBits' int8 activations (MLAS CompInt8): per `block` values along the last dim,
    codes round-half-even(x * 127 / amax), scale amax / 127. The matmul then differs from the runtime's
    integer dots by float summation order only."""
    k = x.shape[-1]
    pad = -k % block
    blocks = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, block))
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    out = torch.round(blocks * inverse) * (amax / 127.0)
    return out.flatten(-2)[..., :k].to(x.dtype)


def _matmul_nbits_weights(model_path: Path) -> list[tuple[torch.Tensor, int, bool]]:
    """Each MatMulNBits node's weight [N, K] (4 or 8 bits), dequantized as ONNX Runtime does, in graph order,
    with its block size and whether it computes with int8 activations (accuracy_level 4)."""
    from onnx import numpy_helper

    model = onnx.load(model_path)
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weights = []
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attr = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        n, k, block, bits = attr["N"], attr["K"], attr["block_size"], attr.get("bits", 4)

        def unpack(packed):  # 4-bit: two codes per byte, low nibble first
            return np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, -1) if bits == 4 else packed

        q = unpack(init[node.input[1]].reshape(n, -1)).reshape(n, -1, block).astype(np.float32)
        scale = init[node.input[2]].reshape(n, -1, 1)
        zp = init[node.input[3]].reshape(n, -1) if len(node.input) > 3 and node.input[3] else None
        zero = (unpack(zp)[:, :q.shape[1], None].astype(np.float32) if zp is not None else 2.0 ** (bits - 1))
        weight = torch.from_numpy(((q - zero) * scale).reshape(n, -1)[:, :k].copy())
        weights.append((weight, block, attr.get("accuracy_level", 0) == 4))
    return weights

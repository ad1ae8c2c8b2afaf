"""ONNX export of OscarCausalLM for ONNX Runtime (the laptop target).

model.onnx: each layer's attention is one `oscar.OscarAttention` node (runtime_ops/onnxruntime,
docs/onnx_ops.md) fed straight from graph inputs `layer{i}.k_sink` ... `layer{i}.v_zero`, which the
native op updates in place: the host binds persistent buffers once (ort_runner.py). The graph's
only output is `logits`.

model_fallback.onnx: the same graph and weights (it reads model.onnx.data) for a stock ONNX
Runtime without the native library. Each node becomes `oscar.OscarAttentionFunctional`, an ONNX
function of standard ops (ops/onnx.py); standard ops cannot write their inputs, so it returns the updated
buffers as outputs `layer{i}.k_sink.next` ... and the host feeds them back.

Weights are 4-bit by default (ONNX Runtime's MatMulNBits quantizer; the lm_head 8-bit; activations
quantized to int8 per block on the fly) with fp16 embedding tables, float with float_weights.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript
import torch
from onnx import TensorProto, helper, numpy_helper

from ...config import OscarInputError
from ...export.graph import OscarCausalLM
from ...ops.onnx import make_fallback, register_schema, translate

MODEL_FILE, DATA_FILE, FALLBACK_FILE = "model.onnx", "model.onnx.data", "model_fallback.onnx"


def export_onnx(module: OscarCausalLM, directory: Path, max_context: int, max_chunk: int = 512,
                float_weights: bool = False, weight_block: int = 32) -> list[Path]:
    """Write model.onnx, model.onnx.data and model_fallback.onnx into an existing directory; 4-bit weights
    have a scale per weight_block input channels."""
    register_schema()
    directory = Path(directory)
    spec = module.cache_spec(max_context)
    names = ["input_ids", "length", *(name for name, _, _ in spec)]
    example = (torch.zeros(1, min(8, max_chunk), dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
               *module.new_cache(max_context))
    chunk = torch.export.Dim("T", min=1, max=max_chunk)
    functional = module.functional
    module.functional = True  # ONNX cannot mutate inputs: trace the functional form, then drop its cache outputs
    try:
        exported = torch.export.export(module, example, dynamic_shapes=({1: chunk}, None, (None,) * len(spec)))
    finally:
        module.functional = functional
    program = torch.onnx.export(
        exported, dynamo=True, input_names=names, output_names=["logits", *(f"{name}.next" for name, _, _ in spec)],
        custom_translation_table={torch.ops.oscar.attention_functional.default: translate}, verbose=False,
    )
    model = program.model
    del model.graph.outputs[1:]  # the native op writes the cache inputs themselves
    ir.passes.common.RemoveUnusedNodesPass()(model)
    model_path = directory / MODEL_FILE
    if float_weights:
        ir.save(model, model_path, external_data=DATA_FILE)
    else:
        # A tied lm_head reads the embedding table through a Transpose the exporter keeps (the table has
        # two users): fold it, so the quantizer sees a constant MatMul weight there too.
        onnxscript.optimizer.fold_constants(model, output_size_limit=2**62,
                                            should_fold=lambda node: True if node.op_type == "Transpose" else None)
        float_path = directory / "float.onnx"
        ir.save(model, float_path, external_data="float.onnx.data")
        _quantize_weights(float_path, model_path, weight_block)
        float_path.unlink()
        (directory / "float.onnx.data").unlink()
    fallback = make_fallback(onnx.load(model_path, load_external_data=False))
    onnx.save(fallback, directory / FALLBACK_FILE)  # initializers keep pointing at model.onnx.data
    return [model_path, directory / DATA_FILE, directory / FALLBACK_FILE]


# MatMulNBits computes with activations quantized to int8 per block (MLAS CompInt8), as llama.cpp's q4 x q8 dots
# do: on SmolLM2-135M, 2 threads, decode runs at 168 tokens/s against 9 with fp32 activations (accuracy level 0).
ACCURACY_LEVEL = 4


def _quantize_weights(src: Path, dst: Path, block: int) -> None:
    """MatMul weights with ONNX Runtime's own quantizer (MatMulNBits, asymmetric, blocks of `block`, int8
    activations): 4-bit, except the lm_head at 8 bits. A 4-bit head flips a small model's answers (SmolLM2-135M: "La France, ..."
    for "Paris"), and llama.cpp's 4-bit files keep it at 8 bits too (Q8_0)."""
    from onnxruntime.quantization import matmul_nbits_quantizer

    log = logging.getLogger(matmul_nbits_quantizer.__name__)
    level = log.level
    log.setLevel(logging.WARNING)  # it logs every node at INFO
    try:
        model = onnx.load(str(src))
        head = [_lm_head(model)]
        body = matmul_nbits_quantizer.MatMulNBitsQuantizer(model, bits=4, block_size=block, is_symmetric=False,
                                                           accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=head)
        body.process()
        quantizer = matmul_nbits_quantizer.MatMulNBitsQuantizer(body.model.model, bits=8, block_size=block,
                                                                is_symmetric=False, accuracy_level=ACCURACY_LEVEL,
                                                                nodes_to_include=head)
        quantizer.process()
    finally:
        log.setLevel(level)
    _half_embeddings(quantizer.model.model)
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)


def _lm_head(model: onnx.ModelProto) -> str:
    """Name of the MatMul that makes the logits: the one whose output reaches the graph's first output."""
    producer = {out: node for node in model.graph.node for out in node.output}
    node = producer.get(model.graph.output[0].name)
    while node is not None and node.op_type != "MatMul":
        node = producer.get(node.input[0])
    if node is None:
        raise OscarInputError("ONNX export: no MatMul produces the logits: expected an lm_head")
    return node.name


def _half_embeddings(model: onnx.ModelProto) -> None:
    """Embedding tables (Gather from a float initializer) stored as fp16 and cast back after the lookup,
    as the planner counts them: half the bytes of the largest tensor MatMulNBits leaves in fp32."""
    graph = model.graph
    uses = Counter(name for node in graph.node for name in node.input)
    tables = {t.name: t for t in graph.initializer
              if t.data_type == TensorProto.FLOAT and len(t.dims) == 2 and uses[t.name] == 1}
    nodes = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type != "Gather" or node.input[0] not in tables:
            continue
        table = tables.pop(node.input[0])
        table.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(table).astype(np.float16), table.name))
        out = node.output[0]
        node.output[0] = f"{out}.fp16"
        nodes.append(helper.make_node("Cast", [node.output[0]], [out], to=TensorProto.FLOAT, name=f"{node.name}.cast"))
    del graph.node[:]
    graph.node.extend(nodes)

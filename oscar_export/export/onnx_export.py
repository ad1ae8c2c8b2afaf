"""ONNX export of OscarCausalLM for ONNX Runtime (the laptop target).

model.onnx: each layer's attention is one `oscar.OscarAttention` node (runtime_ops/onnxruntime,
docs/onnx_ops.md) fed straight from graph inputs `layer{i}.k_sink` ... `layer{i}.v_zero`, which the
native op updates in place: the host binds persistent buffers once (ort_runner.py). The graph's
only output is `logits`.

model_fallback.onnx: the same graph and weights (it reads model.onnx.data) for a stock ONNX
Runtime without the native library. Each node becomes `oscar.OscarAttentionFunctional`, an ONNX
function of standard ops; standard ops cannot write their inputs, so it returns the updated
buffers as outputs `layer{i}.k_sink.next` ... and the host feeds them back.

Weights are 4-bit by default (ONNX Runtime's MatMulNBits quantizer) with fp16 embedding tables, float
with float_weights.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.defs import OpSchema

from ..config import OscarInputError
from .graph import ATTRIBUTES, CACHE_NAMES, OscarCausalLM

DOMAIN = "oscar"
OP = "OscarAttention"
FALLBACK_OP = "OscarAttentionFunctional"
MODEL_FILE, DATA_FILE, FALLBACK_FILE = "model.onnx", "model.onnx.data", "model_fallback.onnx"
INPUTS = ("q", "k_new", "v_new", *CACHE_NAMES, "k_levels", "v_levels", "length")
_TYPES = {"q": "tensor(float)", "k_levels": "tensor(float)", "v_levels": "tensor(float)", "k_codes": "tensor(uint8)",
          "v_codes": "tensor(uint8)", "length": "tensor(int64)"}
WEIGHT_BLOCK = 32  # input channels per 4-bit weight scale, as the planner assumes
_OSCAR = onnxscript.values.Opset(DOMAIN, 1)


def _register_schema() -> None:
    """The op's ONNX schema, so onnxscript can emit it (the native library does its own checks)."""
    if onnx.defs.has(OP, DOMAIN):
        return
    inputs = [OpSchema.FormalParameter(name, _TYPES.get(name, "tensor(float16)")) for name in INPUTS]
    attributes = [OpSchema.Attribute(name, OpSchema.AttrType.FLOAT if name in ("k_clip", "v_clip", "scaling")
                                     else OpSchema.AttrType.INT) for name in ATTRIBUTES]
    onnx.defs.register_schema(OpSchema(OP, DOMAIN, 1, inputs=inputs,
                                       outputs=[OpSchema.FormalParameter("out", "tensor(float)")],
                                       attributes=attributes))


def _translate(q, k_new, v_new, k_sink, v_sink, k_recent, v_recent, k_codes, k_scale, k_zero, v_codes, v_scale,
               v_zero, k_levels, v_levels, length, k_bits, v_bits, cluster_dim, sink, recent, k_clip, v_clip, scaling):
    """oscar::attention_functional -> OscarAttention; the 'updated' buffers are the inputs it writes."""
    cache = (k_sink, v_sink, k_recent, v_recent, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    out = _OSCAR.OscarAttention(q, k_new, v_new, *cache, k_levels, v_levels, length, k_bits=k_bits, v_bits=v_bits,
                                cluster_dim=cluster_dim, sink=sink, recent=recent, k_clip=k_clip, v_clip=v_clip,
                                scaling=scaling)
    return (out, *cache)


def export_onnx(module: OscarCausalLM, directory: Path, max_context: int, max_chunk: int = 512,
                float_weights: bool = False) -> list[Path]:
    """Write model.onnx, model.onnx.data and model_fallback.onnx into an existing directory."""
    _register_schema()
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
        custom_translation_table={torch.ops.oscar.attention_functional.default: _translate}, verbose=False,
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
        _quantize_weights(float_path, model_path)
        float_path.unlink()
        (directory / "float.onnx.data").unlink()
    fallback = make_fallback(onnx.load(model_path, load_external_data=False))
    onnx.save(fallback, directory / FALLBACK_FILE)  # initializers keep pointing at model.onnx.data
    return [model_path, directory / DATA_FILE, directory / FALLBACK_FILE]


def _quantize_weights(src: Path, dst: Path) -> None:
    """4-bit MatMul weights (MatMulNBits, asymmetric, blocks of WEIGHT_BLOCK) with ONNX Runtime's own quantizer."""
    from onnxruntime.quantization import matmul_nbits_quantizer

    log = logging.getLogger(matmul_nbits_quantizer.__name__)
    level = log.level
    log.setLevel(logging.WARNING)  # it logs every node at INFO
    try:
        quantizer = matmul_nbits_quantizer.MatMulNBitsQuantizer(str(src), bits=4, block_size=WEIGHT_BLOCK,
                                                                is_symmetric=False)
        quantizer.process()
    finally:
        log.setLevel(level)
    _half_embeddings(quantizer.model.model)
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=True)


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


# -- the pure-ONNX fallback -------------------------------------------------------------------


def make_fallback(model: onnx.ModelProto) -> onnx.ModelProto:
    """The native graph with every OscarAttention node replaced by the OscarAttentionFunctional function."""
    graph = model.graph
    inputs = {v.name: v for v in graph.input}
    nodes = [n for n in graph.node if n.domain == DOMAIN and n.op_type == OP]
    if not nodes:
        raise OscarInputError(f"no {DOMAIN}.{OP} node in the model: expected a graph from export_onnx")
    for node in nodes:
        cache = list(node.input[3:3 + len(CACHE_NAMES)])
        node.op_type = FALLBACK_OP
        node.output.extend(f"{name}.next" for name in cache)
        for name in cache:
            out = onnx.ValueInfoProto()
            out.CopyFrom(inputs[name])
            out.name = f"{name}.next"
            graph.output.append(out)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    shapes = {name: [d.dim_value for d in inputs[nodes[0].input[3 + i]].type.tensor_type.shape.dim]
              for i, name in enumerate(CACHE_NAMES)}
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    function = _fallback_function(attrs, shapes, opset)
    model.functions.append(ir.serde.serialize_function(function))
    return model


def _fallback_function(attrs: dict, shapes: dict, opset: int) -> ir.Function:
    """OscarAttentionFunctional specialised to one cache layout; the math of docs/format.md sections 3-6."""
    heads, s_cap, d = shapes["k_sink"]
    w_cap, b_cap = shapes["k_recent"][1], shapes["k_codes"][1]
    sink, recent, cd = attrs["sink"], attrs["recent"], attrs["cluster_dim"]
    groups = d // cd
    f32, f16, i64 = ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.INT64

    def dequantize(op, codes, scale, zero, levels, bits):
        """Packed body rows -> fp32 [heads, rows, D]: every 8 codes are one `bits`-byte little-endian word."""
        byte = op.Reshape(op.Cast(codes, to=i64), [heads, b_cap, d // 8, bits])
        word = op.ReduceSum(op.Mul(byte, [256**k for k in range(bits)]), [-1], keepdims=1)
        code = op.Mod(op.Div(word, [2 ** (bits * j) for j in range(8)]), 2**bits)
        values = op.Gather(levels, op.Reshape(code, [heads, b_cap, groups, cd]), axis=0)
        scale, zero = (op.Unsqueeze(op.Cast(x, to=f32), [-1]) for x in (scale, zero))
        return op.Reshape(op.Add(zero, op.Mul(scale, values)), [heads, b_cap, d])

    def quantize(op, x, bits, clip, levels):
        """fp32 [heads, n, D] -> packed codes uint8, scale fp16, zero fp16 (n >= 1)."""
        top = 2**bits - 1
        g = op.Reshape(x, [heads, -1, groups, cd])
        lo, hi = op.ReduceMin(g, [-1], keepdims=0), op.ReduceMax(g, [-1], keepdims=0)
        if clip < 1.0:
            mid, half = op.Mul(op.Add(hi, lo), 0.5), op.Mul(op.Sub(hi, lo), 0.5 * clip)  # clip is fp32: exact
            lo, hi = op.Sub(mid, half), op.Add(mid, half)
        scale, zero = op.Cast(op.Div(op.Sub(hi, lo), float(top)), to=f16), op.Cast(lo, to=f16)
        s32 = op.Unsqueeze(op.Cast(scale, to=f32), [-1])
        u = op.Div(op.Sub(g, op.Unsqueeze(op.Cast(zero, to=f32), [-1])), s32)
        thresholds = op.Mul(op.Add(op.Slice(levels, [0], [top]), op.Slice(levels, [1], [top + 1])), 0.5)
        code = op.ReduceSum(op.Cast(op.Greater(op.Unsqueeze(u, [-1]), thresholds), to=i64), [-1], keepdims=0)
        code = op.Where(op.Equal(s32, 0.0), 0, code)  # a zero scale has codes 0
        word = op.ReduceSum(op.Mul(op.Reshape(code, [heads, -1, d // 8, 8]), [2 ** (bits * j) for j in range(8)]),
                            [-1], keepdims=1)
        byte = op.Mod(op.Div(word, [256**k for k in range(bits)]), 256)
        return op.Cast(op.Reshape(byte, [heads, -1, d * bits // 8]), to=ir.DataType.UINT8), scale, zero

    def write_rows(op, data, rows, where, src):
        """data with slot `rows[j]` of every head replaced by src[:, j] where `where[j]`."""
        return op.Where(op.Reshape(where, [1, -1, 1]), op.Gather(src, rows, axis=1), data)

    def append(op, kind, cache, chunk, levels, n0, n1, t):
        """The buffers of one kind after appending the chunk (format.md section 5), as new tensors."""
        bits, clip = attrs[f"{kind}_bits"], attrs[f"{kind}_clip"]
        sink_buf, ring = cache[f"{kind}_sink"], cache[f"{kind}_recent"]
        last = op.Sub(t, 1)
        out = {}
        if s_cap:  # slots n0 .. n1-1 below the sink size
            slot = op.Range(0, s_cap, 1)
            where = op.And(op.GreaterOrEqual(slot, n0), op.Less(slot, n1))
            out[f"{kind}_sink"] = write_rows(op, sink_buf, op.Clip(op.Sub(slot, n0), 0, last), where, chunk)
        if b_cap:  # positions n0-W .. n1-W-1 that are >= sink enter the body, from the ring or the chunk
            pos = op.Add(op.Range(0, t, 1), op.Sub(n0, recent))
            if recent:
                src = op.Concat(ring, chunk, axis=1)  # read the ring before it is overwritten
                idx = op.Where(op.Less(pos, n0), op.Mod(op.Sub(pos, sink), recent), op.Add(op.Sub(pos, n0), w_cap))
            else:
                src, idx = chunk, op.Range(0, t, 1)
            packed = quantize(op, op.Cast(op.Gather(src, idx, axis=1), to=f32), bits, clip, levels)
            # Positions that do not enter are written to a spare row past the end, cut off afterwards.
            rows = op.Where(op.GreaterOrEqual(pos, sink), op.Sub(pos, sink), b_cap)
            shape = op.Concat([heads], op.Reshape(t, [1]), [1], axis=0)
            index = op.Concat(op.Expand(op.Reshape(op.Range(0, heads, 1), [heads, 1, 1]), shape),
                              op.Expand(op.Reshape(rows, [1, -1, 1]), shape), axis=2)
            for region, update in zip(("codes", "scale", "zero"), packed):
                old = cache[f"{kind}_{region}"]
                spare = op.Concat(old, op.Slice(old, [0], [1], [1]), axis=1)
                out[f"{kind}_{region}"] = op.Slice(op.ScatterND(spare, index, update), [0], [b_cap], [1])
        if w_cap:  # slot r ends up holding the newest position p < n1 with (p - sink) % recent == r
            slot = op.Range(0, w_cap, 1)
            back = op.Sub(op.Sub(n1, sink + 1), slot)
            pos = op.Add(op.Add(slot, sink), op.Mul(op.Div(op.Max(back, 0), recent), recent))
            where = op.And(op.GreaterOrEqual(back, 0), op.GreaterOrEqual(pos, n0))
            out[f"{kind}_recent"] = write_rows(op, ring, op.Clip(op.Sub(pos, n0), 0, last), where, chunk)
        return out

    def body(op, q, k_new, v_new, *rest):
        cache, (k_levels, v_levels, length) = dict(zip(CACHE_NAMES, rest[:10])), rest[10:]
        n0 = op.Squeeze(length)
        t = op.Squeeze(op.Shape(k_new, start=1, end=2))
        n1 = op.Add(n0, t)
        chunk_idx = op.Range(0, t, 1)
        new, levels = {"k": k_new, "v": v_new}, {"k": k_levels, "v": v_levels}
        # Keys: every cache slot (sink, body, ring), visible to the whole chunk once it holds a token,
        # then the chunk itself, causally. rank <= query index <=> visible.
        keys, rank, updated = {}, [], {}
        for kind in ("k", "v"):
            parts = []
            if s_cap:
                parts.append(op.Cast(cache[f"{kind}_sink"], to=f32))
            if b_cap:
                parts.append(dequantize(op, *(cache[f"{kind}_{r}"] for r in ("codes", "scale", "zero")),
                                        levels[kind], attrs[f"{kind}_bits"]))
            if w_cap:
                parts.append(op.Cast(cache[f"{kind}_recent"], to=f32))
            keys[kind] = op.Concat(*parts, op.Cast(new[kind], to=f32), axis=1)
            updated.update(append(op, kind, cache, new[kind], levels[kind], n0, n1, t))
        for cap, filled in ((s_cap, n0), (b_cap, op.Sub(n0, sink + recent)), (w_cap, op.Sub(n0, sink))):
            if cap:
                rank.append(op.Where(op.Less(op.Range(0, cap, 1), filled), -1, 1 << 40))
        mask = op.LessOrEqual(op.Unsqueeze(op.Concat(*rank, chunk_idx, axis=0), [0]), op.Unsqueeze(chunk_idx, [1]))
        # Grouped-query attention: query head h reads KV head h // group.
        group = op.Div(op.Shape(q, start=0, end=1), heads)
        scores = op.MatMul(op.Reshape(q, [heads, -1, d]), op.Transpose(keys["k"], perm=[0, 2, 1]))
        scores = op.Where(op.Tile(mask, op.Concat(group, [1], axis=0)), op.Mul(scores, attrs["scaling"]), -math.inf)
        out = op.Reshape(op.MatMul(op.Softmax(scores, axis=-1), keys["v"]), op.Shape(q))
        # A region without slots passes its (empty) buffer through.
        return (out, *(updated[name] if name in updated else op.Identity(cache[name]) for name in CACHE_NAMES))

    dtypes = {"q": f32, "k_levels": f32, "v_levels": f32, "k_codes": ir.DataType.UINT8, "v_codes": ir.DataType.UINT8,
              "length": i64}
    inputs = [ir.Value(name=name, type=ir.TensorType(dtypes.get(name, f16))) for name in INPUTS]
    return onnxscript.build_function(body, inputs, domain=DOMAIN, name=FALLBACK_OP, opset_imports={"": opset})

"""oscar::attention in ONNX: the OscarAttention node the native ONNX Runtime library runs
(runtime_ops/onnxruntime, docs/onnx_ops.md), and OscarAttentionFunctional, the same op as an ONNX
function of standard ops for a stock ONNX Runtime (docs/format.md sections 3-6).
"""

from __future__ import annotations

import json
import math

import onnx
import onnx_ir as ir
import onnxscript
import torch
from onnx.defs import OpSchema

from ..config import OscarInputError
from .attention import (ATTRIBUTES, BUFFER_SCALE_DTYPES, CACHE_NAMES, E4M3_MAX_BYTE, E4M3_MIDPOINTS, E4M3_TIE_UP,
                        E4M3_VALUES, INPUT_DTYPES, INPUTS, SCALE_NAMES, attribute_config)

DOMAIN = "oscar"
OP = "OscarAttention"
FALLBACK_OP = "OscarAttentionFunctional"
_ONNX_TYPES = {torch.float32: "tensor(float)", torch.float16: "tensor(float16)", torch.uint8: "tensor(uint8)",
               torch.int64: "tensor(int64)"}
_IR_TYPES = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16, torch.uint8: ir.DataType.UINT8,
             torch.int64: ir.DataType.INT64}
_OSCAR = onnxscript.values.Opset(DOMAIN, 1)


def register_schema() -> None:
    """The op's ONNX schema, so onnxscript can emit it (the native library does its own checks)."""
    if onnx.defs.has(OP, DOMAIN):
        return
    # The scales and zeros: float16, or uint8 holding fp8 E4M3 bits (ops/attention.py BUFFER_SCALE_DTYPES).
    inputs = [OpSchema.FormalParameter(name, "TScale" if name in SCALE_NAMES else _ONNX_TYPES[dtype])
              for name, dtype in INPUT_DTYPES]
    scale_types = [_ONNX_TYPES[dtype] for dtype in BUFFER_SCALE_DTYPES.values()]
    attributes = [OpSchema.Attribute(name, OpSchema.AttrType.FLOAT if name in ("k_clip", "v_clip", "scaling")
                                     else OpSchema.AttrType.INT) for name in ATTRIBUTES]
    onnx.defs.register_schema(OpSchema(OP, DOMAIN, 1, inputs=inputs,
                                       outputs=[OpSchema.FormalParameter("out", "tensor(float)")],
                                       attributes=attributes,
                                       type_constraints=[("TScale", scale_types, "scale and zero storage")]))


def translate(q, k_new, v_new, k_sink, v_sink, k_recent, v_recent, k_codes, k_scale, k_zero, v_codes, v_scale,
               v_zero, k_levels, v_levels, k_feedback, length, *attributes):
    """oscar::attention_functional -> OscarAttention; the 'updated' buffers are the inputs it writes."""
    cache = (k_sink, v_sink, k_recent, v_recent, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    out = _OSCAR.OscarAttention(q, k_new, v_new, *cache, k_levels, v_levels, k_feedback, length,
                                **dict(zip(ATTRIBUTES, attributes, strict=True)))
    return (out, *cache)


# -- the pure-ONNX fallback -------------------------------------------------------------------


def make_fallback(model: onnx.ModelProto) -> onnx.ModelProto:
    """The native graph with every OscarAttention node replaced by an OscarAttentionFunctional function, one
    function per distinct attribute set, cache layout and scale storage (float16, or uint8 fp8 bits; layers
    differ in K's width and clip when k_bits_by_layer is set): OscarAttentionFunctional, then
    OscarAttentionFunctional_1, ..."""
    graph = model.graph
    inputs = {v.name: v for v in graph.input}
    nodes = [n for n in graph.node if n.domain == DOMAIN and n.op_type == OP]
    if not nodes:
        raise OscarInputError(f"no {DOMAIN}.{OP} node in the model: expected a graph from the laptop export")
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    variants = {}
    feedback_at = 3 + len(CACHE_NAMES) + 2  # after the cache buffers and the levels
    for node in nodes:
        cache = list(node.input[3:3 + len(CACHE_NAMES)])
        buffer = {name: inputs[value].type.tensor_type for name, value in zip(CACHE_NAMES, cache)}
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        shapes = {name: [d.dim_value for d in t.shape.dim] for name, t in buffer.items()}
        config = attribute_config(attrs)
        scale_dtype = config.scale_dtype
        elems = sorted({buffer[name].elem_type for name in SCALE_NAMES})
        if elems != [int(_IR_TYPES[BUFFER_SCALE_DTYPES[scale_dtype]])]:
            named = ", ".join(onnx.TensorProto.DataType.Name(e).lower() for e in elems)
            raise OscarInputError(f"{node.name or node.output[0]}: scales and zeros of type {named}: expected all "
                                  f"{str(BUFFER_SCALE_DTYPES[scale_dtype]).removeprefix('torch.')}, as its "
                                  f"scale_dtype={scale_dtype!r} stores them")
        # The layer's error-feedback weights, empty for nearest rounding: the function is specialised to either.
        shapes["k_feedback"] = _static_shape(graph, node.input[feedback_at])
        if (config.k_rounding == "feedback") != (math.prod(shapes["k_feedback"]) > 0):
            raise OscarInputError(f"{node.name or node.output[0]}: k_feedback of shape {shapes['k_feedback']} with "
                                  f"k_rounding={config.k_rounding!r}: expected [kv_heads, D, D] weights for "
                                  "'feedback', an empty tensor for 'nearest'")
        key = json.dumps([attrs, shapes, scale_dtype], sort_keys=True)
        if key not in variants:
            name = FALLBACK_OP if not variants else f"{FALLBACK_OP}_{len(variants)}"
            variants[key] = name
            function = _fallback_function(attrs, shapes, scale_dtype, opset, name)
            model.functions.append(ir.serde.serialize_function(function))
        node.op_type = variants[key]
        node.output.extend(f"{name}.next" for name in cache)
        for name in cache:
            out = onnx.ValueInfoProto()
            out.CopyFrom(inputs[name])
            out.name = f"{name}.next"
            graph.output.append(out)
    return model


def _static_shape(graph: onnx.GraphProto, name: str) -> list[int]:
    """The shape of a graph value fixed before any run: an initializer's, a Constant's or a declared input's."""
    for t in graph.initializer:
        if t.name == name:
            return list(t.dims)
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            return list(onnx.helper.get_attribute_value(n.attribute[0]).dims)
    for v in graph.input:
        if v.name == name and all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim):
            return [d.dim_value for d in v.type.tensor_type.shape.dim]
    raise OscarInputError(f"{name}: no static shape in the graph: expected an initializer, a Constant or an input "
                          f"of fixed shape")


# fp8 E4M3 scales and zeros travel as their uint8 bits. Opset 20 has no BitCast, so bits -> value is a table of
# all 256 and value -> bits counts the midpoints below |x| (ops/attention.py E4M3_VALUES, E4M3_MIDPOINTS).
# The midpoints above odd bytes, where a tie goes up; -1 never equals |x|.
_E4M3_ODD_MIDS = torch.where(E4M3_TIE_UP, E4M3_MIDPOINTS, -1.0)


def e4m3_values(op, bits):
    """uint8 E4M3 bits -> fp32 values."""
    return op.Gather(_constant(op, E4M3_VALUES), op.Cast(bits, to=ir.DataType.INT64), axis=0)


def e4m3_bits(op, x):
    """fp32 -> uint8 E4M3 bits, rounded to nearest, ties to even, as torch's cast; the sign of a zero kept. Past
    448 (and for NaN) the bits of NaN, where the reference refuses the values: the output shows it."""
    i64 = ir.DataType.INT64
    mag = op.Abs(x)
    wide = op.Unsqueeze(mag, [-1])

    def count(hits):
        return op.ReduceSum(op.Cast(hits, to=i64), [-1], keepdims=0)

    code = op.Add(count(op.Greater(wide, _constant(op, E4M3_MIDPOINTS))),
                  count(op.Equal(wide, _constant(op, _E4M3_ODD_MIDS))))
    code = op.Where(op.LessOrEqual(mag, float(E4M3_VALUES[E4M3_MAX_BYTE])), code, 127)
    negative = op.Less(op.Div(1.0, x), 0.0)  # -0 too: 1 / -0 = -inf
    return op.Cast(op.Add(op.Mul(op.Cast(negative, to=i64), 128), code), to=ir.DataType.UINT8)


def _constant(op, values: torch.Tensor):
    return op.Constant(value=ir.tensor(values.numpy()))


def _fallback_function(attrs: dict, shapes: dict, scale_dtype: str, opset: int,
                       name: str = FALLBACK_OP) -> ir.Function:
    """OscarAttentionFunctional specialised to one cache layout and scale storage (float16, or float8_e4m3fn as
    uint8 bits); the math of docs/format.md sections 3-6."""
    heads, s_cap, d = shapes["k_sink"]
    w_cap, b_cap = shapes["k_recent"][1], shapes["k_codes"][1]
    sink, recent, cd = attrs["sink"], attrs["recent"], attrs["cluster_dim"]
    groups = d // cd
    f32, f16, i64 = ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.INT64
    fp8 = scale_dtype == "float8_e4m3fn"

    def widen(op, stored):
        return e4m3_values(op, stored) if fp8 else op.Cast(stored, to=f32)

    def narrow(op, x):
        return e4m3_bits(op, x) if fp8 else op.Cast(x, to=f16)

    def dequantize(op, codes, scale, zero, levels, bits):
        """Packed body rows -> fp32 [heads, rows, D]: every 8 codes are one `bits`-byte little-endian word."""
        byte = op.Reshape(op.Cast(codes, to=i64), [heads, b_cap, d // 8, bits])
        word = op.ReduceSum(op.Mul(byte, [256**k for k in range(bits)]), [-1], keepdims=1)
        code = op.Mod(op.Div(word, [2 ** (bits * j) for j in range(8)]), 2**bits)
        values = op.Gather(levels, op.Reshape(code, [heads, b_cap, groups, cd]), axis=0)
        scale, zero = (op.Unsqueeze(widen(op, x), [-1]) for x in (scale, zero))
        return op.Reshape(op.Add(zero, op.Mul(scale, values)), [heads, b_cap, d])

    def quantize(op, x, bits, clip, levels, feedback=None):
        """fp32 [heads, n, D] -> packed codes uint8, scale and zero as stored (n >= 1). feedback [heads, D, D]: the
        codes with error feedback (format.md section 3, step 5), channel by channel."""
        top = 2**bits - 1
        g = op.Reshape(x, [heads, -1, groups, cd])
        lo, hi = op.ReduceMin(g, [-1], keepdims=0), op.ReduceMax(g, [-1], keepdims=0)
        if clip < 1.0:
            mid, half = op.Mul(op.Add(hi, lo), 0.5), op.Mul(op.Sub(hi, lo), 0.5 * clip)  # clip is fp32: exact
            lo, hi = op.Sub(mid, half), op.Add(mid, half)
        scale, zero = narrow(op, op.Div(op.Sub(hi, lo), float(top))), narrow(op, lo)
        s32, z32 = (op.Unsqueeze(widen(op, x), [-1]) for x in (scale, zero))
        thresholds = op.Mul(op.Add(op.Slice(levels, [0], [top]), op.Slice(levels, [1], [top + 1])), 0.5)

        def codes_of(value, s, z):
            code = op.ReduceSum(op.Cast(op.Greater(op.Unsqueeze(op.Div(op.Sub(value, z), s), [-1]), thresholds),
                                        to=i64), [-1], keepdims=0)
            return op.Where(op.Equal(s, 0.0), 0, code)  # a zero scale has codes 0

        if feedback is None:
            code = codes_of(g, s32, z32)
        else:  # unrolled over the channels: each product and difference its own rounded op
            shape = op.Concat([heads], op.Shape(x, start=1, end=2), [groups, cd], axis=0)
            flat = op.Concat([heads], op.Shape(x, start=1, end=2), [d], axis=0)
            s_ch, z_ch = (op.Reshape(op.Expand(v, shape), flat) for v in (s32, z32))
            w, codes = x, []
            for i in range(d):
                wi, si, zi = (op.Slice(v, [i], [i + 1], [2]) for v in (w, s_ch, z_ch))
                ci = codes_of(wi, si, zi)
                codes.append(ci)
                if i + 1 < d:
                    error = op.Sub(wi, op.Add(zi, op.Mul(si, op.Gather(levels, ci, axis=0))))
                    later = op.Sub(op.Slice(w, [i + 1], [d], [2]),
                                   op.Mul(error, op.Slice(feedback, [i, i + 1], [i + 1, d], [1, 2])))
                    w = op.Concat(op.Slice(w, [0], [i + 1], [2]), later, axis=2)
            code = op.Reshape(op.Concat(*codes, axis=2), [heads, -1, groups, cd])
        word = op.ReduceSum(op.Mul(op.Reshape(code, [heads, -1, d // 8, 8]), [2 ** (bits * j) for j in range(8)]),
                            [-1], keepdims=1)
        byte = op.Mod(op.Div(word, [256**k for k in range(bits)]), 256)
        return op.Cast(op.Reshape(byte, [heads, -1, d * bits // 8]), to=ir.DataType.UINT8), scale, zero

    def write_rows(op, data, rows, where, src):
        """data with slot `rows[j]` of every head replaced by src[:, j] where `where[j]`."""
        return op.Where(op.Reshape(where, [1, -1, 1]), op.Gather(src, rows, axis=1), data)

    def append(op, kind, cache, chunk, levels, n0, n1, t, feedback=None):
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
            packed = quantize(op, op.Cast(op.Gather(src, idx, axis=1), to=f32), bits, clip, levels, feedback)
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
        cache, (k_levels, v_levels, k_feedback, length) = dict(zip(CACHE_NAMES, rest[:10])), rest[10:]
        feedback = {"k": k_feedback if shapes["k_feedback"] != [0] else None, "v": None}
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
            updated.update(append(op, kind, cache, new[kind], levels[kind], n0, n1, t, feedback[kind]))
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

    types = {name: _IR_TYPES[BUFFER_SCALE_DTYPES[scale_dtype] if name in SCALE_NAMES else dtype]
             for name, dtype in INPUT_DTYPES}
    inputs = [ir.Value(name=name, type=ir.TensorType(types[name])) for name in INPUTS]
    return onnxscript.build_function(body, inputs, domain=DOMAIN, name=name, opset_imports={"": opset})

"""The op's buffer table (ops/attention.py) is the one the native core and both C++ adapters check against."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from native_cases import GOLDEN, golden_case
from oscar_export import OscarConfig
from oscar_export.config import OscarInputError
from oscar_export.ops.attention import (ATTRIBUTES, BUFFER_SCALE_DTYPES, CACHE_NAMES, INPUT_DTYPES, INPUTS, SCALE_NAMES,
                                         attribute_config, op_attributes)

SOURCES = Path(__file__).resolve().parents[2] / "runtime_ops"
ORT_TYPES = {"kF32": torch.float32, "kF16": torch.float16, "kU8": torch.uint8, "kI64": torch.int64}
ET_TYPES = {"ScalarType::Float": torch.float32, "ScalarType::Half": torch.float16, "ScalarType::Byte": torch.uint8}


def _array(source: str, declaration: str) -> list[str]:
    """The initializer list of a C++ array declared as `declaration[...] = {...};`, item by item."""
    match = re.search(re.escape(declaration) + r"\[[^\]]*\]\s*=\s*\{(.*?)\};", source, re.S)
    assert match, f"{declaration} not found"
    return [item.strip().strip('"') for item in match.group(1).split(",") if item.strip()]


def test_op_attributes_are_the_schema_s_in_order_and_types():
    attrs = op_attributes(OscarConfig(k_bits=3, k_clip=0.9, sink=4, recent=8), 0.125)
    assert tuple(attrs) == ATTRIBUTES
    assert attrs["k_bits"] == 3 and attrs["k_clip"] == 0.9 and attrs["sink"] == 4 and attrs["scaling"] == 0.125
    assert [type(v) for v in attrs.values()] == [int] * 5 + [float] * 3 + [int] * 3  # the schema's ints and floats
    named = op_attributes(OscarConfig(k_rounding="feedback", scale_dtype="float8_e4m3fn"), 0.125)
    assert (named["codebook"], named["k_rounding"], named["scale_dtype"]) == (0, 1, 1)
    assert attribute_config(named) == OscarConfig(k_rounding="feedback", scale_dtype="float8_e4m3fn")
    lloyd = OscarConfig(codebook="lloyd-max", k_clip=0.75, cluster_dim=32, sink=0, recent=16)
    assert attribute_config(op_attributes(lloyd, 1.0)) == lloyd
    with pytest.raises(OscarInputError, match="scale_dtype='bfloat16': expected one the op stores"):
        op_attributes(OscarConfig(scale_dtype="bfloat16"), 0.125)
    with pytest.raises(OscarInputError, match=r"attribute k_rounding=2: expected an integer code 0..1"):
        attribute_config(dict(named, k_rounding=2))


def test_the_op_takes_its_format_from_the_attributes_and_holds_the_buffers_to_it():
    """The eager op (the reference every backend is compared with) refuses buffers that disagree with its
    attributes instead of reading the format off them."""
    case = golden_case(GOLDEN[0])
    assert case.config.codebook == "uniform" and case.feedback is None and case.config.scale_dtype == "float16"
    q, k, v = (torch.from_numpy(np.ascontiguousarray(x)) for x in case.chunks[0])

    def attend(attrs: dict, **buffers):
        cache = {name: torch.from_numpy(a) for name, a in dict(case.empty_cache(), **buffers).items()}
        torch.ops.oscar.attention(q, k, v, *(cache[n] for n in CACHE_NAMES), cache["k_levels"], cache["v_levels"],
                                  cache["k_feedback"], torch.tensor([0]), *attrs.values())

    attrs = op_attributes(case.config, case.scaling)
    attend(attrs)
    h, d = case.kv_heads, case.head_dim
    empty = case.empty_cache()
    fp8 = {name: np.zeros(empty[name].shape, np.uint8) for name in SCALE_NAMES}
    for wrong, buffers, message in (
            (dict(scale_dtype=1), {}, r"k_scale is torch.float16 .*: expected torch.uint8 .*'float8_e4m3fn'"),
            ({}, fp8, r"k_scale is torch.uint8 .*: expected torch.float16 .*'float16'"),
            (dict(k_rounding=1), {}, rf"k_feedback has shape \(0,\): expected \[{h}, {d}, {d}\]"),
            ({}, {"k_feedback": np.zeros((h, d, d), np.float32)}, "an empty tensor with k_rounding='nearest'"),
            ({}, {"v_levels": np.array([0, 0.5, 2, 3], np.float32)}, r"v_levels are \[0.0, 0.5, 2.0, 3.0\]: expected "
                                                                     "the uniform levels 0..3")):
        with pytest.raises(OscarInputError, match=message):
            attend(dict(attrs, **wrong), **buffers)


def test_core_buffer_names_are_the_op_inputs_then_out():
    names = _array((SOURCES / "core" / "oscar_core.cc").read_text(), "const char* const kBufferNames")
    # The core's table has every tensor input but `length` (a scalar it takes separately), then the output.
    assert names == [*INPUTS[:-1], "out"]
    assert INPUTS[3:13] == CACHE_NAMES


def test_onnxruntime_adapter_types_are_the_table():
    types = _array((SOURCES / "onnxruntime" / "oscar_ort.cc").read_text(),
                   "constexpr ONNXTensorElementDataType kInputTypes")
    assert [ORT_TYPES[t] for t in types] == [dtype for _, dtype in INPUT_DTYPES]


def test_executorch_adapter_types_are_the_table():
    types = _array((SOURCES / "executorch" / "oscar_et.cc").read_text(), "constexpr ScalarType kInputTypes")
    assert [ET_TYPES[t] for t in types] == [dtype for _, dtype in INPUT_DTYPES[:-1]]  # length is checked apart


def test_the_onnx_schema_is_built_from_the_table():
    import onnx

    from oscar_export.ops.onnx import DOMAIN, OP, register_schema

    register_schema()
    schema = onnx.defs.get_schema(OP, 1, DOMAIN)
    assert [p.name for p in schema.inputs] == list(INPUTS)
    want = {torch.float32: "tensor(float)", torch.float16: "tensor(float16)", torch.uint8: "tensor(uint8)",
            torch.int64: "tensor(int64)"}
    # The scales and zeros share one type variable: float16, or uint8 holding fp8 E4M3 bits.
    assert [p.type_str for p in schema.inputs] == ["TScale" if name in SCALE_NAMES else want[dtype]
                                                   for name, dtype in INPUT_DTYPES]
    (constraint,) = schema.type_constraints
    assert constraint.type_param_str == "TScale"
    assert sorted(constraint.allowed_type_strs) == sorted(want[d] for d in BUFFER_SCALE_DTYPES.values())

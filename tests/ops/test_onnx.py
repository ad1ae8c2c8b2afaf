"""ops/onnx.py's fp8 E4M3 conversions in standard ONNX ops, under ONNX Runtime, against torch's cast."""

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed")
onnx = pytest.importorskip("onnx", reason="onnx is not installed")

import onnx_ir as ir  # noqa: E402
import onnxscript  # noqa: E402

from oscar_export.ops.onnx import DOMAIN, e4m3_bits, e4m3_values  # noqa: E402


def _run(body, x: np.ndarray, in_type, out_type) -> np.ndarray:
    """One node calling an ONNX function whose body is body(op, x)."""
    value = ir.Value(name="x", type=ir.TensorType(in_type))
    function = onnxscript.build_function(lambda op, x: body(op, x), [value], domain=DOMAIN, name="F",
                                         opset_imports={"": 20})
    elem = {ir.DataType.FLOAT: onnx.TensorProto.FLOAT, ir.DataType.UINT8: onnx.TensorProto.UINT8}
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("F", ["x"], ["y"], domain=DOMAIN)], "g",
        [onnx.helper.make_tensor_value_info("x", elem[in_type], [len(x)])],
        [onnx.helper.make_tensor_value_info("y", elem[out_type], None)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 20),
                                                         onnx.helper.make_opsetid(DOMAIN, 1)])
    model.functions.append(ir.serde.serialize_function(function))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_bits_to_values_is_torchs_reading_of_every_byte():
    every = np.arange(256, dtype=np.uint8)
    got = _run(e4m3_values, every, ir.DataType.UINT8, ir.DataType.FLOAT)
    want = torch.from_numpy(every).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)])
    assert np.isnan(got[np.isnan(want)]).all() and np.isnan(want).sum() == 2


def test_values_to_bits_rounds_as_torch_ties_to_even():
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = finite[torch.isfinite(finite) & (finite >= 0)].sort().values
    mids = (finite[:-1].double() + finite[1:].double()) / 2
    assert (mids.float().double() == mids).all()  # exact in fp32: the ties below are ties
    mids = mids.float()
    up, down = (torch.nextafter(mids, torch.full_like(mids, x)) for x in (np.inf, -np.inf))
    rng = np.random.default_rng(5)
    spread = torch.from_numpy(np.exp(rng.uniform(np.log(1e-4), np.log(448.0), 4000)).astype(np.float32))
    x = torch.cat([finite, mids, up, down, spread, torch.tensor([0.0, 1e-30, 2.0**-10, 447.9, 448.0])])
    x = torch.cat([x, -x])  # negative zero and tiny negatives keep their sign bit, as torch's cast does
    got = _run(e4m3_bits, x.numpy(), ir.DataType.FLOAT, ir.DataType.UINT8)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} differ, first at {x[bad[0]].item()!r}: {got[bad[0]]} vs {want[bad[0]]}"


def test_values_past_448_become_nan_bits_not_a_saturated_scale():
    """The reference refuses such a scale; inside a graph the fallback cannot raise, so it stores NaN, which the
    output carries, rather than torch's saturated 448."""
    x = np.array([448.5, 464.0, 1e6, np.inf, -1e6, np.nan], np.float32)
    got = _run(e4m3_bits, x, ir.DataType.FLOAT, ir.DataType.UINT8)
    assert np.isnan(torch.from_numpy(got).view(torch.float8_e4m3fn).float().numpy()).all(), got



@pytest.mark.parametrize("types", [("FLOAT",) * 4, ("FLOAT16", "FLOAT16", "UINT8", "UINT8"), ("UINT8",) * 4])
def test_fallback_refuses_scales_it_does_not_store(types):
    """float32 scales (a reference-only storage), a mix, or fp8 bits where the node's scale_dtype attribute says
    float16: make_fallback names the node, the types and the attribute's storage."""
    from backends import op_model
    from native_cases import golden_case

    from oscar_export.config import OscarInputError
    from oscar_export.ops.attention import SCALE_NAMES
    from oscar_export.ops.onnx import make_fallback

    model = op_model(golden_case("b2_g64"))
    for value in model.graph.input:
        if value.name in SCALE_NAMES:
            value.type.tensor_type.elem_type = getattr(onnx.TensorProto, types[SCALE_NAMES.index(value.name)])
    named = ", ".join(sorted(set(types), key=lambda t: getattr(onnx.TensorProto, t))).lower()
    with pytest.raises(OscarInputError, match=f"out: scales and zeros of type {named}: expected all float16, as its "
                                              "scale_dtype='float16' stores them"):
        make_fallback(model)

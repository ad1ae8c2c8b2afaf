"""A numpy interpreter for converted Core ML programs, so they can be checked without a Mac.

`MilProgram.run(feeds)` executes the operations of a coremltools MIL program (`saved_program(model)`:
the serialized program of an MLModel and its weight file, read back) one by one, in their order, for the op subset our
graphs use. Every result is cast to the dtype the program declares for it (fp16 where the program
says fp16, int32 where int32), so integer arithmetic and fp16 rounding behave as declared. It is a
test instrument: the answers of Core ML itself come from MLModel.predict on macOS.
"""

from __future__ import annotations

import numpy as np

def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


_DTYPES = {"fp16": np.float16, "fp32": np.float32, "fp64": np.float64, "int32": np.int32, "int64": np.int64,
           "int16": np.int16, "uint16": np.uint16, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_,
           "int4": np.int8, "uint4": np.uint8}


def _dtype(var):
    from coremltools.converters.mil.mil import types

    return _DTYPES.get(types.builtin_to_string(var.dtype))  # None: not a tensor (a string attribute)


def _axes(value, rank):
    return tuple(int(a) % rank for a in np.atleast_1d(value))


def _slice_by_index(x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    rank = x.ndim
    stride = np.ones(rank, int) if stride is None else stride
    index = []
    for i in range(rank):
        if squeeze_mask is not None and squeeze_mask[i]:
            index.append(int(begin[i]))
            continue
        start = None if begin_mask is not None and begin_mask[i] else int(begin[i])
        stop = None if end_mask is not None and end_mask[i] else int(end[i])
        index.append(slice(start, stop, int(stride[i])))
    return x[tuple(index)]


def _reshape(x, shape):
    shape = [int(x.shape[i]) if s == 0 else int(s) for i, s in enumerate(shape)]  # 0 copies the input dim
    return x.reshape(shape)


def _gather(x, indices, axis=0, batch_dims=0, validate_indices=False):
    axis = int(axis) % x.ndim
    if batch_dims:
        raise NotImplementedError("gather with batch_dims is not used by our graphs")
    indices = np.where(indices < 0, indices + x.shape[axis], indices)
    return np.take(x, indices, axis=axis)


def _matmul(x, y, transpose_x=False, transpose_y=False):
    if transpose_x:
        x = np.swapaxes(x, -1, -2)
    if transpose_y:
        y = np.swapaxes(y, -1, -2)
    return np.matmul(x, y)


def _linear(x, weight, bias=None):
    out = np.matmul(x, weight.T)
    return out if bias is None else out + bias


def _reduce(fn):
    def run(x, axes=None, keep_dims=False):
        return fn(x, axis=None if axes is None else _axes(axes, x.ndim), keepdims=bool(keep_dims))

    return run


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=int(axis), keepdims=True))
    return e / e.sum(axis=int(axis), keepdims=True)


def _blockwise_shift_scale(data, scale, offset=None):
    data = data.astype(scale.dtype)
    for axis, (n, m) in enumerate(zip(data.shape, scale.shape)):
        if n != m:
            scale = np.repeat(scale, n // m, axis)
            if offset is not None:
                offset = np.repeat(offset, n // m, axis)
    return scale * (data if offset is None else data - offset.astype(scale.dtype))


def _lut_to_dense(indices, lut, vector_axis=None):
    from coremltools.optimize.coreml._utils import lut_to_dense

    return lut_to_dense(indices, lut, vector_axis)


def _concat(values, axis, interleave=False):
    if interleave:
        raise NotImplementedError("interleaved concat is not used by our graphs")
    if any(np.ndim(v) == 0 for v in values):  # shape vectors assembled from scalars
        values = [np.atleast_1d(v) for v in values]
    return np.concatenate(values, axis=int(axis))


def _binary(fn):
    return lambda x, y: fn(x, y)


def _unary(fn):
    return lambda x: fn(x)


OPS = {
    **{name: _binary(fn) for name, fn in {
        "add": np.add, "sub": np.subtract, "mul": np.multiply, "real_div": np.divide, "floor_div": np.floor_divide,
        "mod": np.mod, "pow": np.power, "maximum": np.maximum, "minimum": np.minimum, "greater": np.greater,
        "greater_equal": np.greater_equal, "less": np.less, "less_equal": np.less_equal, "equal": np.equal,
        "not_equal": np.not_equal, "logical_and": np.logical_and, "logical_or": np.logical_or}.items()},
    **{name: _unary(fn) for name, fn in {
        "logical_not": np.logical_not, "cos": np.cos, "sin": np.sin, "exp": np.exp, "sqrt": np.sqrt, "abs": np.abs,
        "floor": np.floor}.items()},
    "rsqrt": lambda x, epsilon=1e-12: 1 / np.sqrt(x + epsilon),
    "silu": lambda x: x * _sigmoid(x), "sigmoid": _sigmoid, "softmax": _softmax,
    "cast": lambda x, dtype: x.astype(_DTYPES[str(dtype)]),
    "select": lambda cond, a, b: np.where(cond, a, b),
    "slice_by_index": _slice_by_index, "reshape": _reshape, "gather": _gather, "concat": _concat,
    "expand_dims": lambda x, axes: np.expand_dims(x, tuple(int(a) for a in np.atleast_1d(axes))),
    "squeeze": lambda x, axes=None: np.squeeze(x, None if axes is None else _axes(axes, x.ndim)),
    "transpose": lambda x, perm: np.transpose(x, [int(p) for p in perm]),
    "tile": lambda x, reps: np.tile(x, [int(r) for r in reps]),
    "shape": lambda x: np.array(x.shape, np.int32),
    "range_1d": lambda start, end, step: np.arange(start, end, step),
    "fill": lambda shape, value=0.0: np.full([int(s) for s in shape], value),
    "fill_like": lambda ref_tensor, value=0.0: np.full(ref_tensor.shape, value),
    "matmul": _matmul, "linear": _linear,
    "reduce_mean": _reduce(np.mean), "reduce_sum": _reduce(np.sum), "reduce_max": _reduce(np.max),
    "reduce_min": _reduce(np.min),
    "constexpr_blockwise_shift_scale": _blockwise_shift_scale, "constexpr_lut_to_dense": _lut_to_dense,
}


def saved_program(model):
    """The MIL program of an MLModel as serialized (its spec and weight files), read back into pymil."""
    from coremltools.converters.mil.frontend.milproto.load import load_mil_proto

    spec = model.get_spec()
    if not spec.HasField("mlProgram"):
        raise ValueError("the Core ML model is not an ML program: expected one converted with convert_to='mlprogram'")
    return load_mil_proto(spec.mlProgram, spec.specificationVersion, model.weights_dir)


def weights(mil_program, function: str = "main") -> dict[str, np.ndarray]:
    """The model's parameters as the program stores them (fp16, or decompressed from 4 bits), by source name:
    `p_<parameter path with _>` without the suffixes the conversion adds (`_fp16`, `_quantized`, ...)."""
    values = {}
    for op in mil_program.functions[function].operations:
        out = op.outputs[0]
        if not out.name.startswith("p_") or not (op.op_type == "const" or op.op_type.startswith("constexpr_")):
            continue
        if _dtype(out) is None or (out.child_ops and all(c.op_type.startswith("constexpr_") for c in out.child_ops)):
            continue  # attributes, and the stored parts of a compressed weight
        if op.op_type == "const":
            value = out.val
        else:
            value = OPS[op.op_type](**{key: var.val for key, var in op.inputs.items()})
        name = out.name
        while name.endswith(_SUFFIXES):
            name = name.rsplit("_", 1)[0]
        values[name] = np.asarray(value, dtype=_dtype(out))
    return values


_SUFFIXES = ("_fp16", "_quantized", "_palettized")


class MilProgram:
    """One function of a MIL program, executable in numpy."""

    def __init__(self, mil_program, function: str = "main"):
        self.function = mil_program.functions[function]
        missing = sorted({op.op_type for op in self.function.operations} - set(OPS) - {"const"})
        if missing:
            raise NotImplementedError(f"mil_eval has no numpy version of MIL ops {missing}")
        self.inputs = {name: (tuple(var.shape), _dtype(var)) for name, var in self.function.inputs.items()}
        self.output_names = [var.name for var in self.function.outputs]
        # Constants once: weights (and their decompression) do not change between runs.
        self._constants = {}
        for op in self.function.operations:
            if op.op_type == "const":
                out = op.outputs[0]
                dtype = _dtype(out)
                self._constants[out.name] = out.val if dtype is None else np.asarray(out.val, dtype=dtype)
        self._ops = [op for op in self.function.operations if op.op_type != "const"]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = dict(self._constants)
        for name, (_, dtype) in self.inputs.items():
            if name not in feeds:
                raise KeyError(f"input {name!r} is not fed")
            values[self.function.inputs[name].name] = np.asarray(feeds[name]).astype(dtype, copy=False)
        for op in self._ops:
            kwargs = {}
            for key, var in op.inputs.items():
                if isinstance(var, (list, tuple)):
                    kwargs[key] = [self._value(values, v) for v in var]
                else:
                    kwargs[key] = self._value(values, var)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                result = OPS[op.op_type](**kwargs)
            results = result if isinstance(result, tuple) else (result,)
            for var, value in zip(op.outputs, results):
                values[var.name] = np.asarray(value).astype(_dtype(var), copy=False)
        return {name: values[name] for name in self.output_names}

    @staticmethod
    def _value(values, var):
        if var.name in values:
            return values[var.name]
        if var.val is not None:  # an inline constant (attributes such as axis or dtype)
            return var.val
        raise KeyError(f"MIL variable {var.name!r} has no value yet")

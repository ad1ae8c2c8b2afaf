"""oscar::attention: the op every backend implements, defined once.

Its schema (torch.library), fake (shape propagation for torch.export), reference kernel and the
buffer table live here. The reference is OscarKVCache.attend wrapped around the caller's buffers,
so eager runs are the normative math; the native kernels (runtime_ops/, ONNX Runtime and
ExecuTorch adapters) and the lowerings (ops/onnx.py, ops/coreml.py) mirror it, and
tests/ops/test_attention.py checks the buffer table against the C++ adapters' tables.
"""

from __future__ import annotations

import torch

from ..cache import OscarKVCache, buffer_layout
from ..codec import uniform_levels
from ..sizes import CACHE_NAMES, SCALE_BUFFER_DTYPES, capacities
from ..config import OscarConfig, OscarInputError

ATTRIBUTES = ("k_bits", "v_bits", "cluster_dim", "sink", "recent", "k_clip", "v_clip", "scaling", "codebook",
              "k_rounding", "scale_dtype")
# The integer codes of the format's named choices, as the op carries them (the native core's enums in oscar_core.h):
# every backend reads the format from the attributes, never from a buffer's type or size.
ATTRIBUTE_CODES = {"codebook": ("uniform", "lloyd-max"), "k_rounding": ("nearest", "feedback"),
                   "scale_dtype": tuple(SCALE_BUFFER_DTYPES)}

# Every input of the op in order, with its dtype: the table the native adapters check against
# (oscar_core.h kBufferNames; oscar_ort.cc and oscar_et.cc kInputTypes). `length` is the op's last input.
# k_feedback: K's error-feedback weights [kv_heads, D, D] (k_rounding 'feedback'), or empty for nearest rounding.
# The scales and zeros are float16 as listed, or all four uint8 holding fp8 E4M3 bits (scale_dtype
# float8_e4m3fn): every runtime has uint8 tensors, not every one has fp8 ones.
INPUT_DTYPES = (("q", torch.float32), ("k_new", torch.float16), ("v_new", torch.float16),
                *((name, torch.uint8 if name.endswith("_codes") else torch.float16) for name in CACHE_NAMES),
                ("k_levels", torch.float32), ("v_levels", torch.float32), ("k_feedback", torch.float32),
                ("length", torch.int64))
INPUTS = tuple(name for name, _ in INPUT_DTYPES)
SCALE_NAMES = ("k_scale", "k_zero", "v_scale", "v_zero")
# The dtype of the op's scale and zero buffers for each scale_dtype it stores.
BUFFER_SCALE_DTYPES = {name: getattr(torch, dtype) for name, dtype in SCALE_BUFFER_DTYPES.items()}
# fp8 E4M3 for the lowerings that have no bitcast (ops/onnx.py, ops/coreml.py): every byte's value (0x7F and 0xFF
# are NaN), and the midpoints between neighbouring non-negative finite values, exact in fp32 (neighbours have 4
# significant bits, their midpoint 5). A magnitude's byte is the count of midpoints below it; a tie above an odd
# byte rounds up, to the even one, as torch's cast does.
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_MAX_BYTE = 126  # 448, the largest finite magnitude
E4M3_MIDPOINTS = (E4M3_VALUES[:E4M3_MAX_BYTE] + E4M3_VALUES[1:E4M3_MAX_BYTE + 1]) * 0.5
E4M3_TIE_UP = torch.arange(E4M3_MAX_BYTE) % 2 == 1


def op_attributes(config: OscarConfig, scaling: float) -> dict:
    """The op's attributes for one layer's format (config.layer(i) where K's width is per layer), by ATTRIBUTES'
    names in their order: every backend, the graph and the benches take them from here."""
    if config.scale_dtype not in SCALE_BUFFER_DTYPES:
        raise OscarInputError(f"scale_dtype={config.scale_dtype!r}: expected one the op stores, "
                              f"{' or '.join(SCALE_BUFFER_DTYPES)}")
    return {"k_bits": config.k_bits, "v_bits": config.v_bits, "cluster_dim": config.cluster_dim, "sink": config.sink,
            "recent": config.recent, "k_clip": float(config.k_clip), "v_clip": float(config.v_clip),
            "scaling": float(scaling), **{name: codes.index(getattr(config, name))
                                           for name, codes in ATTRIBUTE_CODES.items()}}


def attribute_config(attrs: dict) -> OscarConfig:
    """The one layer's format the op's attributes state (scaling aside); an unknown code is an error naming it."""
    named = {}
    for name, codes in ATTRIBUTE_CODES.items():
        code = attrs[name]
        if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < len(codes):
            raise OscarInputError(f"attribute {name}={code!r}: expected an integer code 0..{len(codes) - 1} "
                                  f"({', '.join(f'{i}: {c}' for i, c in enumerate(codes))})")
        named[name] = codes[code]
    return OscarConfig(k_bits=attrs["k_bits"], v_bits=attrs["v_bits"], cluster_dim=attrs["cluster_dim"],
                       sink=attrs["sink"], recent=attrs["recent"], k_clip=attrs["k_clip"], v_clip=attrs["v_clip"],
                       **named)


_ATTRS = ("int k_bits, int v_bits, int cluster_dim, int sink, int recent, float k_clip, float v_clip, float scaling, "
          "int codebook, int k_rounding, int scale_dtype")
_MUTABLE = ", ".join(f"Tensor({chr(ord('a') + i)}!) {name}" for i, name in enumerate(CACHE_NAMES))
_PLAIN = ", ".join(f"Tensor {name}" for name in CACHE_NAMES)


def _schema(cache: str) -> str:
    return (f"Tensor q, Tensor k_new, Tensor v_new, {cache}, Tensor k_levels, Tensor v_levels, Tensor k_feedback, "
            f"Tensor length, {_ATTRS}")


_lib = torch.library.Library("oscar", "DEF")
# Updates the cache buffers in place, as the native ONNX Runtime and ExecuTorch kernels do.
_lib.define(f"attention({_schema(_MUTABLE)}) -> Tensor")
_lib.define(f"attention.out({_schema(_MUTABLE)}, *, Tensor(z!) out) -> Tensor(z!)")
# The same op with the updated buffers as outputs: what ONNX can express (ops/onnx.py).
_lib.define(f"attention_functional({_schema(_PLAIN)}) -> (Tensor, {', '.join(['Tensor'] * len(CACHE_NAMES))})")


def wrap_cache(cache, k_levels, v_levels, k_feedback, length, config: OscarConfig):
    """An OscarKVCache of one layer in `config`'s format (attribute_config) whose storage is the given buffers
    (written in place). Every buffer is checked against the format: the scale buffers' element type against
    scale_dtype, k_feedback against k_rounding (empty for nearest), a uniform codebook's levels against 0..2^bits-1."""
    given = dict(zip(CACHE_NAMES, cache))
    kv_heads, head_dim = given["k_sink"].shape[0], given["k_sink"].shape[-1]
    caps = (given["k_sink"].shape[1], given["k_recent"].shape[1], given["k_codes"].shape[1])
    if capacities(config, sum(caps)) != caps:
        raise OscarInputError(f"cache capacities (sink, recent, body) = {caps}: expected "
                              f"{capacities(config, sum(caps))} for sink={config.sink}, recent={config.recent}")
    for name, (shape, dtype) in buffer_layout(config, 1, kv_heads, head_dim, sum(caps)).items():
        want = shape if name.endswith("_codes") else shape[1:]  # the caller's buffers have no layer axis
        if name in SCALE_NAMES:
            dtype = BUFFER_SCALE_DTYPES[config.scale_dtype]  # fp8 travels as its uint8 bits
        if given[name].shape != want or given[name].dtype != dtype:
            raise OscarInputError(f"{name} is {given[name].dtype} {tuple(given[name].shape)}: "
                                  f"expected {dtype} {tuple(want)} (scale_dtype={config.scale_dtype!r})")
    if config.scale_dtype == "float8_e4m3fn":  # views: writes reach the caller's uint8 buffers
        given.update({name: given[name].view(torch.float8_e4m3fn) for name in SCALE_NAMES})
    feedback = config.k_rounding == "feedback"
    if feedback != (k_feedback.numel() > 0):
        raise OscarInputError(f"k_feedback has shape {tuple(k_feedback.shape)}: expected "
                              + (f"[{kv_heads}, {head_dim}, {head_dim}] with k_rounding='feedback'" if feedback
                                 else "an empty tensor with k_rounding='nearest'"))
    levels = {}
    if config.codebook == "uniform":
        for kind, given_levels, bits in (("k", k_levels, config.k_bits), ("v", v_levels, config.v_bits)):
            if not torch.equal(given_levels.float(), uniform_levels(bits)):
                raise OscarInputError(f"{kind}_levels are {given_levels.tolist()}: expected the uniform levels "
                                      f"0..{2**bits - 1} with codebook='uniform'")
    else:
        levels = {"k_levels": [k_levels], "v_levels": [v_levels]}
    # Views with a layer axis of one: writes reach the caller's buffers. Codes are held per layer (their own width).
    storage = {name: tensor if name.endswith("_codes") else tensor.unsqueeze(0) for name, tensor in given.items()}
    kv = OscarKVCache(config, 1, kv_heads, head_dim, max(sum(caps), 1), **levels, device=given["k_sink"].device,
                      k_feedback=k_feedback[None] if feedback else None, storage=storage)
    kv.length[0] = int(length.reshape(-1)[0])
    return kv


def _attention(q, k_new, v_new, *args):
    *cache, k_levels, v_levels, k_feedback, length = args[:14]
    attrs = dict(zip(ATTRIBUTES, args[14:]))
    kv = wrap_cache(cache, k_levels, v_levels, k_feedback, length, attribute_config(attrs))
    return kv.attend(0, q, k_new, v_new, attrs["scaling"])


def _attention_out(*args, out):
    return out.copy_(_attention(*args))


def _attention_functional(q, k_new, v_new, *args):
    cache = [t.clone() for t in args[: len(CACHE_NAMES)]]
    out = _attention(q, k_new, v_new, *cache, *args[len(CACHE_NAMES):])
    return (out, *cache)


_lib.impl("attention", _attention, "CompositeExplicitAutograd")
_lib.impl("attention.out", _attention_out, "CompositeExplicitAutograd")
_lib.impl("attention_functional", _attention_functional, "CompositeExplicitAutograd")


@torch.library.register_fake("oscar::attention")
def _(q, *args):
    return q.new_empty(q.shape)


@torch.library.register_fake("oscar::attention.out")
def _(*args, out):
    return out


@torch.library.register_fake("oscar::attention_functional")
def _(q, k_new, v_new, *args):
    return (q.new_empty(q.shape), *(t.new_empty(t.shape) for t in args[: len(CACHE_NAMES)]))

"""End-to-end decode tokens/s in ONNX Runtime: the laptop artifact (OSCAR cache, native op) against
the same model with a standard fp32 KV cache.

All variants hold the same weights, so only the cache differs: as the laptop artifact stores them
(4-bit MatMulNBits, int8 activations, 8-bit lm_head; the fp32 graphs go through the same quantizer),
or float32 with float_weights. OSCAR: the model.onnx that
the laptop export writes, run by OrtLM (cache buffers bound once, appended in place by the op). fp32: a
decode graph of standard ONNX ops built here from the same Hugging Face weights, in the layout ONNX
Runtime decoders use: past K/V inputs [1, Hkv, past, D] and present outputs (the past with the new
token concatenated), bound with IO binding and fed back as the next step's past. fp32 shared: the
same graph with ONNX Runtime's GroupQueryAttention over max-length fp32 buffers bound as both past and
present, so it appends in place as OSCAR does (the onnxruntime-genai layout): no per-step copy.

Decode cost does not depend on the values in the cache, and prefilling a long context through the
model would take minutes on a laptop CPU, so both caches start from a synthetic state: OSCAR's fp16
windows hold random rows and its packed body random rows quantized by the reference codec; the fp32
past holds random values. Then all decode greedily in alternating blocks of steps, so a noisy machine
slows all alike, and the median step latency (logits and argmax included) gives tokens/s.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from ..export.artifact import load_manifest
from .common import WARMUP, bench_setup, step_times
from ..config import OscarConfig, OscarInputError
from ..ops.attention import CACHE_NAMES
from ..targets import get
from ..targets.laptop import LaptopTarget
from ..targets.laptop.runner import OrtLM

FP32_FILE, SHARED_FILE = "fp32_decoder.onnx", "fp32_shared_decoder.onnx"
# fp32: past/present concatenated each step; fp32_shared: GroupQueryAttention appending in place.
CONTESTANTS = {"oscar": ("OSCAR", None), "fp32": ("fp32", "speedup"), "fp32_shared": ("fp32 shared", "speedup_shared")}


WEIGHTS = "float32 in every variant"


def oscar_decoder(directory: Path, model_name: str, context: int, config: OscarConfig, threads: int,
                  float_weights: bool) -> OrtLM:
    """Export the laptop artifact into `directory` and load it with the native op."""
    from ..export.pipeline import export_artifact

    export_artifact(get(LaptopTarget.name), model_name, directory, "hadamard", context, float_weights=float_weights,
                    config=config)
    return OrtLM(directory, "onnxruntime", threads)  # the op runs on the session's intra-op threads


class _Builder:
    """Nodes and initializers of a graph, each node with one fresh output name unless one is given."""

    def __init__(self):
        self.nodes, self.initializers = [], []

    def const(self, array) -> str:
        name = f"const_{len(self.initializers)}"
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs) -> str:
        out = out or f"{op_type.lower()}_{len(self.nodes)}"
        # Named: the weight quantizer picks nodes (the lm_head) by name.
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def linear(self, x: str, layer: torch.nn.Linear, out: str | None = None) -> str:
        weight = self.const(layer.weight.detach().float().numpy().T)
        if layer.bias is None:
            return self.op("MatMul", x, weight, out=out)
        return self.op("Add", self.op("MatMul", x, weight), self.const(layer.bias.detach().float().numpy()), out=out)

    def rms_norm(self, x: str, norm) -> str:
        eps = getattr(norm, "variance_epsilon", None) or norm.eps
        mean = self.op("ReduceMean", self.op("Pow", x, self.const(np.float32(2))), self.const(np.array([-1])),
                       keepdims=1)
        scaled = self.op("Div", x, self.op("Sqrt", self.op("Add", mean, self.const(np.float32(eps)))))
        return self.op("Mul", scaled, self.const(norm.weight.detach().float().numpy()))


def fp32_decoder(model, shared: bool = False) -> onnx.ModelProto:
    """One-token decode graph of a Llama-family model with an fp32 KV cache.

    Inputs input_ids int64 [1, 1], past.{i}.key / past.{i}.value float [1, Hkv, past, D]; outputs logits
    [1, 1, vocab], present.{i}.key / present.{i}.value [1, Hkv, past + 1, D]; standard ONNX ops only.
    shared: attention is GroupQueryAttention (com.microsoft) over buffers of capacity `max` tokens that
    the host binds as both past and present; an input `position` int64 [1] counts the cached tokens.
    """
    text = model.get_decoder()
    cfg = model.config.get_text_config()
    attn = text.layers[0].self_attn
    if getattr(attn, "q_norm", None) is not None or cfg.hidden_act != "silu":
        raise OscarInputError(f"model_type={cfg.model_type!r} with hidden_act={cfg.hidden_act!r}: the fp32 decode "
                              "graph expects a Llama, Mistral or Qwen2 model (SiLU MLP, no q/k norms)")
    d = attn.head_dim
    q_heads, kv_heads = attn.q_proj.out_features // d, attn.k_proj.out_features // d
    g = _Builder()
    # RoPE at the token's index (the cached tokens), as transformers computes it.
    cached = "position" if shared else g.op("Shape", "past.0.key", start=2, end=3)
    position = g.op("Cast", cached, to=TensorProto.FLOAT)
    if shared:
        seqlens = g.op("Cast", cached, to=TensorProto.INT32)
        total = g.op("Cast", g.op("Add", cached, g.const(np.array([1]))), to=TensorProto.INT32)
    freqs = g.op("Mul", position, g.const(text.rotary_emb.inv_freq.float().numpy()))
    emb = g.op("Concat", freqs, freqs, axis=0)
    scaling = g.const(np.float32(text.rotary_emb.attention_scaling))
    cos, sin = (g.op("Mul", g.op(f, emb), scaling) for f in ("Cos", "Sin"))
    half = [g.const(np.array([v])) for v in (0, d // 2, d, -1)]

    def rope(x):
        x1, x2 = g.op("Slice", x, half[0], half[1], half[3]), g.op("Slice", x, half[1], half[2], half[3])
        rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
        return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))

    h = g.op("Gather", g.const(text.embed_tokens.weight.detach().float().numpy()), "input_ids")
    for i, block in enumerate(text.layers):
        attn = block.self_attn
        x = g.rms_norm(h, block.input_layernorm)
        # One token: heads reshape straight to [1, H, 1, D].
        q = rope(g.op("Reshape", g.linear(x, attn.q_proj), g.const(np.array([1, q_heads, 1, d]))))
        k = rope(g.op("Reshape", g.linear(x, attn.k_proj), g.const(np.array([1, kv_heads, 1, d]))))
        if shared:
            flat = [g.op("Reshape", t, g.const(np.array([1, 1, -1]))) for t in (q, k)]
            node = helper.make_node("GroupQueryAttention", [*flat, g.linear(x, attn.v_proj), f"past.{i}.key",
                                                            f"past.{i}.value", seqlens, total],
                                    [f"attention_{i}", f"present.{i}.key", f"present.{i}.value"],
                                    name=f"attention_{i}", domain="com.microsoft", num_heads=q_heads,
                                    kv_num_heads=kv_heads,
                                    scale=float(attn.scaling))
            g.nodes.append(node)
            out = f"attention_{i}"
        else:
            v = g.op("Reshape", g.linear(x, attn.v_proj), g.const(np.array([1, kv_heads, 1, d])))
            keys = g.op("Concat", f"past.{i}.key", k, axis=2, out=f"present.{i}.key")
            values = g.op("Concat", f"past.{i}.value", v, axis=2, out=f"present.{i}.value")
            # The query heads of KV head h are rows of one [group, D] matrix; the scale goes on q, not on scores.
            grouped = g.op("Reshape", q, g.const(np.array([1, kv_heads, q_heads // kv_heads, d])))
            grouped = g.op("Mul", grouped, g.const(np.float32(attn.scaling)))
            scores = g.op("MatMul", grouped, g.op("Transpose", keys, perm=[0, 1, 3, 2]))
            out = g.op("MatMul", g.op("Softmax", scores, axis=-1), values)
            out = g.op("Reshape", out, g.const(np.array([1, 1, q_heads * d])))
        h = g.op("Add", h, g.linear(out, attn.o_proj))
        x = g.rms_norm(h, block.post_attention_layernorm)
        gate = g.linear(x, block.mlp.gate_proj)
        act = g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), g.linear(x, block.mlp.up_proj))
        h = g.op("Add", h, g.linear(act, block.mlp.down_proj))
    g.linear(g.rms_norm(h, text.norm), model.lm_head, out="logits")

    layers = range(len(text.layers))
    cache = [f"past.{i}.{part}" for i in layers for part in ("key", "value")]
    past, present = ("max", "max") if shared else ("past", "present")
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1])]
    if shared:
        inputs.append(helper.make_tensor_value_info("position", TensorProto.INT64, [1]))
    inputs += [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, kv_heads, past, d]) for name in cache]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, cfg.vocab_size])]
    outputs += [helper.make_tensor_value_info(name.replace("past", "present"), TensorProto.FLOAT,
                                              [1, kv_heads, present, d]) for name in cache]
    graph = helper.make_graph(g.nodes, "fp32_decoder", inputs, outputs, g.initializers)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model


class Fp32Decoder:
    """An fp32 decode graph in ONNX Runtime. Concatenating graph: present outputs become the next step's past
    inputs. Shared graph: each past buffer is bound as its present too, and GroupQueryAttention appends in place."""

    def __init__(self, path: Path, threads: int):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.past = [i.name for i in self.session.get_inputs() if i.name.startswith("past.")]
        self.shared = any(i.name == "position" for i in self.session.get_inputs())
        self.binding, self.length = self.session.io_binding(), 0

    def start(self, past: list[np.ndarray], length: int) -> None:
        """Bind the cache: arrays of `length` tokens, or for the shared graph of its capacity with `length` used."""
        self.length = length
        self.binding.bind_output("logits", "cpu")  # first, so it is the first output
        for name, array in zip(self.past, past):
            value = ort.OrtValue.ortvalue_from_numpy(array)
            self.binding.bind_ortvalue_input(name, value)
            if self.shared:
                self.binding.bind_ortvalue_output(name.replace("past", "present"), value)

    def step(self, token: int) -> np.ndarray:
        """Logits [vocab] after one token; the cache grows by it."""
        self.binding.bind_cpu_input("input_ids", np.array([[token]], np.int64))
        if self.shared:
            self.binding.bind_cpu_input("position", np.array([self.length], np.int64))
        else:  # a fresh present of one more token each step
            for name in self.past:
                self.binding.bind_output(name.replace("past", "present"), "cpu")
        self.session.run_with_iobinding(self.binding)
        logits, *present = self.binding.get_outputs()
        if not self.shared:
            for name, value in zip(self.past, present):
                self.binding.bind_ortvalue_input(name, value)
        self.length += 1
        return logits.numpy()[0, -1]


def save_decoder(model: onnx.ModelProto, path: Path, float_weights: bool) -> None:
    """An fp32-cache graph, its weights as given or as the laptop artifact stores them (4-bit MatMulNBits)."""
    if float_weights:
        onnx.save(model, path, save_as_external_data=True, location=path.name + ".data")
        return
    from ..targets.laptop.lower import quantize_file

    float_path = path.with_name(f"float.{path.name}")
    onnx.save(model, float_path, save_as_external_data=True, location=float_path.name + ".data")
    quantize_file(float_path, path, LaptopTarget.options.weight_block)
    float_path.unlink()
    float_path.with_name(float_path.name + ".data").unlink()


def bench_decode(contexts, steps: int = 64, threads: int | None = None, model_name: str = "bundled",
                 config: OscarConfig | None = None, work_dir=None, float_weights: bool = False) -> dict:
    """Decode tokens/s of the OSCAR artifact and of both fp32-cache graphs at each context, in one run.

    speedup compares with the concatenating fp32 graph, speedup_shared with the shared-buffer one.

    Each variant starts from a synthetic cache of context - WARMUP - steps - 1 tokens, so the timed steps
    end one token short of `context`. work_dir keeps the exported models (default: a temporary directory).
    """
    config, contexts, threads, model, rng = bench_setup(contexts, config, steps, threads, model_name)
    with tempfile.TemporaryDirectory(prefix="oscar-decode-bench-") as temp:
        work = Path(work_dir or temp)
        work.mkdir(parents=True, exist_ok=True)
        fp32 = {}
        for name, file, shared in (("fp32", FP32_FILE, False), ("fp32_shared", SHARED_FILE, True)):
            save_decoder(fp32_decoder(model, shared), work / file, float_weights)
            fp32[name] = Fp32Decoder(work / file, threads)
        results = []
        for context in contexts:
            length = context - WARMUP - steps - 1
            oscar = oscar_decoder(work / f"oscar-{context}", model_name, context, config, threads, float_weights)
            oscar.fill_synthetic(length, config, rng)
            heads, _, head_dim = oscar.cache["layer0.k_sink"].shape
            layers = len(oscar.cache) // len(CACHE_NAMES)
            past = [rng.standard_normal((1, heads, length, head_dim), dtype=np.float32) for _ in range(2 * layers)]
            fp32["fp32"].start(past, length)
            full = [np.zeros((1, heads, context, head_dim), np.float32) for _ in past]
            for buffer, rows in zip(full, past):
                buffer[:, :, :length] = rows
            fp32["fp32_shared"].start(full, length)
            times = step_times({"oscar": lambda t, lm=oscar: lm.step([t]), **{n: d.step for n, d in fp32.items()}},
                                int(rng.integers(model.config.get_text_config().vocab_size)), steps)
            ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
            result = {"context": context}
            for name in ms:
                result[f"{name}_tokens_per_s"] = round(1e3 / ms[name], 2)
            result["speedup"] = round(ms["fp32"] / ms["oscar"], 3)
            result["speedup_shared"] = round(ms["fp32_shared"] / ms["oscar"], 3)
            result.update({f"{name}_ms": round(value, 4) for name, value in ms.items()})
            result["oscar_cache_bytes"] = sum(a.nbytes for a in oscar.cache.values())
            result["fp32_cache_bytes"] = 2 * layers * heads * context * head_dim * 4
            results.append(result)
            oscar_weights = load_manifest(work / f"oscar-{context}")["weights"]
            del oscar  # its session and buffers before the next, larger context
    weights = WEIGHTS if float_weights else f"{oscar_weights} in every variant"
    return {"results": results, "threads": threads, "steps": steps, "weights": weights, "model": model_name,
            "config": config.to_dict(),
            "state": f"synthetic: random fp16 windows and codec-quantized random body rows (OSCAR), the same random "
                     f"fp32 past for both fp32 graphs; "
                     f"{WARMUP} untimed steps, then {steps} timed greedy steps ending at context - 1 tokens"}

def measure(request) -> dict:
    """`bench decode` of the request's model."""
    return bench_decode(request.contexts, request.steps, request.threads, request.model, request.config,
                        float_weights=request.float_weights)

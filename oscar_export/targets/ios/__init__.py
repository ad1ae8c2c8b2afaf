"""The ios target: an artifact directory with a Core ML ML program (docs/ios.md).

Directory contents: model.mlpackage (the converted OscarCausalLM, 4-bit weights unless float),
the tokenizer files, the rotation file when one was used, and manifest.json (what was exported,
the cache I/O layout, sha256 of every file).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import Lowered, Target, TargetOptions, register
from ...ops.coreml import ROW_NAMES, SCALE_DTYPES

LONG_CONTEXT = 32768  # the context at which the manifest states the cache's bits per element


@dataclass(frozen=True)
class IosOptions(TargetOptions):
    weight_block: int = 32  # input channels per 4-bit weight scale (iOS 18 blockwise ops)


def cache_bits_per_element(layout: list, layers: int, kv_heads: int, head_dim: int, context: int) -> float:
    """Bits per K/V element of the cache buffers as the app allocates them: windows, codes, scales, zeros."""
    stored = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, dtype in layout)
    return stored * 8 / (layers * kv_heads * 2 * head_dim * context)


def io_layout(module, max_context: int, max_chunk: int) -> dict:
    """The model's inputs and outputs as the app sees them (docs/ios.md)."""
    from .lower import cache_inputs

    h, d = module.kv_heads, module.head_dim
    groups = d // module.config.cluster_dim
    scale_type = "int32" if module.config.scale_dtype == "float8_e4m3fn" else "float16"  # fp8: bytes 0..255

    def rows(config) -> dict:  # one layer's rows; its code words follow its own K width
        out = {"k_new": ([h, "T", d], "float16"), "v_new": ([h, "T", d], "float16")}
        for kind in ("k", "v"):
            out[f"{kind}_body_codes"] = ([h, "T", d * config.bits(kind) // 32], "int32")
            out[f"{kind}_body_scale"] = ([h, "T", groups], scale_type)
            out[f"{kind}_body_zero"] = ([h, "T", groups], scale_type)
        return out

    per_layer = [rows(config) for config in module.config.layers(len(module.layers))]
    return {
        "inputs": [{"name": "input_ids", "shape": [1, "T"], "dtype": "int32"},
                   {"name": "length", "shape": [1], "dtype": "int32"},
                   *({"name": name, "shape": list(shape), "dtype": np.dtype(dtype).name}
                     for name, shape, dtype in cache_inputs(module, max_context))],
        "outputs": [{"name": "logits", "shape": [1, 1, module.lm_head.out_features], "dtype": "float32"},
                    *({"name": f"layer{i}_{name}", "shape": layer[name][0], "dtype": layer[name][1]}
                      for i, layer in enumerate(per_layer) for name in ROW_NAMES)],
        "T": f"1 .. {max_chunk}",
    }


class IosTarget(Target):
    name = "ios"
    scale_dtypes = SCALE_DTYPES  # the Core ML rows' scale and zero storage (ops/coreml.py)
    runtime = "coreml"
    description = ("an .mlpackage for Core ML on iPhone, iPad and Mac (iOS 18 / macOS 15) whose 2-bit cache is "
                   "app-held int32 buffers, 4-bit weights from coremltools.optimize, tokenizer and manifest.json")
    options = IosOptions()
    packages = ("oscar-export", "torch", "transformers", "coremltools")
    runtimes = {"coreml-mil": "the converted MIL program executed in numpy (mil_eval)",
                "coreml": "MLModel.predict (macOS)"}
    float_weights_help = "keep fp16 weights (default: 4-bit, coremltools.optimize linear quantization)"

    def check(self, options, config, max_context):
        from .lower import check_layout

        super().check(options, config, max_context)
        check_layout(config.sink, config.recent, max_context)

    def weight_plan(self, options, float_weights):
        # every parameter matrix, the embedding table too, 4-bit symmetric (no zero points)
        return dict(weight_bits=16 if float_weights else 4, embedding_bits=16 if float_weights else 4,
                    weight_zero_points=False, weight_group=options.weight_block)

    def lower(self, module, model, tokenizer, max_context, max_chunk, float_weights, options,
              weights=None) -> Lowered:
        from .lower import MODEL_FILE, cache_inputs, convert

        mlmodel = convert(module, max_context, max_chunk, float_weights, weight_block=options.weight_block)
        shape = (len(module.layers), module.kv_heads, module.head_dim)
        cache = {
            "bytes": sum(int(np.prod(s)) * np.dtype(t).itemsize for _, s, t in cache_inputs(module, max_context)),
            "bits_per_element_at_max_context": cache_bits_per_element(cache_inputs(module, max_context), *shape,
                                                                      max_context),
            f"bits_per_element_at_{LONG_CONTEXT}": cache_bits_per_element(cache_inputs(module, LONG_CONTEXT), *shape,
                                                                          LONG_CONTEXT),
        }
        return Lowered(lambda temp: mlmodel.save(str(temp / MODEL_FILE)),
                       "float16" if float_weights else f"int4 (linear_symmetric, block {options.weight_block})",
                       dict(deployment_target="iOS18 / macOS15", compute_precision="float32",
                            io=io_layout(module, max_context, max_chunk), cache=cache))

    def program_io(self, directory):
        from .runner import program_io

        return program_io(directory)

    def runner(self, directory, manifest, runtime, threads):
        from .runner import CoreMLLM, load

        cfg = manifest["config"]
        return CoreMLLM(load(directory), runtime, manifest["model"]["layers"], cfg["sink"], cfg["recent"],
                        manifest["max_chunk"])

    def unavailable_runtimes(self):
        from .runner import coreml_available

        ok, why = coreml_available()
        return {} if ok else {"coreml": why}

    def artifact_module(self, directory, manifest, module=None):
        """The eager graph with the weights the program stores (fp16, or 4-bit dequantized)."""
        import torch

        from .runner import load
        from .mil_eval import saved_program, weights

        module = super().artifact_module(directory, manifest, module)
        state = module.state_dict()
        found = weights(saved_program(load(directory)))
        for key in state:
            name = "p_" + key.replace(".", "_")
            if name in found:
                state[key] = torch.from_numpy(found[name].astype(np.float32))
        module.load_state_dict(state)
        return module


register(IosTarget())

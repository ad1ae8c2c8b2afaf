"""The one export pipeline every target goes through.

export_artifact: check the arguments, load the model and its shape, choose the context, resolve
the rotations and the cache config, build the exportable graph (graph.OscarCausalLM; for a target that
streams weights, on the meta device with the weights read layer by layer: streamed.py), let the target
lower it and quantize its weights, then write the artifact atomically with its manifest and
memory plan. A target supplies only Target.lower (targets/); finding a target by name is its caller's
business, so this package never imports the targets.
"""

from __future__ import annotations

from ..config import OscarConfig, config_for
from .artifact import (check_export_args, default_context, eos_ids, export_lock, finish_manifest,
                       rotation_metadata, save_inputs, staged)


def export_artifact(target, model_name: str, out, rotations="hadamard", max_context: int | None = None,
                    float_weights: bool = False, device_memory: str | None = None, options=None,
                    config: OscarConfig | None = None, format_choice: dict | None = None) -> dict:
    """Export `model_name` ('bundled' or a local checkpoint) for `target` (a registered targets.Target; options:
    its TargetOptions, default target.options) into the directory `out`; returns the manifest. config: the cache
    format, used as given; None: the defaults completed by the rotation file's metadata (its clip ratios, codebook
    and K rounding, or the whole format a budget search chose), the group sized for the model's head_dim.
    format_choice: why the format is what it is when the export chose it for a device (the manifest keeps it)."""
    options = options or target.options
    memory = check_export_args(out, rotations, device_memory or options.device_memory)
    if config is not None and not isinstance(config, OscarConfig):
        raise TypeError(f"config is {type(config).__name__}: expected an OscarConfig or None")
    with export_lock(out):
        return _export(target, model_name, out, rotations, max_context, float_weights, memory, options, config,
                       format_choice)


def _export(target, model_name, out, rotations, max_context, float_weights, memory, options, config,
            format_choice) -> dict:
    from ..hf_cache import resolve_rotations
    from ..models import is_gguf, load_model, model_dir, model_shape
    from ..planner import plan
    from .graph import OscarCausalLM
    from .streamed import StreamedWeights, is_streamable, meta_model

    shape = model_shape(model_name)
    max_context = default_context(shape, max_context)
    if config is None:
        config = config_for(rotation_metadata(rotations), shape.head_dim)
    config.check_head_dim(shape.head_dim)
    target.check(options, config, max_context)
    checkpoint = None if is_gguf(model_name) else model_dir(model_name)
    streamed = target.streams_weights and checkpoint is not None and is_streamable(checkpoint)
    model, tokenizer = meta_model(checkpoint) if streamed else load_model(model_name)
    eos_ids(model)  # a model that names no end of sequence is refused before minutes of lowering
    max_chunk = min(options.max_chunk, max_context)
    resolved = resolve_rotations(rotations, model)
    module = OscarCausalLM(model, config, resolved).eval()
    weights = StreamedWeights(module, model, checkpoint) if streamed else None
    lowered = target.lower(module, model, tokenizer, max_context, max_chunk, float_weights, options, weights)
    with staged(out) as temp:
        lowered.write(temp)
        weights_plan = target.weight_plan(options, float_weights)
        return finish_manifest(temp, target.name, target.runtime, model_name, model, shape,
                               save_inputs(temp, tokenizer, rotations, resolved), config, max_context, max_chunk,
                               lowered.weights, plan(shape, config, memory, max_context, **weights_plan),
                               target.packages, **lowered.manifest,
                               **({"format_choice": format_choice} if format_choice else {}))

"""The one export pipeline every target goes through, and the runs every artifact shares.

export_artifact: check the arguments, load the model and its shape, choose the context, resolve
the rotations and the cache config, build the exportable graph (graph.OscarCausalLM; for a target that
streams weights, on the meta device with the weights read layer by layer: streamed.py), let the target
lower it and quantize its weights, then write the artifact atomically with its manifest and
memory plan. A target supplies only Target.lower (targets/).
"""

from __future__ import annotations

from pathlib import Path

from ..config import OscarInputError
from ..targets import REFERENCE, Target, TargetOptions, get
from .artifact import (check_export_args, config_for, default_context, eager_trace, finish_manifest, load_manifest,
                       prompt_ids, save_inputs, staged)


def export_artifact(target: str | Target, model_name: str, out, rotations="hadamard", max_context: int | None = None,
                    float_weights: bool = False, device_memory: str | None = None,
                    options: TargetOptions | None = None, **config_fields) -> dict:
    """Export `model_name` ('bundled' or a local checkpoint) for `target` into the directory `out`; returns the
    manifest. config_fields: OscarConfig fields (k_bits, cluster_dim, sink, ...); None keeps the default, or
    the rotation file's value for clip ratios and codebook."""
    from ..hf_cache import resolve_rotations
    from ..models import is_gguf, load_model, model_dir, model_shape
    from ..planner import plan
    from .graph import OscarCausalLM
    from .streamed import StreamedWeights, is_streamable, meta_model

    target = get(target) if isinstance(target, str) else target
    options = options or target.options
    memory = check_export_args(out, rotations, device_memory or options.device_memory)
    shape = model_shape(model_name)
    max_context = default_context(shape, max_context)
    target.check(options, config_fields, max_context)
    checkpoint = None if is_gguf(model_name) else model_dir(model_name)
    streamed = target.streams_weights and checkpoint is not None and is_streamable(checkpoint)
    model, tokenizer = meta_model(checkpoint) if streamed else load_model(model_name)
    max_chunk = min(options.max_chunk, max_context)
    resolved = resolve_rotations(rotations, model)
    config = config_for(resolved, shape.head_dim, **config_fields)
    module = OscarCausalLM(model, config, resolved).eval()
    weights = StreamedWeights(module, model, checkpoint) if streamed else None
    lowered = target.lower(module, model, tokenizer, max_context, max_chunk, float_weights, options, weights)
    with staged(out) as temp:
        lowered.write(temp)
        return finish_manifest(temp, target.name, target.runtime, model_name, model, shape,
                               save_inputs(temp, tokenizer, rotations, resolved), config, max_context, max_chunk,
                               lowered.weights, plan(shape, config, memory, max_context, **lowered.plan_args),
                               target.packages, **lowered.manifest)


def open_artifact(directory) -> tuple[Path, dict, Target]:
    """The artifact's directory, verified manifest and target."""
    directory = Path(directory)
    manifest = load_manifest(directory)
    return directory, manifest, get(manifest["target"])


def check_runtime(target: Target, runtime: str | None) -> str:
    allowed = target.run_runtimes()
    runtime = runtime or allowed[0]
    if runtime not in allowed:
        raise OscarInputError(f"--runtime {runtime!r} does not run a {target.name} artifact: expected one of "
                              f"{allowed}")
    return runtime


def reference_module(directory) -> tuple:
    """(module, manifest): the artifact's reference, the eager graph.OscarCausalLM with its config, rotations and
    its own weights (as the target stores them)."""
    directory, manifest, target = open_artifact(directory)
    return target.artifact_module(directory, manifest), manifest


def reference_trace(directory, ids: list[int], steps: int, device: str = "cpu") -> dict:
    """The artifact's reference run, greedy: tokens, each step's logits, the packed body codes by cache name."""
    module, manifest = reference_module(directory)
    return eager_trace(module.to(device), manifest, ids, steps, device)


def chat_prompt(tokenizer, question: str) -> str:
    """The question as one user turn in the tokenizer's chat template, ready for the assistant's answer."""
    if not tokenizer.chat_template:
        raise OscarInputError("--chat: the artifact's tokenizer has no chat template: expected a chat model's "
                              "artifact, or --prompt with the text as the model expects it")
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def run_artifact(directory, prompt: str, max_new_tokens: int, runtime: str | None = None, threads: int = 0,
                 chat: bool = False) -> dict:
    """Greedy generation from an artifact on one of its target's runtimes: {"tokens": [...], "text": "..."}.
    chat: `prompt` is a question, put in the chat template the artifact's tokenizer carries."""
    from transformers import AutoTokenizer

    directory, manifest, target = open_artifact(directory)
    runtime = check_runtime(target, runtime)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if chat:
        prompt = chat_prompt(tokenizer, prompt)
    # A chat template writes its special tokens itself: the tokenizer must not add them again.
    ids = prompt_ids(tokenizer, prompt, add_special_tokens=not chat)
    if runtime == REFERENCE:
        tokens = reference_trace(directory, ids, max_new_tokens)["tokens"]
        return {"tokens": tokens, "text": tokenizer.decode(tokens)}
    return target.generate(directory, manifest, runtime, tokenizer, prompt, ids, max_new_tokens, threads)

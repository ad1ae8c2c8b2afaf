"""Opening an exported artifact and running it: the target its manifest names, one of that target's runtimes, or
the reference (the eager graph with the artifact's own weights)."""

from __future__ import annotations

from pathlib import Path

from .config import OscarInputError
from .export.artifact import artifact_tokenizer, eager_trace, load_manifest, prompt_ids
from .targets import REFERENCE, Target, get


def open_artifact(directory) -> tuple[Path, dict, Target]:
    """The artifact's directory, verified manifest (its files' hashes, and its fields against the programs) and
    target."""
    directory = Path(directory)
    manifest = load_manifest(directory)
    target = get(manifest["target"])
    target.check_artifact(directory, manifest)
    return directory, manifest, target


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
    directory, manifest, target = open_artifact(directory)
    runtime = check_runtime(target, runtime)
    tokenizer = artifact_tokenizer(directory)
    if chat:
        prompt = chat_prompt(tokenizer, prompt)
    # A chat template writes its special tokens itself: the tokenizer must not add them again.
    ids = prompt_ids(tokenizer, prompt, add_special_tokens=not chat)
    vocab = manifest["model"]["vocab"]
    if max(ids) >= vocab:  # an added token (a GGUF tokenizer's pad) past the embedding
        raise OscarInputError(f"the prompt has token {tokenizer.convert_ids_to_tokens(max(ids))!r} (id {max(ids)}), "
                              f"which the model has no embedding for (vocabulary {vocab}): expected text without it")
    context = manifest["max_context"]
    if len(ids) >= context:
        raise OscarInputError(f"the prompt is {len(ids)} tokens: expected fewer than the artifact's context, {context}")
    # Each new token but the last is fed back; one slot is left free, as every runtime's runner needs.
    steps = min(max_new_tokens, context - len(ids))
    if runtime == REFERENCE:
        tokens = reference_trace(directory, ids, steps)["tokens"]
        result = {"tokens": tokens, "text": tokenizer.decode(tokens)}
    else:
        result = target.generate(directory, manifest, runtime, tokenizer, prompt, ids, steps, threads)
    if steps < max_new_tokens and len(result["tokens"]) == steps:
        result["stopped_at_context"] = context
    return result

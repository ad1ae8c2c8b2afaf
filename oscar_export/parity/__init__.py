"""Parity: the same prompt through every available runtime, compared code by code and token by token.

Two levels, thresholds in docs/parity.md:
- op level: each runtime's attention is fed the reference run's exact q/k/v, call by call; its
  codes must be bit-exact except rounding ties (codes_mismatch_fraction <= 1e-3) and its
  attention outputs within max relative error 1e-3;
- end to end: the runtime generates greedily on its own; logits within 1e-2 relative and the
  same tokens.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import torch

from ..codec import unpack_codes
from ..config import OscarConfig, OscarInputError
from ..hf_cache import OscarCache, patch_model_for_kv_quant
from ..progress import progress
from ..sizes import MAX_STEPS
from ..targets import REFERENCE

THRESHOLDS = {"codes_mismatch_fraction": 1e-3, "max_rel_error": 1e-3, "logits_max_rel_error": 1e-2}


@dataclass
class Trace:
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    calls: list[tuple] = field(default_factory=list)  # (layer, q, k, v, scaling, out) per attention call
    cache: OscarCache | None = None


def available_runtimes() -> dict[str, str]:
    """Runtime name -> how it runs here."""
    runtimes = {"reference": "PyTorch fp32 reference"}
    if importlib.util.find_spec("triton") is not None:
        if torch.cuda.is_available():
            runtimes["triton"] = "Triton on CUDA"
        elif os.environ.get("TRITON_INTERPRET") == "1":
            runtimes["triton"] = "Triton interpreter on CPU"
    return runtimes


def _record(trace_: Trace):
    def observer(layer, q, k, v, scaling, out):
        trace_.calls.append((layer, q.detach(), k.detach(), v.detach(), scaling, out.detach().float().cpu()))

    return observer


@torch.no_grad()
def generate_trace(model, prompt: torch.Tensor, steps: int, backend: str) -> Trace:
    """Greedy decoding through an OscarCache on `backend`, recording logits and every attention call."""
    result = Trace()
    cache = OscarCache(model, max_context=prompt.shape[1] + steps, backend=backend)
    cache.observer = _record(result)
    ids = prompt
    for _ in progress(range(steps), f"parity: {backend} generates"):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].float().cpu()
        result.logits.append(logits)
        result.tokens.append(int(logits.argmax()))
        ids = torch.tensor([[result.tokens[-1]]], device=prompt.device)
    result.cache = cache
    return result


@torch.no_grad()
def replay_trace(model, reference: Trace, backend: str) -> Trace:
    """Feed the reference run's exact attention inputs, call by call, to `backend`'s cache."""
    result = Trace()
    cache = OscarCache(model, max_context=reference.cache.kv.max_context, backend=backend)
    cache.observer = _record(result)
    for layer, q, k, v, scaling, _ in progress(reference.calls, f"parity: {backend} replays"):
        cache.attend(layer, q, k, v, scaling)
    result.cache = cache
    return result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def compare_ops(candidate: Trace, reference: Trace) -> dict:
    kv, ref = candidate.cache.kv, reference.cache.kv
    mismatched = total = 0
    exact = True
    for kind in ("k", "v"):
        for cfg, got, want in zip(kv.layer_configs, kv.codes[kind], ref.codes[kind]):
            a, b = unpack_codes(got.cpu(), cfg.bits(kind)), unpack_codes(want.cpu(), cfg.bits(kind))
            mismatched += int((a != b).sum())
            total += a.numel()
        for region in ("sink", "recent", "scale", "zero"):
            exact &= torch.equal(getattr(kv, region)[kind].cpu(), getattr(ref, region)[kind].cpu())
    errors = [_rel(a[-1], b[-1]) for a, b in zip(candidate.calls, reference.calls)]
    return {
        "codes_mismatch_fraction": mismatched / max(total, 1),
        "codes_mismatched": mismatched,
        "windows_scales_zeros_exact": exact,
        "max_rel_error": max(errors),
        "mean_rel_error": sum(errors) / len(errors),
    }


def compare_tokens(candidate: Trace, reference: Trace) -> dict:
    return {
        "logits_max_rel_error": max(_rel(a, b) for a, b in zip(candidate.logits, reference.logits)),
        "tokens_match": candidate.tokens == reference.tokens,
        "tokens": candidate.tokens,
    }


def run_parity(model, prompt: torch.Tensor, steps: int, config: OscarConfig, rotations="hadamard") -> dict:
    """Every available runtime against the reference, on the same prompt and cache inputs."""
    patch_model_for_kv_quant(model, config, rotations=rotations)
    reference = generate_trace(model, prompt, steps, "reference")
    report = {
        "prompt_tokens": prompt.shape[1],
        "steps": steps,
        "config": config.to_dict(),
        "rotations": rotations if isinstance(rotations, str) else "file",
        "thresholds": THRESHOLDS,
        "runtimes": {},
    }
    for name, how in available_runtimes().items():
        if name == "reference":
            ops, tokens = reference, reference
        else:
            ops, tokens = replay_trace(model, reference, name), generate_trace(model, prompt, steps, name)
        row = {"how": how, **compare_ops(ops, reference), **compare_tokens(tokens, reference)}
        row["ok"] = row["tokens_match"] and row["windows_scales_zeros_exact"] and all(
            row[key] <= limit for key, limit in THRESHOLDS.items()
        )
        report["runtimes"][name] = row
    report["ok"] = all(row["ok"] for row in report["runtimes"].values())
    return report


# -- exported artifacts ------------------------------------------------------------------------------

# End to end on an artifact: the logits limit of compare_tokens, and the codes limit of compare_ops.
ARTIFACT_THRESHOLDS = {"logits_max_rel_error": 1e-2, "codes_mismatch_fraction": 1e-3}
TRACE_FORMAT = "oscar-export/parity-trace/1"


def _artifact_identity(manifest: dict) -> str:
    """sha256 over the artifact's file table: a trace is only checked against the artifact it was recorded on."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()


def save_trace(path, directory, ids: list[int], steps: int) -> dict:
    """Record the artifact's reference run (prompt, greedy tokens, each step's logits, the packed body codes after
    the run) into a safetensors file, on CUDA when this machine has it: the other side of a cross-machine parity
    check (`parity --artifact DIR --against FILE`)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from ..run import open_artifact, reference_trace
    from ..calibration.files import write_atomically

    directory, manifest, _ = open_artifact(directory)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trace = reference_trace(directory, ids, steps, device=device)
    tensors = {"prompt": np.asarray(ids, np.int64), "tokens": np.asarray(trace["tokens"], np.int64),
               "logits": np.stack(trace["logits"]).astype(np.float32),
               **{f"codes.{name}": np.ascontiguousarray(array) for name, array in trace["codes"].items()}}
    metadata = {"format": TRACE_FORMAT, "artifact": _artifact_identity(manifest), "target": manifest["target"],
                "config": json.dumps(manifest["config"]), "weights": manifest["weights"], "device": device,
                "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "torch": torch.__version__, "steps": str(steps)}
    write_atomically(path, lambda temp: save_file(tensors, str(temp), metadata=metadata))
    return metadata


def load_trace(path, manifest: dict) -> tuple[list[int], int, dict, dict]:
    """(prompt ids, steps, the reference trace, its metadata) from a file save_trace wrote for this artifact."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "np") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, ValueError, SafetensorError) as err:
        raise OscarInputError(f"--against {str(path)!r}: cannot read it ({str(err).splitlines()[0][:200]}): expected "
                              f"a file written by parity --save-trace") from None
    fields = {"format", "artifact", "steps", "device_name", "torch"}
    if (metadata.get("format") != TRACE_FORMAT or not fields <= set(metadata) or not metadata["steps"].isdigit()
            or not {"prompt", "tokens", "logits"} <= set(tensors) or len(tensors["logits"]) != len(tensors["tokens"])):
        raise OscarInputError(f"--against {str(path)!r}: not a parity trace: expected a file written by "
                              f"parity --save-trace")
    if metadata.get("artifact") != _artifact_identity(manifest):
        raise OscarInputError(f"--against {str(path)!r} was recorded on another artifact (its files differ from "
                              f"this one's): expected a trace saved with --artifact on a copy of this artifact")
    _check_trace(path, tensors, int(metadata["steps"]), manifest)
    trace = {"tokens": tensors["tokens"].tolist(), "logits": list(tensors["logits"]),
             "codes": {name[len("codes."):]: array for name, array in tensors.items() if name.startswith("codes.")}}
    return tensors["prompt"].tolist(), int(metadata["steps"]), trace, metadata


def _check_trace(path, tensors: dict, steps: int, manifest: dict) -> None:
    """Every value of a trace file within what this artifact can have given: a trace is data from elsewhere."""
    import numpy as np

    from ..export.artifact import manifest_cache_layout

    vocab, context = manifest["model"]["vocab"], manifest["max_context"]
    prompt, tokens, logits = tensors["prompt"], tensors["tokens"], tensors["logits"]

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise OscarInputError(f"--against {str(path)!r}: {what}: expected a file written by parity --save-trace "
                                  "on this artifact")

    require(1 <= steps <= MAX_STEPS, f"steps {steps}, not 1..{MAX_STEPS}")
    for name, ids in (("prompt", prompt), ("tokens", tokens)):
        require(ids.ndim == 1 and ids.dtype == np.int64 and bool(((ids >= 0) & (ids < vocab)).all()),
                f"{name} is not a list of token ids below the vocabulary's {vocab}")
    require(1 <= len(prompt) and len(prompt) + steps <= context,
            f"a {len(prompt)}-token prompt and {steps} steps, not within the context of {context} tokens")
    require(1 <= len(tokens) <= steps, f"{len(tokens)} tokens for {steps} steps")
    require(logits.shape == (len(tokens), vocab) and logits.dtype == np.float32,
            f"logits {tuple(logits.shape)} {logits.dtype}, not ({len(tokens)}, {vocab}) float32")
    layout = {name: shape for name, shape, _ in manifest_cache_layout(manifest)}
    for name, array in tensors.items():
        if name.startswith("codes."):
            want = layout.get(name[len("codes."):]) if name.endswith("_codes") else None
            require(want is not None and array.shape == want and array.dtype == np.uint8,
                    f"{name} {tuple(array.shape)} {array.dtype}, not a packed body of this artifact")


def _codes_mismatches(got: dict, want: dict, config: dict, slots: int | None = None) -> tuple[int, int, dict]:
    """Mismatched codes over the first `slots` body positions of every cache (all of them when None): in all, of
    all, and the fraction in each cache by name."""
    import numpy as np

    layers = OscarConfig.from_dict(config)
    mismatched = total = 0
    fractions = {}
    for cache_name, reference in want.items():  # layer{i}.k_codes: that layer's width
        layer, buffer = cache_name.split(".")
        bits = layers.layer(int(layer.removeprefix("layer"))).bits(buffer[0])
        a = unpack_codes(torch.from_numpy(np.ascontiguousarray(got[cache_name][:, :slots])), bits)
        b = unpack_codes(torch.from_numpy(np.ascontiguousarray(reference[:, :slots])), bits)
        mismatched += int((a != b).sum())
        total += a.numel()
        fractions[cache_name] = float((a != b).sum()) / max(a.numel(), 1)
    return mismatched, total, fractions


# A greedy pick may differ from the reference's only where the reference itself rates the two within this many nats
# of log-probability (equal to their logit gap): a near tie, which any float difference may settle either way.
TIE_MARGIN = 0.5


def _divergence(got: dict, reference: dict) -> dict:
    """Where the tokens first differ, and whether each step where they differ is a near tie in the reference: its
    top token leads the runtime's pick by at most TIE_MARGIN nats (tie_margin: the widest such lead). A greedy run
    reads different tokens after its first difference, so nothing later is comparable; a run fed the reference's
    tokens (got["forced"]) reads the same prefix at every step, so every step is checked."""
    pairs = list(zip(got["tokens"], reference["tokens"]))
    steps = [i for i, (g, w) in enumerate(pairs) if g is not None and g != w]
    if not got.get("forced"):
        steps = steps[:1]
    if not steps:
        return {"tokens_match": len(got["tokens"]) == len(reference["tokens"]), "diverged_at": None, "near_tie": False,
                "tie_margin": None, "tokens_differing": 0, "not_a_tie_at": None}
    margins = []
    for step in steps:
        logits = reference["logits"][step]
        # abs: in a doctored or foreign trace the reference token need not be its own logits' argmax
        margins.append(abs(float(logits[reference["tokens"][step]] - logits[got["tokens"][step]])))
    ties = [margin <= TIE_MARGIN for margin in margins]
    return {"tokens_match": False, "diverged_at": steps[0], "near_tie": all(ties), "tie_margin": max(margins),
            "tokens_differing": len(steps), "not_a_tie_at": next((s for s, tie in zip(steps, ties) if not tie), None)}


def compare_artifact_traces(got: dict, reference: dict, config: dict, prompt_tokens: int,
                            limits: dict = ARTIFACT_THRESHOLDS) -> dict:
    """A runtime's trace against the reference: tokens, logits and codes. The tokens must match, or differ only at
    near ties (_divergence). A runtime fed the reference's tokens (got["forced"]) is compared at every step, its
    logits and codes over the whole run; a greedy one up to its first difference. A runtime that gives tokens only
    (the stock C++ runner) is held to its tokens, where an id it could not recover from its text counts as equal.
    `limits` holds the codes limit and, for an artifact whose activations stay float, the logits limit."""
    import numpy as np

    row = {"tokens": got["tokens"], "forced": bool(got.get("forced")), **_divergence(got, reference)}
    tokens_ok = row["tokens_match"] or row["near_tie"]
    if got["logits"] is None:
        return {**row, "logits_max_abs_error": None, "logits_max_rel_error": None, "codes_mismatched": None,
                "codes_mismatch_fraction": None, "codes_worst_cache": None, "codes_worst_fraction": None,
                "ok": tokens_ok}
    upto = None if row["diverged_at"] is None or row["forced"] else row["diverged_at"] + 1
    pairs = list(zip(got["logits"][:upto], reference["logits"][:upto]))
    # Body slot j holds position sink + j; positions from prompt + divergence on hold different tokens.
    slots = None if upto is None else max(prompt_tokens + row["diverged_at"] - config["sink"], 0)
    mismatched, total, fractions = _codes_mismatches(got["codes"], reference["codes"], config, slots)
    worst = max(fractions, key=fractions.get, default=None)
    row.update({
        "codes_worst_cache": worst, "codes_worst_fraction": None if worst is None else fractions[worst],
        "logits_max_abs_error": max(float(np.abs(a - b).max()) for a, b in pairs),
        "logits_max_rel_error": max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) for a, b in pairs),
        "codes_mismatched": mismatched, "codes_mismatch_fraction": mismatched / max(total, 1)})
    row["ok"] = tokens_ok and all(row[key] <= limit for key, limit in limits.items())
    return row


def tokens_verdict(row: dict) -> str:
    """The tokens column of a parity table."""
    if row["tokens_match"]:
        return "match"
    if row["near_tie"]:
        if row.get("tokens_differing", 1) > 1:
            return f"{row['tokens_differing']} near ties, the first at step {row['diverged_at']}"
        return f"near tie at step {row['diverged_at']}"
    if row["diverged_at"] is None:
        return "DIFFER"
    return f"DIFFER at step {row['not_a_tie_at']} (the reference leads by {row['tie_margin']:.2f} nats)"


# -- distributions over a real text ------------------------------------------------------------------------------

DISTRIBUTION_TOKENS = 2048  # positions scored, when the artifact's context holds them (--kl-tokens)
DISTRIBUTION_PROMPT = 32  # prefilled; every later position is fed one token at a time, as decoding feeds it

# Runtime against reference, teacher-forced over the text: KL(reference || runtime) per position, judged on its mean
# and 99th percentile. A runtime may add at most DISTRIBUTION_SHARE of what the artifact's weight format already
# costs (the float model against the reference, the same statistic), and never less than the floor, which float
# summation order alone reaches where the format costs nothing (float weights). Fixed: neither side of the runtime
# being judged moves them. docs/parity.md gives the measurements.
DISTRIBUTION_SHARE = 0.2
DISTRIBUTION_FLOORS = {"kl_mean": 1e-4, "kl_p99": 1e-3}


# Weights read back from the artifact against the source checkpoint's: the least-squares gain <a, b> / <b, b> of
# each tensor. A 4-bit grid leaves it within 1.3e-3 of 1 (docs/parity.md); a tensor rescaled by 1% or taken from
# elsewhere is far past the limit.
WEIGHT_GAIN_LIMIT = 3e-3


def _forced_text(text_ids: list[int], eos: list[int], max_context: int, tokens: int) -> tuple[list[int], list[int]]:
    """(prompt, forced tokens) of the distribution check: at most `tokens` scored positions that fit the context,
    cut before any EOS id (a run stops there)."""
    forced = text_ids[DISTRIBUTION_PROMPT:DISTRIBUTION_PROMPT + min(tokens, max_context - DISTRIBUTION_PROMPT)]
    cut = next((i for i, t in enumerate(forced) if t in eos), len(forced))
    if not cut:
        raise OscarInputError(f"--kl-tokens: no position to score after the {DISTRIBUTION_PROMPT}-token prompt (context "
                              f"{max_context}, or the text's next token is an EOS id): expected a context above "
                              f"{DISTRIBUTION_PROMPT} and a text that goes on, or --kl-tokens 0")
    return text_ids[:DISTRIBUTION_PROMPT], forced[:cut]


def weight_gains(module, float_module) -> dict:
    """Every floating-point tensor of `module` (the artifact's weights) against the same tensor of `float_module`
    (the source checkpoint's): the least-squares gain <a, b> / <b, b>, the relative error, and the worst of each."""
    rows = {}
    source = float_module.state_dict()
    for name, tensor in module.state_dict().items():
        want = source.get(name)
        # torchao's quantized weights (android) are tensor subclasses, skipped: that reference quantizes the source
        if (want is None or type(tensor) is not torch.Tensor or not tensor.is_floating_point()
                or tensor.shape != want.shape or tensor.numel() < 2):
            continue
        a, b = tensor.detach().double().flatten(), want.detach().double().flatten()
        if torch.equal(a, b) or float(b @ b) == 0:
            continue
        rows[name] = {"gain": float(a @ b / (b @ b)), "rel_error": float((a - b).norm() / b.norm())}
    worst = max(rows, key=lambda n: abs(rows[n]["gain"] - 1), default=None)
    return {"tensors": len(rows), "worst": worst, "worst_gain": None if worst is None else rows[worst]["gain"],
            "max_rel_error": max((r["rel_error"] for r in rows.values()), default=0.0),
            "ok": worst is None or abs(rows[worst]["gain"] - 1) <= WEIGHT_GAIN_LIMIT}


def distribution_parity(module, float_module, target, directory, manifest: dict, text_ids: list[int],
                        tokens: int, runtimes: dict) -> dict:
    """Every runtime with logits, and the float model, teacher-forced over the same text: each against the
    reference (the eager graph with the artifact's weights) by distribution.compare; `float` is the weight format's
    own cost (source weights and float activations, the same cache), beside what the runtime adds."""
    from .distribution import Distributions, compare
    from ..export.artifact import eager_trace

    prompt, forced = _forced_text(text_ids, manifest["eos_token_ids"], manifest["max_context"], tokens)
    kind = "rounded activations" if target.rounds_activations(manifest) else "float activations"
    reference = Distributions(eager_trace(module, manifest, prompt, len(forced), forced=forced)["logits"], forced)
    float_run = Distributions(eager_trace(float_module, manifest, prompt, len(forced), forced=forced)["logits"], forced)
    weight_format = compare(float_run, reference)
    limits = {key: max(floor, DISTRIBUTION_SHARE * weight_format[key]) for key, floor in DISTRIBUTION_FLOORS.items()}
    report = {"prompt_tokens": len(prompt), "positions": len(forced), "activations": kind, "limits": limits,
              "reference_perplexity": reference.perplexity(), "weight_format": weight_format, "runtimes": {},
              "unavailable": {}}
    for name, how in runtimes.items():
        got = target.trace(directory, manifest, name, prompt, len(forced), forced=forced)
        if "skipped" in got or got.get("logits") is None:
            report["unavailable"][name] = got.get("skipped", "gives tokens only, no logits: checked on its answers")
            continue
        row = compare(reference, Distributions(got["logits"], forced))
        row["ok"] = all(row[key] <= limit for key, limit in limits.items())
        report["runtimes"][name] = {"how": how, **row}
    return report


def answers_parity(module, target, directory, manifest: dict, runtimes: dict) -> dict:
    """The known questions of the artifact's model (answers.py), greedily on the reference and every runtime: an
    answer must be right (name an expected word) and the runtime's tokens must be the reference's, or part from
    them at a near tie."""
    from .answers import ANSWER_TOKENS, is_right, questions_for
    from ..export.artifact import artifact_tokenizer, eager_trace, prompt_ids
    from ..run import chat_prompt

    model, questions = questions_for(manifest["model"]["source"])
    tokenizer = artifact_tokenizer(directory)
    eos = manifest["eos_token_ids"]
    rows = []
    for question in questions:
        text = chat_prompt(tokenizer, question.prompt) if question.chat else question.prompt
        ids = prompt_ids(tokenizer, text, add_special_tokens=not question.chat)
        reference = eager_trace(module, manifest, ids, ANSWER_TOKENS)
        answer = tokenizer.decode(reference["tokens"], skip_special_tokens=True)
        row = {"question": question.prompt, "expected": list(question.expected),
               "answers": {REFERENCE: {"answer": answer, "right": is_right(question, answer),
                                       "ok": is_right(question, answer)}}}
        for name in runtimes:
            got = target.generate(directory, manifest, name, tokenizer, text, ids, ANSWER_TOKENS, 0)
            tokens = list(got["tokens"])
            if len(tokens) < len(reference["tokens"]) and eos and (not tokens or tokens[-1] not in eos):
                tokens.append(eos[0])  # it stopped at an EOS it does not report (the stock runner's pieces)
            answer = got["text"] if None in tokens else tokenizer.decode(tokens, skip_special_tokens=True)
            parted = _divergence({"tokens": tokens}, reference)
            right = is_right(question, answer)
            row["answers"][name] = {"answer": answer, "right": right, "same_as_reference": parted["tokens_match"],
                                    "parted_at": parted["diverged_at"], "tie_margin": parted["tie_margin"],
                                    "ok": right and (parted["tokens_match"] or parted["near_tie"])}
        row["ok"] = all(a["ok"] for a in row["answers"].values())
        rows.append(row)
    return {"model": model, "tokens": ANSWER_TOKENS, "questions": rows, "ok": all(r["ok"] for r in rows)}


def run_artifact_parity(directory, ids: list[int], steps: int, against=None, text_ids: list[int] | None = None,
                        distribution_tokens: int = DISTRIBUTION_TOKENS, answers: bool = True) -> dict:
    """Every runtime of the artifact's target that runs here against the reference: the eager graph with the
    artifact's own weights (run.reference_trace), run now, or `against`, a trace file recorded elsewhere
    with save_trace (then its prompt and steps apply). Three checks: the tokens, logits and codes of a greedy run
    fed the reference's tokens; the next-token distributions over `text_ids` teacher-forced (distribution_parity,
    with the float model's row and the weights against the source's); the known questions' answers."""
    import copy

    from ..export.artifact import eager_module, eager_trace
    from ..run import open_artifact

    directory, manifest, target = open_artifact(directory)
    if against is not None:  # checked before the model loads
        ids, steps, reference, metadata = load_trace(against, manifest)
        source = f"trace {against} ({metadata['device_name']}, torch {metadata['torch']})"
    float_module = eager_module(directory, manifest)
    module = target.artifact_module(directory, manifest, copy.deepcopy(float_module))
    if against is None:
        reference = eager_trace(module, manifest, ids, steps)
        source = "eager graph.OscarCausalLM with the artifact's weights (PyTorch, here)"
    unavailable = dict(target.unavailable_runtimes())
    limits = {**ARTIFACT_THRESHOLDS, **target.parity_limits(manifest)}
    if target.rounds_activations(manifest):
        # Rounded activations flip codes wherever float differences cross a boundary, and the flips compound over
        # the layers: the logits are judged on the probability scale instead (the distribution check).
        limits.pop("logits_max_rel_error")
    report = {
        "artifact": str(directory),
        "target": target.name,
        "prompt_tokens": len(ids),
        "steps": steps,
        "config": manifest["config"],
        "weights": manifest["weights"],
        "reference": source,
        "thresholds": limits,
        "tie_margin_nats": TIE_MARGIN,
        "unavailable": unavailable,
        "runtimes": {},
    }
    runtimes = {name: how for name, how in target.runtimes.items() if name not in unavailable}
    checked = dict(runtimes)
    if against is not None:
        checked = {REFERENCE: "eager graph with the artifact's weights (PyTorch, here)", **runtimes}
    for name, how in checked.items():
        if name == REFERENCE:
            got = eager_trace(module, manifest, ids, steps)
        else:
            got = target.trace(directory, manifest, name, ids, steps, forced=reference["tokens"])
        if "skipped" in got:  # this prompt cannot be given to this runtime
            report["unavailable"][name] = got["skipped"]
            continue
        report["runtimes"][name] = {"how": how, **compare_artifact_traces(got, reference, manifest["config"], len(ids),
                                                                          limits)}
    report["weight_gains"] = weight_gains(module, float_module)
    report["distribution"] = None
    if text_ids is not None and distribution_tokens:
        report["distribution"] = distribution_parity(module, float_module, target, directory, manifest, text_ids,
                                                     distribution_tokens, runtimes)
    report["answers"] = answers_parity(module, target, directory, manifest, runtimes) if answers else None
    report["ok"] = (all(row["ok"] for row in report["runtimes"].values()) and report["weight_gains"]["ok"]
                    and (report["distribution"] is None
                         or all(row["ok"] for row in report["distribution"]["runtimes"].values()))
                    and (report["answers"] is None or report["answers"]["ok"]))
    return report


def artifact_parity_command(args, out) -> int:
    """`oscar-export parity --artifact DIR [--save-trace FILE | --against FILE]`; `out` is the CLI console."""
    import json

    from ..export.artifact import artifact_tokenizer, load_manifest
    from ..report import read_tokens

    if args.save_trace is not None and args.against is not None:
        raise OscarInputError("--save-trace and --against: expected one of them (record here, or check here)")
    manifest = load_manifest(args.artifact)
    ids, text_ids = [], None
    if args.against is None or args.kl_tokens:
        tokenizer = artifact_tokenizer(args.artifact)
        ids = read_tokens(tokenizer, args.text, args.prompt_tokens)[0].tolist()
        if args.kl_tokens:
            scored = min(args.kl_tokens, manifest["max_context"] - DISTRIBUTION_PROMPT)
            text_ids = read_tokens(tokenizer, args.text, DISTRIBUTION_PROMPT + scored)[0].tolist()
    if args.save_trace is not None:
        metadata = save_trace(args.save_trace, args.artifact, ids, args.steps)
        out.print(f"wrote {args.save_trace}: the reference run of {args.artifact} on {metadata['device_name']} "
                  f"({len(ids)}-token prompt, {args.steps} steps); check a runtime elsewhere with "
                  f"parity --artifact DIR --against {args.save_trace}")
        return 0
    report = run_artifact_parity(args.artifact, ids, args.steps, against=args.against, text_ids=text_ids,
                                 distribution_tokens=args.kl_tokens, answers=not args.no_answers)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_artifact_parity(report, args.artifact, out)
    return 0 if report["ok"] else 1


def print_artifact_parity(report: dict, artifact, out) -> None:
    """The three checks of run_artifact_parity as tables on the CLI console."""
    from rich.table import Table

    def number(value, fmt="{:.2e}"):
        return "n/a" if value is None else fmt.format(value)

    def verdict(ok):
        return "ok" if ok else "FAIL"

    table = Table(title=f"Parity of {artifact} ({report['target']}, weights {report['weights']}): "
                        f"{report['prompt_tokens']}-token prompt, {report['steps']} decode steps, against the "
                        f"{report['reference']}; a runtime with logits is fed the reference's tokens, and "
                        f"tokens compares its own pick at each step (a near tie: the reference's top two within "
                        f"{report['tie_margin_nats']:g} nats)")
    for col in ("runtime", "codes mismatch", "logits max abs err", "logits max rel err", "tokens", "verdict"):
        table.add_column(col)
    for name, r in report["runtimes"].items():
        codes = "n/a" if r["codes_mismatched"] is None else \
            f"{r['codes_mismatch_fraction']:.2e} ({r['codes_mismatched']}); worst {r['codes_worst_cache']} " \
            f"{r['codes_worst_fraction']:.2e}"
        table.add_row(f"{name} ({r['how']})", codes, number(r["logits_max_abs_error"]),
                      number(r["logits_max_rel_error"]), tokens_verdict(r), verdict(r["ok"]))
    out.print(table)
    limits = ", ".join(f"{key} {value:.1e}" for key, value in report["thresholds"].items())
    out.print(f"limits: {limits}" + ("" if "logits_max_rel_error" in report["thresholds"] else
                                     "; logits judged by the distribution check (activations rounded on the fly)"))
    gains = report["weight_gains"]
    out.print(f"weights against the source checkpoint: {gains['tensors']} tensors read back, worst gain "
              f"{number(gains['worst_gain'], '{:.6f}')} ({gains['worst']}), limit 1 +- {WEIGHT_GAIN_LIMIT:g}, largest "
              f"relative error {gains['max_rel_error']:.3f}: {verdict(gains['ok'])}")
    if (d := report["distribution"]) is not None:
        table = Table(title=f"Next-token distributions over {d['positions']} positions of the text, teacher-forced "
                            f"after a {d['prompt_tokens']}-token prompt, against the reference (perplexity "
                            f"{d['reference_perplexity']:.3f}, {d['activations']}); a runtime may add "
                            f"{DISTRIBUTION_SHARE:g} of the weight format's cost: KL mean <= "
                            f"{d['limits']['kl_mean']:.2e}, p99 <= {d['limits']['kl_p99']:.2e}")
        for col in ("run", "KL mean", "KL p99", "KL p99.9", "KL max", "top-1 agree", "ppl ratio", "verdict"):
            table.add_column(col)

        def cells(r):
            return (f"{r['kl_mean']:.2e}", f"{r['kl_p99']:.2e}", f"{r['kl_p999']:.2e}", f"{r['kl_max']:.2e}",
                    f"{r['top1_agreement']:.2%}", f"{r['perplexity_ratio']:.4f}")

        f = d["weight_format"]
        table.add_row("float model vs reference: the weight format's own cost", *cells(f), "(reported)")
        for name, r in d["runtimes"].items():
            table.add_row(f"{name} vs reference", *cells(r), verdict(r["ok"]))
        out.print(table)
        for name, why in d["unavailable"].items():
            out.print(f"distributions: runtime {name} not compared: {why}")
    if (a := report["answers"]) is not None:
        if not a["questions"]:
            out.print("answers: no known questions for this model (oscar_export/parity/answers.py)")
        for q in a["questions"]:
            expected = " or ".join(repr(w) for w in q["expected"]) or "the reference's answer"
            out.print(f"answers to {q['question']!r} (expected: {expected}): {verdict(q['ok'])}")
            for name, r in q["answers"].items():
                how = "" if name == REFERENCE else (
                    "; same as the reference" if r["same_as_reference"] else
                    f"; parts from the reference at token {r['parted_at']} ({r['tie_margin']:.2f} nats)")
                out.print(f"  {name}: {r['answer'].strip()!r} ({'right' if r['right'] else 'WRONG'}{how})",
                          markup=False)
    for name, why in report["unavailable"].items():
        out.print(f"runtime {name} skipped: {why}")

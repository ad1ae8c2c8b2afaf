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

from .codec import unpack_codes
from .config import OscarConfig
from .hf_cache import OscarCache, patch_model_for_kv_quant
from .progress import progress

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
        bits = kv.config.bits(kind)
        a, b = unpack_codes(kv.codes[kind].cpu(), bits), unpack_codes(ref.codes[kind].cpu(), bits)
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
    fields = config.to_dict()
    patch_model_for_kv_quant(model, cluster_dim=fields.pop("cluster_dim"), rotations=rotations, **fields)
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

# End to end on an artifact: the logits limit of compare_tokens, as an absolute and a relative figure.
ARTIFACT_THRESHOLDS = {"logits_max_rel_error": 1e-2, "codes_mismatch_fraction": 1e-3}


def run_artifact_parity(directory, ids: list[int], steps: int) -> dict:
    """An exported artifact's runtimes against the eager graph (graph.OscarCausalLM) on the same prompt.

    The artifact's target CLI module provides parity_runtimes() {name: how}, unavailable_runtimes()
    {name: why}, trace(directory, runtime, ids, steps) and reference_trace(directory, ids, steps),
    each trace a dict of greedy `tokens`, per-step `logits` (the prefill's, then each decode step's)
    and the packed body `codes` by cache name (uint8, format.md layout).
    """
    import numpy as np

    from .config import OscarInputError
    from .export.artifact import load_manifest
    from .targets import cli_module

    manifest = load_manifest(directory)
    module = cli_module(manifest["target"])
    if module is None or not hasattr(module, "trace"):
        raise OscarInputError(f"--artifact {str(directory)!r}: parity is not available for the "
                              f"{manifest['target']} target yet: expected a laptop or ios artifact")
    reference = module.reference_trace(directory, ids, steps)
    report = {
        "artifact": str(directory),
        "target": manifest["target"],
        "prompt_tokens": len(ids),
        "steps": steps,
        "config": manifest["config"],
        "weights": manifest["weights"],
        "thresholds": ARTIFACT_THRESHOLDS,
        "unavailable": module.unavailable_runtimes(),
        "runtimes": {},
    }
    for name, how in {"reference": "eager graph.OscarCausalLM (PyTorch)", **module.parity_runtimes()}.items():
        got = reference if name == "reference" else module.trace(directory, name, ids, steps)
        abs_err = max(float(np.abs(a - b).max()) for a, b in zip(got["logits"], reference["logits"]))
        rel_err = max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
                      for a, b in zip(got["logits"], reference["logits"]))
        mismatched = total = 0
        for cache_name, want in reference["codes"].items():
            bits = manifest["config"][f"{cache_name.split('.')[1][0]}_bits"]
            a = unpack_codes(torch.from_numpy(np.ascontiguousarray(got["codes"][cache_name])), bits)
            b = unpack_codes(torch.from_numpy(want), bits)
            mismatched += int((a != b).sum())
            total += a.numel()
        row = {"how": how, "tokens_match": got["tokens"] == reference["tokens"], "tokens": got["tokens"],
               "logits_max_abs_error": abs_err, "logits_max_rel_error": rel_err,
               "codes_mismatched": mismatched, "codes_mismatch_fraction": mismatched / max(total, 1)}
        row["ok"] = row["tokens_match"] and all(row[key] <= limit for key, limit in ARTIFACT_THRESHOLDS.items())
        report["runtimes"][name] = row
    report["ok"] = all(row["ok"] for row in report["runtimes"].values())
    return report


def artifact_parity_command(args, out) -> int:
    """`oscar-export parity --artifact DIR`: run_artifact_parity on the artifact's tokenizer; `out` is the CLI console."""
    import json

    from rich.table import Table
    from transformers import AutoTokenizer

    from .export.artifact import load_manifest
    from .report import read_tokens

    load_manifest(args.artifact)
    tokenizer = AutoTokenizer.from_pretrained(args.artifact, local_files_only=True)
    ids = read_tokens(tokenizer, args.text, args.prompt_tokens)[0].tolist()
    report = run_artifact_parity(args.artifact, ids, args.steps)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        table = Table(title=f"Parity of {args.artifact} ({report['target']}, weights {report['weights']}): "
                            f"{len(ids)}-token prompt, {args.steps} greedy steps")
        for col in ("runtime", "codes mismatch", "logits max abs err", "logits max rel err", "tokens", "verdict"):
            table.add_column(col)
        for name, r in report["runtimes"].items():
            table.add_row(f"{name} ({r['how']})", f"{r['codes_mismatch_fraction']:.2e} ({r['codes_mismatched']})",
                          f"{r['logits_max_abs_error']:.2e}", f"{r['logits_max_rel_error']:.2e}",
                          "match" if r["tokens_match"] else "DIFFER", "ok" if r["ok"] else "FAIL")
        out.print(table)
        for name, why in report["unavailable"].items():
            out.print(f"runtime {name} skipped: {why}")
    return 0 if report["ok"] else 1

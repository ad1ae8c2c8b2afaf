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

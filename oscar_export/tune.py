"""`calibrate --budget-bits B`: the cache format that fits B bits per K/V element at a context and
loses least, chosen on the calibration data alone.

Candidates are the K and V bit widths, group sizes and fp16 window pairs (WINDOWS) whose cache stores
at most B bits per element at `context` (cache.bits_per_element: the layout the planner counts). For
each (k_bits, v_bits, cluster_dim) only the largest windows that fit are kept: windows cost bits,
never accuracy. Every candidate gets the calibration's clip search (calibrate.fit_quantizer, on the
held-out calibration tokens); the `shortlist` with the lowest attention-output error (K's plus V's)
are then scored by perplexity of the calibration text's first `context` tokens through the packed
cache, in one pass (evaluate.one_pass_logits), and the lowest wins. No evaluation text is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .cache import bits_per_element
from .config import SUPPORTED_BITS, SUPPORTED_CLUSTER_DIMS, OscarConfig, OscarInputError

# (sink, recent) fp16 tokens, the most tokens first (at equal totals the longer recent window).
WINDOWS = tuple(sorted(((s, r) for s in (64, 32, 16, 0) for r in (512, 384, 256, 192, 128, 64, 32)),
                       key=lambda w: (-(w[0] + w[1]), -w[1])))
SHORTLIST = 4
CHUNK = 64  # decode-like chunks after the first, as eval runs them


@dataclass
class Candidate:
    config: OscarConfig
    bits: float  # per K/V element at the context
    attention_error: float | None = None  # held-out attention-output error, K plus V, at the searched clips
    perplexity: float | None = None  # of the calibration text's first `context` tokens (shortlist only)
    quantizer: dict | None = None  # fit_quantizer's result for this format

    def summary(self) -> dict:
        c = self.config
        return {"k_bits": c.k_bits, "v_bits": c.v_bits, "cluster_dim": c.cluster_dim, "sink": c.sink,
                "recent": c.recent, "k_clip": c.k_clip, "v_clip": c.v_clip, "bits": round(self.bits, 4),
                "attention_error": None if self.attention_error is None else round(self.attention_error, 5),
                "perplexity": None if self.perplexity is None else round(self.perplexity, 4)}


def candidates(budget: float, context: int, head_dim: int, codebook: str = "uniform") -> list[Candidate]:
    """Every format within `budget` bits per element at `context` (the largest windows per bits and group)."""
    found, cheapest = [], math.inf
    for k_bits in SUPPORTED_BITS:
        for v_bits in SUPPORTED_BITS:
            for cluster_dim in SUPPORTED_CLUSTER_DIMS:
                if head_dim % cluster_dim:
                    continue
                for sink, recent in WINDOWS:
                    config = OscarConfig(k_bits=k_bits, v_bits=v_bits, cluster_dim=cluster_dim, sink=sink,
                                         recent=recent, codebook=codebook)
                    bits = bits_per_element(config, head_dim, context)
                    cheapest = min(cheapest, bits)
                    if bits <= budget:
                        found.append(Candidate(config, bits))
                        break
    if not found:
        raise OscarInputError(f"--budget-bits {budget:g}: no cache format fits at context {context}: expected at "
                              f"least {cheapest:.3f} bits per element")
    return found


def choose(model, tokenizer, fitted: dict, text: str, budget: float, context: int, lloyd_max: bool = False,
           shortlist: int = SHORTLIST) -> tuple[Candidate, list[Candidate]]:
    """The chosen candidate and every candidate considered (attention error for all, perplexity for the
    shortlist), from a rotation fit (calibrate.fit_rotations) and its calibration text."""
    import torch

    from .calibrate import _tokens_from_text, fit_quantizer
    from .evaluate import EvalOscarKVCache, token_nll

    if not budget > 0:
        raise OscarInputError(f"--budget-bits {budget}: expected a positive number of bits per element")
    found = candidates(budget, context, fitted["head_dim"], "lloyd-max" if lloyd_max else "uniform")
    for c in found:
        c.quantizer = fit_quantizer(fitted, c.config, lloyd_max)
        c.config = replace(c.config, k_clip=c.quantizer["k_clip"], v_clip=c.quantizer["v_clip"])
        c.attention_error = min(c.quantizer["k_clip_errors"].values()) + min(c.quantizer["v_clip_errors"].values())
    ranked = sorted(found, key=lambda c: (c.attention_error, c.bits))[:shortlist]
    ids = _tokens_from_text(tokenizer, text, min(context, fitted["calibration_tokens"]), "calibration text")
    layers, kv_heads, head_dim = fitted["layers"], fitted["kv_heads"], fitted["head_dim"]
    for c in ranked:
        q = c.quantizer
        cache = EvalOscarKVCache(c.config, layers, kv_heads, head_dim, len(ids), q["k_rotation"], q["v_rotation"],
                                 q.get("k_levels"), q.get("v_levels"))
        with torch.no_grad():
            nll = token_nll(model, ids, cache, CHUNK, max(c.config.sink + c.config.recent, CHUNK))
        c.perplexity = math.exp(float(nll.mean()))
    return min(ranked, key=lambda c: c.perplexity), found

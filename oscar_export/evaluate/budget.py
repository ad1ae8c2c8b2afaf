"""`calibrate --budget-bits B`: the cache format that fits B bits per K/V element at a context and
loses least, chosen on the calibration data alone.

Candidates are the K and V bit widths, group sizes and fp16 window pairs (WINDOWS) whose cache stores
at most B bits per element at `context` (sizes.bits_per_element: the layout the planner counts). For
each (k_bits, v_bits, cluster_dim) only the largest windows that fit are kept: windows cost bits,
never accuracy. Every candidate gets the calibration's clip search (fit.fit_quantizer, on the
held-out calibration tokens); the `shortlist` with the lowest attention-output error (K's plus V's)
are then scored by perplexity through the packed cache, in one pass (evaluate.one_pass.one_pass_logits), of the
calibration text's first PROBE_CONTEXT tokens (fewer when the context is shorter) with a retrieval probe in them
(retrieval_probe: spans of the text inserted into it and repeated at its end, as the needle evaluation does with
other text). The probe is why: the clip search's attention-output error and plain perplexity both favour a hard K
clip, while copying a span seen far back needs precise K, and the repeats' NLL is what says so.

Then K: the winner's clip is scored against wider ones (CLIP_CANDIDATES above it), and mixed K widths: each wider
width in the n layers where it lowers the held-out attention-output error most, each n at the largest windows that
still fit (fewer wider layers leave bits for longer windows), MIXED_SHORTLIST counts per width spread from one layer
to the most that fit. The mixed candidates are scored like the shortlist, and the lowest perplexity of all wins, so
a mix is only chosen where the probe says it beats the one-width format. No evaluation text is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..planner import cache_budget_bits
from ..sizes import bits_per_element
from ..config import SUPPORTED_BITS, SUPPORTED_CLUSTER_DIMS, OscarConfig, OscarInputError

# (sink, recent) fp16 tokens, the most tokens first (at equal totals the longer recent window).
WINDOWS = tuple(sorted(((s, r) for s in (64, 32, 16, 0) for r in (512, 384, 256, 192, 128, 64, 32)),
                       key=lambda w: (-(w[0] + w[1]), -w[1])))
SHORTLIST = 2
CHUNK = 64  # decode-like chunks after the first, as eval runs them
WIDER_CLIPS = 2  # K clips scored above the searched one, evenly spread up to 1.0
MIXED_SHORTLIST = 3  # mixed-K candidates scored per wider K width, spread from one wider layer to the most that fit
# Tokens the probe scores at most: a pass costs more than linearly in them, and on SmolLM2 at 8K a probe of
# 2,048 tokens chose the widths, group and windows one of 4,096 did (docs/calibration.md).
PROBE_CONTEXT = 2048
# The retrieval probe: as evaluate's needles (24 tokens, scored after 8, at five depths).
PROBE_TOKENS, PROBE_PREFIX, PROBE_DEPTHS = 24, 8, (0.1, 0.3, 0.5, 0.7, 0.9)
# What the search does, in a calibration cache key: a change to it is a new key.
SEARCH = ("v2: one-width shortlist of 2 by attention error, perplexity with a retrieval probe of at most 2048 tokens, "
          "2 wider K clips, 3 mixed K counts per width ranked by held-out error")
# The most bits per element an export without format flags spends on the cache: at 3.0 with fp8 scales the search's
# format met the quality goals on SmolLM2 (docs/calibration.md); a device with more room keeps its memory.
DEFAULT_CEILING_BITS = 3.0
# Scales the device-chosen format stores, the first a target takes: fp8 frees bits for windows and wider K.
PREFERRED_SCALE_DTYPES = ("float8_e4m3fn", "float16")


@dataclass
class Candidate:
    config: OscarConfig
    bits: float  # per K/V element at the context
    attention_error: float | None = None  # held-out attention-output error, K plus V, at the searched clips
    perplexity: float | None = None  # of the calibration text's first `context` tokens (shortlist only)
    quantizer: dict | None = None  # fit_quantizer's result for this format
    layer_gains: list[float] | None = None  # mixed K: the per-layer ranking its wider layers were taken from

    def summary(self) -> dict:
        c = self.config
        return {"format": c.describe(), "k_bits": c.k_bits, "v_bits": c.v_bits, "cluster_dim": c.cluster_dim,
                "k_bits_by_layer": list(c.k_bits_by_layer) or None, "sink": c.sink,
                "recent": c.recent, "k_clip": c.k_clip, "v_clip": c.v_clip, "bits": round(self.bits, 4),
                "attention_error": None if self.attention_error is None else round(self.attention_error, 5),
                "perplexity": None if self.perplexity is None else round(self.perplexity, 4)}


def candidates(budget: float, context: int, head_dim: int, codebook: str = "uniform", k_rounding: str = "nearest",
               scale_dtype: str = "float16", min_window: int = 0) -> list[Candidate]:
    """Every format within `budget` bits per element at `context` (the largest windows per bits and group, each
    window at least `min_window` tokens)."""
    found = []
    for config in _formats(codebook, k_rounding, scale_dtype, head_dim):
        for sink, recent in windows(min_window):
            candidate = _windowed(config, sink, recent, head_dim, context)
            if candidate.bits <= budget:
                found.append(candidate)
                break
    if not found:
        cheapest = cheapest_format(context, head_dim, codebook, k_rounding, scale_dtype, min_window)
        c = cheapest.config
        raise OscarInputError(f"--budget-bits {budget:g}: no cache format fits at context {context}: expected at "
                              f"least {cheapest.bits:.3f} bits per element ({c.describe()}, group {c.cluster_dim}, "
                              f"sink {c.sink}, recent {c.recent}; a group is at most head_dim={head_dim} elements)")
    return found


def _formats(codebook: str, k_rounding: str, scale_dtype: str, head_dim: int):
    """Each K and V width and group the search tries, with no windows yet."""
    for k_bits in SUPPORTED_BITS:
        for v_bits in SUPPORTED_BITS:
            for cluster_dim in SUPPORTED_CLUSTER_DIMS:
                if head_dim % cluster_dim == 0:
                    yield OscarConfig(k_bits=k_bits, v_bits=v_bits, cluster_dim=cluster_dim, sink=0, recent=0,
                                      codebook=codebook, k_rounding=k_rounding, scale_dtype=scale_dtype)


def cheapest_format(context: int, head_dim: int, codebook: str = "uniform", k_rounding: str = "nearest",
                    scale_dtype: str = "float16", min_window: int = 0) -> Candidate:
    """The format the search could choose that stores the fewest bits per element at `context`."""
    return min((_windowed(c, s, r, head_dim, context) for c in _formats(codebook, k_rounding, scale_dtype, head_dim)
                for s, r in windows(min_window)), key=lambda c: c.bits)


def windows(min_window: int = 0) -> tuple[tuple[int, int], ...]:
    """WINDOWS whose sink and recent windows both hold at least `min_window` tokens (a target's floor)."""
    return tuple(w for w in WINDOWS if min(w) >= min_window)


def _windowed(config: OscarConfig, sink: int, recent: int, head_dim: int, context: int) -> Candidate:
    config = replace(config, sink=sink, recent=recent)
    return Candidate(config, bits_per_element(config, head_dim, context))


def budget_candidates(budget: float, context: int, head_dim: int, lloyd_max: bool = False,
                      k_rounding: str = "nearest", scale_dtype: str = "float16", min_window: int = 0
                      ) -> list[Candidate]:
    """The one-width formats choose() searches under `budget`, or the error that says none fits. Arithmetic only,
    so run_calibration asks before its rotation fit rather than after it."""
    if not budget > 0:
        raise OscarInputError(f"--budget-bits {budget}: expected a positive number of bits per element")
    return candidates(budget, context, head_dim, "lloyd-max" if lloyd_max else "uniform", k_rounding, scale_dtype,
                      min_window)


def retrieval_probe(ids):
    """The calibration tokens `ids` with a copy task in them: five spans of the text inserted at depths 0.1 to
    0.9 of the rest, then repeated at its end (evaluate.metrics.needle_cases on calibration tokens: a few dozen tokens
    shorter than `ids`). Scored whole, its NLL counts ordinary prediction and retrieval from far back."""
    from .metrics import needle_cases

    haystack = len(ids) - 3 * len(PROBE_DEPTHS) * PROBE_TOKENS
    if haystack < 2 * len(PROBE_DEPTHS) * PROBE_TOKENS:
        return ids  # too few tokens for spans that are far from their repeats
    return needle_cases(ids, haystack, PROBE_TOKENS, PROBE_PREFIX, PROBE_DEPTHS, 1)[0].ids


def mixed_candidates(base: OscarConfig, wider_clip: float, order: list[int], layers: int, budget: float,
                     context: int, head_dim: int, shortlist: int = MIXED_SHORTLIST, wider_bits: int | None = None,
                     min_window: int = 0) -> list[Candidate]:
    """`base` with K `wider_bits` wide (default one bit wider; at `wider_clip`) in the first n of the layers
    `order` lists (the ones it helps, most helped first), for n from 1 to all but one of `layers` (all is a
    uniform format), each at the largest windows that fit `budget`: the `shortlist` of them evenly spread over
    n, the most layers included."""
    wider_bits = base.k_bits + 1 if wider_bits is None else wider_bits
    by_count = []
    for n in range(1, min(len(order), layers - 1) + 1):
        wide = set(order[:n])
        widths = tuple(wider_bits if i in wide else base.k_bits for i in range(layers))
        clips = tuple(wider_clip if i in wide else base.k_clip for i in range(layers))
        for sink, recent in windows(min_window):
            config = replace(base, sink=sink, recent=recent, k_bits_by_layer=widths, k_clip_by_layer=clips)
            bits = bits_per_element(config, head_dim, context)
            if bits <= budget:
                by_count.append(Candidate(config, bits))
                break
    if len(by_count) <= shortlist:
        return by_count
    picks = {round(j * (len(by_count) - 1) / (shortlist - 1)) for j in range(shortlist)}
    return [by_count[j] for j in sorted(picks)]


def cache_nll(model, ids, config: OscarConfig, quantizer: dict, fitted: dict):
    """NLL [T - 1] of the calibration tokens `ids` through the packed cache of `config`, in one pass."""
    import torch

    from .baselines import EvalOscarKVCache
    from .metrics import token_nll

    cache = EvalOscarKVCache(config, fitted["layers"], fitted["kv_heads"], fitted["head_dim"], len(ids),
                             quantizer["k_rotation"], quantizer["v_rotation"], quantizer.get("k_levels"),
                             quantizer.get("v_levels"),
                             k_feedback=quantizer["k_feedback"] if config.k_rounding == "feedback" else None)
    with torch.no_grad():
        return token_nll(model, ids, cache, CHUNK, max(config.sink + config.recent, CHUNK))


def key_error_gains(fitted: dict, base: OscarConfig, wider_bits: int, wider_clip: float) -> list[float]:
    """Per layer: the held-out attention-output error with only K quantized at `base`'s width and clip, less that
    at `wider_bits` and `wider_clip` (calibration.fit.clip_errors on that layer's held-out tokens)."""
    from ..calibration.fit import clip_errors

    feedback = fitted["k_feedback"] if base.k_rounding == "feedback" else None
    wider = replace(base, k_bits=wider_bits)

    def error(layer: int, config: OscarConfig, clip: float) -> float:
        return clip_errors({layer: fitted["heldout"][layer]}, fitted["rotations"], config, "k", (clip,), feedback)[clip]

    return [error(layer, base, base.k_clip) - error(layer, wider, wider_clip) for layer in range(fitted["layers"])]


def wider_clips(clip: float, count: int = WIDER_CLIPS) -> list[float]:
    """`count` of CLIP_CANDIDATES above `clip`, evenly spread, 1.0 (no clipping) always among them."""
    from ..calibration.fit import CLIP_CANDIDATES

    above = sorted(c for c in CLIP_CANDIDATES if c > clip)
    if len(above) <= count:
        return above
    return [above[round((j + 1) * (len(above) - 1) / count)] for j in range(count)]


def choose(model, tokenizer, fitted: dict, text: str, budget: float, context: int, lloyd_max: bool = False,
           shortlist: int = SHORTLIST, k_rounding: str = "nearest", scale_dtype: str = "float16",
           min_window: int = 0, probe_context: int = PROBE_CONTEXT) -> tuple[Candidate, list[Candidate]]:
    """The chosen candidate and every candidate considered (attention error for the one-width ones, perplexity
    for their shortlist and the mixed-K ones), from a rotation fit (fit.fit_rotations) and its
    calibration text."""
    from ..calibration.fit import clip_candidates, clip_errors, fit_quantizer, tokens_from_text

    found = budget_candidates(budget, context, fitted["head_dim"], lloyd_max, k_rounding, scale_dtype, min_window)
    for c in found:
        c.quantizer = fit_quantizer(fitted, c.config, lloyd_max)
        c.config = replace(c.config, k_clip=c.quantizer["k_clip"], v_clip=c.quantizer["v_clip"])
        c.attention_error = min(c.quantizer["k_clip_errors"].values()) + min(c.quantizer["v_clip_errors"].values())
    ranked = sorted(found, key=lambda c: (c.attention_error, c.bits))[:shortlist]
    ids = tokens_from_text(tokenizer, text, min(context, probe_context, fitted["calibration_tokens"]),
                           "calibration text")
    probe = retrieval_probe(ids)

    def score(c: Candidate) -> Candidate:
        c.perplexity = math.exp(float(cache_nll(model, probe, c.config, c.quantizer, fitted).mean()))
        return c

    for c in ranked:
        score(c)
    best = min(ranked, key=lambda c: c.perplexity)
    # A wider K clip than the attention error's keeps the far tokens' scores that retrieval reads.
    clipped = [score(Candidate(replace(best.config, k_clip=clip), best.bits, quantizer=dict(best.quantizer, k_clip=clip)))
               for clip in wider_clips(best.config.k_clip)]
    best = min([best] + clipped, key=lambda c: c.perplexity)
    considered = found + clipped
    if lloyd_max or best.config.k_bits == max(SUPPORTED_BITS) or fitted["layers"] < 2:
        return best, considered  # Lloyd-Max levels are fitted at one width; nothing wider than 4 bits
    mixed = []
    for bits in range(best.config.k_bits + 1, max(SUPPORTED_BITS) + 1):
        errors = clip_errors(fitted["heldout"], fitted["rotations"], replace(best.config, k_bits=bits), "k",
                             clip_candidates("k", k_rounding),
                             fitted["k_feedback"] if k_rounding == "feedback" else None)
        clip = min(errors, key=errors.get)
        gains = key_error_gains(fitted, best.config, bits, clip)
        order = sorted((i for i in range(fitted["layers"]) if gains[i] > 0), key=lambda i: -gains[i])
        for c in mixed_candidates(best.config, clip, order, fitted["layers"], budget, context, fitted["head_dim"],
                                  wider_bits=bits, min_window=min_window):
            # the same rotations; each layer's K clip is in the config
            c.quantizer, c.layer_gains = best.quantizer, gains
            mixed.append(score(c))
    return min([best] + mixed, key=lambda c: c.perplexity), considered + mixed


def format_chooser(budget: float, context: int, head_dim: int, lloyd_max: bool = False, k_rounding: str = "nearest",
                   scale_dtype: str = "float16", min_window: int = 0):
    """calibration.cached.run_calibration's `choose` for a budget of `budget` bits per element at `context`: a
    budget no format meets is refused here, before minutes of fitting; the chooser returns the chosen format, its
    quantizer and the metadata that records it (the format, the budget and every candidate scored)."""
    budget_candidates(budget, context, head_dim, lloyd_max, k_rounding, scale_dtype, min_window)

    def pick(model, tokenizer, fitted: dict, text: str) -> tuple[OscarConfig, dict, dict]:
        chosen, considered = choose(model, tokenizer, fitted, text, budget, context, lloyd_max=lloyd_max,
                                    k_rounding=k_rounding, scale_dtype=scale_dtype, min_window=min_window)
        config = chosen.config
        metadata = {"sink": config.sink, "recent": config.recent, "budget_bits": budget, "budget_context": context,
                    "bits_per_element": chosen.bits, "budget_candidates": [c.summary() for c in considered]}
        if config.mixed:
            metadata.update({"k_bits_by_layer": list(config.k_bits_by_layer),
                             "k_clip_by_layer": list(config.k_clip_by_layer),
                             "k_layer_gains": [round(g, 4) for g in chosen.layer_gains]})
        return config, chosen.quantizer, metadata

    return pick


def device_budget(shape, device_memory: int, context: int, weight_plan: dict, scale_dtype: str,
                  k_rounding: str = "nearest", ceiling: float = DEFAULT_CEILING_BITS, reserve: int | None = None,
                  min_window: int = 0) -> dict:
    """The budget an export without format flags searches within: the bits per element the device leaves a cache
    of `context` tokens (planner.cache_budget_bits: the weights as `weight_plan` stores them, the reserve: default
    the planner's), floored to a hundredth of a bit, at most `ceiling` or the cheapest format's bits if more. A
    device where even the cheapest format does not fit is an error naming the device and the context."""
    available = cache_budget_bits(shape, device_memory, context, reserve, k_feedback=k_rounding == "feedback",
                                  **weight_plan)
    cheapest = cheapest_format(context, shape.head_dim, k_rounding=k_rounding, scale_dtype=scale_dtype,
                               min_window=min_window)
    # At a short context the fp16 windows alone can take more than the ceiling: then the cheapest format's bits.
    ceiling = max(ceiling, math.ceil(cheapest.bits * 100) / 100)
    budget = min(math.floor(available * 100) / 100, ceiling)
    if budget < cheapest.bits:
        c = cheapest.config
        raise OscarInputError(
            f"--device-memory {_size(device_memory)} at --context {context}: {shape.name}'s weights and the "
            f"reserve leave the cache {max(available, 0):.3f} bits per K/V element: expected at least "
            f"{cheapest.bits:.3f}, the cheapest format ({c.describe()}, group {c.cluster_dim}, recent {c.recent}); "
            "a shorter --context or a larger device fits (oscar-export plan shows the fit)")
    return {"device_memory_bytes": device_memory, "context": context, "available_bits": round(available, 4),
            "ceiling_bits": ceiling, "budget_bits": budget}


def device_scale_dtype(scale_dtypes: tuple[str, ...]) -> str:
    """The scales a device-chosen format stores: the first of PREFERRED_SCALE_DTYPES a target takes."""
    return next(d for d in PREFERRED_SCALE_DTYPES if d in scale_dtypes)


def _size(n: int) -> str:
    """Bytes as --device-memory takes them (binary units)."""
    return f"{n // 2**30}GB" if n % 2**30 == 0 else f"{n / 2**20:.1f}MB"


def device_calibration(model_name: str, shape, device_memory: int, context: int, weight_plan: dict,
                       scale_dtypes: tuple[str, ...], min_window: int = 0, text_path=None,
                       tokens: int | None = None, store=None) -> tuple:
    """The rotation file of the format chosen for a device: the budget search (format_chooser) within
    device_budget's bits, calibrated once and cached like every calibration (its key holds the budget, the context
    and the scales). Returns (path, reused, choice): choice says why (device_budget's fields, the chosen format's
    bits per element). scale_dtypes: the ones the target stores (device_scale_dtype picks).
    min_window: the fewest tokens the target's fp16 windows take. store: where a new calibration is written
    (default: the cache directory)."""
    from ..calibration.cached import CALIBRATED_K_ROUNDING, DEFAULT_TOKENS, calibrated_rotations
    from ..calibration.files import load_rotations

    scale_dtype = device_scale_dtype(scale_dtypes)
    choice = device_budget(shape, device_memory, context, weight_plan, scale_dtype, CALIBRATED_K_ROUNDING,
                           min_window=min_window)
    base = OscarConfig(k_rounding=CALIBRATED_K_ROUNDING, scale_dtype=scale_dtype)
    chooser = format_chooser(choice["budget_bits"], context, shape.head_dim, k_rounding=CALIBRATED_K_ROUNDING,
                             scale_dtype=scale_dtype, min_window=min_window)
    path, reused = calibrated_rotations(model_name, base, text_path, tokens or DEFAULT_TOKENS, store=store,
                                        choose=chooser,
                                        choice={"budget_bits": choice["budget_bits"], "budget_context": context,
                                                "min_window": min_window, "search": SEARCH})
    metadata = load_rotations(path).metadata
    choice.update(scale_dtype=scale_dtype, bits_per_element=metadata["bits_per_element"])
    return path, reused, choice

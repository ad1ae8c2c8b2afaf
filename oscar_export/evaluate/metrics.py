"""The three metrics: attention-output error per layer, token NLL (perplexity) and needle retrieval."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import OscarInputError
from .one_pass import one_pass_logits


def _rel_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm().clamp(min=1e-30))


def attention_errors(qkv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], make_cache: Callable[[int], object],
                     decode_tokens: int = 16) -> list[float]:
    """Per layer: relative error of the decoded attention outputs against exact fp32 attention.

    qkv {layer: (q [Hq, T, D], k, v [Hkv, T, D])}; the first T - decode_tokens tokens are prefilled
    as one chunk, the rest decoded one token at a time through a fresh cache.
    """
    layers = sorted(qkv)
    tokens = qkv[layers[0]][1].shape[1]
    if not 0 < decode_tokens < tokens:
        raise OscarInputError(f"decode_tokens={decode_tokens}: expected 0 < decode_tokens < {tokens} captured tokens")
    split = tokens - decode_tokens
    cache = make_cache(tokens)
    errors = []
    for layer in layers:
        q, k, v = (x.to(torch.float32) for x in qkv[layer])
        exact = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
        cache.attend(layer, q[:, :split], k[:, :split], v[:, :split])
        out = [cache.attend(layer, q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1]) for t in range(split, tokens)]
        errors.append(_rel_error(torch.cat(out, 1), exact[:, split:]))
    return errors


def token_nll(model, ids: torch.Tensor, cache, chunk: int, first: int | None) -> torch.Tensor:
    """NLL [T - 1] of each next token of 1-D `ids`, the window attended through `cache` (one_pass_logits)."""
    logits = one_pass_logits(model, ids, cache, chunk, first)
    return F.cross_entropy(logits[:-1], ids.reshape(-1)[1:], reduction="none")


@dataclass
class NeedleCase:
    ids: torch.Tensor  # haystack with every needle inserted (the control: without them), then the repeats
    seed: int
    answers: dict[float, tuple[int, int]]  # depth -> positions [from, to) of its repeat that are scored


def needle_cases(ids: torch.Tensor, context: int, needle_tokens: int, prefix: int,
                 depths: Sequence[float], seeds: int, control: bool = False) -> list[NeedleCase]:
    """One sequence per seed: `context` tokens of haystack with one needle of `needle_tokens` inserted
    at each depth, then every needle repeated in depth order. Haystack and needles are disjoint spans
    of `ids`, drawn per seed. A repeat is scored after its first `prefix` tokens.

    control=True: the same haystack continued for as many tokens as the needles take instead of them,
    then the same repeats: what the model predicts of a needle it has not seen (not retrieval).
    """
    if not 0 < prefix < needle_tokens:
        raise OscarInputError(f"needle_prefix={prefix}: expected 0 < needle_prefix < needle_tokens={needle_tokens}")
    depths = sorted(depths)
    if not depths or len(set(depths)) != len(depths):
        raise OscarInputError(f"needle depths {depths}: expected distinct fractions")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise OscarInputError(f"needle depth {depth}: expected a fraction 0 <= depth <= 1")
    n, k = ids.shape[0], len(depths)
    span = context + k * needle_tokens  # haystack plus the needles (or the control's continuation)
    if n < span + 2 * k * needle_tokens:
        raise OscarInputError(
            f"evaluation text has {n} tokens: expected at least needle_context + 3 * needle_tokens * depths = "
            f"{span + 2 * k * needle_tokens}"
        )
    cases = []
    for seed in range(seeds):
        rng = random.Random(seed)
        h0 = rng.randrange(0, n - span + 1)
        # Needle starts: non-overlapping spans outside the haystack, drawn from a shuffled grid.
        starts = [p for p in range(0, n - needle_tokens + 1, needle_tokens)
                  if p + needle_tokens <= h0 or p >= h0 + span]
        needles = [ids[p : p + needle_tokens] for p in rng.sample(starts, k)]
        if control:
            parts = [ids[h0 : h0 + span]]
        else:
            hay, parts, at = ids[h0 : h0 + context], [], 0
            for depth, needle in zip(depths, needles):
                pos = round(depth * context)
                parts += [hay[at:pos], needle]
                at = pos
            parts.append(hay[at:])
        answers = {depth: (span + i * needle_tokens + prefix, span + (i + 1) * needle_tokens)
                   for i, depth in enumerate(depths)}
        cases.append(NeedleCase(torch.cat(parts + needles), seed, answers))
    return cases


def needle_accuracy(model, case: NeedleCase, cache, chunk: int, first: int | None) -> dict[float, float]:
    """Per depth: the fraction of its scored repeat tokens that greedy prediction gets right (teacher forcing)."""
    n = case.ids.shape[0]
    start = min(a for a, _ in case.answers.values()) - 1  # logits at p predict token p + 1
    pred = one_pass_logits(model, case.ids, cache, chunk, first, keep_last=n - start).argmax(-1)
    return {depth: float((pred[a - 1 - start : b - 1 - start] == case.ids[a:b]).float().mean())
            for depth, (a, b) in case.answers.items()}

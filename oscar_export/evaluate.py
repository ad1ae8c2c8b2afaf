"""Quality of the packed cache against baselines at the same bit budget.

Methods (every quantized one keeps the same fp16 sink and recent windows from the OscarConfig,
so the bit budgets match; each reports the bits per element its format stores). A spec may carry
its own bits: ``oscar-3`` (3-bit K and V), ``oscar-k3v2`` (3-bit K, 2-bit V):

- ``fp16``: plain attention over K/V rounded to fp16 (16 bits per element).
- ``naive``: the OSCAR cache without a rotation (per-token, per-group asymmetric INT).
- ``hadamard``: the OSCAR cache with the data-free Hadamard rotation (QuaRot-style).
- ``kivi``: KIVI: K per channel (one scale/zero per channel per block of ``cluster_dim``
  tokens), V per token (groups of ``cluster_dim`` channels), with its fp16 residual
  (:class:`KiviCache`).
- ``oscar``: the OSCAR cache with rotations from a rotation file, or calibrated on the fly
  (:mod:`oscar_export.calibrate`: rotations fitted once, clip ratios searched per bit width) on
  text disjoint from the evaluation text.
- ``online``: rotations estimated from each sequence's first chunk, as ``OscarCache``'s online
  mode does (:class:`OnlineOscarKVCache`).

Text split: the evaluation text (default: the bundled model's ``heldout.txt``) is tokenized
once. Its first ``calibration_tokens + calibration_heldout + 16`` tokens are reserved for
calibration (the 16 absorb re-tokenization at the cut) and never evaluated; every metric reads
only the tokens after them. The reservation holds whether or not calibration runs, so numbers
from runs with and without a rotation file are comparable.

Metrics:

1. Perplexity at each context length: non-overlapping windows of the longest context, each run
   through the model with the method's cache as if fed in chunks (first chunk ``sink + recent``
   tokens, then ``chunk`` tokens), so later chunks read earlier tokens as the cache stores them.
   Perplexity at a shorter context c is that of the windows' first c tokens (for a causal model,
   a window of c tokens).
2. Attention-output relative error per layer on the model's captured post-RoPE Q/K/V:
   prefill all but the last ``decode_tokens`` tokens, then decode those one at a time through the
   cache itself; the decoded outputs are compared with exact fp32 attention.
3. Needle retrieval: per seed, one sequence of ``needle_context`` haystack tokens with a random
   ``needle_tokens`` span of other evaluation text inserted at each depth (fraction of the haystack
   before it), then every needle repeated at the end. Accuracy per depth is the fraction of its
   repeat's tokens after the first ``needle_prefix`` that greedy next-token prediction gets right
   under teacher forcing. ``needle_control_accuracy`` is the fp16 accuracy on the same tokens when
   the haystack does not contain the needles: only accuracy above it is retrieval.

Perplexity and needle sequences run in one forward each (:class:`OnePass`): which positions a chunk
reads from the body depends only on where the chunk starts, and what the body holds for a position
only on that position's K/V (KIVI: its block), so the stored values are those of the chunked run
bit for bit (tests compare them with the caches' own) and the attention differs only in float
summation order.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .cache import OscarKVCache, causal_gqa_attention
from .cache import bits_per_element as oscar_bits_per_element
from .calibrate import online_rotations
from .capture import collect_qkv
from .codec import Quantized, check_finite, dequantize, quantize
from .config import OscarConfig, OscarInputError
from .hf_cache import attention_shape, route_attention
from .progress import note
from .rotations import hadamard_rotations

METHODS = ("fp16", "naive", "hadamard", "kivi", "oscar", "online")
DEFAULT_METHODS = ("fp16", "naive", "hadamard", "kivi", "oscar", "online", "oscar-3", "oscar-k3v2")
# Default contexts reach the model's max_position_embeddings up to this many tokens.
DEFAULT_LONGEST_CONTEXT = 8192
METRICS = ("perplexity", "attention", "needle")
WINDOW_DTYPE = torch.float16
FP16_MAX = torch.finfo(torch.float16).max
# Tokens reserved after the calibration text, so re-tokenizing its decoded form never runs short.
SPLIT_MARGIN = 16


# -- attention over a cache --------------------------------------------------------------------


def _check_chunk(cache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if not 0 <= layer < cache.layers:
        raise OscarInputError(f"layer={layer}: expected 0 <= layer < {cache.layers}")
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or x.shape[0] != cache.kv_heads or x.shape[2] != cache.head_dim or x.shape[1] != k.shape[1]:
            raise OscarInputError(
                f"{name} has shape {tuple(x.shape)}: expected ({cache.kv_heads}, {k.shape[1]}, {cache.head_dim})"
            )
        if bool((x.abs() > FP16_MAX).any()) or not bool(torch.isfinite(x).all()):
            raise OscarInputError(f"{name} has values outside the fp16 range or non-finite: expected finite fp16 values")
    if q.dim() != 3 or q.shape[0] % cache.kv_heads or q.shape[1:] != k.shape[1:]:
        raise OscarInputError(
            f"q has shape {tuple(q.shape)}: expected (q_heads, {k.shape[1]}, {cache.head_dim}) "
            f"with q_heads a multiple of {cache.kv_heads}"
        )
    n0 = cache.length[layer]
    if n0 + k.shape[1] > cache.max_context:
        raise OscarInputError(f"cache capacity exceeded: {n0} + {k.shape[1]} tokens > max_context={cache.max_context}")


class Fp16Cache:
    """The ``fp16`` baseline: every K/V vector kept at fp16 (16 bits per element), attention in fp32.

    ``dtype=torch.float32`` keeps K/V exactly, for checking the chunked evaluation itself.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_context: int, dtype=WINDOW_DTYPE):
        self.layers, self.kv_heads, self.head_dim, self.max_context = layers, kv_heads, head_dim, max_context
        self.dtype = dtype
        self.k = torch.zeros(layers, kv_heads, max_context, head_dim, dtype=dtype)
        self.v = torch.zeros(layers, kv_heads, max_context, head_dim, dtype=dtype)
        self.length = [0] * layers

    def attend(self, layer: int, q, k, v, scaling: float | None = None) -> torch.Tensor:
        _check_chunk(self, layer, q, k, v)
        n0, n1 = self.length[layer], self.length[layer] + k.shape[1]
        self.k[layer, :, n0:n1] = k.to(self.dtype)
        self.v[layer, :, n0:n1] = v.to(self.dtype)
        scale = self.head_dim**-0.5 if scaling is None else scaling
        out = causal_gqa_attention(q, self.k[layer, :, :n1].float(), self.v[layer, :, :n1].float(), n0, scale)
        self.length[layer] = n1
        return out

    def sequence(self, layer: int, q, k, v, first: int) -> SequenceKV:
        _check_chunk(self, layer, q, k, v)
        return SequenceKV(q.float(), {"k": k.to(self.dtype).float(), "v": v.to(self.dtype).float()})

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V held now (fp16: 2 bytes per element)."""
        return sum(self.length) * self.kv_heads * 2 * self.head_dim * self.k.element_size()

    def bits_per_element(self) -> float:
        return _bits_from_bytes(self, self.nbytes)


def _bits_from_bytes(cache, nbytes: int) -> float:
    elements = sum(cache.length) * cache.kv_heads * 2 * cache.head_dim
    if not elements:
        raise OscarInputError("bits per element of an empty cache: expected at least one cached token")
    return nbytes * 8 / elements


def kivi_quantized_tokens(config: OscarConfig, context: int) -> int:
    """Tokens KIVI holds quantized after `context` tokens: whole blocks of cluster_dim that left the recent window."""
    past_window = max(context - config.sink - config.recent, 0)
    return past_window // config.cluster_dim * config.cluster_dim


def kivi_bits_per_element(config: OscarConfig, head_dim: int, context: int) -> float:
    """Average stored bits per K/V element of KIVI after `context` tokens (fp16 sink, window and residual)."""
    if context <= 0:
        raise OscarInputError(f"context={context}: expected a positive token count")
    config.check_head_dim(head_dim)
    g, scale_bits = config.cluster_dim, 8 * config.scale_bytes
    quantized = kivi_quantized_tokens(config, context)
    k_bits = quantized * head_dim * config.k_bits + (quantized // g) * head_dim * 2 * scale_bits
    v_bits = quantized * head_dim * config.v_bits + quantized * (head_dim // g) * 2 * scale_bits
    fp16_bits = (context - quantized) * 2 * head_dim * 16
    return (fp16_bits + k_bits + v_bits) / (context * 2 * head_dim)


class KiviCache:
    """KIVI baseline (K per channel, V per token) with the same sink and recent windows as OSCAR.

    Positions ``< sink`` stay fp16. Past the sink, positions form blocks of ``G = cluster_dim``
    consecutive tokens (``sink + j*G ... sink + (j+1)*G - 1``); a block is quantized once all of
    its tokens have left the recent window: K per channel (the block transposed to [D, G] and
    quantized as one group per channel, so one scale/zero per channel per block), V per token
    (groups of ``cluster_dim`` channels, one scale/zero per token per group). Tokens past the
    window in a block that is not full yet stay fp16 (KIVI's residual). Values are rounded to
    fp16 first and the codec is :func:`oscar_export.codec.quantize` (uniform levels, the
    config's clip ratios and scale dtype). No rotation.
    """

    def __init__(self, config: OscarConfig, layers: int, kv_heads: int, head_dim: int, max_context: int):
        config.check_head_dim(head_dim)
        for name, value in (("layers", layers), ("kv_heads", kv_heads), ("max_context", max_context)):
            if not isinstance(value, int) or value <= 0:
                raise OscarInputError(f"{name}={value!r}: expected a positive integer")
        self.config, self.layers, self.kv_heads, self.head_dim = config, layers, kv_heads, head_dim
        self.max_context = max_context
        self.group = config.cluster_dim
        shape = (layers, kv_heads, max_context, head_dim)
        # fp16 values of every position (only sink, window and residual positions are read from it)
        self.window = {kind: torch.zeros(shape, dtype=WINDOW_DTYPE) for kind in ("k", "v")}
        # dequantized body, written once when a block is quantized (the codes below are what KIVI stores)
        self.body = {kind: torch.zeros(shape, dtype=torch.float32) for kind in ("k", "v")}
        self.blocks: dict[str, list[list[Quantized]]] = {kind: [[] for _ in range(layers)] for kind in ("k", "v")}
        self.quantized_to = [config.sink] * layers  # positions sink..quantized_to-1 are quantized
        self.length = [0] * layers

    def _quantize_blocks(self, k: torch.Tensor, v: torch.Tensor):
        """Whole blocks k, v [Hkv, blocks * G, D] fp32 -> (dequantized K, dequantized V, K's and V's Quantized):
        K per channel within each block, V per token."""
        cfg, g = self.config, self.group
        heads, d = k.shape[0], k.shape[2]
        blocks = k.reshape(heads, -1, g, d).transpose(-1, -2)  # [Hkv, blocks, D, G]: one group per channel
        qk = quantize(blocks, cfg.k_bits, g, cfg.k_clip, None, cfg.scale_dtype)
        qv = quantize(v, cfg.v_bits, cfg.cluster_dim, cfg.v_clip, None, cfg.scale_dtype)
        k_out = dequantize(*qk, cfg.k_bits, g).transpose(-1, -2).reshape(heads, -1, d)
        return k_out, dequantize(*qv, cfg.v_bits, cfg.cluster_dim), qk, qv

    def _quantize_block(self, layer: int, p0: int) -> None:
        p1 = p0 + self.group
        k, v = (self.window[kind][layer, :, p0:p1].to(torch.float32) for kind in ("k", "v"))
        self.body["k"][layer, :, p0:p1], self.body["v"][layer, :, p0:p1], qk, qv = self._quantize_blocks(k, v)
        self.blocks["k"][layer].append(Quantized(*(t.squeeze(1) for t in qk)))
        self.blocks["v"][layer].append(qv)

    def stored(self, kind: str, layer: int) -> torch.Tensor:
        """K or V of the cached tokens in position order as attention reads them, fp32 [kv_heads, n, D]."""
        n = self.length[layer]
        out = self.window[kind][layer, :, :n].to(torch.float32)
        s, q_to = self.config.sink, self.quantized_to[layer]
        if q_to > s:
            out[:, s:q_to] = self.body[kind][layer, :, s:q_to]
        return out

    def attend(self, layer: int, q, k, v, scaling: float | None = None) -> torch.Tensor:
        """Causal GQA attention of a chunk over the cache before it plus its own fp16 K/V, then append it."""
        _check_chunk(self, layer, q, k, v)
        n0, n1 = self.length[layer], self.length[layer] + k.shape[1]
        chunk = {"k": k.to(WINDOW_DTYPE), "v": v.to(WINDOW_DTYPE)}
        keys, values = (torch.cat([self.stored(kind, layer), chunk[kind].float()], dim=1) for kind in ("k", "v"))
        scale = self.head_dim**-0.5 if scaling is None else scaling
        out = causal_gqa_attention(q, keys, values, n0, scale)
        for kind in ("k", "v"):
            self.window[kind][layer, :, n0:n1] = chunk[kind]
        self.length[layer] = n1
        while self.quantized_to[layer] + self.group <= n1 - self.config.recent:
            self._quantize_block(layer, self.quantized_to[layer])
            self.quantized_to[layer] += self.group
        return out

    def body_end(self, n0: int) -> int:
        """End of the quantized positions a chunk starting at n0 reads: whole blocks that left the window."""
        s = self.config.sink
        return s + max(n0 - self.config.recent - s, 0) // self.group * self.group

    def sequence(self, layer: int, q, k, v, first: int) -> SequenceKV:
        """Every whole block of the sequence quantized as _quantize_block does it, all blocks at once."""
        _check_chunk(self, layer, q, k, v)
        g, s = self.group, self.config.sink
        window = {"k": k.to(WINDOW_DTYPE).float(), "v": v.to(WINDOW_DTYPE).float()}
        body = {kind: torch.zeros_like(x) for kind, x in window.items()}
        end = s + max(k.shape[1] - s, 0) // g * g
        if end > s:
            body["k"][:, s:end], body["v"][:, s:end], _, _ = self._quantize_blocks(window["k"][:, s:end],
                                                                                  window["v"][:, s:end])
        return SequenceKV(q.float(), window, body, s)

    @property
    def nbytes(self) -> int:
        """Bytes KIVI holds now: codes, scales and zeros of the quantized blocks plus fp16 for every other token."""
        packed = sum(t.numel() * t.element_size() for kind in self.blocks.values() for layer in kind
                     for block in layer for t in block)
        quantized = [q_to - self.config.sink for q_to in self.quantized_to]  # quantized_to starts at sink
        fp16 = (sum(self.length) - sum(quantized)) * self.kv_heads * 2 * self.head_dim * 2
        return packed + fp16

    def bits_per_element(self) -> float:
        return _bits_from_bytes(self, self.nbytes)


class EvalOscarKVCache(OscarKVCache):
    """The reference OSCAR cache, plus the one-pass view of a whole sequence the evaluation runs."""

    def body_end(self, n0: int) -> int:
        """End of the body a chunk starting at n0 reads: positions that left the recent window before it."""
        return max(self.config.sink, n0 - self.config.recent)

    def sequence(self, layer: int, q, k, v, first: int) -> SequenceKV:
        """Rotated fp16 K/V of every position, and the values the body holds for each: dequantized from
        the codes _store would write (quantize of the same fp16 vectors, one token at a time)."""
        window = self._rotated_chunks(layer, k, v)  # validates, rotates and rounds as attend does
        check_finite("q", q)
        cfg, body = self.layer_configs[layer], {}
        for kind, x in window.items():
            args = (cfg.bits(kind), cfg.cluster_dim)
            levels = self.levels[kind][layer]
            codes = quantize(x.float(), *args, cfg.clip(kind), levels, cfg.scale_dtype, self.feedback_for(kind, layer))
            body[kind] = dequantize(*codes, *args, levels)
        return SequenceKV(self.rotate("k", layer, q), {kind: x.float() for kind, x in window.items()}, body,
                          cfg.sink, lambda out: self.unrotate_values(layer, out))


class OnlineOscarKVCache(EvalOscarKVCache):
    """OscarCache's online mode on a plain OscarKVCache: each layer's rotations are estimated from
    its first chunk (the prompt) with the calibration objectives, then frozen."""

    def attend(self, layer: int, q, k, v, scaling: float | None = None) -> torch.Tensor:
        if self.length[layer] == 0:
            self.set_rotation(layer, *online_rotations(q, k, v))
        return super().attend(layer, q, k, v, scaling)

    def sequence(self, layer: int, q, k, v, first: int) -> SequenceKV:
        self.set_rotation(layer, *online_rotations(q[:, :first], k[:, :first], v[:, :first]))
        return super().sequence(layer, q, k, v, first)


# -- one pass over a whole sequence ----------------------------------------------------------------
#
# A chunk's queries read the sink, the recent window and the chunk itself at fp16, and the body as
# the codes the cache holds. Which positions are body depends only on where the query's chunk starts,
# and a position's stored value only on its own K/V (KIVI: on its block), so a whole sequence can be
# attended in one forward with the same stored values as feeding it chunk by chunk: the evaluation
# runs one forward per sequence instead of one per chunk.


@dataclass
class SequenceKV:
    """A cache's view of a whole sequence: queries in the space it attends in, the fp16 value of every
    position (`window`) and, where the cache quantizes, the value its body holds (`body`, [Hkv, T, D])."""

    q: torch.Tensor
    window: dict[str, torch.Tensor]
    body: dict[str, torch.Tensor] | None = None
    sink: int = 0
    unrotate: Callable[[torch.Tensor], torch.Tensor] = lambda out: out


def one_pass_attention(seq: SequenceKV, body_end: torch.Tensor, scaling: float, block: int = 512) -> torch.Tensor:
    """Causal GQA attention [Hq, T, D] where query p reads position t from the body when
    sink <= t < body_end[p], else its fp16 value. Per block of queries, positions whose choice varies
    inside the block appear twice (fp16 and body), each masked to the queries that read it."""
    q, k, v = seq.q, seq.window["k"], seq.window["v"]
    tokens = q.shape[1]
    if seq.body is None:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scaling,
                                              enable_gqa=True)[0]
    out = torch.empty_like(q)
    for a in range(0, tokens, block):
        b = min(a + block, tokens)
        ends = body_end[a:b]
        # Positions sink..lo-1 are body for every query here; none reads past b - 1.
        lo, hi = min(int(ends.min()), b), min(int(ends.max()), b)
        s = min(seq.sink, lo)
        keys = [torch.cat([x[:, :s], seq.body[kind][:, s:lo], x[:, lo:b], seq.body[kind][:, lo:hi]], 1)
                for kind, x in (("k", k), ("v", v))]
        pos = torch.arange(b)
        query = torch.arange(a, b)[:, None]
        allowed = pos[None, :] <= query  # causal
        allowed[:, lo:] &= pos[None, lo:] >= ends[:, None]  # fp16 copies of the varying positions
        extra = (pos[None, lo:hi] < ends[:, None]) & (pos[None, lo:hi] <= query)
        mask = torch.cat([allowed, extra], 1)
        out[:, a:b] = F.scaled_dot_product_attention(q[None, :, a:b], keys[0][None], keys[1][None], attn_mask=mask,
                                                     scale=scaling, enable_gqa=True)[0]
    return out


class OnePass:
    """route_attention target: each layer's attention over the whole sequence at once, equal to feeding
    the sequence to `cache` in the chunks `bounds` (first chunk bounds[0])."""

    def __init__(self, cache, bounds: list[tuple[int, int]]):
        self.cache, self.bounds = cache, bounds
        self.tokens = bounds[-1][1]
        self.body_end = torch.zeros(self.tokens, dtype=torch.long)
        if hasattr(cache, "body_end"):
            for n0, n1 in bounds:
                self.body_end[n0:n1] = cache.body_end(n0)

    def attend(self, layer: int, q, k, v, scaling: float | None = None) -> torch.Tensor:
        if q.shape[1] != self.tokens:
            raise OscarInputError(f"q has {q.shape[1]} tokens: expected the whole sequence of {self.tokens}")
        seq = self.cache.sequence(layer, q, k, v, self.bounds[0][1])
        scale = self.cache.head_dim**-0.5 if scaling is None else scaling
        return seq.unrotate(one_pass_attention(seq, self.body_end, scale))


def bits_at(cache, context: int) -> float:
    """Bits per K/V element `cache`'s format stores once `context` tokens are cached (the layout formulas;
    tests hold them to the bytes the caches really allocate)."""
    if isinstance(cache, OscarKVCache):
        return oscar_bits_per_element(cache.config, cache.head_dim, context)
    if isinstance(cache, KiviCache):
        return kivi_bits_per_element(cache.config, cache.head_dim, context)
    return 8.0 * cache.k.element_size()


# -- running a model with a cache ----------------------------------------------------------------

def chunk_bounds(total: int, chunk: int, first: int | None = None) -> list[tuple[int, int]]:
    """[(n0, n1)] covering 0..total: a first chunk of `first` tokens (default `chunk`), then `chunk` each."""
    if chunk <= 0 or (first is not None and first <= 0):
        raise OscarInputError(f"chunk={chunk}, first chunk={first}: expected positive token counts")
    bounds, n0 = [], 0
    step = first or chunk
    while n0 < total:
        n1 = min(n0 + step, total)
        bounds.append((n0, n1))
        n0, step = n1, chunk
    return bounds


@torch.no_grad()
def one_pass_logits(model, ids: torch.Tensor, cache, chunk: int, first: int | None = None,
                    keep_last: int | None = None) -> torch.Tensor:
    """Logits [T, V] of 1-D `ids` (of the last `keep_last` positions only, when given), attended through
    `cache` as when fed to it in chunks of `chunk` tokens after a first chunk of `first`, in one forward."""
    ids = ids.reshape(-1)
    n = ids.shape[0]
    kwargs = {} if keep_last is None else {"logits_to_keep": keep_last}
    with route_attention(model, OnePass(cache, chunk_bounds(n, chunk, first))):
        out = model(input_ids=ids[None], position_ids=torch.arange(n)[None], use_cache=False, **kwargs)
    return out.logits[0].float()


# -- methods -------------------------------------------------------------------------------------


@dataclass
class Method:
    """One evaluated cache: its format config and a factory of fresh caches for `max_context` tokens."""

    name: str
    config: OscarConfig | None
    make: Callable[[int], object]
    rotation: str
    notes: list[str] = field(default_factory=list)


def _oscar_factory(config, shape, k_rot=None, v_rot=None, k_levels=None, v_levels=None, cls=EvalOscarKVCache,
                   k_feedback=None):
    layers, kv_heads, head_dim, _ = shape
    return lambda n: cls(config, layers, kv_heads, head_dim, n, k_rot, v_rot, k_levels, v_levels, k_feedback=k_feedback)


def _levels_for(levels, bits: int):
    return levels if levels is not None and levels.shape[-1] == 2**bits else None


def oscar_from_rotations(rotations, config: OscarConfig, shape, source: str, label: str | None = None,
                         name: str = "oscar") -> Method:
    """The `oscar` method from a RotationSet-like object (.k, .v, .k_levels, .v_levels, .k_feedback, .metadata).

    Its clip ratios (and codebook, when Lloyd-Max levels for these bits are present) come from the
    metadata; what the metadata does not give comes from `config`. K rounding with feedback needs the
    object's k_feedback.
    """
    meta = getattr(rotations, "metadata", None) or {}
    notes = []
    changes = {key: meta[key] for key in ("k_clip", "v_clip") if meta.get(key) is not None}
    k_levels = _levels_for(getattr(rotations, "k_levels", None), config.k_bits)
    v_levels = _levels_for(getattr(rotations, "v_levels", None), config.v_bits)
    if meta.get("codebook") == "lloyd-max" or config.codebook == "lloyd-max":
        if k_levels is not None and v_levels is not None:
            changes["codebook"] = "lloyd-max"
        else:
            changes["codebook"] = "uniform"
            notes.append(f"no Lloyd-Max levels for K{config.k_bits}/V{config.v_bits} bits in {source}: uniform levels used")
    if changes.get("codebook", config.codebook) == "uniform":
        k_levels = v_levels = None
    for key in ("k_bits", "v_bits"):
        if meta.get(key) is not None and meta[key] != getattr(config, key):
            notes.append(f"{source} was calibrated for {key}={meta[key]}; evaluated at {getattr(config, key)}")
    cfg = replace(config, **changes)
    feedback = getattr(rotations, "k_feedback", None) if cfg.k_rounding == "feedback" else None
    if cfg.k_rounding == "feedback" and feedback is None:
        raise OscarInputError(f"k_rounding='feedback' needs K's feedback weights: {source} has none (expected a "
                              f"rotation file from oscar-export calibrate)")
    return Method(name, cfg, _oscar_factory(cfg, shape, rotations.k, rotations.v, k_levels, v_levels,
                                            k_feedback=feedback), label or f"file {source}", notes)


@dataclass
class _Calibrated:
    k: torch.Tensor
    v: torch.Tensor
    k_levels: torch.Tensor | None
    v_levels: torch.Tensor | None
    metadata: dict
    k_feedback: torch.Tensor | None = None


def method_config(spec: str, config: OscarConfig) -> tuple[str, OscarConfig]:
    """A method spec -> (method, its cache config): 'oscar' keeps `config`'s bits, 'oscar-3' has 3-bit K and V,
    'oscar-k3v2' 3-bit K and 2-bit V."""
    name, dash, bits = spec.partition("-")
    match = re.fullmatch(r"([234])|k([234])v([234])", bits)
    if name not in METHODS or (dash and (name == "fp16" or not match)):
        raise OscarInputError(f"methods: {spec!r} is not a method: expected one of {list(METHODS)}, a quantized "
                              f"one optionally with its bits: NAME-B or NAME-kBvB, B in 2, 3, 4 (e.g. oscar-3, kivi-k3v2)")
    if not bits:
        return name, config
    k_bits, v_bits = (int(match[1]),) * 2 if match[1] else (int(match[2]), int(match[3]))
    return name, replace(config, k_bits=k_bits, v_bits=v_bits, k_bits_by_layer=(), k_clip_by_layer=())


def _oscar_method(model, tokenizer, spec, config, shape, rotations, calibration, fitted,
                  per_head: bool = False) -> Method:
    """`oscar` at `config`: from `rotations` (a file or RotationSet), else calibrated on `calibration`
    (text, tokens, held-out tokens), one rotation per KV head with `per_head`; `fitted` keeps the
    rotation fit for the other bit widths."""
    layers, kv_heads, head_dim, _ = shape
    if rotations is not None and not isinstance(rotations, (str, Path)):
        return oscar_from_rotations(rotations, config, shape, "the given rotation set", "given rotation set", spec)
    if rotations is not None:
        from .rotation_files import load_rotations

        rs = load_rotations(rotations, layers=layers, head_dim=head_dim, kv_heads=kv_heads)
        return oscar_from_rotations(rs, config, shape, str(rotations), None, spec)
    text, tokens, heldout = calibration
    if text is None:
        raise OscarInputError("methods: 'oscar' without rotations needs calibration text")
    from .calibrate import fit_quantizer, fit_rotations

    if not fitted:
        fitted.update(fit_rotations(model, tokenizer, text, tokens, heldout, per_head=per_head,
                                    text_name="calibration part of the evaluation text"))
    result = fit_quantizer(fitted, config, lloyd_max=config.codebook == "lloyd-max")
    meta = {"k_clip": result["k_clip"], "v_clip": result["v_clip"], "codebook": config.codebook}
    calibrated = _Calibrated(result["k_rotation"], result["v_rotation"], result.get("k_levels"),
                             result.get("v_levels"), meta, result["k_feedback"])
    method = oscar_from_rotations(calibrated, config, shape, "calibration", "calibrated", spec)
    method.notes.append(f"clip K {result['k_clip']:g}, V {result['v_clip']:g} (searched on the held-out "
                        f"calibration tokens)")
    return method


def build_methods(model, tokenizer, names: Sequence[str], config: OscarConfig, rotations=None,
                  calibration_text: str | None = None, calibration_tokens: int = 4096,
                  calibration_heldout: int = 512, match_clip: bool = False, per_head: bool = False) -> list[Method]:
    """Method objects for the specs `names` (see method_config), in that order.

    Baselines use the uniform codebook and nearest rounding (feedback weights come from calibration data they do
    not have); `oscar` takes its clip ratios (and Lloyd-Max levels, K feedback weights) from the
    rotation file or the calibration, which fits the rotations once for every bit width. match_clip:
    the quantized baselines use the first oscar method's clip ratios too, so only the rotation (or
    KIVI's grouping) differs. per_head: calibrated oscar fits one rotation per KV head.
    """
    shape = attention_shape(model)
    layers, kv_heads, head_dim, _ = shape
    config.check_head_dim(head_dim)
    specs = [(spec, *method_config(spec, config)) for spec in names]
    calibration, fitted = (calibration_text, calibration_tokens, calibration_heldout), {}
    oscars = {spec: _oscar_method(model, tokenizer, spec, cfg, shape, rotations, calibration, fitted, per_head)
              for spec, name, cfg in specs if name == "oscar"}
    clips = {}
    if match_clip:
        if not oscars:
            raise OscarInputError("match_clip: expected 'oscar' among the methods (its clip ratios are matched)")
        first = next(iter(oscars.values())).config
        clips = {"k_clip": first.k_clip, "v_clip": first.v_clip}
    methods = []
    for spec, name, cfg in specs:
        base = replace(cfg, codebook="uniform", k_rounding="nearest", **clips)
        if name == "fp16":
            methods.append(Method(spec, None, lambda n: Fp16Cache(layers, kv_heads, head_dim, n), "none"))
        elif name == "naive":
            methods.append(Method(spec, base, _oscar_factory(base, shape), "none"))
        elif name == "hadamard":
            rot = hadamard_rotations(layers, head_dim)
            methods.append(Method(spec, base, _oscar_factory(base, shape, rot, rot), "hadamard"))
        elif name == "kivi":
            methods.append(Method(spec, base, lambda n, b=base: KiviCache(b, layers, kv_heads, head_dim, n),
                                  "none (K per channel, V per token)"))
        elif name == "online":
            methods.append(Method(spec, base, _oscar_factory(base, shape, cls=OnlineOscarKVCache),
                                  "online (from each sequence's first chunk)"))
        else:
            methods.append(oscars[spec])
    return methods


# -- metrics -------------------------------------------------------------------------------------


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


# -- the evaluation ------------------------------------------------------------------------------


def _text_tokens(tokenizer, text_path: Path, reserve: int) -> tuple[str, torch.Tensor]:
    if not text_path.is_file():
        raise OscarInputError(f"text file {str(text_path)!r} does not exist: expected a UTF-8 text file")
    # verbose=False: a long text is expected here, it is cut into windows
    ids = tokenizer(text_path.read_text(encoding="utf-8", errors="replace"), verbose=False)["input_ids"]
    if len(ids) <= reserve:
        raise OscarInputError(
            f"text file {str(text_path)!r} has {len(ids)} tokens: expected more than the {reserve} reserved for calibration"
        )
    calibration = tokenizer.decode(ids[:reserve], skip_special_tokens=True)
    return calibration, torch.tensor(ids[reserve:])


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise OscarInputError(f"{name}={value!r}: expected a positive integer")


def evaluate(
    model_name_or_path: str = "bundled",
    methods: Sequence[str] = DEFAULT_METHODS,
    bits: int | None = 2,
    config: OscarConfig | None = None,
    rotations=None,
    contexts: Sequence[int] | None = None,
    *,
    text: str | Path | None = None,
    metrics: Sequence[str] = METRICS,
    chunk: int = 64,
    prefill: int | None = None,
    ppl_tokens: int = 4096,
    attn_tokens: int = 1024,
    decode_tokens: int = 16,
    needle_context: int | None = None,
    needle_tokens: int = 24,
    needle_prefix: int = 8,
    needle_depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    needle_seeds: int = 1,
    calibration_tokens: int = 4096,
    calibration_heldout: int = 512,
    match_clip: bool = False,
    per_head: bool = False,
    model=None,
    tokenizer=None,
) -> dict:
    """Perplexity, attention error and needle retrieval of each method's cache (see the module docstring).

    methods: specs, see method_config (e.g. oscar, oscar-3, kivi-k3v2). bits: K and V bits of every
    quantized method without its own (None: those of `config`). rotations: a rotation file (or
    RotationSet) for `oscar`; None calibrates on the reserved first part of the text. contexts:
    perplexity context lengths: windows of the longest one, ppl_tokens of text in all (whole windows, at
    least one); a shorter context's perplexity is that of the windows' first tokens. Default: P/4, P/2
    and P, P the model's max_position_embeddings up to DEFAULT_LONGEST_CONTEXT (2048 when it has none);
    needle_context defaults to P/2. prefill: first chunk
    (default sink + recent, which only ever reads fp16, so it changes nothing but gives `online` a
    prompt to estimate from). match_clip: the quantized baselines use oscar's clip ratios (default: the
    config's, 1.0 unless set), so the comparison isolates the rotation from the clipping. per_head:
    calibrated oscar fits one rotation per KV head (rotation file v2) instead of one per layer.
    model/tokenizer: an already loaded model (then model_name_or_path only names it).
    """
    started = time.perf_counter()
    config = config or OscarConfig()
    if bits is not None:
        config = replace(config, k_bits=bits, v_bits=bits, k_bits_by_layer=(), k_clip_by_layer=())
    methods = list(methods)
    if not methods or len(set(methods)) != len(methods):
        raise OscarInputError(f"methods={methods}: expected distinct method specs")
    for spec in methods:
        method_config(spec, config)
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise OscarInputError(f"metrics={list(metrics)}: expected a subset of {list(METRICS)}")
    for name, value in (("chunk", chunk), ("ppl_tokens", ppl_tokens), ("attn_tokens", attn_tokens),
                        ("decode_tokens", decode_tokens),
                        ("needle_tokens", needle_tokens), ("needle_seeds", needle_seeds),
                        ("calibration_tokens", calibration_tokens), ("calibration_heldout", calibration_heldout)):
        _check_positive(name, value)
    if contexts is not None:
        contexts = sorted(set(contexts))
        if "perplexity" in metrics and not contexts:
            raise OscarInputError("contexts: expected at least one context length")
        for c in contexts:
            _check_positive("contexts", c)
    if needle_context is not None:
        _check_positive("needle_context", needle_context)
    first = prefill if prefill is not None else max(config.sink + config.recent, chunk)
    _check_positive("prefill", first)

    if model is None:
        from .models import load_model

        model, tokenizer = load_model(model_name_or_path)
    elif tokenizer is None:
        raise OscarInputError("tokenizer: expected one with the given model")
    shape = attention_shape(model)
    layers, kv_heads, head_dim, q_heads = shape
    config.check_head_dim(head_dim)
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest_default = min(max_pos or 2048, DEFAULT_LONGEST_CONTEXT)
    contexts = contexts or [longest_default // 4, longest_default // 2, longest_default]
    needle_context = needle_context or longest_default // 2
    needle_length = needle_context + 2 * len(needle_depths) * needle_tokens
    longest = max([*(contexts if "perplexity" in metrics else []),
                   *([needle_length] if "needle" in metrics else []),
                   *([attn_tokens] if "attention" in metrics else [])], default=0)
    if max_pos and longest > max_pos:
        raise OscarInputError(
            f"contexts/needle sequence/attn_tokens need {longest} positions: expected at most the model's "
            f"max_position_embeddings={max_pos} (a needle sequence is needle_context + 2 * needle_tokens * depths)"
        )

    if text is None:
        from .models import BUNDLED_MODEL_DIR

        text = BUNDLED_MODEL_DIR / "heldout.txt"
    text = Path(text)
    reserve = calibration_tokens + calibration_heldout + SPLIT_MARGIN
    calibration_text, ids = _text_tokens(tokenizer, text, reserve)

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    specs = build_methods(model, tokenizer, methods, config, rotations, calibration_text,
                          calibration_tokens, calibration_heldout, match_clip, per_head)
    timings["methods_and_calibration"] = time.perf_counter() - t0
    note(f"eval: methods ready in {timings['methods_and_calibration']:.0f} s")
    results = {
        m.name: {
            "rotation": m.rotation,
            "config": m.config.to_dict() if m.config else None,
            "notes": m.notes,
            "perplexity": None,
            "perplexity_by_context": {},
            "attention_error": None,
            "attention_error_by_layer": [],
            "bits_per_element": None,
            "bits_per_element_by_context": {},
            "needle_accuracy": None,
            "needle_by_depth": {},
        }
        for m in specs
    }

    windows, needle_control = [], None
    if "perplexity" in metrics:
        t0 = time.perf_counter()
        longest_context = contexts[-1]
        count = min(max(1, ppl_tokens // longest_context), ids.shape[0] // longest_context)
        if count == 0:
            raise OscarInputError(
                f"contexts: {longest_context} tokens but the evaluation part of {str(text)!r} has {ids.shape[0]}: "
                f"expected a context length that fits"
            )
        windows = [ids[i * longest_context : (i + 1) * longest_context] for i in range(count)]
        for m in specs:
            t1 = time.perf_counter()
            nll = torch.zeros(longest_context - 1)
            for w in windows:
                nll += token_nll(model, w, m.make(longest_context), chunk, first)
            r = results[m.name]
            # A causal model's first c tokens of a window are a window of c tokens.
            r["perplexity_by_context"] = {str(c): math.exp(float(nll[: c - 1].sum()) / (count * (c - 1)))
                                          for c in contexts}
            r["perplexity"] = sum(r["perplexity_by_context"].values()) / len(contexts)
            r["bits_per_element_by_context"] = {str(c): bits_at(m.make(1), c) for c in contexts}
            note(f"eval: {m.name} perplexity " + ", ".join(f"{c}: {r['perplexity_by_context'][str(c)]:.3f}"
                                                        for c in contexts)
                 + f" ({count} window(s), {time.perf_counter() - t1:.0f} s)")
        timings["perplexity"] = time.perf_counter() - t0

    if "attention" in metrics:
        t0 = time.perf_counter()
        if ids.shape[0] < attn_tokens:
            raise OscarInputError(f"attn_tokens={attn_tokens}: the evaluation text has only {ids.shape[0]} tokens")
        qkv = collect_qkv(model, ids[None, :attn_tokens])
        for m in specs:
            errors = attention_errors(qkv, m.make, decode_tokens)
            results[m.name]["attention_error_by_layer"] = errors
            results[m.name]["attention_error"] = sum(errors) / len(errors)
            results[m.name]["bits_per_element_by_context"].setdefault(str(attn_tokens), bits_at(m.make(1), attn_tokens))
            note(f"eval: {m.name} attention error {results[m.name]['attention_error']:.4f}")
        timings["attention"] = time.perf_counter() - t0

    if "needle" in metrics:
        t0 = time.perf_counter()
        cases = needle_cases(ids, needle_context, needle_tokens, needle_prefix, needle_depths, needle_seeds)
        for m in specs:
            t1 = time.perf_counter()
            acc = [needle_accuracy(model, case, m.make(needle_length), chunk, first) for case in cases]
            by_depth = {str(d): sum(a[d] for a in acc) / len(acc) for d in sorted(needle_depths)}
            results[m.name]["needle_by_depth"] = by_depth
            results[m.name]["needle_accuracy"] = sum(by_depth.values()) / len(by_depth)
            results[m.name]["bits_per_element_by_context"].setdefault(str(needle_length),
                                                                      bits_at(m.make(1), needle_length))
            note(f"eval: {m.name} needle at {needle_context}: {results[m.name]['needle_accuracy']:.3f} "
                 f"({len(cases)} sequence(s) of {needle_length} tokens, {time.perf_counter() - t1:.0f} s)")
        control = [needle_accuracy(model, case, Fp16Cache(layers, kv_heads, head_dim, needle_length), chunk, first)
                   for case in needle_cases(ids, needle_context, needle_tokens, needle_prefix, needle_depths,
                                            needle_seeds, control=True)]
        needle_control = sum(sum(a.values()) / len(a) for a in control) / len(control)
        note(f"eval: needle control (fp16, no needle in the haystack) {needle_control:.3f}")
        timings["needle"] = time.perf_counter() - t0

    for m in specs:
        by_ctx = results[m.name]["bits_per_element_by_context"]
        if by_ctx:
            results[m.name]["bits_per_element"] = by_ctx[max(by_ctx, key=int)]
    timings["total"] = time.perf_counter() - started
    note(f"eval: done in {timings['total']:.0f} s")
    return {
        "model": str(model_name_or_path),
        "bits": config.k_bits if config.k_bits == config.v_bits and not config.mixed else config.describe(),
        "config": config.to_dict(),
        "shape": {"layers": layers, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": head_dim},
        "text": str(text),
        "split": {
            "calibration_tokens": reserve,
            "evaluation_tokens": int(ids.shape[0]),
            "rule": f"the first {reserve} tokens of the text are reserved for calibration; metrics read the rest",
        },
        "settings": {
            "metrics": list(metrics),
            "contexts": contexts,
            "perplexity_windows": len(windows),
            "perplexity_window_tokens": contexts[-1] if windows else None,
            "chunk": chunk,
            "prefill": first,
            "attn_tokens": attn_tokens,
            "decode_tokens": decode_tokens,
            "needle_context": needle_context,
            "needle_sequence_tokens": needle_length,
            "needle_tokens": needle_tokens,
            "needle_prefix": needle_prefix,
            "needle_depths": sorted(needle_depths),
            "needle_seeds": needle_seeds,
            "match_clip": match_clip,
        },
        "methods": results,
        # fp16 accuracy on the needles' tokens when the haystack does not contain them: what is not retrieval
        "needle_control_accuracy": needle_control,
        "runtime_s": timings,
    }


# -- output --------------------------------------------------------------------------------------


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(result: dict, console=None) -> None:
    """One row per method: bits per element, perplexity per context and mean, attention error, needle accuracy."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cfg = result["config"]
    contexts = result["settings"]["contexts"] if "perplexity" in result["settings"]["metrics"] else []
    table = Table(title=f"Quality of {result['model']} at {result['bits']} bits: cluster_dim {cfg['cluster_dim']}, "
                        f"sink {cfg['sink']}, recent {cfg['recent']}")
    table.add_column("method")
    table.add_column("rotation")
    table.add_column("bits/elem", justify="right")
    for c in contexts:
        table.add_column(f"ppl@{c}", justify="right")
    table.add_column("ppl mean", justify="right")
    table.add_column("attn err", justify="right")
    table.add_column("needle acc", justify="right")
    for name, r in result["methods"].items():
        table.add_row(
            name,
            r["rotation"],
            _fmt(r["bits_per_element"], ".3f"),
            *(_fmt(r["perplexity_by_context"].get(str(c)), ".3f") for c in contexts),
            _fmt(r["perplexity"], ".3f"),
            _fmt(r["attention_error"], ".4f"),
            _fmt(r["needle_accuracy"], ".3f"),
        )
    console.print(table)
    if result.get("needle_control_accuracy") is not None:
        console.print(f"needle control (fp16, needles not in the haystack): {result['needle_control_accuracy']:.3f} "
                      "accuracy; only the excess over it is retrieval")
    for name, r in result["methods"].items():
        for line in r["notes"]:
            console.print(f"[yellow]note ({name}):[/yellow] {line}")


def plot(result: dict, path: str | Path) -> Path:
    """One PNG, three panels: perplexity by context, attention error by layer, needle accuracy by depth."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise OscarInputError("plot: matplotlib is not installed: expected `pip install matplotlib`") from None
    path = Path(path)
    if path.is_dir() or not path.parent.is_dir():
        raise OscarInputError(f"plot file {str(path)!r}: expected a file path in an existing directory")
    fig = Figure(figsize=(16, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_ppl, ax_err, ax_needle = fig.subplots(1, 3)
    for name, r in result["methods"].items():
        label = f"{name} ({r['bits_per_element']:.2f} b)" if r["bits_per_element"] is not None else name
        if r["perplexity_by_context"]:
            xs = sorted(r["perplexity_by_context"], key=int)
            ax_ppl.plot([int(x) for x in xs], [r["perplexity_by_context"][x] for x in xs], marker="o", label=label)
        if r["attention_error_by_layer"]:
            ax_err.plot(range(len(r["attention_error_by_layer"])), r["attention_error_by_layer"], marker="o", label=label)
        if r["needle_by_depth"]:
            xs = sorted(r["needle_by_depth"], key=float)
            ax_needle.plot([float(x) for x in xs], [r["needle_by_depth"][x] for x in xs], marker="o", label=label)
    if result.get("needle_control_accuracy") is not None:
        ax_needle.axhline(result["needle_control_accuracy"], color="gray", linestyle="--", label="control (no needle)")
    contexts = sorted({int(c) for r in result["methods"].values() for c in r["perplexity_by_context"]})
    if contexts:
        ax_ppl.set_xticks(contexts)
    ax_err.xaxis.get_major_locator().set_params(integer=True)
    ax_ppl.set(title="perplexity by context", xlabel="context (tokens)", ylabel="perplexity")
    ax_err.set(title="decode attention-output relative error", xlabel="layer", ylabel="relative error", yscale="log")
    ax_needle.set(title="needle retrieval accuracy", xlabel="needle depth", ylabel="accuracy", ylim=(-0.02, 1.02))
    for ax in (ax_ppl, ax_err, ax_needle):
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(f"{Path(result['model']).name}: {result['bits']}-bit KV cache, sink {result['config']['sink']}, "
                 f"recent {result['config']['recent']}, cluster_dim {result['config']['cluster_dim']}")
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise OscarInputError(f"plot file {str(path)!r}: cannot write ({err.strerror}): expected a writable path") from None
    return path

"""Quality of the packed cache against baselines at the same bit budget.

Methods (every quantized one keeps the same fp16 sink and recent windows from the OscarConfig,
so the bit budgets match; each reports the bits per element its cache really stores):

- ``fp16``: plain attention over K/V rounded to fp16 (16 bits per element).
- ``naive``: the OSCAR cache without a rotation (per-token, per-group asymmetric INT).
- ``hadamard``: the OSCAR cache with the data-free Hadamard rotation (QuaRot-style).
- ``kivi``: KIVI: K per channel (one scale/zero per channel per block of ``cluster_dim``
  tokens), V per token (groups of ``cluster_dim`` channels), with its fp16 residual
  (:class:`KiviCache`).
- ``oscar``: the OSCAR cache with rotations from a rotation file, or calibrated on the fly
  (:func:`oscar_export.calibrate.calibrate`) on text disjoint from the evaluation text.
- ``online``: rotations estimated from each sequence's first chunk, as ``OscarCache``'s online
  mode does (:class:`OnlineOscarKVCache`).

Text split: the evaluation text (default: the bundled model's ``heldout.txt``) is tokenized
once. Its first ``calibration_tokens + calibration_heldout + 16`` tokens are reserved for
calibration (the 16 absorb re-tokenization at the cut) and never evaluated; every metric reads
only the tokens after them. The reservation holds whether or not calibration runs, so numbers
from runs with and without a rotation file are comparable.

Metrics:

1. Perplexity at each context length: non-overlapping windows of the evaluation text, run
   through the model with the method's cache in chunks (first chunk ``sink + recent`` tokens,
   then ``chunk`` tokens), so later chunks read earlier tokens from the cache as stored.
   Every predicted token of a window counts.
2. Attention-output relative error per layer on the model's captured post-RoPE Q/K/V:
   prefill all but the last ``decode_tokens`` tokens, then decode those one at a time; the
   decoded outputs are compared with exact fp32 attention.
3. Needle retrieval: a random ``needle_tokens`` span of evaluation text is inserted at a depth
   (fraction of the haystack before it) into ``needle_context`` tokens of other evaluation text,
   and repeated at the end. Accuracy is the fraction of the repeat's tokens after its first
   ``needle_prefix`` that greedy next-token prediction gets right under teacher forcing.
   ``needle_control_accuracy`` is the fp16 accuracy on the same tokens when the haystack does
   not contain the needle: only accuracy above it is retrieval.
"""

from __future__ import annotations

import math
import random
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
from .codec import Quantized, dequantize, quantize
from .config import OscarConfig, OscarInputError
from .hf_cache import attention_shape, route_attention
from .progress import progress
from .rotations import hadamard_rotations

METHODS = ("fp16", "naive", "hadamard", "kivi", "oscar", "online")
DEFAULT_METHODS = ("fp16", "naive", "hadamard", "kivi", "oscar")
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

    def _quantize_block(self, layer: int, p0: int) -> None:
        cfg, p1 = self.config, p0 + self.group
        k = self.window["k"][layer, :, p0:p1].to(torch.float32)  # [Hkv, G, D]
        qk = quantize(k.transpose(-1, -2), cfg.k_bits, self.group, cfg.k_clip, None, cfg.scale_dtype)  # per channel
        self.body["k"][layer, :, p0:p1] = dequantize(*qk, cfg.k_bits, self.group).transpose(-1, -2)
        v = self.window["v"][layer, :, p0:p1].to(torch.float32)
        qv = quantize(v, cfg.v_bits, cfg.cluster_dim, cfg.v_clip, None, cfg.scale_dtype)  # per token
        self.body["v"][layer, :, p0:p1] = dequantize(*qv, cfg.v_bits, cfg.cluster_dim)
        self.blocks["k"][layer].append(qk)
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


class OnlineOscarKVCache(OscarKVCache):
    """OscarCache's online mode on a plain OscarKVCache: each layer's rotations are estimated from
    its first chunk (the prompt) with the calibration objectives, then frozen."""

    def attend(self, layer: int, q, k, v, scaling: float | None = None) -> torch.Tensor:
        if self.length[layer] == 0:
            self.set_rotation(layer, *online_rotations(q, k, v))
        return super().attend(layer, q, k, v, scaling)


def stored_bits_per_element(cache) -> float:
    """Bits per K/V element the cache really stores for the tokens it holds."""
    if isinstance(cache, OscarKVCache):
        return oscar_bits_per_element(cache.config, cache.head_dim, max(cache.length))
    return cache.bits_per_element()


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
def run_chunks(model, ids: torch.Tensor, cache, chunk: int, first: int | None = None,
               keep: Callable[[int, int, torch.Tensor], None] | None = None) -> list[torch.Tensor]:
    """Forward 1-D `ids` through `model` in chunks, every attention going through `cache`.

    Each chunk gets explicit position_ids n0..n1-1 (use_cache=False would restart them at 0).
    keep(n0, n1, logits [T, V]) is called per chunk; without it the chunks' logits are returned.
    """
    ids = ids.reshape(-1)
    kept = []
    with route_attention(model, cache):
        for n0, n1 in chunk_bounds(ids.shape[0], chunk, first):
            logits = model(
                input_ids=ids[None, n0:n1], position_ids=torch.arange(n0, n1)[None], use_cache=False
            ).logits[0].float()
            if keep is None:
                kept.append(logits)
            else:
                keep(n0, n1, logits)
    return kept


def chunked_logits(model, ids: torch.Tensor, cache, chunk: int = 64, first: int | None = None) -> torch.Tensor:
    """Logits [T, V] of a chunked forward through `cache`."""
    return torch.cat(run_chunks(model, ids, cache, chunk, first), dim=0)


# -- methods -------------------------------------------------------------------------------------


@dataclass
class Method:
    """One evaluated cache: its format config and a factory of fresh caches for `max_context` tokens."""

    name: str
    config: OscarConfig | None
    make: Callable[[int], object]
    rotation: str
    notes: list[str] = field(default_factory=list)


def _oscar_factory(config, shape, k_rot=None, v_rot=None, k_levels=None, v_levels=None, cls=OscarKVCache):
    layers, kv_heads, head_dim, _ = shape
    return lambda n: cls(config, layers, kv_heads, head_dim, n, k_rot, v_rot, k_levels, v_levels)


def _levels_for(levels, bits: int):
    return levels if levels is not None and levels.shape[-1] == 2**bits else None


def oscar_from_rotations(rotations, config: OscarConfig, shape, source: str, label: str | None = None) -> Method:
    """The `oscar` method from a RotationSet-like object (.k, .v, .k_levels, .v_levels, .metadata).

    Its clip ratios (and codebook, when Lloyd-Max levels for these bits are present) come from the
    metadata; what the metadata does not give comes from `config`.
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
    return Method("oscar", cfg, _oscar_factory(cfg, shape, rotations.k, rotations.v, k_levels, v_levels),
                  label or f"file {source}", notes)


@dataclass
class _Calibrated:
    k: torch.Tensor
    v: torch.Tensor
    k_levels: torch.Tensor | None
    v_levels: torch.Tensor | None
    metadata: dict


def _oscar_method(model, tokenizer, config, shape, rotations, calibration_text, calibration_tokens,
                  calibration_heldout) -> Method:
    layers, kv_heads, head_dim, _ = shape
    if rotations is not None and not isinstance(rotations, (str, Path)):
        return oscar_from_rotations(rotations, config, shape, "the given rotation set", "given rotation set")
    if rotations is not None:
        from .rotation_files import load_rotations

        rs = load_rotations(rotations, layers=layers, head_dim=head_dim, kv_heads=kv_heads)
        return oscar_from_rotations(rs, config, shape, str(rotations))
    if calibration_text is None:
        raise OscarInputError("methods: 'oscar' without rotations needs calibration text")
    from .calibrate import calibrate

    result = calibrate(model, tokenizer, calibration_text, config, tokens=calibration_tokens,
                       heldout_tokens=calibration_heldout, lloyd_max=config.codebook == "lloyd-max",
                       text_name="calibration part of the evaluation text")
    meta = {"k_clip": result["k_clip"], "v_clip": result["v_clip"], "codebook": config.codebook}
    calibrated = _Calibrated(result["k_rotation"], result["v_rotation"], result.get("k_levels"),
                             result.get("v_levels"), meta)
    return oscar_from_rotations(calibrated, config, shape, "calibration", "calibrated")


def build_methods(model, tokenizer, names: Sequence[str], config: OscarConfig, rotations=None,
                  calibration_text: str | None = None, calibration_tokens: int = 4096,
                  calibration_heldout: int = 512, match_clip: bool = False) -> list[Method]:
    """Method objects for `names`, in that order.

    Baselines use `config` with the uniform codebook; `oscar` takes its clip ratios (and Lloyd-Max
    levels) from the rotation file or the calibration. match_clip: the quantized baselines use
    oscar's clip ratios too, so only the rotation (or KIVI's grouping) differs.
    """
    shape = attention_shape(model)
    layers, kv_heads, head_dim, _ = shape
    config.check_head_dim(head_dim)
    unknown = [name for name in names if name not in METHODS]
    if unknown:
        raise OscarInputError(f"methods: unknown method {unknown[0]!r}; expected a subset of {list(METHODS)}")
    oscar = None
    if "oscar" in names:
        oscar = _oscar_method(model, tokenizer, config, shape, rotations, calibration_text, calibration_tokens,
                              calibration_heldout)
    base = replace(config, codebook="uniform")
    if match_clip:
        if oscar is None:
            raise OscarInputError("match_clip: expected 'oscar' among the methods (its clip ratios are matched)")
        base = replace(base, k_clip=oscar.config.k_clip, v_clip=oscar.config.v_clip)
    methods = []
    for name in names:
        if name == "fp16":
            methods.append(Method(name, None, lambda n: Fp16Cache(layers, kv_heads, head_dim, n), "none"))
        elif name == "naive":
            methods.append(Method(name, base, _oscar_factory(base, shape), "none"))
        elif name == "hadamard":
            rot = hadamard_rotations(layers, head_dim)
            methods.append(Method(name, base, _oscar_factory(base, shape, rot, rot), "hadamard"))
        elif name == "kivi":
            methods.append(Method(name, base, lambda n: KiviCache(base, layers, kv_heads, head_dim, n),
                                  "none (K per channel, V per token)"))
        elif name == "online":
            methods.append(Method(name, base, _oscar_factory(base, shape, cls=OnlineOscarKVCache),
                                  "online (from each sequence's first chunk)"))
        else:
            methods.append(oscar)
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


def window_nll(model, ids: torch.Tensor, cache, chunk: int, first: int | None) -> tuple[float, int]:
    """Summed next-token NLL and count over a window, run in chunks through `cache`."""
    total = [0.0, 0]
    n = ids.shape[0]

    def keep(n0, n1, logits):
        end = min(n1, n - 1)  # the last position predicts nothing
        if end > n0:
            total[0] += float(F.cross_entropy(logits[: end - n0], ids[n0 + 1 : end + 1], reduction="sum"))
            total[1] += end - n0

    run_chunks(model, ids, cache, chunk, first, keep)
    return total[0], total[1]


@dataclass
class NeedleCase:
    ids: torch.Tensor  # haystack with the needle inserted, then the needle repeated
    depth: float | None  # None: the control, haystack without the needle, then the needle
    seed: int
    answer_from: int  # first position of the repeat that is scored


def needle_cases(ids: torch.Tensor, context: int, needle_tokens: int, prefix: int,
                 depths: Sequence[float], seeds: int, control: bool = False) -> list[NeedleCase]:
    """Haystack of `context` tokens and a needle of `needle_tokens` from disjoint spans of `ids`
    (drawn per seed), the needle inserted at each depth and repeated at the end.

    control=True gives one case per seed instead: the same haystack continued for
    `needle_tokens` more tokens in place of the needle, then the needle: what the model
    predicts of the needle without having seen it (the accuracy that is not retrieval).
    """
    if not 0 < prefix < needle_tokens:
        raise OscarInputError(f"needle_prefix={prefix}: expected 0 < needle_prefix < needle_tokens={needle_tokens}")
    n, span = ids.shape[0], context + needle_tokens
    if n < span + needle_tokens:
        raise OscarInputError(
            f"evaluation text has {n} tokens: expected at least needle_context + 2 * needle_tokens = "
            f"{span + needle_tokens}"
        )
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise OscarInputError(f"needle depth {depth}: expected a fraction 0 <= depth <= 1")
    cases = []
    for seed in range(seeds):
        rng = random.Random(seed)
        h0 = rng.randrange(0, n - span + 1)
        free = [r for r in (range(0, h0 - needle_tokens + 1), range(h0 + span, n - needle_tokens + 1)) if len(r)]
        s0 = rng.choice(rng.choice(free))
        hay, needle = ids[h0 : h0 + span], ids[s0 : s0 + needle_tokens]
        answer_from = span + prefix
        if control:
            cases.append(NeedleCase(torch.cat([hay, needle]), None, seed, answer_from))
            continue
        for depth in depths:
            pos = round(depth * context)
            seq = torch.cat([hay[:pos], needle, hay[pos:context], needle])
            cases.append(NeedleCase(seq, depth, seed, answer_from))
    return cases


def needle_accuracy(model, case: NeedleCase, cache, chunk: int, first: int | None) -> float:
    """Fraction of the repeat's tokens from answer_from on that greedy prediction gets right (teacher forcing)."""
    n = case.ids.shape[0]
    hits = [0, 0]

    def keep(n0, n1, logits):
        lo = max(n0, case.answer_from - 1)  # logits at p predict token p + 1
        hi = min(n1, n - 1)
        if hi > lo:
            pred = logits[lo - n0 : hi - n0].argmax(-1)
            hits[0] += int((pred == case.ids[lo + 1 : hi + 1]).sum())
            hits[1] += hi - lo

    run_chunks(model, case.ids, cache, chunk, first, keep)
    return hits[0] / hits[1]


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
    contexts: Sequence[int] = (512, 1024, 2048),
    *,
    text: str | Path | None = None,
    metrics: Sequence[str] = METRICS,
    chunk: int = 64,
    prefill: int | None = None,
    ppl_tokens: int = 4096,
    attn_tokens: int = 1024,
    decode_tokens: int = 16,
    needle_context: int = 1024,
    needle_tokens: int = 24,
    needle_prefix: int = 8,
    needle_depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9),
    needle_seeds: int = 2,
    calibration_tokens: int = 4096,
    calibration_heldout: int = 512,
    match_clip: bool = False,
    model=None,
    tokenizer=None,
) -> dict:
    """Perplexity, attention error and needle retrieval of each method's cache (see the module docstring).

    bits: K and V bits of every quantized method (None: those of `config`). rotations: a rotation
    file (or RotationSet) for `oscar`; None calibrates on the reserved first part of the text.
    contexts: perplexity context lengths; ppl_tokens: tokens of text per context length (as many
    whole windows as fit, at least one). prefill: first chunk (default sink + recent, which only
    ever reads fp16, so it changes nothing but gives `online` a prompt to estimate from).
    match_clip: the quantized baselines use oscar's clip ratios (default: the config's, 1.0 unless set),
    so the comparison isolates the rotation from the clipping.
    model/tokenizer: an already loaded model (then model_name_or_path only names it).
    """
    started = time.perf_counter()
    config = config or OscarConfig()
    if bits is not None:
        config = replace(config, k_bits=bits, v_bits=bits)
    methods = list(methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods or len(set(methods)) != len(methods):
        raise OscarInputError(f"methods={methods}: expected distinct names from {list(METHODS)}")
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise OscarInputError(f"metrics={list(metrics)}: expected a subset of {list(METRICS)}")
    for name, value in (("chunk", chunk), ("ppl_tokens", ppl_tokens), ("attn_tokens", attn_tokens),
                        ("decode_tokens", decode_tokens), ("needle_context", needle_context),
                        ("needle_tokens", needle_tokens), ("needle_seeds", needle_seeds),
                        ("calibration_tokens", calibration_tokens), ("calibration_heldout", calibration_heldout)):
        _check_positive(name, value)
    contexts = sorted(set(contexts))
    if "perplexity" in metrics:
        if not contexts:
            raise OscarInputError("contexts: expected at least one context length")
        for c in contexts:
            _check_positive("contexts", c)
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
    longest = max([*(contexts if "perplexity" in metrics else []),
                   *([needle_context + 2 * needle_tokens] if "needle" in metrics else []),
                   *([attn_tokens] if "attention" in metrics else [])], default=0)
    if max_pos and longest > max_pos:
        raise OscarInputError(
            f"contexts/needle_context/attn_tokens need {longest} positions: expected at most the model's "
            f"max_position_embeddings={max_pos}"
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
                          calibration_tokens, calibration_heldout, match_clip)
    timings["methods_and_calibration"] = time.perf_counter() - t0
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

    windows, needle_control = {}, None
    if "perplexity" in metrics:
        t0 = time.perf_counter()
        for c in contexts:
            count = min(max(1, ppl_tokens // c), ids.shape[0] // c)
            if count == 0:
                raise OscarInputError(
                    f"contexts: {c} tokens but the evaluation part of {str(text)!r} has {ids.shape[0]}: "
                    f"expected a context length that fits"
                )
            windows[c] = [ids[i * c : (i + 1) * c] for i in range(count)]
        work = [(m, c, w) for m in specs for c in contexts for w in windows[c]]
        sums = {(m.name, c): [0.0, 0] for m in specs for c in contexts}
        for m, c, w in progress(work, f"perplexity ({len(work)} windows)"):
            cache = m.make(c)
            nll, count = window_nll(model, w, cache, chunk, first)
            sums[(m.name, c)][0] += nll
            sums[(m.name, c)][1] += count
            results[m.name]["bits_per_element_by_context"][str(c)] = stored_bits_per_element(cache)
        for m in specs:
            r = results[m.name]
            r["perplexity_by_context"] = {str(c): math.exp(sums[(m.name, c)][0] / sums[(m.name, c)][1]) for c in contexts}
            r["perplexity"] = sum(r["perplexity_by_context"].values()) / len(contexts)
        timings["perplexity"] = time.perf_counter() - t0

    if "attention" in metrics:
        t0 = time.perf_counter()
        if ids.shape[0] < attn_tokens:
            raise OscarInputError(f"attn_tokens={attn_tokens}: the evaluation text has only {ids.shape[0]} tokens")
        qkv = collect_qkv(model, ids[None, :attn_tokens])
        for m in progress(specs, "attention error"):
            errors = attention_errors(qkv, m.make, decode_tokens)
            results[m.name]["attention_error_by_layer"] = errors
            results[m.name]["attention_error"] = sum(errors) / len(errors)
            if "perplexity" not in metrics:
                cache = m.make(attn_tokens)
                for layer in range(layers):
                    q, k, v = qkv[layer]
                    cache.attend(layer, q, k, v)
                results[m.name]["bits_per_element_by_context"][str(attn_tokens)] = stored_bits_per_element(cache)
        timings["attention"] = time.perf_counter() - t0

    if "needle" in metrics:
        t0 = time.perf_counter()
        cases = needle_cases(ids, needle_context, needle_tokens, needle_prefix, needle_depths, needle_seeds)
        acc = {(m.name, d): [] for m in specs for d in needle_depths}
        work = [(m, case) for m in specs for case in cases]
        for m, case in progress(work, f"needle retrieval ({len(work)} runs)"):
            cache = m.make(case.ids.shape[0])
            acc[(m.name, case.depth)].append(needle_accuracy(model, case, cache, chunk, first))
            if not results[m.name]["bits_per_element_by_context"]:
                results[m.name]["bits_per_element_by_context"][str(case.ids.shape[0])] = stored_bits_per_element(cache)
        control = [
            needle_accuracy(model, case, Fp16Cache(layers, kv_heads, head_dim, case.ids.shape[0]), chunk, first)
            for case in needle_cases(ids, needle_context, needle_tokens, needle_prefix, (), needle_seeds, True)
        ]
        needle_control = sum(control) / len(control)
        for m in specs:
            by_depth = {str(d): sum(acc[(m.name, d)]) / len(acc[(m.name, d)]) for d in needle_depths}
            results[m.name]["needle_by_depth"] = by_depth
            results[m.name]["needle_accuracy"] = sum(by_depth.values()) / len(by_depth)
        timings["needle"] = time.perf_counter() - t0

    for m in specs:
        by_ctx = results[m.name]["bits_per_element_by_context"]
        if by_ctx:
            results[m.name]["bits_per_element"] = by_ctx[max(by_ctx, key=int)]
    timings["total"] = time.perf_counter() - started
    return {
        "model": str(model_name_or_path),
        "bits": config.k_bits if config.k_bits == config.v_bits else f"K{config.k_bits}/V{config.v_bits}",
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
            "windows_per_context": {str(c): len(w) for c, w in windows.items()},
            "chunk": chunk,
            "prefill": first,
            "attn_tokens": attn_tokens,
            "decode_tokens": decode_tokens,
            "needle_context": needle_context,
            "needle_tokens": needle_tokens,
            "needle_prefix": needle_prefix,
            "needle_depths": list(needle_depths),
            "needle_seeds": needle_seeds,
            "match_clip": match_clip,
        },
        "methods": results,
        # fp16 accuracy on the needle's tokens when the haystack does not contain it: what is not retrieval
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
        console.print(f"needle control (fp16, needle not in the haystack): {result['needle_control_accuracy']:.3f} "
                      "accuracy; only the excess over it is retrieval")
    for name, r in result["methods"].items():
        for note in r["notes"]:
            console.print(f"[yellow]note ({name}):[/yellow] {note}")


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
    fig.suptitle(f"{result['model']}: {result['bits']}-bit KV cache, sink {result['config']['sink']}, "
                 f"recent {result['config']['recent']}, cluster_dim {result['config']['cluster_dim']}")
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise OscarInputError(f"plot file {str(path)!r}: cannot write ({err.strerror}): expected a writable path") from None
    return path

"""The caches evaluated against each other: fp16, KIVI, and the OSCAR cache as eval drives it (also online)."""

from __future__ import annotations


import torch

from ..cache import OscarKVCache, causal_gqa_attention
from ..sizes import bits_per_element as oscar_bits_per_element
from ..calibration.fit import online_rotations
from ..codec import Quantized, check_finite, dequantize, quantize
from ..config import OscarConfig, OscarInputError
from .one_pass import SequenceKV


WINDOW_DTYPE = torch.float16
FP16_MAX = torch.finfo(torch.float16).max


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


def bits_at(cache, context: int) -> float:
    """Bits per K/V element `cache`'s format stores once `context` tokens are cached (the layout formulas;
    tests hold them to the bytes the caches really allocate)."""
    if isinstance(cache, OscarKVCache):
        return oscar_bits_per_element(cache.config, cache.head_dim, context)
    if isinstance(cache, KiviCache):
        return kivi_bits_per_element(cache.config, cache.head_dim, context)
    return 8.0 * cache.k.element_size()

"""Reference OSCAR KV cache (sink + packed body + recent ring) and reference attention.

This is the ground truth for every backend: plain PyTorch, attention in fp32.
Layout and eviction rules are specified in docs/format.md.
"""

from __future__ import annotations

import math

import torch

from .codec import check_feedback, check_finite, check_levels, dequantize, quantize, torch_scale_dtype
from .config import OscarConfig, OscarInputError
from .sizes import KINDS, capacities, packed_bytes

WINDOW_DTYPE = torch.float16
FP16_MAX = torch.finfo(torch.float16).max


def buffer_layout(config: OscarConfig, layers: int, kv_heads: int, head_dim: int,
                  max_context: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every buffer of a cache: {k,v}_{sink,recent,scale,zero} [layers, kv_heads, slots,
    ...] and the packed codes, one tensor per layer (its own width): {k,v}_codes{i}, or {k,v}_codes for one layer."""
    sink, recent, body = capacities(config, max_context)
    groups, sdt = head_dim // config.cluster_dim, torch_scale_dtype(config.scale_dtype)
    layout = {}
    for kind in KINDS:
        layout[f"{kind}_sink"] = ((layers, kv_heads, sink, head_dim), WINDOW_DTYPE)
        layout[f"{kind}_recent"] = ((layers, kv_heads, recent, head_dim), WINDOW_DTYPE)
        for i, c in enumerate(config.layers(layers)):
            name = f"{kind}_codes" if layers == 1 else f"{kind}_codes{i}"
            layout[name] = ((kv_heads, body, packed_bytes(head_dim, c.bits(kind))), torch.uint8)
        layout[f"{kind}_scale"] = ((layers, kv_heads, body, groups), sdt)
        layout[f"{kind}_zero"] = ((layers, kv_heads, body, groups), sdt)
    return layout


def causal_gqa_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n0: int, scaling: float
) -> torch.Tensor:
    """q [Hq, T, D] at positions n0..n0+T-1 over keys/values [Hkv, n0+T, D]: fp32, grouped-query, causal."""
    group = q.shape[0] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
    t = q.shape[1]
    scores = (q.to(torch.float32) @ keys.transpose(-1, -2)) * scaling
    key_pos = torch.arange(n0 + t, device=q.device)
    query_pos = torch.arange(n0, n0 + t, device=q.device)
    scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], -math.inf)
    return torch.softmax(scores, dim=-1) @ values


def check_rotation(name: str, rot: torch.Tensor | None, layers: int, kv_heads: int, head_dim: int):
    if rot is None:
        return None
    rot = torch.as_tensor(rot, dtype=torch.float32)
    ok = rot.shape in ((layers, head_dim, head_dim), (layers, kv_heads, head_dim, head_dim))
    if not ok:
        raise OscarInputError(
            f"{name} has shape {tuple(rot.shape)}: expected ({layers}, {head_dim}, {head_dim}) per layer "
            f"or ({layers}, {kv_heads}, {head_dim}, {head_dim}) per KV head"
        )
    check_finite(name, rot)
    if rot.dim() == 3:
        rot = rot.unsqueeze(1).expand(layers, kv_heads, head_dim, head_dim)
    return rot.contiguous()


class OscarKVCache:
    """Packed KV cache for one sequence, all layers; K and V are stored rotated.

    Per (layer, KV head) every region is one contiguous block, so a decode kernel
    reads sink, body codes, body scales/zeros and the recent ring linearly.
    """

    def __init__(
        self,
        config: OscarConfig,
        layers: int,
        kv_heads: int,
        head_dim: int,
        max_context: int,
        k_rotation: torch.Tensor | None = None,
        v_rotation: torch.Tensor | None = None,
        k_levels: torch.Tensor | None = None,
        v_levels: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        k_feedback: torch.Tensor | None = None,
        storage: dict[str, torch.Tensor] | None = None,
    ):
        config.check_head_dim(head_dim)
        for name, value in (("layers", layers), ("kv_heads", kv_heads), ("max_context", max_context)):
            if not isinstance(value, int) or value <= 0:
                raise OscarInputError(f"{name}={value!r}: expected a positive integer")
        self.layer_configs = config.layers(layers)
        self.config, self.layers, self.kv_heads, self.head_dim = config, layers, kv_heads, head_dim
        self.max_context, self.device = max_context, torch.device(device)
        self.rotation = {
            kind: None if rot is None else rot.to(self.device)
            for kind, rot in (
                ("k", check_rotation("k_rotation", k_rotation, layers, kv_heads, head_dim)),
                ("v", check_rotation("v_rotation", v_rotation, layers, kv_heads, head_dim)),
            )
        }
        self.levels = {}
        for kind, given in (("k", k_levels), ("v", v_levels)):
            if config.codebook == "uniform":
                if given is not None:
                    raise OscarInputError(f"{kind}_levels given but codebook='uniform': expected None")
                self.levels[kind] = [None] * layers
            else:
                bits = config.bits(kind)  # a Lloyd-Max config has one width (OscarConfig checks)
                if given is None or len(given) != layers:
                    raise OscarInputError(f"{kind}_levels: expected {layers} Lloyd-Max codebooks of {2**bits} levels")
                self.levels[kind] = [check_levels(lv, bits, f"{kind}_levels[{i}]") for i, lv in enumerate(given)]

        # K's error-feedback weights per layer and KV head, exactly when the config rounds K with feedback.
        self.feedback = None
        if (config.k_rounding == "feedback") != (k_feedback is not None):
            raise OscarInputError(f"k_feedback {'absent' if k_feedback is None else 'given'} but "
                                  f"k_rounding={config.k_rounding!r}: expected k_feedback exactly with 'feedback'")
        if k_feedback is not None:
            k_feedback = check_feedback(k_feedback, head_dim)
            if k_feedback.shape != (layers, kv_heads, head_dim, head_dim):
                raise OscarInputError(f"k_feedback has shape {tuple(k_feedback.shape)}: expected "
                                      f"({layers}, {kv_heads}, {head_dim}, {head_dim})")
            self.feedback = k_feedback.to(self.device)

        layout = buffer_layout(config, layers, kv_heads, head_dim, max_context)
        if storage is None:
            storage = {name: torch.zeros(shape, dtype=dtype, device=self.device)
                       for name, (shape, dtype) in layout.items()}
        else:  # the caller's buffers, adopted as they are (writes reach them): the exported op's in-place cache
            for name, (shape, dtype) in layout.items():
                given = storage.get(name)
                if not isinstance(given, torch.Tensor) or given.shape != shape or given.dtype != dtype:
                    found = "nothing" if not isinstance(given, torch.Tensor) else f"{given.dtype} {tuple(given.shape)}"
                    raise OscarInputError(f"{name} is {found}: expected {dtype} {tuple(shape)}")
        self.sink = {kind: storage[f"{kind}_sink"] for kind in KINDS}
        self.recent = {kind: storage[f"{kind}_recent"] for kind in KINDS}
        # One tensor per layer: a layer's code width is its own (k_bits_by_layer).
        self.codes = {kind: [storage[f"{kind}_codes"] if layers == 1 else storage[f"{kind}_codes{i}"]
                             for i in range(layers)] for kind in KINDS}
        self.scale = {kind: storage[f"{kind}_scale"] for kind in KINDS}
        self.zero = {kind: storage[f"{kind}_zero"] for kind in KINDS}
        self.length = [0] * layers

    @property
    def nbytes(self) -> int:
        regions = (self.sink, self.recent, self.scale, self.zero)
        codes = [t for per_layer in self.codes.values() for t in per_layer]
        tensors = [t for region in regions for t in region.values()] + codes
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- rotation -------------------------------------------------------------------------
    def _rotation_per_head(self, kind: str, layer: int, heads: int) -> torch.Tensor | None:
        rot = self.rotation[kind]
        if rot is None:
            return None
        return rot[layer].repeat_interleave(heads // self.kv_heads, dim=0)

    def rotate(self, kind: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [heads, T, D] -> x @ R in fp32; query heads use the K rotation of their KV head."""
        rot = self._rotation_per_head(kind, layer, x.shape[0])
        x = x.to(self.device, torch.float32)
        return x if rot is None else x @ rot

    def set_rotation(self, layer: int, k_rotation: torch.Tensor, v_rotation: torch.Tensor) -> None:
        """Replace one layer's rotations ([D, D] or [kv_heads, D, D]) before it caches any token (online mode)."""
        if self.length[layer]:
            raise OscarInputError(f"layer {layer} already holds {self.length[layer]} tokens: rotations are frozen")
        eye = torch.eye(self.head_dim, device=self.device).expand(self.layers, self.kv_heads, self.head_dim, self.head_dim)
        for kind, rot in (("k", k_rotation), ("v", v_rotation)):
            if self.rotation[kind] is None:
                self.rotation[kind] = eye.clone()
            self.rotation[kind][layer] = rot.to(self.device)

    def unrotate_values(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        rot = self._rotation_per_head("v", layer, out.shape[0])
        return out if rot is None else out @ rot.transpose(-1, -2)

    # -- storage --------------------------------------------------------------------------
    def _check_chunk(self, layer: int, name: str, x: torch.Tensor, heads: int) -> None:
        if not 0 <= layer < self.layers:
            raise OscarInputError(f"layer={layer}: expected 0 <= layer < {self.layers}")
        if x.dim() != 3 or x.shape[0] != heads or x.shape[2] != self.head_dim:
            raise OscarInputError(
                f"{name} has shape {tuple(x.shape)}: expected ({heads}, tokens, {self.head_dim})"
            )
        check_finite(name, x)

    def _to_window(self, name: str, x_rot: torch.Tensor) -> torch.Tensor:
        if bool((x_rot.abs() > FP16_MAX).any()):
            raise OscarInputError(f"rotated {name} exceeds the fp16 window range ({FP16_MAX:g}): expected smaller values")
        return x_rot.to(WINDOW_DTYPE)

    def feedback_for(self, kind: str, layer: int) -> torch.Tensor | None:
        """K's error-feedback weights of a layer, [kv_heads, 1, D, D] to broadcast over tokens; None for V and for
        nearest rounding."""
        return self.feedback[layer][:, None] if kind == "k" and self.feedback is not None else None

    def _quantize_into_body(self, kind: str, layer: int, first: int, values: torch.Tensor, quantizer=quantize) -> None:
        cfg = self.layer_configs[layer]
        feedback = self.feedback_for(kind, layer)
        q = quantizer(
            values.to(torch.float32),
            cfg.bits(kind),
            cfg.cluster_dim,
            cfg.clip(kind),
            self.levels[kind][layer],
            cfg.scale_dtype,
            **({} if feedback is None else {"feedback": feedback}),
        )
        end = first + values.shape[1]
        self.codes[kind][layer][:, first:end] = q.codes
        self.scale[kind][layer, :, first:end] = q.scale
        self.zero[kind][layer, :, first:end] = q.zero

    def _rotated_chunks(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """Validate a K/V chunk and return it rotated and rounded to fp16, as every region stores it."""
        for name, x in (("k", k), ("v", v)):
            self._check_chunk(layer, name, x, self.kv_heads)
        if k.shape[1] != v.shape[1]:
            raise OscarInputError(f"k has {k.shape[1]} tokens but v has {v.shape[1]}: expected the same count")
        n0, t = self.length[layer], k.shape[1]
        if n0 + t > self.max_context:
            raise OscarInputError(f"cache capacity exceeded: {n0} + {t} tokens > max_context={self.max_context}")
        return {kind: self._to_window(kind, self.rotate(kind, layer, x)) for kind, x in (("k", k), ("v", v))}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store post-RoPE k, v [kv_heads, T, head_dim] at positions length..length+T-1."""
        self._store(layer, self._rotated_chunks(layer, k, v))

    def _store(self, layer: int, chunks: dict[str, torch.Tensor], quantizer=quantize) -> None:
        """The placement rule; `quantizer` (codec.quantize or a bit-exact kernel) fills the body."""
        n0 = self.length[layer]
        n1 = n0 + chunks["k"].shape[1]
        s, w = self.config.sink, self.config.recent
        for kind, chunk in chunks.items():
            # Sink: positions < s.
            sink_end = min(s, n1)
            if n0 < sink_end:
                self.sink[kind][layer, :, n0:sink_end] = chunk[:, : sink_end - n0]
            # Body: positions that leave (or skip) the recent window, quantized from their fp16 value.
            body_from, body_to = max(s, n0 - w), max(s, n1 - w)
            if body_to > body_from:
                positions = torch.arange(body_from, body_to, device=self.device)
                from_ring = positions < n0
                values = torch.empty(
                    self.kv_heads, body_to - body_from, self.head_dim, dtype=WINDOW_DTYPE, device=self.device
                )
                if bool(from_ring.any()):
                    values[:, from_ring] = self.recent[kind][layer][:, (positions[from_ring] - s) % w]
                values[:, ~from_ring] = chunk[:, positions[~from_ring] - n0]
                self._quantize_into_body(kind, layer, body_from - s, values, quantizer)
            # Recent ring: the last w positions, slot (p - s) % w.
            ring_from = max(s, n1 - w, n0)
            if w and ring_from < n1:
                positions = torch.arange(ring_from, n1, device=self.device)
                self.recent[kind][layer][:, (positions - s) % w] = chunk[:, positions - n0]
        self.length[layer] = n1

    def stored(self, kind: str, layer: int) -> torch.Tensor:
        """Rotated K or V of the cached tokens in position order, fp32 [kv_heads, n, D]."""
        n = self.length[layer]
        s, w = self.config.sink, self.config.recent
        parts = [self.sink[kind][layer, :, : min(s, n)].to(torch.float32)]
        n_body = max(n - s - w, 0)
        if n_body:
            parts.append(
                dequantize(
                    self.codes[kind][layer][:, :n_body],
                    self.scale[kind][layer, :, :n_body],
                    self.zero[kind][layer, :, :n_body],
                    self.layer_configs[layer].bits(kind),
                    self.config.cluster_dim,
                    self.levels[kind][layer],
                )
            )
        ring_from = max(s, n - w)
        if ring_from < n:
            slots = (torch.arange(ring_from, n, device=self.device) - s) % w
            parts.append(self.recent[kind][layer][:, slots].to(torch.float32))
        return torch.cat(parts, dim=1)

    # -- attention ------------------------------------------------------------------------
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None = None
    ) -> torch.Tensor:
        """Causal GQA attention of a chunk, then append the chunk.

        q [q_heads, T, D], k/v [kv_heads, T, D] post-RoPE, at positions length..length+T-1.
        Queries see the cache as it was before the chunk plus the chunk's own K/V at fp16.
        Returns fp32 [q_heads, T, D] in the model's (unrotated) space.
        """
        chunks = self._rotated_chunks(layer, k, v)
        if q.dim() != 3 or q.shape[0] % self.kv_heads or q.shape[1:] != k.shape[1:]:
            raise OscarInputError(
                f"q has shape {tuple(q.shape)}: expected (q_heads, {k.shape[1]}, {self.head_dim}) "
                f"with q_heads a multiple of {self.kv_heads}"
            )
        check_finite("q", q)
        keys, values = (torch.cat([self.stored(kind, layer), chunks[kind].to(torch.float32)], dim=1) for kind in KINDS)
        scale = self.head_dim**-0.5 if scaling is None else scaling
        out = causal_gqa_attention(self.rotate("k", layer, q), keys, values, self.length[layer], scale)
        self._store(layer, chunks)
        return self.unrotate_values(layer, out)

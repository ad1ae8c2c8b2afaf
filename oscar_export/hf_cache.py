"""Hugging Face integration: OscarCache, a transformers Cache holding the real packed OSCAR cache.

`patch_model_for_kv_quant` switches a model's attention to the reference OSCAR attention, so
`model.generate()` stores K/V as packed codes (sink + recent windows + body) and attends over them.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .cache import OscarKVCache
from .calibration.fit import online_rotations
from .config import OscarConfig, OscarInputError, config_for
from .calibration.files import ROTATION_MODES
from .calibration.rotations import hadamard_rotations

ATTENTION_IMPLEMENTATION = "oscar"
BACKENDS = ("reference", "triton")


@dataclass
class OscarSettings:
    """What patch_model_for_kv_quant attached to a model."""

    config: OscarConfig
    rotations: str | object  # a mode from ROTATION_MODES or a RotationSet
    max_context: int | None
    backend: str = "reference"


def attention_shape(model) -> tuple[int, int, int, int]:
    """(layers, kv_heads, head_dim, q_heads) of a loaded Hugging Face causal LM (models.model_shape reads a
    checkpoint's config without loading it)."""
    cfg = model.config.get_text_config()
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads or heads, head_dim, heads


def check_backend(backend: str) -> None:
    """A known backend (every one runs every cache format); importing the Triton kernels fails early, with triton's
    own message, where triton is missing."""
    if backend not in BACKENDS:
        raise OscarInputError(f"backend={backend!r}: expected one of {BACKENDS}")
    if backend == "triton":
        from .kernels import triton_oscar  # noqa: F401


class OscarCacheLayer(CacheLayerMixin):
    """One layer's view of the shared packed cache. update() hands the new chunk to the attention."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "OscarCache", layer_idx: int):
        super().__init__()
        self.owner, self.layer_idx = owner, layer_idx
        self.pending = False

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise OscarInputError(f"batch size {key_states.shape[0]}: OscarCache holds one sequence (batch size 1)")
        self.is_initialized = True
        self.pending = True  # the OSCAR attention consumes this chunk and stores it
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.kv.length[self.layer_idx]

    def get_max_length(self) -> int:
        return self.owner.kv.max_context

    def reset(self) -> None:
        raise OscarInputError("OscarCache cannot be reset: create a new OscarCache for a new sequence")


class OscarCache(Cache):
    """A transformers Cache whose storage is the packed OSCAR cache of one sequence.

    Create it for a patched model (or pass config/rotations yourself); it attaches itself to
    the model's attention layers, so one OscarCache is live per model at a time.
    """

    def __init__(
        self,
        model,
        max_context: int | None = None,
        config: OscarConfig | None = None,
        rotations=None,
        backend: str | None = None,
    ):
        settings: OscarSettings | None = getattr(model, "oscar", None)
        if settings is None and config is None:
            raise OscarInputError("OscarCache: the model is not patched; call patch_model_for_kv_quant(model) first")
        config = config or settings.config
        rotations = rotations if rotations is not None else (settings.rotations if settings else "none")
        max_context = max_context or (settings.max_context if settings else None)
        self.backend = backend or (settings.backend if settings else "reference")
        check_backend(self.backend)
        if self.backend == "triton":
            from .kernels import triton_oscar

            self._triton = triton_oscar
        layers, kv_heads, head_dim, _ = attention_shape(model)
        if not max_context:
            max_context = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 4096
        k_rot = v_rot = k_levels = v_levels = k_feedback = None
        self.online = rotations == "online"
        self.observer = None  # called as observer(layer, q, k, v, scaling, out) after every attention (parity)
        if rotations == "hadamard":
            k_rot = v_rot = hadamard_rotations(layers, head_dim)
        elif rotations not in ROTATION_MODES:
            k_rot, v_rot = rotations.k, rotations.v
            k_levels, v_levels = rotations.k_levels, rotations.v_levels
            if config.codebook == "uniform":
                k_levels = v_levels = None
            if config.k_rounding == "feedback":
                k_feedback = rotations.k_feedback
        if config.k_rounding == "feedback" and k_feedback is None:
            given = f"rotations={rotations!r}" if isinstance(rotations, str) else "a rotation set without k_feedback"
            raise OscarInputError("k_rounding='feedback' needs K's feedback weights: expected a rotation file from "
                                  f"oscar-export calibrate, not {given}")
        self.kv = OscarKVCache(
            config, layers, kv_heads, head_dim, max_context, k_rot, v_rot, k_levels, v_levels, device=model.device,
            k_feedback=k_feedback,
        )
        super().__init__(layers=[OscarCacheLayer(self, i) for i in range(layers)])
        _set_target(model, self)

    @property
    def nbytes(self) -> int:
        """Bytes the packed cache really allocates (windows, codes, scales and zeros)."""
        return self.kv.nbytes

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling) -> torch.Tensor:
        if self.online and self.kv.length[layer] == 0:
            # Online mode: the prompt's own Q/K/V estimate this layer's rotations, then they are frozen.
            self.kv.set_rotation(layer, *online_rotations(q, k, v))
        if self.backend == "triton" and q.shape[1] == 1:
            # The Triton quantize kernel rounds to the nearest level; feedback rounding appends through the reference.
            append = "triton" if self.kv.config.k_rounding == "nearest" else "reference"
            out = self._triton.triton_decode_attend(self.kv, layer, q, k, v, scaling, append=append)
        else:
            out = self.kv.attend(layer, q, k, v, scaling)
        if self.observer is not None:
            self.observer(layer, q, k, v, scaling, out)
        return out


def _set_target(model, target) -> None:
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "head_dim"):
            module.oscar_target = target


def _oscar_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    target = getattr(module, "oscar_target", None)
    if isinstance(target, OscarCache):
        layer = target.layers[module.layer_idx]
        target = target if layer.pending else None
        layer.pending = False
    if target is None:
        # A forward without an OscarCache (use_cache=False): plain attention.
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[0] != 1:
        raise OscarInputError(f"batch size {query.shape[0]}: the OSCAR cache holds one sequence (batch size 1)")
    out = target.attend(module.layer_idx, query[0].float(), key[0].float(), value[0].float(), scaling)
    # transformers expects [batch, tokens, heads, head_dim]
    return out.to(query.dtype).transpose(0, 1).unsqueeze(0).contiguous(), None


AttentionInterface.register(ATTENTION_IMPLEMENTATION, _oscar_attention)


@contextmanager
def route_attention(model, target):
    """Within the block, every attention layer of `model` calls target.attend(layer, q, k, v, scaling).

    For forwards without a transformers cache (use_cache=False); pass position_ids explicitly
    when feeding a sequence in chunks. `target` is any object with that attend method:
    an OscarKVCache, or a baseline cache used by the evaluation.
    """
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    _set_target(model, target)
    try:
        yield target
    finally:
        _set_target(model, None)
        model.set_attn_implementation(previous)


def resolve_rotations(rotations, model):
    if rotations is None:
        return "none"
    if isinstance(rotations, str) and rotations in ROTATION_MODES:
        return rotations
    if isinstance(rotations, (str, Path)):
        from .calibration.files import load_rotations

        layers, kv_heads, head_dim, _ = attention_shape(model)
        return load_rotations(rotations, layers=layers, head_dim=head_dim, kv_heads=kv_heads)
    return rotations  # a RotationSet


def patch_model_for_kv_quant(
    model,
    config: OscarConfig | None = None,
    rotations="online",
    backend: str = "reference",
    max_context: int | None = None,
):
    """Make `model.generate()` keep its KV cache as packed OSCAR codes.

    config: the cache format, used as given; None: the defaults completed by a rotation file's metadata (its clip
    ratios, codebook and K rounding, or the whole format a budget search chose), the group sized for the model's
    head_dim. rotations: "online" (estimated from each prompt, no calibration file), "hadamard" (data-free),
    "none", a rotation file path, or a RotationSet. backend="triton" decodes with the Triton kernels (CUDA, or
    the interpreter with TRITON_INTERPRET=1).
    """
    if backend not in BACKENDS:
        raise OscarInputError(f"backend={backend!r}: expected one of {BACKENDS}")
    if config is not None and not isinstance(config, OscarConfig):
        raise TypeError(f"config is {type(config).__name__}: expected an OscarConfig or None")
    resolved = resolve_rotations(rotations, model)
    head_dim = attention_shape(model)[2]
    cfg = config or config_for({} if resolved in ROTATION_MODES else resolved.metadata, head_dim)
    cfg.check_head_dim(head_dim)
    check_backend(backend)
    model.oscar = OscarSettings(cfg, resolved, max_context, backend)
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    if not hasattr(model, "_generate_without_oscar"):
        model._generate_without_oscar = model.generate

        @functools.wraps(model._generate_without_oscar)
        def generate(*args, **kwargs):
            if kwargs.get("cache") is None and kwargs.get("past_key_values") is None:
                ids = kwargs.get("input_ids", args[0] if args else None)
                new = kwargs.get("max_new_tokens") or model.generation_config.max_new_tokens or 20
                length = model.oscar.max_context or (ids.shape[-1] + new if ids is not None else None)
                kwargs["cache"] = OscarCache(model, max_context=length)
            return model._generate_without_oscar(*args, **kwargs)

        model.generate = generate
    return model

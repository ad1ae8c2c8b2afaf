"""The exportable graph: a Hugging Face causal LM as one module over the packed OSCAR cache.

OscarCausalLM.forward(input_ids [1, T], length int64[1], *cache) runs a chunk of T tokens at
positions length .. length+T-1 (a prefill chunk, or T = 1 for a decode step) and returns the
logits. Attention is one custom op per layer, `oscar::attention` (ops/attention.py), whose reference
kernel is the normative math, so eager runs of this module are the reference.

K is rotated after RoPE by a plain matmul on q and k; the V rotation is folded into v_proj and
R_v^T into o_proj, so values cost nothing extra at run time.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from ..cache import check_rotation
from ..codec import uniform_levels
from ..sizes import CACHE_NAMES, KINDS, SCALE_BUFFER_DTYPES, cache_layout
from ..config import OscarConfig, OscarInputError
from ..hf_cache import attention_shape, resolve_rotations
from ..models import FAMILIES
from ..ops.attention import op_attributes
from ..calibration.rotations import hadamard_rotations


def _fold_v(v_proj: nn.Linear, rot: torch.Tensor) -> nn.Linear:
    """v_proj whose output per KV head h is v_h @ R_h: weight rows of head h become R_h^T W_h."""
    heads, d, _ = rot.shape
    w = v_proj.weight.detach().double().reshape(heads, d, -1)
    rot = rot.to(w.device)
    folded = nn.Linear(v_proj.in_features, v_proj.out_features, bias=v_proj.bias is not None, device=w.device)
    folded.weight.data = (rot.double().transpose(1, 2) @ w).reshape_as(v_proj.weight).to(v_proj.weight.dtype)
    if v_proj.bias is not None:
        b = v_proj.bias.detach().double().reshape(heads, 1, d)
        folded.bias.data = (b @ rot.double()).reshape_as(v_proj.bias).to(v_proj.bias.dtype)
    return folded


def _fold_o(o_proj: nn.Linear, rot_per_q_head: torch.Tensor) -> nn.Linear:
    """o_proj reading rotated attention outputs: columns of query head h become W_h @ R_v(h)."""
    heads, d, _ = rot_per_q_head.shape
    # One [out, d] x [d, d] product per head, not out x heads tiny ones: 12 s a layer less at Llama-3-8B's shape.
    w = o_proj.weight.detach().double().reshape(o_proj.out_features, heads, d).transpose(0, 1)
    folded = nn.Linear(o_proj.in_features, o_proj.out_features, bias=o_proj.bias is not None, device=w.device)
    product = w @ rot_per_q_head.to(w.device).double()
    folded.weight.data = product.transpose(0, 1).reshape_as(o_proj.weight).to(o_proj.weight.dtype)
    if o_proj.bias is not None:
        folded.bias.data = o_proj.bias.detach().clone()
    return folded


class OscarDecoderLayer(nn.Module):
    """One decoder block; its attention goes through oscar::attention over this layer's buffers."""

    def __init__(self, block, config: OscarConfig, k_rot, v_rot, k_levels, v_levels, k_feedback=None):
        super().__init__()
        attn = block.self_attn
        self.head_dim = attn.head_dim
        self.input_layernorm, self.post_attention_layernorm = block.input_layernorm, block.post_attention_layernorm
        self.mlp, self.q_proj, self.k_proj = block.mlp, attn.q_proj, attn.k_proj
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3
        self.v_proj, self.o_proj = attn.v_proj, attn.o_proj
        self.group = group = attn.q_proj.out_features // attn.k_proj.out_features
        self.rotated = k_rot is not None
        if self.rotated:
            self.register_buffer("k_rot", k_rot.clone())
            self.v_proj = _fold_v(attn.v_proj, v_rot)
            self.o_proj = _fold_o(attn.o_proj, v_rot.repeat_interleave(group, dim=0))
        self.register_buffer("k_levels", k_levels.clone())
        self.register_buffer("v_levels", v_levels.clone())
        # K's error-feedback weights [kv_heads, D, D]; empty for nearest rounding (the op reads it so).
        self.register_buffer("k_feedback", torch.zeros(0) if k_feedback is None else k_feedback.clone())
        self.scaling = float(attn.scaling)
        self.attrs = tuple(op_attributes(config, self.scaling).values())

    def forward(self, h, cos, sin, length, cache, functional: bool):
        t = h.shape[1]
        x = self.input_layernorm(h)
        q = self.q_proj(x).view(1, t, -1, self.head_dim)
        k = self.k_proj(x).view(1, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(1, t, -1, self.head_dim).transpose(1, 2)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        q, k, v = q[0], k[0], v[0]
        if self.rotated:
            # Query heads use the K rotation of their KV head (OscarKVCache.rotate); a KV head's
            # query heads are contiguous, so the rotation broadcasts over them.
            q = (q.unflatten(0, (-1, self.group)) @ self.k_rot[:, None]).flatten(0, 1)
            k = k @ self.k_rot
        out, cache = self.attend(q, k, v, length, cache, functional)
        h = h + self.o_proj(out.transpose(0, 1).reshape(1, t, -1))
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, cache

    def attend(self, q, k, v, length, cache, functional):
        """Attention of q [Hq, T, D] over the cache with k, v [Hkv, T, D] appended at `length`:
        (out [Hq, T, D], the updated buffers in functional mode, else [])"""
        args = (q, k.half(), v.half(), *cache, self.k_levels, self.v_levels, self.k_feedback, length, *self.attrs)
        if functional:
            out, *cache = torch.ops.oscar.attention_functional(*args)
            return out, cache
        return torch.ops.oscar.attention(*args), []


class OscarCausalLM(nn.Module):
    """forward(input_ids [1, T], length int64[1], *cache) -> logits [1, 1, vocab] of the last position.

    cache: for each layer the ten buffers of CACHE_NAMES (new_cache() allocates them). Default
    mode updates them in place. functional=True leaves them untouched and returns
    (logits, *updated buffers) instead: the form ONNX export uses. all_logits=True returns
    [1, T, vocab].
    """

    layer_class = OscarDecoderLayer  # a benchmark's subclass swaps the attention, keeping the rest of the graph

    def __init__(self, model, config: OscarConfig, rotations="hadamard", functional: bool = False,
                 all_logits: bool = False):
        super().__init__()
        family = model.config.get_text_config().model_type
        if family not in FAMILIES:
            raise OscarInputError(f"model_type={family!r}: expected one of {tuple(FAMILIES)}")
        if isinstance(rotations, str) and rotations == "online":
            raise OscarInputError("rotations='online' estimates rotations from each prompt and cannot be exported: "
                                  "expected 'hadamard', 'none' or a rotation file (oscar-export calibrate)")
        if config.scale_dtype not in SCALE_BUFFER_DTYPES:
            raise OscarInputError(f"scale_dtype={config.scale_dtype!r}: expected one of {tuple(SCALE_BUFFER_DTYPES)}, "
                                  "the scale formats the exported op stores")
        layers, kv_heads, head_dim, _ = attention_shape(model)
        config.check_head_dim(head_dim)
        config.check_layers(layers)
        self.config, self.kv_heads, self.head_dim = config, kv_heads, head_dim
        self.functional, self.all_logits = functional, all_logits

        resolved = resolve_rotations(rotations, model)
        k_rot = v_rot = None
        if resolved == "hadamard":
            k_rot = v_rot = hadamard_rotations(layers, head_dim)
        elif resolved != "none":
            k_rot, v_rot = resolved.k, resolved.v
        # Per layer: with k_bits_by_layer, K's levels differ in count between layers.
        levels = {kind: [uniform_levels(c.bits(kind)) for c in config.layers(layers)] for kind in KINDS}
        if config.codebook == "lloyd-max":
            if getattr(resolved, "k_levels", None) is None:
                raise OscarInputError("codebook='lloyd-max' needs Lloyd-Max levels: expected a rotation file "
                                      "calibrated with --lloyd-max")
            levels = {"k": resolved.k_levels, "v": resolved.v_levels}
            for kind, lv in levels.items():
                if lv.shape[-1] != 2 ** config.bits(kind):
                    raise OscarInputError(f"{kind}_levels have {lv.shape[-1]} levels: expected "
                                          f"{2 ** config.bits(kind)} for {kind}_bits={config.bits(kind)}")
        k_rot = check_rotation("k_rotation", k_rot, layers, kv_heads, head_dim)
        v_rot = check_rotation("v_rotation", v_rot, layers, kv_heads, head_dim)
        feedback = None
        if config.k_rounding == "feedback":
            feedback = getattr(resolved, "k_feedback", None)
            if feedback is None:
                given = f"rotations={resolved!r}" if isinstance(resolved, str) else "one without k_feedback"
                raise OscarInputError(f"k_rounding='feedback' needs K's feedback weights: expected a rotation file "
                                      f"from oscar-export calibrate, not {given}")
            if tuple(feedback.shape) != (layers, kv_heads, head_dim, head_dim):
                raise OscarInputError(f"k_feedback has shape {tuple(feedback.shape)}: expected "
                                      f"({layers}, {kv_heads}, {head_dim}, {head_dim}) for this model")

        text = model.get_decoder()
        self.embed_tokens, self.norm, self.lm_head = text.embed_tokens, text.norm, model.lm_head
        self.register_buffer("inv_freq", text.rotary_emb.inv_freq.float().clone())
        self.rope_scaling = float(text.rotary_emb.attention_scaling)
        # Plain attributes: decoder_layer rebuilds a layer.
        self.rotations, self.levels, self.feedback = (k_rot, v_rot), levels, feedback
        self.layers = nn.ModuleList(self.decoder_layer(block, i) for i, block in enumerate(text.layers))

    def decoder_layer(self, block, i: int) -> OscarDecoderLayer:
        """Layer i of this graph made from a Hugging Face decoder block; a streamed export (export/streamed.py)
        calls it again with the block's real weights when the graph was built on the meta device."""
        k_rot, v_rot = self.rotations
        return self.layer_class(block, self.config.layer(i), None if k_rot is None else k_rot[i],
                                 None if v_rot is None else v_rot[i], self.levels["k"][i].float(),
                                 self.levels["v"][i].float(), None if self.feedback is None else self.feedback[i])

    def cache_spec(self, max_context: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype) of every cache buffer, layer by layer, in forward's order (sizes.cache_layout)."""
        return [(name, shape, getattr(torch, dtype)) for name, shape, dtype in
                cache_layout(self.config, len(self.layers), self.kv_heads, self.head_dim, max_context)]

    def new_cache(self, max_context: int) -> list[torch.Tensor]:
        """Zeroed buffers for a sequence of up to max_context tokens (only `length` tokens are ever read)."""
        return [torch.zeros(shape, dtype=dtype) for _, shape, dtype in self.cache_spec(max_context)]

    def forward(self, input_ids, length, *cache):
        t = input_ids.shape[1]
        # RoPE exactly as transformers computes it, at positions length .. length+T-1.
        freqs = (length + torch.arange(t, device=input_ids.device))[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        h = self.embed_tokens(input_ids)
        n = len(CACHE_NAMES)
        updated = []
        for i, layer in enumerate(self.layers):
            h, new = layer(h, cos, sin, length, cache[i * n:(i + 1) * n], self.functional)
            updated += new
        # Kept 3-D so lm_head exports as a MatMul, which the 4-bit weight quantizer handles.
        logits = self.lm_head(self.norm(h if self.all_logits else h[:, -1:]))
        return (logits, *updated) if self.functional else logits


@torch.no_grad()
def greedy(module: OscarCausalLM, ids: torch.Tensor, max_new_tokens: int, max_context: int) -> list[int]:
    """Greedy tokens from the module in eager mode (in-place cache): the reference for exported runtimes."""
    if module.functional:
        raise OscarInputError("greedy() updates the cache in place: expected a module with functional=False")
    cache, length = module.new_cache(max_context), torch.zeros(1, dtype=torch.int64)
    logits, tokens = module(ids, length, *cache), []
    length += ids.shape[1]
    for _ in range(max_new_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        if len(tokens) == max_new_tokens:
            break
        logits = module(torch.tensor([[tokens[-1]]]), length, *cache)
        length += 1
    return tokens

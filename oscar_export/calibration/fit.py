"""Fit OSCAR rotations, clip ratios and Lloyd-Max levels from a model's own activations.

Memory stays O(layers x D^2) whatever the token count: the K and V objectives are streamed
into D x D accumulators, and only one bounded held-out window is kept for the clip search.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .capture import capture_qkv, collect_qkv
from ..codec import dequantize, fit_lloyd_max_levels, normalized_codes, quantize
from ..config import OscarConfig, OscarInputError
from ..progress import progress
from .rotations import oscar_rotation

# Down to 0.5: both models here chose the bottom of a range that stopped at 0.8.
CLIP_CANDIDATES = (1.0, 0.98, 0.96, 0.94, 0.92, 0.90, 0.88, 0.85, 0.80, 0.75, 0.70, 0.65, 0.60, 0.55, 0.50)
# With error feedback the attention-output error keeps favouring harder K clips than retrieval can bear: on
# SmolLM2's validation split it picked 0.75, which gave 7.5 needle points less than 0.85 and no lower perplexity.
FEEDBACK_K_CLIP_FLOOR = 0.85


def query_covariance(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Per KV head, the sum of Q_g^T Q_g over the query heads sharing it: [kv_heads, D, D] (float64)."""
    heads, _, d = q.shape
    grouped = q.to(torch.float64).reshape(kv_heads, -1, d)  # query heads of KV head g are consecutive
    return grouped.transpose(1, 2) @ grouped


def value_weights(k: torch.Tensor, q_cov: torch.Tensor) -> torch.Tensor:
    """w[t] = k_t Sigma_Q k_t^T per KV head: how strongly the queries read token t. [kv_heads, T]."""
    k = k.to(torch.float64)
    return ((k @ q_cov) * k).sum(-1)


@dataclass
class ObjectiveAccumulators:
    """Streaming sums for one layer's K objective (query covariance) and V objective (score-weighted)."""

    kv_heads: int
    head_dim: int
    q_sum: torch.Tensor = field(init=False)
    q_count: int = 0
    v_sum: torch.Tensor = field(init=False)
    w_total: torch.Tensor = field(init=False)

    def __post_init__(self):
        shape = (self.kv_heads, self.head_dim, self.head_dim)
        self.q_sum = torch.zeros(shape, dtype=torch.float64)
        self.v_sum = torch.zeros(shape, dtype=torch.float64)
        self.w_total = torch.zeros(self.kv_heads, dtype=torch.float64)

    def add_queries(self, q: torch.Tensor) -> None:
        self.q_sum += query_covariance(q, self.kv_heads)
        self.q_count += q.shape[1] * (q.shape[0] // self.kv_heads)

    @property
    def q_cov(self) -> torch.Tensor:
        return self.q_sum / max(self.q_count, 1)

    def add_values(self, k: torch.Tensor, v: torch.Tensor) -> None:
        w = value_weights(k, self.q_cov)
        v = v.to(torch.float64)
        self.v_sum += (v * w.unsqueeze(-1)).transpose(1, 2) @ v
        self.w_total += w.sum(-1)

    @property
    def v_cov(self) -> torch.Tensor:
        # Weights normalised to mean 1: sum w v v^T / sum w.
        return self.v_sum / self.w_total.clamp(min=1e-30).view(-1, 1, 1)


def rotations_from(acc: list[ObjectiveAccumulators], per_head: bool) -> dict[str, torch.Tensor]:
    """R = U.H.P_br for K and V of every layer; per layer the KV-head covariances are averaged."""
    out: dict[str, list] = {"k": [], "v": [], "k_eig": [], "v_eig": []}
    for layer in acc:
        for kind, cov in (("k", layer.q_cov), ("v", layer.v_cov)):
            rot, eig = oscar_rotation(cov if per_head else cov.mean(0))
            out[kind].append(rot)
            out[f"{kind}_eig"].append(eig)
    return {name: torch.stack(items) for name, items in out.items()}


# Added to the query covariance before it is inverted, as a fraction of its mean diagonal: GPTQ's damping. It keeps
# the feedback weights near 1 in magnitude (directions no query reads would otherwise absorb any error).
FEEDBACK_DAMPING = 0.01


def feedback_weights(q_cov: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """K's error-feedback weights (codec.encode_feedback) per KV head, fp32 [kv_heads, D, D]: for the query
    covariance H in the rotated space (R^T Sigma_Q R, damped), U = the upper Cholesky factor of H^-1 and weight
    [i, j] = U[i, j] / U[i, i] for j > i, zero elsewhere. Rounding channel i then moves the later channels as the
    optimal-brain-surgeon update does (GPTQ, per vector), so the error q . (k - k_hat) that the queries see is
    smaller than that of rounding each element to its nearest level. q_cov [kv_heads, D, D]; rotation [D, D] or
    [kv_heads, D, D]."""
    r = _expand(rotation, q_cov.shape[0]).to(torch.float64)
    h = r.transpose(1, 2) @ q_cov.to(torch.float64) @ r
    d = h.shape[-1]
    damp = FEEDBACK_DAMPING * h.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-12)
    h = h + damp[:, None, None] * torch.eye(d, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    return torch.triu(u / u.diagonal(dim1=1, dim2=2).unsqueeze(-1), 1).to(torch.float32)


def online_rotations(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online mode: one layer's (R_k, R_v) [D, D] from a prompt's own q [Hq,T,D], k/v [Hkv,T,D]."""
    acc = ObjectiveAccumulators(k.shape[0], k.shape[-1])
    acc.add_queries(q.to(torch.float32))
    acc.add_values(k.to(torch.float32), v.to(torch.float32))
    rot = rotations_from([acc], per_head=False)
    return rot["k"][0], rot["v"][0]


def _expand(rot: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[D, D] or [kv_heads, D, D] -> [kv_heads, D, D]."""
    return rot.expand(kv_heads, *rot.shape[-2:]) if rot.dim() == 2 else rot


def _roundtrip(x_rot: torch.Tensor, bits: int, cluster_dim: int, clip: float, scale_dtype: str,
               feedback: torch.Tensor | None = None) -> torch.Tensor:
    """x_rot [kv_heads, T, D] through the codec; feedback [kv_heads, D, D]: K's error-feedback weights."""
    q = quantize(x_rot, bits, cluster_dim, clip, None, scale_dtype, None if feedback is None else feedback[:, None])
    return dequantize(*q, bits, cluster_dim)


def _attention(q, k, v):
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]


def clip_candidates(kind: str, k_rounding: str) -> tuple[float, ...]:
    """The clip ratios the search tries for `kind` ("k" or "v"): K with feedback rounding stops at the floor."""
    if kind == "k" and k_rounding == "feedback":
        return tuple(c for c in CLIP_CANDIDATES if c >= FEEDBACK_K_CLIP_FLOOR)
    return CLIP_CANDIDATES


def clip_errors(
    heldout: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    rotations: dict[str, torch.Tensor],
    config: OscarConfig,
    kind: str,
    candidates=CLIP_CANDIDATES,
    feedback: torch.Tensor | None = None,
) -> dict[float, float]:
    """Mean attention-output relative error over layers when only `kind` is quantized, per clip ratio. feedback
    ([layers, kv_heads, D, D]): K's codes chosen with error feedback, as config.k_rounding='feedback' stores them."""
    errors = {c: 0.0 for c in candidates}
    for layer, (q, k, v) in heldout.items():
        exact = _attention(q, k, v)
        x = k if kind == "k" else v
        rot = _expand(rotations[kind][layer], x.shape[0])
        x_rot = (x.to(torch.float32) @ rot).to(torch.float16).to(torch.float32)
        weights = feedback[layer] if feedback is not None and kind == "k" else None
        for clip in candidates:
            approx = _roundtrip(x_rot, config.bits(kind), config.cluster_dim, clip, config.scale_dtype, weights)
            back = approx @ rot.transpose(-1, -2)
            out = _attention(q, back, v) if kind == "k" else _attention(q, k, back)
            errors[clip] += float((out - exact).norm() / exact.norm()) / len(heldout)
    return errors


POSITIONS_LIMIT = 131072  # the widest span calibration windows are spread over


def calibration_positions(model) -> int:
    """The positions calibration windows are spread over: the model's context (max_position_embeddings; 4096
    when it has none), at most POSITIONS_LIMIT."""
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 4096
    return min(int(positions), POSITIONS_LIMIT)


def tokens_from_text(tokenizer, text: str, tokens: int, name: str) -> torch.Tensor:
    ids = tokenizer(text, verbose=False)["input_ids"]
    if len(ids) < tokens:
        raise OscarInputError(f"{name} has {len(ids)} tokens: expected at least {tokens} (calibration plus held-out "
                              f"tokens): give a longer text or fewer tokens")
    return torch.tensor(ids[:tokens])


def fit_rotations(
    model,
    tokenizer,
    text: str,
    tokens: int = 16384,
    heldout_tokens: int = 512,
    window: int = 512,
    per_head: bool = False,
    text_name: str = "calibration text",
    positions: int | None = None,
) -> dict:
    """The K and V rotations of `model` from the first `tokens` tokens of `text` (in windows of `window`
    tokens), and the next `heldout_tokens` tokens' captured Q/K/V for fit_quantizer. They do not depend on
    the cache format, so one fit serves every bit width.

    The windows sit at offsets spread evenly over [0, positions) (default: calibration_positions(model)), not
    all at position 0: post-RoPE queries and keys turn with their position, so covariances taken at the first
    few hundred positions describe a long context badly (on SmolLM2, K feedback weights fitted at positions
    0-511 put perplexity at 8K 25% over fp16; spread over 8K, 2%)."""
    if tokens <= 0 or heldout_tokens <= 0 or window <= 0:
        raise OscarInputError("tokens, heldout_tokens and window: expected positive token counts")
    ids = tokens_from_text(tokenizer, text, tokens + heldout_tokens, text_name)
    calib, heldout_ids = ids[:tokens], ids[tokens:]
    windows = [calib[i : i + window] for i in range(0, tokens, window)]
    layers = model.config.get_text_config().num_hidden_layers
    acc: list[ObjectiveAccumulators] = []

    positions = calibration_positions(model) if positions is None else positions
    span = max(positions - window, 0)
    offsets = [round(i * span / max(len(windows) - 1, 1)) for i in range(len(windows))]

    def stream(pass_name, add):
        for offset, chunk in progress(list(zip(offsets, windows)),
                                      f"calibration: {pass_name} ({len(windows)} windows x {layers} layers)"):
            with capture_qkv(model, add), torch.no_grad():
                model(input_ids=chunk[None], position_ids=(offset + torch.arange(len(chunk)))[None], use_cache=False)

    def add_queries(layer, q, k, v):
        if layer == len(acc):
            acc.append(ObjectiveAccumulators(k.shape[1], k.shape[-1]))
        acc[layer].add_queries(q[0])

    # Two passes: the V objective weights tokens by the final query covariance.
    stream("query covariance", add_queries)
    stream("score-weighted value covariance", lambda layer, q, k, v: acc[layer].add_values(k[0], v[0]))
    rotations = rotations_from(acc, per_head)
    feedback = torch.stack([feedback_weights(a.q_cov, rotations["k"][i]) for i, a in enumerate(acc)])
    return {"rotations": rotations, "k_feedback": feedback, "heldout": collect_qkv(model, heldout_ids[None]),
            "positions": positions,
            "kv_heads": acc[0].kv_heads, "head_dim": acc[0].head_dim, "layers": layers, "calibration_tokens": tokens}


def fit_quantizer(fitted: dict, config: OscarConfig, lloyd_max: bool = False) -> dict:
    """Clip ratios for `config`'s bits, group and K rounding, picked by attention-output error on the held-out
    tokens (the searched curve is kept), and Lloyd-Max levels when asked: the calibration's result."""
    config.check_head_dim(fitted["head_dim"])
    rot, heldout = fitted["rotations"], fitted["heldout"]
    feedback = fitted["k_feedback"] if config.k_rounding == "feedback" else None
    clips, curves = {}, {}
    for kind in progress(("k", "v"), "calibration: clip search"):
        curves[kind] = clip_errors(heldout, rot, config, kind, clip_candidates(kind, config.k_rounding), feedback)
        clips[kind] = min(curves[kind], key=curves[kind].get)
    result = {
        "k_rotation": rot["k"],
        "v_rotation": rot["v"],
        "k_feedback": fitted["k_feedback"],
        "k_eigenvalues": rot["k_eig"],
        "v_eigenvalues": rot["v_eig"],
        "k_clip": clips["k"],
        "v_clip": clips["v"],
        # the searched curve: mean attention-output relative error on the held-out tokens per clip ratio
        "k_clip_errors": curves["k"],
        "v_clip_errors": curves["v"],
        "kv_heads": fitted["kv_heads"],
        "head_dim": fitted["head_dim"],
        "layers": fitted["layers"],
    }
    if lloyd_max:
        for kind in ("k", "v"):
            bits = config.bits(kind)
            levels = []
            for layer, (q, k, v) in heldout.items():
                x = k if kind == "k" else v
                x_rot = (x @ _expand(rot[kind][layer], x.shape[0])).to(torch.float16).to(torch.float32)
                u = normalized_codes(x_rot, bits, config.cluster_dim, clips[kind], config.scale_dtype)
                levels.append(fit_lloyd_max_levels(u, bits))
            result[f"{kind}_levels"] = torch.stack(levels)
    return result


def calibrate(
    model,
    tokenizer,
    text: str,
    config: OscarConfig,
    tokens: int = 16384,
    heldout_tokens: int = 512,
    window: int = 512,
    per_head: bool = False,
    lloyd_max: bool = False,
    text_name: str = "calibration text",
) -> dict:
    """Rotations (and clip ratios, Lloyd-Max levels) for `model` from `tokens` tokens of `text`.

    The first `tokens` tokens feed the K and V objectives in windows of `window` tokens; the next
    `heldout_tokens` pick the clip ratios by attention-output error and fit Lloyd-Max levels.
    """
    fitted = fit_rotations(model, tokenizer, text, tokens, heldout_tokens, window, per_head, text_name)
    return fit_quantizer(fitted, config, lloyd_max)

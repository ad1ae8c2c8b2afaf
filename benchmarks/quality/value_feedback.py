"""Would V gain from error-feedback rounding as K does? A proxy measurement on SmolLM2-135M-Instruct.

    nice -n 10 .venv/bin/python -m benchmarks.quality.value_feedback --split validation     # about 2 minutes on 2 cores

K's feedback weights (calibrate.feedback_weights) come from the query covariance, the quadratic form the scores
read K's error through. V's error reaches the model through o_proj: for KV head g, an error e (rotated V space)
of a token moves the layer output by sum over g's query heads h of p_h W_o[:, h] R_v e, so the matching form is
R_v^T (sum_h W_o[:, h]^T W_o[:, h]) R_v, with the same damping and Cholesky update. Both are measured the way
calibration's clip search scores a format, on the split's held-out calibration tokens (2-bit, group 64, the
searched clips): K quantized alone, the attention-output relative error; V quantized alone, the relative error
after o_proj (the error V feedback minimizes). Each with nearest rounding and with feedback.

Results: benchmarks/results/quality/value_feedback_<split>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from oscar_export.calibration.fit import (
    FEEDBACK_DAMPING,
    _attention,
    _expand,
    _roundtrip,
    fit_quantizer,
    fit_rotations,
)
from oscar_export.config import OscarConfig

from benchmarks.common import CALIB_HELDOUT, CALIB_TOKENS, load_split, log

ROOT = Path(__file__).resolve().parents[2]


def feedback_from_form(h: torch.Tensor) -> torch.Tensor:
    """Feedback weights [kv_heads, D, D] for error forms h [kv_heads, D, D] in the rotated space, as
    calibrate.feedback_weights derives K's from the query covariance (which it rotates itself)."""
    d = h.shape[-1]
    damp = FEEDBACK_DAMPING * h.diagonal(dim1=1, dim2=2).mean(-1).clamp(min=1e-12)
    h = h + damp[:, None, None] * torch.eye(d, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    return torch.triu(u / u.diagonal(dim1=1, dim2=2).unsqueeze(-1), 1).to(torch.float32)


def output_form(o_proj: torch.Tensor, rotation: torch.Tensor, q_heads: int) -> torch.Tensor:
    """R_v^T (sum over a KV group's query heads of W_h^T W_h) R_v per KV head, fp64 [kv_heads, D, D]."""
    kv_heads, d = rotation.shape[0], rotation.shape[-1]
    w = o_proj.to(torch.float64).reshape(o_proj.shape[0], q_heads, d).transpose(0, 1)  # [q_heads, hidden, D]
    gram = (w.transpose(1, 2) @ w).reshape(kv_heads, q_heads // kv_heads, d, d).sum(1)
    r = rotation.to(torch.float64)
    return r.transpose(1, 2) @ gram @ r


def flat_heads(x: torch.Tensor) -> torch.Tensor:
    """[heads, T, D] -> [T, heads * D], o_proj's input layout."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", choices=("validation", "test"), default="validation")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quality")
    args = p.parse_args()
    model, tokenizer, calibration_text, *_ = load_split(args.split, needle=False)
    fitted = fit_rotations(model, tokenizer, calibration_text, CALIB_TOKENS, CALIB_HELDOUT, per_head=True)
    config = OscarConfig()
    clips = fit_quantizer(fitted, config)
    rot = fitted["rotations"]
    errors = {name: [] for name in ("k_nearest", "k_feedback", "v_nearest", "v_feedback")}
    for layer, (q, k, v) in fitted["heldout"].items():
        exact = _attention(q, k, v)
        o_proj = model.model.layers[layer].self_attn.o_proj.weight.detach()
        exact_out = flat_heads(exact).to(torch.float64) @ o_proj.to(torch.float64).T
        r_k, r_v = _expand(rot["k"][layer], k.shape[0]), _expand(rot["v"][layer], v.shape[0])
        v_weights = feedback_from_form(output_form(o_proj, r_v, q.shape[0]))
        for kind, x, r, weights, clip in (("k", k, r_k, fitted["k_feedback"][layer], clips["k_clip"]),
                                          ("v", v, r_v, v_weights, clips["v_clip"])):
            x_rot = (x @ r).to(torch.float16).to(torch.float32)
            for rounding, w in (("nearest", None), ("feedback", weights)):
                back = _roundtrip(x_rot, config.bits(kind), config.cluster_dim, clip, config.scale_dtype, w)
                back = back @ r.transpose(-1, -2)
                out = _attention(q, back, v) if kind == "k" else _attention(q, k, back)
                if kind == "k":
                    error = (out - exact).norm() / exact.norm()
                else:
                    out = flat_heads(out).to(torch.float64) @ o_proj.to(torch.float64).T
                    error = (out - exact_out).norm() / exact_out.norm()
                errors[f"{kind}_{rounding}"].append(float(error))
        log(f"layer {layer}: " + ", ".join(f"{n} {e[-1]:.4f}" for n, e in errors.items()))
    mean = {name: sum(e) / len(e) for name, e in errors.items()}
    change = {kind: 100 * (mean[f"{kind}_feedback"] / mean[f"{kind}_nearest"] - 1) for kind in ("k", "v")}
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"value_feedback_{args.split}.json"
    out.write_text(json.dumps({"split": args.split, "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
                               "format": config.describe(), "k_clip": clips["k_clip"], "v_clip": clips["v_clip"],
                               "mean_relative_error": mean, "feedback_change_percent": change,
                               "per_layer": errors}, indent=1) + "\n")
    print(f"K (attention output): nearest {mean['k_nearest']:.4f}, feedback {mean['k_feedback']:.4f} "
          f"({change['k']:+.1f}%)")
    print(f"V (after o_proj):     nearest {mean['v_nearest']:.4f}, feedback {mean['v_feedback']:.4f} "
          f"({change['v']:+.1f}%)")


if __name__ == "__main__":
    main()

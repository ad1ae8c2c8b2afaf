"""Subspace clustering of K on SmolLM2-135M-Instruct: C K rotations per layer (or per KV head) instead of
one, each token's K vector (per KV head) routed to the rotation whose 2-bit reconstruction is best, the
cluster id stored in the cache (log2(C) bits per token per KV head, counted in the bits). V keeps today's
one rotation per layer. Measured against oscar-2 (g64, sink 64, recent 256) and its per-KV-head rotations
at equal or lower bits per element at 8K: the recent window gives up the few tokens the ids cost.

    nice -n 10 .venv/bin/python -m benchmarks.quality.subspace_clustering                 # validation, every row
    nice -n 10 .venv/bin/python -m benchmarks.quality.subspace_clustering --split test --rows C4-l2-layer

The validation run took 55 min on 2 shared CPU cores (each row's 8K window plus needle 2-5 min; fits
0.2-9 min, C8 per KV head the slowest); peak memory stays near 2 GB.

Same split, calibration and metrics as benchmarks/quality/smollm2_levers.py: the split's first 4,096 tokens fit
every rotation (clusters included), the next 512 pick each row's K clip ratio (attention-output error
with only K quantized, calibrate.clip_errors' criterion; V keeps oscar-2's), then one 8,192-token window
gives perplexity at 2K/4K/8K and one needle sequence (5 x 24 tokens in a 4,096-token haystack) gives
retrieval. fp16 and both oscar-2 rows are rerun in the same process.

Cluster fit, per layer (scope "layer": shared by the KV heads) or per KV head (scope "head"): seed C
directions by k-means++ on the calibration K vectors' directions (sign-free), then alternate: refit each
cluster's rotation with rotations.oscar_rotation on its members' second moment, reassign each vector to
the rotation with the lowest codec error (codec.quantize/dequantize, 2 bits, group 64, oscar-2's K clip);
the rotations with the lowest mean calibration error are kept. Routing at run time uses the same error
under the actual codec: "l2" the squared reconstruction error, "q" that error weighted by the layer's
query covariance (per KV head, from the same calibration tokens). Results:
benchmarks/results/quality/subspace_<split>.json and .md.

The one-rotation rows (C1) isolate the K objective: K's rotation fitted on K's own second moment
instead of the query covariance, no ids. Their runs (about 8 and 5 min, quieter cores), renamed to
subspace_k_objective_<split>.json and .md:

    nice -n 10 .venv/bin/python -m benchmarks.quality.subspace_clustering --rows C1-l2-head,C1-l2-layer --out OUT
    nice -n 10 .venv/bin/python -m benchmarks.quality.subspace_clustering --split test --rows C1-l2-head --out OUT
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F


from oscar_export.sizes import bits_per_element
from oscar_export.calibration.fit import CLIP_CANDIDATES, ObjectiveAccumulators, clip_errors
from oscar_export.calibration.capture import capture_qkv
from oscar_export.codec import dequantize, quantize
from oscar_export.config import OscarConfig
from oscar_export.evaluate.baselines import EvalOscarKVCache, Fp16Cache
from oscar_export.evaluate.methods import oscar_method
from oscar_export.hf_cache import attention_shape
from oscar_export.calibration.rotations import oscar_rotation

from benchmarks.common import (BITS_CONTEXT, CALIB_HELDOUT, CALIB_TOKENS, CONTEXTS, ROOT, WINDOW, cluster_bits, load_split, log,
                    measure)

FIT_ITERATIONS = 4
# C1-l2-layer is the one-rotation control (K second-moment rotation, no ids); C4-l2-layer the plain design;
# the q-head rows had the lowest held-out calibration proxy error in a C=4 comparison of the four metric/scope
# pairs (8 of the 30 layers, clip 0.65).
ROWS = ("C1-l2-layer", "C4-l2-layer", "C2-q-head", "C4-q-head", "C8-q-head")


# -- routing under the codec -------------------------------------------------------------------


def routed_roundtrip(x, rots, cfg: OscarConfig, q_cov=None, chunk: int = 2048):
    """x [H, T, D] fp32, rots [H, C, D, D] -> (reconstruction [H, T, D] in x's space, cluster ids [H, T],
    the winning error [H, T]).

    Each vector is rotated by every candidate, rounded to fp16 (as the cache stores it), quantized and
    dequantized; the candidate with the lowest error wins: squared error, or with q_cov [H, D, D] the
    error's energy under the query covariance (what the attention scores see)."""
    heads, tokens, d = x.shape
    recon, ids, errors = torch.empty_like(x), torch.empty(heads, tokens, dtype=torch.long), x.new_empty(heads, tokens)
    bits, g = cfg.k_bits, cfg.cluster_dim
    back_rot = rots.transpose(-1, -2)
    for a in range(0, tokens, chunk):
        xr = (x[:, None, a:a + chunk] @ rots).to(torch.float16).float()  # [H, C, t, D]
        deq = dequantize(*quantize(xr, bits, g, cfg.k_clip, None, cfg.scale_dtype), bits, g)
        if q_cov is None:
            err = ((deq - xr) ** 2).sum(-1)  # rotations are orthogonal: the same in either space
        else:
            e = (deq - xr) @ back_rot
            err = ((e @ q_cov[:, None]) * e).sum(-1)
        best = err.argmin(1)  # [H, t]; ties go to the lower id
        pick = best[:, None, :, None].expand(heads, 1, best.shape[1], d)
        recon[:, a:a + chunk] = (deq @ back_rot).gather(1, pick).squeeze(1)
        ids[:, a:a + chunk] = best
        errors[:, a:a + chunk] = err.gather(1, best[:, None]).squeeze(1)
    return recon, ids, errors


class ClusteredKCache(EvalOscarKVCache):
    """The evaluation's OSCAR cache with K's body routed among C rotations per layer (or KV head). Queries
    and the fp16 windows stay in the base rotation's space; each body K is reconstructed from its cluster's codes
    and moved into that space (a kernel rotates the query by each of the C rotations instead)."""

    def __init__(self, config, shape, max_context, k_rot, v_rot, clusters, q_cov, stats):
        layers, kv_heads, head_dim, _ = shape
        super().__init__(config, layers, kv_heads, head_dim, max_context, k_rot, v_rot)
        self.clusters, self.q_cov, self.stats = clusters, q_cov, stats

    def sequence(self, layer, q, k, v, first):
        seq = super().sequence(layer, q, k, v, first)
        q_cov = None if self.q_cov is None else self.q_cov[layer]
        recon, ids, _ = routed_roundtrip(k.float(), self.clusters[layer], self.config, q_cov)
        seq.body["k"] = recon @ self.rotation["k"][layer]
        if self.stats is not None:
            body = ids[:, self.config.sink:max(self.config.sink, ids.shape[1] - self.config.recent)]
            self.stats["switches"] += int((body[:, 1:] != body[:, :-1]).sum())
            self.stats["pairs"] += body[:, 1:].numel()
            counts = torch.bincount(body.reshape(-1), minlength=self.clusters.shape[2])
            self.stats["counts"] = [a + int(b) for a, b in zip(self.stats["counts"], counts)]
        return seq


def equal_bits_recent(cfg: OscarConfig, head_dim: int, clusters: int) -> int:
    """The longest recent window whose cluster format costs no more at 8K than `cfg` does."""
    budget = bits_per_element(cfg, head_dim, BITS_CONTEXT)
    recent = cfg.recent
    while recent > 0 and cluster_bits(replace(cfg, recent=recent), head_dim, clusters, BITS_CONTEXT) > budget + 1e-12:
        recent -= 1
    return recent


# -- fitting the clusters on calibration tokens --------------------------------------------------


def calibration_kq(model, tokenizer, text: str):
    """K [layers][H, N, D] of the first CALIB_TOKENS calibration tokens (fit_rotations' windows) and each
    layer's query covariance per KV head [H, D, D]."""
    ids = torch.tensor(tokenizer(text, verbose=False)["input_ids"][:CALIB_TOKENS])
    keys: dict[int, list] = {}
    acc: dict[int, ObjectiveAccumulators] = {}

    def keep(layer, q, k, v):
        keys.setdefault(layer, []).append(k[0].detach().float())
        acc.setdefault(layer, ObjectiveAccumulators(k.shape[1], k.shape[-1])).add_queries(q[0].detach().float())

    for a in range(0, CALIB_TOKENS, WINDOW):
        with capture_qkv(model, keep), torch.no_grad():
            model(input_ids=ids[None, a:a + WINDOW], use_cache=False)
    layers = sorted(keys)
    return [torch.cat(keys[i], 1) for i in layers], torch.stack([acc[i].q_cov.float() for i in layers])


def second_moment_rotation(x: torch.Tensor) -> torch.Tensor:
    return oscar_rotation(x.double().T @ x.double() / x.shape[0])[0]


def seed_assignment(x: torch.Tensor, clusters: int, generator) -> torch.Tensor:
    """k-means++ on directions (distance 1 - cos^2, so x and -x agree): each vector's nearest seed."""
    u = F.normalize(x, dim=-1)
    seeds = [u[int(torch.randint(len(u), (1,), generator=generator))]]
    dist = 1 - (u @ seeds[0]) ** 2
    for _ in range(1, clusters):
        seeds.append(u[int(torch.multinomial(dist.clamp(min=0) + 1e-12, 1, generator=generator))])
        dist = torch.minimum(dist, 1 - (u @ seeds[-1]) ** 2)
    return ((u @ torch.stack(seeds).T) ** 2).argmax(-1)


def fit_clusters(k: torch.Tensor, q_cov: torch.Tensor, clusters: int, cfg: OscarConfig, metric: str, scope: str,
                 generator) -> tuple[torch.Tensor, list[float], list[float]]:
    """One layer's rotations [H, C, D, D] from its calibration K [H, N, D]; per assignment, the fraction
    of vectors that changed cluster and the mean routed error. The alternation is not a strict descent
    (the refit is a second-moment fit, the assignment a codec error), so the best rotations seen are kept."""
    heads, n, d = k.shape
    groups = [list(range(heads))] if scope == "layer" else [[h] for h in range(heads)]
    rots = torch.empty(heads, clusters, d, d)
    changed, mean_error = [0.0] * FIT_ITERATIONS, [0.0] * FIT_ITERATIONS
    for members in groups:
        x = k[members]  # [h, N, D]
        flat = x.reshape(-1, d)
        qc = q_cov[members] if metric == "q" else None
        assign = (seed_assignment(flat, clusters, generator) if clusters > 1
                  else torch.zeros(len(flat), dtype=torch.long))
        r = torch.stack([second_moment_rotation(flat)] * clusters)
        best_error, best_r = math.inf, r.clone()
        for it in range(FIT_ITERATIONS):
            for c in range(clusters):
                sel = flat[assign == c]
                if len(sel) >= 2 * d:  # too few members leave the rotation as it was
                    r[c] = second_moment_rotation(sel)
            _, ids, err = routed_roundtrip(x, r.expand(len(members), *r.shape), cfg, qc)
            ids, error = ids.reshape(-1), float(err.mean())
            changed[it] += float((ids != assign).float().mean()) / len(groups)
            mean_error[it] += error / len(groups)
            if error < best_error:
                best_error, best_r = error, r.clone()
            if clusters == 1:
                break
            assign = ids
        rots[members] = best_r
    return rots, changed, mean_error


def proxy_errors(heldout, base_rot, clusters, q_cov, cfg: OscarConfig, metric: str) -> dict[float, float]:
    """calibrate.clip_errors for the routed K: mean attention-output relative error over layers on the
    held-out calibration tokens, only K quantized, per clip ratio."""
    errors = {c: 0.0 for c in CLIP_CANDIDATES}
    for layer, (q, k, v) in heldout.items():
        exact = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
        for clip in CLIP_CANDIDATES:
            recon, _, _ = routed_roundtrip(k.float(), clusters[layer], replace(cfg, k_clip=clip),
                                        q_cov[layer] if metric == "q" else None)
            out = F.scaled_dot_product_attention(q[None], recon[None], v[None], is_causal=True, enable_gqa=True)[0]
            errors[clip] += float((out - exact).norm() / exact.norm()) / len(heldout)
    return errors


# -- evaluation ----------------------------------------------------------------------------------


def fit_row(cal_k, q_cov, clusters: int, metric: str, scope: str, cfg: OscarConfig) -> tuple[torch.Tensor, dict]:
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    fitted = [fit_clusters(cal_k[i], q_cov[i], clusters, cfg, metric, scope, gen) for i in range(len(cal_k))]
    layers = len(fitted)
    log_ = {"fit_s": round(time.perf_counter() - t0, 1),
            "changed_per_iteration": [round(sum(f[1][i] for f in fitted) / layers, 4) for i in range(FIT_ITERATIONS)],
            "calibration_error_per_iteration": [round(sum(f[2][i] for f in fitted) / layers, 5)
                                                for i in range(FIT_ITERATIONS)]}
    return torch.stack([f[0] for f in fitted]), log_


def write_report(args, rows, proxy, fit_log, started, final: bool) -> None:
    base = rows["fp16"]["ppl"]
    for r in rows.values():
        r["ppl_increase"] = {c: 100 * (r["ppl"][c] / base[c] - 1) for c in CONTEXTS}
    best_base = min(("oscar-2/g64", "oscar-2/g64-perhead"), key=lambda n: rows[n]["ppl"][BITS_CONTEXT])
    ref = rows[best_base]

    def wins(r):
        return r["bits"] <= ref["bits"] + 1e-9 and all(r["ppl"][c] < ref["ppl"][c] for c in CONTEXTS)

    winners = [n for n, r in rows.items() if r.get("clusters", 1) > 1 and wins(r)]
    controls = [n for n, r in rows.items() if r.get("clusters") == 1 and wins(r)]
    if winners:
        verdict = (f"**Kept**: {', '.join(winners)} beat{'s' if len(winners) == 1 else ''} {best_base} at 2K, 4K and "
                   f"8K at equal or lower bits per element on the {args.split} split.")
    else:
        verdict = (f"**Rejected**: no cluster row measured here beats {best_base} (the best existing row, "
                   f"{ref['bits']:.2f} bits/elem) at all of 2K, 4K and 8K at equal bits on the {args.split} split.")
    if controls:
        control = rows[controls[0]]
        beyond = [n for n in winners if all(rows[n]["ppl"][c] < control["ppl"][c] for c in CONTEXTS)]
        verdict += (f" The one-rotation control {controls[0]} (K second-moment rotation, no ids) also beats "
                    f"it, so part of the gain is the K objective; "
                    + (f"{', '.join(beyond)} also beat{'s' if len(beyond) == 1 else ''} the control at every context: "
                       f"the clustering adds the rest." if beyond else "no cluster row beats the control everywhere."))
    wall = round(time.perf_counter() - started, 1)
    report = {"split": args.split, "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "contexts": CONTEXTS,
              "verdict": verdict if final else "incomplete run", "rows": rows, "fits": fit_log,
              "proxy_clip_errors": {k: {str(c): e for c, e in v.items()} for k, v in proxy.items()}, "wall_s": wall}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"subspace_{args.split}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    if not final:
        return
    lines = [verdict, "",
             f"SmolLM2-135M-Instruct, {args.split} split, 2-bit K/V, group 64, sink 64; fp16 and the oscar-2 rows "
             f"rerun here. subspace-C<C>-<metric>-<scope>: C K rotations per layer (scope layer) or per KV head "
             f"(scope head), routed by squared error (l2) or query-weighted error (q) under the codec; the recent "
             f"window (rN) gives up what the ids cost. One 8K window, one needle sequence; wall {wall:.0f} s "
             f"(command in benchmarks/quality/subspace_clustering.py).", "",
             "| config | bits/elem at 8K | ppl 2K | ppl 4K | ppl 8K | needle 4K | switch rate | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    def order(name):
        r = rows[name]
        return ("clusters" in r, r.get("metric", ""), r.get("scope", ""), r.get("clusters", 0))

    for name in sorted(rows, key=order):
        r = rows[name]
        needle = "-" if r["needle"] is None else f"{r['needle']:.3f}"
        switch = f"{r['switch_rate']:.3f}" if "switch_rate" in r else "-"
        label = f"{name} (r{r['config']['recent']})" if "clusters" in r else name
        lines.append(f"| {label} | {r['bits']:.3f} | "
                     + " | ".join(f"{r['ppl'][c]:.2f} ({r['ppl_increase'][c]:+.1f}%)" for c in CONTEXTS)
                     + f" | {needle} | {switch} | {r['wall_s']:.0f} |")
    lines += ["", "switch rate: fraction of adjacent body tokens (per KV head, 8K window) whose cluster differs.", "",
              "Held-out calibration tokens: attention-output error with only K quantized at the best clip "
              "(calibrate.clip_errors' criterion), and the cluster fit:", "",
              "| variant | clip K | proxy error | fit s | changed per iteration |", "|---|---|---|---|---|"]
    for name, curve in proxy.items():
        best = min(curve, key=curve.get)
        f = fit_log.get(name, {})
        lines.append(f"| {name} | {best} | {curve[best]:.4f} | {f.get('fit_s', '-')} | "
                     f"{' '.join(f'{x:.2f}' for x in f.get('changed_per_iteration', [])) or '-'} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split", choices=("validation", "test"), default="validation")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated cluster rows C<C>-<l2|q>-<layer|head>")
    p.add_argument("--no-needle", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quality")
    args = p.parse_args()
    started = time.perf_counter()
    model, tokenizer, calibration_text, window, cases, needle_length = load_split(args.split, not args.no_needle)
    shape = attention_shape(model)
    layers, kv_heads, head_dim, _ = shape

    # Baselines exactly as the lever sweep builds them (rotation fit, clip search).
    calibration = (calibration_text, CALIB_TOKENS, CALIB_HELDOUT)
    fitted_layer, fitted_head = {}, {}
    oscar = oscar_method(model, tokenizer, "oscar-2", OscarConfig(), shape, None, calibration, fitted_layer)
    cfg = oscar.config  # clip K/V searched on the held-out calibration tokens
    heldout = fitted_layer["heldout"]
    base_k, rot_v = fitted_layer["rotations"]["k"], fitted_layer["rotations"]["v"]
    perhead = oscar_method(model, tokenizer, "oscar-2", OscarConfig(), shape, None, calibration, fitted_head,
                            per_head=True)
    log(f"baselines calibrated: clip K {cfg.k_clip}, V {cfg.v_clip}; per-head clip K {perhead.config.k_clip}")
    proxy = {"oscar-2/g64": clip_errors(heldout, fitted_layer["rotations"], cfg, "k"),
             "oscar-2/g64-perhead": clip_errors(heldout, fitted_head["rotations"], perhead.config, "k")}
    rows, fit_log = {}, {}
    rows["fp16"] = measure(model, lambda n: Fp16Cache(layers, kv_heads, head_dim, n), None, window, cases,
                           needle_length, head_dim)
    for name, method in (("oscar-2/g64", oscar), ("oscar-2/g64-perhead", perhead)):
        rows[name] = measure(model, method.make, method.config, window, cases, needle_length, head_dim)
        rows[name]["config"] = method.config.to_dict()
        log(f"{name}: {rows[name]}")
    write_report(args, rows, proxy, fit_log, started, final=False)

    cal_k, q_cov = calibration_kq(model, tokenizer, calibration_text)
    for spec in args.rows.split(","):
        c, metric, scope = spec.split("-")
        c = int(c[1:])
        name = f"subspace-{spec}"
        rots, fit_log[name] = fit_row(cal_k, q_cov, c, metric, scope, cfg)
        proxy[name] = proxy_errors(heldout, base_k, rots, q_cov, cfg, metric)
        fit_log[name]["clip"] = min(proxy[name], key=proxy[name].get)
        log(f"{name}: {fit_log[name]}, proxy {proxy[name][fit_log[name]['clip']]:.4f}")
        run_cfg = replace(cfg, k_clip=fit_log[name]["clip"])
        run_cfg = replace(run_cfg, recent=equal_bits_recent(run_cfg, head_dim, c))
        stats = {"switches": 0, "pairs": 0, "counts": [0] * c}

        def make(n, run_cfg=run_cfg, rots=rots, stats=stats, weights=q_cov if metric == "q" else None):
            return ClusteredKCache(run_cfg, shape, n, base_k, rot_v, rots, weights,
                                   stats if n == BITS_CONTEXT else None)

        rows[name] = measure(model, make, run_cfg, window, cases, needle_length, head_dim, c)
        total = sum(stats["counts"])
        rows[name].update(config=run_cfg.to_dict(), clusters=c, metric=metric, scope=scope,
                          switch_rate=stats["switches"] / max(stats["pairs"], 1),
                          cluster_share=[round(x / total, 4) for x in stats["counts"]])
        log(f"{name}: {rows[name]}")
        write_report(args, rows, proxy, fit_log, started, final=False)
    write_report(args, rows, proxy, fit_log, started, final=True)


if __name__ == "__main__":
    main()

"""Parity: the same prompt through every available runtime, compared code by code and token by token.

Two levels, thresholds in docs/parity.md:
- op level: each runtime's attention is fed the reference run's exact q/k/v, call by call; its
  codes must be bit-exact except rounding ties (codes_mismatch_fraction <= 1e-3) and its
  attention outputs within max relative error 1e-3;
- end to end: the runtime generates greedily on its own; logits within 1e-2 relative and the
  same tokens.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import torch

from .codec import unpack_codes
from .config import OscarConfig
from .hf_cache import OscarCache, patch_model_for_kv_quant
from .progress import progress

THRESHOLDS = {"codes_mismatch_fraction": 1e-3, "max_rel_error": 1e-3, "logits_max_rel_error": 1e-2}


@dataclass
class Trace:
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    calls: list[tuple] = field(default_factory=list)  # (layer, q, k, v, scaling, out) per attention call
    cache: OscarCache | None = None


def available_runtimes() -> dict[str, str]:
    """Runtime name -> how it runs here."""
    runtimes = {"reference": "PyTorch fp32 reference"}
    if importlib.util.find_spec("triton") is not None:
        if torch.cuda.is_available():
            runtimes["triton"] = "Triton on CUDA"
        elif os.environ.get("TRITON_INTERPRET") == "1":
            runtimes["triton"] = "Triton interpreter on CPU"
    return runtimes


def _record(trace_: Trace):
    def observer(layer, q, k, v, scaling, out):
        trace_.calls.append((layer, q.detach(), k.detach(), v.detach(), scaling, out.detach().float().cpu()))

    return observer


@torch.no_grad()
def generate_trace(model, prompt: torch.Tensor, steps: int, backend: str) -> Trace:
    """Greedy decoding through an OscarCache on `backend`, recording logits and every attention call."""
    result = Trace()
    cache = OscarCache(model, max_context=prompt.shape[1] + steps, backend=backend)
    cache.observer = _record(result)
    ids = prompt
    for _ in progress(range(steps), f"parity: {backend} generates"):
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[0, -1].float().cpu()
        result.logits.append(logits)
        result.tokens.append(int(logits.argmax()))
        ids = torch.tensor([[result.tokens[-1]]], device=prompt.device)
    result.cache = cache
    return result


@torch.no_grad()
def replay_trace(model, reference: Trace, backend: str) -> Trace:
    """Feed the reference run's exact attention inputs, call by call, to `backend`'s cache."""
    result = Trace()
    cache = OscarCache(model, max_context=reference.cache.kv.max_context, backend=backend)
    cache.observer = _record(result)
    for layer, q, k, v, scaling, _ in progress(reference.calls, f"parity: {backend} replays"):
        cache.attend(layer, q, k, v, scaling)
    result.cache = cache
    return result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def compare_ops(candidate: Trace, reference: Trace) -> dict:
    kv, ref = candidate.cache.kv, reference.cache.kv
    mismatched = total = 0
    exact = True
    for kind in ("k", "v"):
        for cfg, got, want in zip(kv.layer_configs, kv.codes[kind], ref.codes[kind]):
            a, b = unpack_codes(got.cpu(), cfg.bits(kind)), unpack_codes(want.cpu(), cfg.bits(kind))
            mismatched += int((a != b).sum())
            total += a.numel()
        for region in ("sink", "recent", "scale", "zero"):
            exact &= torch.equal(getattr(kv, region)[kind].cpu(), getattr(ref, region)[kind].cpu())
    errors = [_rel(a[-1], b[-1]) for a, b in zip(candidate.calls, reference.calls)]
    return {
        "codes_mismatch_fraction": mismatched / max(total, 1),
        "codes_mismatched": mismatched,
        "windows_scales_zeros_exact": exact,
        "max_rel_error": max(errors),
        "mean_rel_error": sum(errors) / len(errors),
    }


def compare_tokens(candidate: Trace, reference: Trace) -> dict:
    return {
        "logits_max_rel_error": max(_rel(a, b) for a, b in zip(candidate.logits, reference.logits)),
        "tokens_match": candidate.tokens == reference.tokens,
        "tokens": candidate.tokens,
    }


def run_parity(model, prompt: torch.Tensor, steps: int, config: OscarConfig, rotations="hadamard") -> dict:
    """Every available runtime against the reference, on the same prompt and cache inputs."""
    fields = config.to_dict()
    patch_model_for_kv_quant(model, cluster_dim=fields.pop("cluster_dim"), rotations=rotations, **fields)
    reference = generate_trace(model, prompt, steps, "reference")
    report = {
        "prompt_tokens": prompt.shape[1],
        "steps": steps,
        "config": config.to_dict(),
        "rotations": rotations if isinstance(rotations, str) else "file",
        "thresholds": THRESHOLDS,
        "runtimes": {},
    }
    for name, how in available_runtimes().items():
        if name == "reference":
            ops, tokens = reference, reference
        else:
            ops, tokens = replay_trace(model, reference, name), generate_trace(model, prompt, steps, name)
        row = {"how": how, **compare_ops(ops, reference), **compare_tokens(tokens, reference)}
        row["ok"] = row["tokens_match"] and row["windows_scales_zeros_exact"] and all(
            row[key] <= limit for key, limit in THRESHOLDS.items()
        )
        report["runtimes"][name] = row
    report["ok"] = all(row["ok"] for row in report["runtimes"].values())
    return report


# -- exported artifacts ------------------------------------------------------------------------------

# End to end on an artifact: the logits limit of compare_tokens, and the codes limit of compare_ops.
ARTIFACT_THRESHOLDS = {"logits_max_rel_error": 1e-2, "codes_mismatch_fraction": 1e-3}
TRACE_FORMAT = "oscar-export/parity-trace/1"


def _artifact_identity(manifest: dict) -> str:
    """sha256 over the artifact's file table: a trace is only checked against the artifact it was recorded on."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()


def save_trace(path, directory, ids: list[int], steps: int) -> dict:
    """Record the artifact's reference run (prompt, greedy tokens, each step's logits, the packed body codes after
    the run) into a safetensors file, on CUDA when this machine has it: the other side of a cross-machine parity
    check (`parity --artifact DIR --against FILE`)."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from .export.pipeline import open_artifact, reference_trace
    from .rotation_files import write_atomically

    directory, manifest, _ = open_artifact(directory)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trace = reference_trace(directory, ids, steps, device=device)
    tensors = {"prompt": np.asarray(ids, np.int64), "tokens": np.asarray(trace["tokens"], np.int64),
               "logits": np.stack(trace["logits"]).astype(np.float32),
               **{f"codes.{name}": np.ascontiguousarray(array) for name, array in trace["codes"].items()}}
    metadata = {"format": TRACE_FORMAT, "artifact": _artifact_identity(manifest), "target": manifest["target"],
                "config": json.dumps(manifest["config"]), "weights": manifest["weights"], "device": device,
                "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "torch": torch.__version__, "steps": str(steps)}
    write_atomically(path, lambda temp: save_file(tensors, str(temp), metadata=metadata))
    return metadata


def load_trace(path, manifest: dict) -> tuple[list[int], int, dict, dict]:
    """(prompt ids, steps, the reference trace, its metadata) from a file save_trace wrote for this artifact."""
    from safetensors import SafetensorError, safe_open

    from .config import OscarInputError

    try:
        with safe_open(str(path), "np") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, ValueError, SafetensorError) as err:
        raise OscarInputError(f"--against {str(path)!r}: cannot read it ({str(err).splitlines()[0][:200]}): expected "
                              f"a file written by parity --save-trace") from None
    fields = {"format", "artifact", "steps", "device_name", "torch"}
    if (metadata.get("format") != TRACE_FORMAT or not fields <= set(metadata) or not metadata["steps"].isdigit()
            or not {"prompt", "tokens", "logits"} <= set(tensors) or len(tensors["logits"]) != len(tensors["tokens"])):
        raise OscarInputError(f"--against {str(path)!r}: not a parity trace: expected a file written by "
                              f"parity --save-trace")
    if metadata.get("artifact") != _artifact_identity(manifest):
        raise OscarInputError(f"--against {str(path)!r} was recorded on another artifact (its files differ from "
                              f"this one's): expected a trace saved with --artifact on a copy of this artifact")
    trace = {"tokens": tensors["tokens"].tolist(), "logits": list(tensors["logits"]),
             "codes": {name[len("codes."):]: array for name, array in tensors.items() if name.startswith("codes.")}}
    return tensors["prompt"].tolist(), int(metadata["steps"]), trace, metadata


def _codes_mismatches(got: dict, want: dict, config: dict, slots: int | None = None) -> tuple[int, int]:
    """Mismatched codes over the first `slots` body positions of every cache (all of them when None)."""
    import numpy as np

    layers = OscarConfig.from_dict(config)
    mismatched = total = 0
    for cache_name, reference in want.items():  # layer{i}.k_codes: that layer's width
        layer, buffer = cache_name.split(".")
        bits = layers.layer(int(layer.removeprefix("layer"))).bits(buffer[0])
        a = unpack_codes(torch.from_numpy(np.ascontiguousarray(got[cache_name][:, :slots])), bits)
        b = unpack_codes(torch.from_numpy(np.ascontiguousarray(reference[:, :slots])), bits)
        mismatched += int((a != b).sum())
        total += a.numel()
    return mismatched, total


def _divergence(got: dict, reference: dict, rel_limit: float) -> dict:
    """Where the tokens first differ, and whether each step where they differ is a near tie in the reference: its
    top token leads the runtime's by at most 2 * rel_limit * ||logits||, a gap any runtime within the logits limit
    could close (tie_margin: the widest such lead). A greedy run reads different tokens after its first
    difference, so nothing later is comparable; a run fed the reference's tokens (got["forced"]) reads the same
    prefix at every step, so every step is checked."""
    import numpy as np

    pairs = list(zip(got["tokens"], reference["tokens"]))
    steps = [i for i, (g, w) in enumerate(pairs) if g is not None and g != w]
    if not got.get("forced"):
        steps = steps[:1]
    if not steps:
        return {"tokens_match": len(got["tokens"]) == len(reference["tokens"]), "diverged_at": None, "near_tie": False,
                "tie_margin": None, "tokens_differing": 0, "not_a_tie_at": None}
    ties, margins = [], []
    for step in steps:
        logits = reference["logits"][step]
        margin = float(logits[reference["tokens"][step]] - logits[got["tokens"][step]])
        # abs: in a doctored or foreign trace the reference token need not be its own logits' argmax
        ties.append(abs(margin) <= 2 * rel_limit * float(np.linalg.norm(logits)))
        margins.append(margin)
    return {"tokens_match": False, "diverged_at": steps[0], "near_tie": all(ties),
            "tie_margin": max(margins, key=abs), "tokens_differing": len(steps),
            "not_a_tie_at": next((step for step, tie in zip(steps, ties) if not tie), None)}


def compare_artifact_traces(got: dict, reference: dict, config: dict, prompt_tokens: int,
                            limits: dict = ARTIFACT_THRESHOLDS, tie_limit: float | None = None) -> dict:
    """A runtime's trace against the reference: tokens, logits and codes. The tokens must match, or differ only at
    near ties (_divergence). A runtime fed the reference's tokens (got["forced"]) is compared at every step, its
    logits and codes over the whole run; a greedy one up to its first difference. A runtime that gives tokens only
    (the stock C++ runner) is held to its tokens, where an id it could not recover from its text counts as equal."""
    import numpy as np

    row = {"tokens": got["tokens"], "forced": bool(got.get("forced")),
           **_divergence(got, reference, tie_limit or limits["logits_max_rel_error"])}
    tokens_ok = row["tokens_match"] or row["near_tie"]
    if got["logits"] is None:
        return {**row, "logits_max_abs_error": None, "logits_max_rel_error": None, "codes_mismatched": None,
                "codes_mismatch_fraction": None, "ok": tokens_ok}
    upto = None if row["diverged_at"] is None or row["forced"] else row["diverged_at"] + 1
    pairs = list(zip(got["logits"][:upto], reference["logits"][:upto]))
    # Body slot j holds position sink + j; positions from prompt + divergence on hold different tokens.
    slots = None if upto is None else max(prompt_tokens + row["diverged_at"] - config["sink"], 0)
    mismatched, total = _codes_mismatches(got["codes"], reference["codes"], config, slots)
    row.update({
        "logits_max_abs_error": max(float(np.abs(a - b).max()) for a, b in pairs),
        "logits_max_rel_error": max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) for a, b in pairs),
        "codes_mismatched": mismatched, "codes_mismatch_fraction": mismatched / max(total, 1)})
    row["ok"] = tokens_ok and all(row[key] <= limit for key, limit in limits.items())
    return row


def tokens_verdict(row: dict) -> str:
    """The tokens column of a parity table."""
    if row["tokens_match"]:
        return "match"
    if row["near_tie"]:
        if row.get("tokens_differing", 1) > 1:
            return f"{row['tokens_differing']} near ties, the first at step {row['diverged_at']}"
        return f"near tie at step {row['diverged_at']}"
    return "DIFFER" if row["diverged_at"] is None else f"DIFFER at step {row['not_a_tie_at']}"


# The noise floor of an artifact whose matmuls quantize activations on the fly (Target.rounds_activations): the
# reference run again, fed its own tokens, with every attention output (o_proj's input) multiplied by 1 + eps * N(0, 1)
# per element. eps is a few fp32 ulps, below any two runtimes' summation-order differences, yet on SmolLM2's 30
# layers it moves the logits as far as any runtime does (flipped activation codes compound), so a runtime within
# NOISE_FACTOR times the widest of NOISE_RUNS such runs cannot be told apart from float rounding end to end.
NOISE_EPS = 1e-6
NOISE_RUNS = 3  # the CLI's --noise-runs default
NOISE_FACTOR = 2.0


def noise_floor(module, manifest: dict, ids: list[int], steps: int, reference: dict, runs: int = NOISE_RUNS,
                eps: float = NOISE_EPS) -> dict:
    """How far the artifact's reference module (export/pipeline.reference_module) moves from `reference` when its
    attention outputs are jittered by a relative `eps` (seeds 0 .. runs-1): each run's logits and codes drift, and
    the widest of each."""
    from .export.artifact import eager_trace
    from .export.graph import OscarDecoderLayer

    projections = [m.o_proj for m in module.modules() if isinstance(m, OscarDecoderLayer)]
    drift = []
    for seed in range(runs):
        noise = torch.Generator().manual_seed(seed)

        def jitter(_, args, noise=noise):
            x = args[0]
            return (x * (1 + eps * torch.randn(x.shape, generator=noise, dtype=x.dtype)),) + args[1:]

        hooks = [p.register_forward_pre_hook(jitter, prepend=True) for p in projections]  # before any rounding
        try:
            got = eager_trace(module, manifest, ids, steps, forced=reference["tokens"])
        finally:
            for hook in hooks:
                hook.remove()
        row = compare_artifact_traces(got, reference, manifest["config"], len(ids))
        drift.append({key: row[key] for key in ("logits_max_rel_error", "codes_mismatch_fraction")})
    return {"eps": eps, "runs": drift,
            **{key: max(run[key] for run in drift) for key in ("logits_max_rel_error", "codes_mismatch_fraction")}}


def run_artifact_parity(directory, ids: list[int], steps: int, against=None, noise_runs: int = NOISE_RUNS) -> dict:
    """Every runtime of the artifact's target that runs here against the reference on the same prompt: the eager
    graph with the artifact's own weights (export/pipeline.reference_trace), run now, or `against`, a trace file
    recorded elsewhere with save_trace (then its prompt and steps apply)."""
    from .export.artifact import eager_trace
    from .export.pipeline import open_artifact
    from .targets import REFERENCE

    directory, manifest, target = open_artifact(directory)
    if against is not None:  # checked before the model loads
        ids, steps, reference, metadata = load_trace(against, manifest)
        source = f"trace {against} ({metadata['device_name']}, torch {metadata['torch']})"
    module = target.artifact_module(directory, manifest)  # built once: the reference, its noise floor, `against`
    if against is None:
        reference = eager_trace(module, manifest, ids, steps)
        source = "eager graph.OscarCausalLM with the artifact's weights (PyTorch, here)"
    unavailable = dict(target.unavailable_runtimes())
    limits = {**ARTIFACT_THRESHOLDS, **target.parity_limits(manifest)}
    tie_limit = limits["logits_max_rel_error"]  # a near tie stays what the fixed limit calls one
    floor = None
    if noise_runs and target.rounds_activations(manifest):
        floor = noise_floor(module, manifest, ids, steps, reference, noise_runs)
        limits = {key: max(limit, NOISE_FACTOR * floor[key]) for key, limit in limits.items()}
    report = {
        "artifact": str(directory),
        "target": target.name,
        "prompt_tokens": len(ids),
        "steps": steps,
        "config": manifest["config"],
        "weights": manifest["weights"],
        "reference": source,
        "thresholds": limits,
        "noise_floor": floor,
        "unavailable": unavailable,
        "runtimes": {},
    }
    runtimes = {name: how for name, how in target.runtimes.items() if name not in unavailable}
    if against is not None:
        runtimes = {REFERENCE: "eager graph with the artifact's weights (PyTorch, here)", **runtimes}
    for name, how in runtimes.items():
        if name == REFERENCE:
            got = eager_trace(module, manifest, ids, steps)
        else:
            got = target.trace(directory, manifest, name, ids, steps, forced=reference["tokens"])
        if "skipped" in got:  # this prompt cannot be given to this runtime
            report["unavailable"][name] = got["skipped"]
            continue
        report["runtimes"][name] = {"how": how, **compare_artifact_traces(got, reference, manifest["config"], len(ids),
                                                                          limits, tie_limit)}
    report["ok"] = all(row["ok"] for row in report["runtimes"].values())
    return report


def artifact_parity_command(args, out) -> int:
    """`oscar-export parity --artifact DIR [--save-trace FILE | --against FILE]`; `out` is the CLI console."""
    import json

    from rich.table import Table
    from transformers import AutoTokenizer

    from .config import OscarInputError
    from .export.artifact import load_manifest
    from .report import read_tokens

    if args.save_trace is not None and args.against is not None:
        raise OscarInputError("--save-trace and --against: expected one of them (record here, or check here)")
    load_manifest(args.artifact)
    ids = []
    if args.against is None:
        tokenizer = AutoTokenizer.from_pretrained(args.artifact, local_files_only=True)
        ids = read_tokens(tokenizer, args.text, args.prompt_tokens)[0].tolist()
    if args.save_trace is not None:
        metadata = save_trace(args.save_trace, args.artifact, ids, args.steps)
        out.print(f"wrote {args.save_trace}: the reference run of {args.artifact} on {metadata['device_name']} "
                  f"({len(ids)}-token prompt, {args.steps} steps); check a runtime elsewhere with "
                  f"parity --artifact DIR --against {args.save_trace}")
        return 0
    report = run_artifact_parity(args.artifact, ids, args.steps, against=args.against, noise_runs=args.noise_runs)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        table = Table(title=f"Parity of {args.artifact} ({report['target']}, weights {report['weights']}): "
                            f"{report['prompt_tokens']}-token prompt, {report['steps']} decode steps, against the "
                            f"{report['reference']}; a runtime with logits is fed the reference's tokens, and "
                            f"tokens compares its own pick at each step")
        for col in ("runtime", "codes mismatch", "logits max abs err", "logits max rel err", "tokens", "verdict"):
            table.add_column(col)

        def number(value, fmt="{:.2e}"):
            return "n/a" if value is None else fmt.format(value)

        for name, r in report["runtimes"].items():
            codes = "n/a" if r["codes_mismatched"] is None else \
                f"{r['codes_mismatch_fraction']:.2e} ({r['codes_mismatched']})"
            table.add_row(f"{name} ({r['how']})", codes, number(r["logits_max_abs_error"]),
                          number(r["logits_max_rel_error"]), tokens_verdict(r),
                          "ok" if r["ok"] else "FAIL")
        out.print(table)
        if (floor := report["noise_floor"]) is not None:
            out.print(f"noise floor: the reference fed its own tokens with its attention outputs jittered by a relative "
                      f"{floor['eps']:g} ({len(floor['runs'])} runs) drifts up to {floor['logits_max_rel_error']:.2e} in "
                      f"logits and {floor['codes_mismatch_fraction']:.2e} in codes: this artifact rounds activations, so "
                      f"end to end nothing smaller can be told apart from float rounding; limits applied: logits "
                      f"{report['thresholds']['logits_max_rel_error']:.2e}, codes "
                      f"{report['thresholds']['codes_mismatch_fraction']:.2e} (at least {NOISE_FACTOR:g}x the floor)")
        for name, why in report["unavailable"].items():
            out.print(f"runtime {name} skipped: {why}")
    return 0 if report["ok"] else 1

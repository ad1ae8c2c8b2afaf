"""The laptop target's CLI (targets/laptop.toml): export, run, `bench attention` and `bench decode` on ONNX Runtime.

cli_targets.py dispatches here. Bad input raises OscarInputError, which becomes a one-line error.
"""

from __future__ import annotations

import argparse
import json

from .cli_targets import export_parser, run_export


def export_target(argv: list[str]) -> int:
    """Run `oscar-export --target laptop ...`; argv is the whole command line."""
    from .export.laptop import export_laptop

    p = export_parser("laptop", "Export a model for ONNX Runtime on a laptop: model.onnx with the native "
                                "OscarAttention op, a pure-ONNX fallback graph, the op library, tokenizer and "
                                "manifest.json.",
                      "keep float weights (default: 4-bit MatMulNBits)", "16GB")
    return run_export("laptop", p.parse_args(argv), export_laptop)


def run_artifact(directory, prompt: str, max_new_tokens: int, runtime: str, threads: int) -> dict:
    from .export.laptop import run_artifact

    return run_artifact(directory, prompt, max_new_tokens, runtime, threads)


def bench(args: argparse.Namespace) -> int:
    from .cli import config_from_args
    from .cli_targets import contexts as parse_contexts
    from .export.ort_bench import bench_attention
    from .models import model_shape

    contexts = parse_contexts(args.context)
    if args.what == "decode":
        return _bench_decode(args, contexts, config_from_args(args))
    shape = model_shape(args.model)
    report = bench_attention(contexts, shape.q_heads, shape.kv_heads, shape.head_dim, config_from_args(args),
                             args.threads)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"decode attention, one layer of {args.model} ({shape.q_heads} q heads, {shape.kv_heads} KV heads, "
          f"head_dim {shape.head_dim}), threads: {report['threads']}, ONNX Runtime")
    for r in report["results"]:
        print(f"  context {r['context']:>7}: OSCAR {r['oscar_ms']:.3f} ms, fp32 baseline {r['baseline_ms']:.3f} ms, "
              f"speed-up {r['speedup']:.2f}x")
    return 0


def _bench_decode(args: argparse.Namespace, contexts: list[int], config) -> int:
    from .export.ort_decode_bench import bench_decode

    report = bench_decode(contexts, args.steps, args.threads, args.model, config)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"greedy decode of {args.model}, weights {report['weights']}, median of {report['steps']} steps, "
          f"threads: {report['threads']}, ONNX Runtime. OSCAR: the native op; fp32: past/present concatenated "
          "each step; fp32 shared: GroupQueryAttention appending in place")
    print(f"  {'context':>7}  {'OSCAR tok/s':>11}  {'fp32 tok/s':>10}  {'speed-up':>8}  {'fp32 shared':>11}  "
          f"{'speed-up':>8}  {'OSCAR cache':>11}  {'fp32 cache':>10}")
    for r in report["results"]:
        print(f"  {r['context']:>7}  {r['oscar_tokens_per_s']:>11.1f}  {r['fp32_tokens_per_s']:>10.1f}  "
              f"{r['speedup']:>7.2f}x  {r['fp32_shared_tokens_per_s']:>11.1f}  {r['speedup_shared']:>7.2f}x  "
              f"{r['oscar_cache_bytes'] / 2**20:>7.2f} MiB  {r['fp32_cache_bytes'] / 2**20:>6.2f} MiB")
    return 0


# -- parity hooks (parity.run_artifact_parity) -------------------------------------------------


def parity_runtimes() -> dict[str, str]:
    return {"onnxruntime": "ONNX Runtime with the native op library",
            "onnx-fallback": "stock ONNX Runtime, pure-ONNX function of the op"}


def unavailable_runtimes() -> dict[str, str]:
    return {}


def trace(directory, runtime: str, ids: list[int], steps: int) -> dict:
    from .export.laptop import trace

    return trace(directory, runtime, ids, steps)


def reference_trace(directory, ids: list[int], steps: int) -> dict:
    from .export.laptop import reference_trace

    return reference_trace(directory, ids, steps)

"""The android target's CLI (targets/android.toml): export, run and `bench attention` on ExecuTorch.

cli_targets.py dispatches here. Bad input raises OscarInputError, which becomes a one-line error.
"""

from __future__ import annotations

import argparse
import functools
import json

from .cli import positive_int
from .cli_targets import export_parser, run_export


def export_target(argv: list[str]) -> int:
    """Run `oscar-export --target android ...`; argv is the whole command line."""
    from .export.android import DEFAULT_GROUP_SIZE, export_android

    p = export_parser("android", "Export a model for ExecuTorch on Android: model.pte (XNNPACK, the native OSCAR "
                                 "kernel over a packed cache in mutable buffers), the kernel library and its C++ "
                                 "sources for an NDK build, tokenizer and manifest.json.",
                      "keep float weights (default: 4-bit grouped weights, 8-bit dynamic activations)", "8GB")
    p.add_argument("--group-size", type=positive_int, default=DEFAULT_GROUP_SIZE,
                   help="input channels per 4-bit weight group (default %(default)s)")
    args = p.parse_args(argv)
    return run_export("android", args, functools.partial(export_android, group_size=args.group_size))


def run_artifact(directory, prompt: str, max_new_tokens: int, runtime: str, threads: int) -> dict:
    from .export.android import run_artifact

    return run_artifact(directory, prompt, max_new_tokens, runtime, threads)


def bench(args: argparse.Namespace) -> int:
    from .cli import config_from_args
    from .cli_targets import contexts as parse_contexts
    from .export.et_bench import bench_attention
    from .models import model_shape

    contexts = parse_contexts(args.context)
    shape = model_shape(args.model)
    report = bench_attention(contexts, shape.q_heads, shape.kv_heads, shape.head_dim, config_from_args(args),
                             args.threads)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"decode attention, one layer of {args.model} ({shape.q_heads} q heads, {shape.kv_heads} KV heads, "
          f"head_dim {shape.head_dim}), threads: {report['threads']}, ExecuTorch")
    for r in report["results"]:
        print(f"  context {r['context']:>7}: OSCAR {r['oscar_ms']:.3f} ms, fp32 custom_sdpa {r['baseline_ms']:.3f} ms "
              f"({r['speedup']:.2f}x), int8 custom_quantized_sdpa {r['int8_ms']:.3f} ms "
              f"({r['speedup_vs_int8']:.2f}x)")
    return 0

"""The android target's CLI (targets/android.toml): export, run and `bench attention` on ExecuTorch.

cli_targets.py dispatches here. Bad input raises OscarInputError, which becomes a one-line error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli import _Parser, add_cache_flags, positive_int
from .config import OscarInputError


def _export_parser() -> argparse.ArgumentParser:
    from .export.android import DEFAULT_GROUP_SIZE

    p = _Parser(prog="oscar-export --target android",
                description="Export a model for ExecuTorch on Android: model.pte (XNNPACK, the native OSCAR kernel "
                            "over a packed cache in mutable buffers), the kernel library and its C++ sources for an "
                            "NDK build, tokenizer and manifest.json.")
    p.add_argument("--target", choices=("android",), required=True)
    p.add_argument("--model", default="bundled", help="'bundled' or a local Hugging Face checkpoint directory")
    p.add_argument("--rotations", default="hadamard", help="a rotation file, hadamard or none (default %(default)s)")
    p.add_argument("--context", type=positive_int,
                   help="max tokens of the cache (default: the model's max_position_embeddings, at most 4096)")
    p.add_argument("--out", type=Path, default=Path("oscar-android"), help="artifact directory (default %(default)s)")
    p.add_argument("--float-weights", action="store_true",
                   help="keep float weights (default: 4-bit grouped weights, 8-bit dynamic activations)")
    p.add_argument("--group-size", type=positive_int, default=DEFAULT_GROUP_SIZE,
                   help="input channels per 4-bit weight group (default %(default)s)")
    p.add_argument("--device-memory", default="8GB", help="phone memory for the manifest's plan (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the manifest")
    add_cache_flags(p)
    p.set_defaults(k_clip=None, v_clip=None)  # unset: a rotation file's clip ratios apply
    return p


def export_target(argv: list[str]) -> int:
    """Run `oscar-export --target android ...`; argv is the whole command line."""
    args = _export_parser().parse_args(argv)
    from .export.android import export_android

    try:
        manifest = export_android(
            args.model, args.out, rotations=args.rotations, max_context=args.context,
            float_weights=args.float_weights, group_size=args.group_size, device_memory=args.device_memory,
            k_bits=args.k_bits or args.bits, v_bits=args.v_bits or args.bits, cluster_dim=args.cluster_dim,
            k_clip=args.k_clip, v_clip=args.v_clip, sink=args.sink, recent=args.recent)
    except (OscarInputError, RuntimeError) as err:  # RuntimeError: the kernel library could not be built
        print(f"oscar-export --target android: error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        print(f"wrote {args.out}: {len(manifest['files'])} files, model.pte "
              f"{manifest['files']['model.pte']['bytes'] / 2**20:.1f} MiB, weights {manifest['weights']}, "
              f"context {manifest['max_context']}")
    return 0


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

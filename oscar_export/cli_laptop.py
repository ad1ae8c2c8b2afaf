"""`oscar-export --target laptop`, `run` and `bench attention`: the ONNX Runtime target.

cli.py wires them in: `export_target(target, argv)` for --target, `add_laptop_commands(subparsers)`
for run and bench. Bad input raises OscarInputError, which becomes a one-line error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli import TARGETS, _Parser, positive_int, add_cache_flags
from .config import OscarInputError

RUN_RUNTIMES = ("onnxruntime", "onnx-fallback", "reference")


def _export_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="oscar-export --target laptop",
                description="Export a model for ONNX Runtime on a laptop: model.onnx with the native OscarAttention "
                            "op, a pure-ONNX fallback graph, the op library, tokenizer and manifest.json.")
    p.add_argument("--target", choices=("laptop",), required=True)
    p.add_argument("--model", default="bundled", help="'bundled' or a local Hugging Face checkpoint directory")
    p.add_argument("--rotations", default="hadamard", help="a rotation file, hadamard or none (default %(default)s)")
    p.add_argument("--context", type=positive_int,
                   help="max tokens of the cache (default: the model's max_position_embeddings, at most 4096)")
    p.add_argument("--out", type=Path, default=Path("oscar-laptop"), help="artifact directory (default %(default)s)")
    p.add_argument("--float-weights", action="store_true", help="keep float weights (default: 4-bit MatMulNBits)")
    p.add_argument("--device-memory", default="16GB", help="memory for the manifest's plan (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the manifest")
    add_cache_flags(p)
    p.set_defaults(k_clip=None, v_clip=None)  # unset: a rotation file's clip ratios apply
    return p


def export_target(argv: list[str]) -> int:
    """Run `oscar-export --target TARGET ...`; argv is the whole command line."""
    pre = _Parser(prog="oscar-export", add_help=False)
    pre.add_argument("--target", choices=TARGETS)
    target = pre.parse_known_args(argv)[0].target
    if target != "laptop":
        print(f"oscar-export --target {target}: export is not available yet in this version", file=sys.stderr)
        return 2
    args = _export_parser().parse_args(argv)
    from .export.laptop import export_laptop

    try:
        manifest = export_laptop(
            args.model, args.out, rotations=args.rotations, max_context=args.context,
            float_weights=args.float_weights, device_memory=args.device_memory, k_bits=args.k_bits or args.bits,
            v_bits=args.v_bits or args.bits, cluster_dim=args.cluster_dim, k_clip=args.k_clip, v_clip=args.v_clip,
            sink=args.sink, recent=args.recent)
    except (OscarInputError, RuntimeError) as err:  # RuntimeError: the native op library could not be built
        print(f"oscar-export --target laptop: error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        total = sum(f["bytes"] for f in manifest["files"].values())
        print(f"wrote {args.out}: {len(manifest['files'])} files, {total / 2**20:.1f} MiB, weights "
              f"{manifest['weights']}, context {manifest['max_context']}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .export.laptop import run_artifact

    result = run_artifact(args.artifact, args.prompt, args.max_new_tokens, args.runtime, args.threads)
    print(json.dumps(result) if args.json else result["text"])
    return 0


def _contexts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise OscarInputError(f"--context={text!r}: expected comma-separated positive token counts, e.g. 4096,32768")
    return values


def cmd_bench(args: argparse.Namespace) -> int:
    from .cli import config_from_args
    from .export.ort_bench import bench_attention
    from .models import model_shape

    contexts = _contexts(args.context)
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


def add_laptop_commands(sub) -> None:
    p = sub.add_parser("run", help="generate text from an exported artifact",
                       description="Greedy generation from a --target laptop artifact.")
    p.add_argument("--artifact", required=True, type=Path, help="directory written by --target laptop")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate (default %(default)s)")
    p.add_argument("--runtime", choices=RUN_RUNTIMES, default="onnxruntime",
                   help="onnxruntime (native op), onnx-fallback (stock ONNX Runtime, slower) or reference "
                        "(transformers with the reference cache; needs the source checkpoint)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: its default)")
    p.add_argument("--json", action="store_true", help='print {"tokens": [...], "text": "..."}')
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="benchmark the OSCAR attention kernels",
                       description="Decode-attention latency of the OSCAR op against the runtime's own fp32 "
                                   "attention over the same context, same threads.")
    p.add_argument("what", choices=("attention",))
    p.add_argument("--runtime", choices=("onnxruntime",), default="onnxruntime")
    p.add_argument("--context", default="4096,32768", help="comma-separated contexts (default %(default)s)")
    p.add_argument("--model", default="bundled", help="model whose attention shape is used: 'bundled', a preset "
                                                      "(llama-3-8b, ...) or a local checkpoint")
    p.add_argument("--threads", type=positive_int, help="threads for both (default: every core)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p)
    p.set_defaults(func=cmd_bench)

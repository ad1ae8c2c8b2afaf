"""The ios target's CLI (targets/ios.toml): export to Core ML, run, and the parity hooks.

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
    p = _Parser(prog="oscar-export --target ios",
                description="Export a model for Core ML on iPhone, iPad and Mac (iOS 18 / macOS 15): an .mlpackage "
                            "whose packed cache is app-held int32 buffers, the tokenizer and manifest.json.")
    p.add_argument("--target", choices=("ios",), required=True)
    p.add_argument("--model", default="bundled", help="'bundled' or a local Hugging Face checkpoint directory")
    p.add_argument("--rotations", default="hadamard", help="a rotation file, hadamard or none (default %(default)s)")
    p.add_argument("--context", type=positive_int,
                   help="max tokens of the cache (default: the model's max_position_embeddings, at most 4096)")
    p.add_argument("--out", type=Path, default=Path("oscar-ios"), help="artifact directory (default %(default)s)")
    p.add_argument("--float-weights", action="store_true",
                   help="keep fp16 weights (default: 4-bit, coremltools.optimize linear quantization)")
    p.add_argument("--device-memory", default="8GB", help="memory for the manifest's plan (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the manifest")
    add_cache_flags(p)
    p.set_defaults(k_clip=None, v_clip=None)  # unset: a rotation file's clip ratios apply
    return p


def export_target(argv: list[str]) -> int:
    """Run `oscar-export --target ios ...`; argv is the whole command line."""
    args = _export_parser().parse_args(argv)
    from .export.ios import export_ios

    try:
        manifest = export_ios(
            args.model, args.out, rotations=args.rotations, max_context=args.context,
            float_weights=args.float_weights, device_memory=args.device_memory, k_bits=args.k_bits or args.bits,
            v_bits=args.v_bits or args.bits, cluster_dim=args.cluster_dim, k_clip=args.k_clip, v_clip=args.v_clip,
            sink=args.sink, recent=args.recent)
    except OscarInputError as err:
        print(f"oscar-export --target ios: error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        total = sum(f["bytes"] for f in manifest["files"].values())
        print(f"wrote {args.out}: {len(manifest['files'])} files, {total / 2**20:.1f} MiB, weights "
              f"{manifest['weights']}, context {manifest['max_context']}, cache "
              f"{manifest['cache']['bits_per_element_at_max_context']:.3f} bits per K/V element")
    return 0


def run_artifact(directory, prompt: str, max_new_tokens: int, runtime: str, threads: int) -> dict:
    from .export.ios import run_artifact

    return run_artifact(directory, prompt, max_new_tokens, runtime, threads)


# parity --artifact (oscar_export/parity.py) looks these up on every target's CLI module.


def parity_runtimes() -> dict[str, str]:
    from .export.ios import parity_runtimes

    return parity_runtimes()


def unavailable_runtimes() -> dict[str, str]:
    from .export.ios import unavailable_runtimes

    return unavailable_runtimes()


def trace(directory, runtime: str, ids: list[int], steps: int) -> dict:
    from .export.ios import trace

    return trace(directory, runtime, ids, steps)


def reference_trace(directory, ids: list[int], steps: int) -> dict:
    from .export.ios import reference_trace

    return reference_trace(directory, ids, steps)

"""`oscar-export --target T`, `run` and `bench`: dispatch to the target's CLI module.

targets/<name>.toml names each target's module (oscar_export.targets). A module provides
export_target(argv) for `--target` (built from export_parser and run_export here),
run_artifact(directory, prompt, max_new_tokens, runtime, threads) for `run`, bench(args) when
its recipe lists bench runtimes, and the parity hooks parity.run_artifact_parity looks up.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli import _Parser, add_cache_flags, context_tokens, positive_int, thread_count
from .calibrations import DEFAULT_TOKENS
from .config import OscarInputError
from .targets import TARGETS, available, bench_runtimes, cli_module, recipe, run_runtimes


def export_target(argv: list[str]) -> int:
    """Run `oscar-export --target TARGET ...`; argv is the whole command line."""
    pre = _Parser(prog="oscar-export", add_help=False)
    pre.add_argument("--target", choices=TARGETS)
    target = pre.parse_known_args(argv)[0].target
    module = cli_module(target)
    if module is None:
        print(f"oscar-export --target {target}: export is not available yet in this version", file=sys.stderr)
        return 2
    return module.export_target(argv)


def export_parser(target: str, description: str, float_weights_help: str, device_memory: str) -> argparse.ArgumentParser:
    """The flags every target's export takes; a target adds its own (android: --group-size)."""
    p = _Parser(prog=f"oscar-export --target {target}", description=description)
    p.add_argument("--target", choices=(target,), required=True)
    p.add_argument("--model", default="bundled", help="'bundled' or a local Hugging Face checkpoint directory")
    p.add_argument("--rotations", default="calibrate",
                   help="calibrate (OSCAR rotations and clips fitted on --calibration-text, cached), a rotation "
                        "file, hadamard (data-free) or none (default %(default)s)")
    p.add_argument("--calibration-text", type=Path,
                   help="UTF-8 text for --rotations calibrate (default: the bundled public-domain text)")
    p.add_argument("--calibration-tokens", type=positive_int, default=DEFAULT_TOKENS,
                   help="tokens for --rotations calibrate (default %(default)s)")
    p.add_argument("--context", type=context_tokens,
                   help="max tokens of the cache (default: the model's max_position_embeddings, at most 4096)")
    p.add_argument("--out", type=Path, default=Path(recipe(target)["default_out"]),
                   help="artifact directory (default %(default)s)")
    p.add_argument("--float-weights", action="store_true", help=float_weights_help)
    p.add_argument("--device-memory", default=device_memory, help="memory for the manifest's plan (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the manifest")
    add_cache_flags(p)
    p.set_defaults(k_clip=None, v_clip=None)  # unset: a rotation file's clip ratios apply
    return p


def run_export(target: str, args: argparse.Namespace, export, summary: str = "") -> int:
    """Call export(model, out, rotations=..., max_context=..., float_weights=..., device_memory=..., **cache
    fields) and print the manifest (--json) or one line; bad input is a one-line error."""
    try:
        rotations, calibration = export_rotations(args)
        manifest = export(args.model, args.out, rotations=rotations, max_context=args.context,
                          float_weights=args.float_weights, device_memory=args.device_memory,
                          k_bits=args.k_bits or args.bits, v_bits=args.v_bits or args.bits,
                          cluster_dim=args.cluster_dim, k_clip=args.k_clip, v_clip=args.v_clip, sink=args.sink,
                          recent=args.recent)
    except (OscarInputError, RuntimeError) as err:  # RuntimeError: a native library could not be built
        print(f"oscar-export --target {target}: error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=2))
    else:
        total = sum(f["bytes"] for f in manifest["files"].values())
        print(f"wrote {args.out}: {len(manifest['files'])} files, {total / 2**20:.1f} MiB, weights "
              f"{manifest['weights']}, context {manifest['max_context']}, rotations {calibration}"
              f"{summary.format(**manifest)}")
    return 0


def export_rotations(args: argparse.Namespace) -> tuple[object, str]:
    """--rotations as the export takes it, and a few words on where it came from. `calibrate` is a cached
    calibration for the model, text and cache format (calibrations.calibrated_rotations)."""
    if args.rotations != "calibrate":
        if args.calibration_text is not None:
            raise OscarInputError(f"--calibration-text is for --rotations calibrate, not {args.rotations!r}")
        return args.rotations, args.rotations
    from .calibrations import calibrated_rotations
    from .cli import config_from_args

    config = config_from_args(args)
    path, reused = calibrated_rotations(args.model, config, args.calibration_text, args.calibration_tokens)
    return path, "calibrated (reused)" if reused else "calibrated"


def cmd_run(args: argparse.Namespace) -> int:
    from .export.artifact import load_manifest

    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as lone surrogates
        raise OscarInputError("--prompt is not valid UTF-8: expected text") from None
    target = load_manifest(args.artifact)["target"]
    allowed = recipe(target)["run_runtimes"]
    runtime = args.runtime or allowed[0]
    if runtime not in allowed:
        raise OscarInputError(f"--runtime {runtime!r} does not run a {target} artifact: expected one of {allowed}")
    result = _module(target).run_artifact(args.artifact, args.prompt, args.max_new_tokens, runtime, args.threads)
    print(json.dumps(result) if args.json else result["text"])
    return 0


def _module(target: str):
    module = cli_module(target)
    if module is None:
        raise OscarInputError(f"the {target} target is not available yet in this version")
    return module


def cmd_bench(args: argparse.Namespace) -> int:
    target = bench_runtimes()[args.runtime]
    kinds = recipe(target)["bench"]
    if args.what not in kinds:
        raise OscarInputError(f"bench {args.what} --runtime {args.runtime}: not available for the {target} target: "
                              f"expected one of {kinds}")
    args.threads = args.threads or None  # 0 and unset: every core
    return _module(target).bench(args)


def add_target_commands(sub) -> None:
    p = sub.add_parser("run", help="generate text from an exported artifact",
                       description="Greedy generation from an artifact written by --target.")
    p.add_argument("--artifact", required=True, type=Path, help="directory written by --target")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate (default %(default)s)")
    p.add_argument("--runtime", choices=run_runtimes(),
                   help="default: the target's runtime. laptop: " + ", ".join(recipe("laptop")["run_runtimes"])
                        + "; android: " + ", ".join(recipe("android")["run_runtimes"])
                        + "; ios: " + ", ".join(recipe("ios")["run_runtimes"])
                        + ". reference runs transformers with the reference cache (needs the source checkpoint)")
    p.add_argument("--threads", type=thread_count, default=0, help="runtime threads (0: its default)")
    p.add_argument("--json", action="store_true", help='print {"tokens": [...], "text": "..."}')
    p.set_defaults(func=cmd_run)

    runtimes = bench_runtimes()
    p = sub.add_parser("bench", help="benchmark the OSCAR attention kernels and decoding",
                       description="attention: decode-attention latency of the OSCAR op against the runtime's own "
                                   "attention over the same context. decode: end-to-end decode tokens/s of the "
                                   "exported model with the OSCAR cache against an fp32 KV cache. Same threads, "
                                   "measured in one run.")
    p.add_argument("what", choices=("attention", "decode"))
    p.add_argument("--steps", type=positive_int, default=64,
                   help="decode: timed greedy steps per context (default %(default)s)")
    p.add_argument("--runtime", choices=tuple(runtimes), default=next(r for t in ("laptop", *TARGETS) for r, rt in runtimes.items() if rt == t and available(t)),
                   help="runtime whose kernels and baselines are timed (default %(default)s)")
    p.add_argument("--context", default="4096,32768", help="comma-separated contexts (default %(default)s)")
    p.add_argument("--model", default="bundled", help="model whose attention shape is used: 'bundled', a preset "
                                                      "(llama-3-8b, ...) or a local checkpoint")
    p.add_argument("--threads", type=thread_count, help="threads for both (default or 0: every core)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p)
    p.set_defaults(func=cmd_bench)


def contexts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise OscarInputError(f"--context={text!r}: expected comma-separated positive token counts, e.g. 4096,32768")
    return values

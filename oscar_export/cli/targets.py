"""`oscar-export --target T`, `run` and `bench`: each asks the target registry (oscar_export/targets)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..bench import RUNTIMES, BenchRequest, kinds, measurer as bench_module
from ..config import OscarConfig, OscarInputError
from ..targets import get, names, registry
from .flags import (Parser, add_cache_flags, cache_flags_given, config_from_args, context_tokens, contexts,
                    export_parser, export_rotations, greedy_steps, positive_int, thread_count)


def export_target(argv: list[str]) -> int:
    """Run `oscar-export --target TARGET ...`; argv is the whole command line."""
    from ..export.artifact import check_export_args, default_context, rotation_metadata
    from ..export.pipeline import export_artifact
    from ..models import model_shape

    pre = Parser(prog="oscar-export", add_help=False)
    pre.add_argument("--target", choices=names())
    target = get(pre.parse_known_args(argv)[0].target)
    args = export_parser(target).parse_args(argv)
    missing = target.missing()
    try:
        if missing:
            raise OscarInputError(f"this target cannot export here: {missing}")
        options = target.export_options(args)
        # Before a calibration that may take minutes: --out, --device-memory and the rotations are checked at once.
        memory = check_export_args(args.out, args.rotations, args.device_memory)
        shape = model_shape(args.model)
        choice = None
        if device_chooses(args):
            rotations, calibration, choice = device_rotations(args, target, options, shape, memory)
        else:
            # A format the target cannot run is refused before calibrating too.
            target.check(options, config_from_args(args), default_context(shape, args.context))
            rotations, calibration = export_rotations(args)
        manifest = export_artifact(target, args.model, args.out, rotations=rotations, max_context=args.context,
                                   float_weights=args.float_weights, device_memory=args.device_memory,
                                   options=options, config=config_from_args(args, rotation_metadata(rotations)),
                                   format_choice=choice)
    except (OscarInputError, RuntimeError) as err:  # RuntimeError: a native library could not be built
        print(f"oscar-export --target {target.name}: error: {err}".splitlines()[0], file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(manifest, indent=2))
        return 0
    total = sum(f["bytes"] for f in manifest["files"].values())
    line = (f"wrote {args.out}: {len(manifest['files'])} files, {total / 2**20:.1f} MiB, weights {manifest['weights']}, "
            f"context {manifest['max_context']}, rotations {calibration}")
    if "cache" in manifest:
        line += f", cache {manifest['cache']['bits_per_element_at_max_context']:.3f} bits per K/V element"
    if choice is not None:
        config = OscarConfig.from_dict(manifest["config"])
        line += (f"; cache format chosen for {args.device_memory} at {manifest['max_context']} tokens: "
                 f"{config.describe()}, group {config.cluster_dim}, sink {config.sink}, recent {config.recent}, "
                 f"{choice['bits_per_element']:.3f} bits per element within a budget of {choice['budget_bits']:g} "
                 f"(the device leaves {choice['available_bits']:.2f} bits per element; without format flags an "
                 f"export spends at most {choice['ceiling_bits']:g})")
    print(line)
    return 0


def device_chooses(args: argparse.Namespace) -> bool:
    """The export chooses the cache format for --device-memory and --context: calibrated rotations and no flag
    that names a part of the format."""
    return args.rotations == "calibrate" and not cache_flags_given(args)


def device_rotations(args: argparse.Namespace, target, options, shape, memory: int) -> tuple:
    """(rotation file, where it came from, why its format): evaluate.budget.device_calibration for the device
    (`memory` bytes) and context the export is for."""
    from ..evaluate.budget import device_calibration
    from ..export.artifact import default_context

    path, reused, choice = device_calibration(
        args.model, shape, memory, default_context(shape, args.context),
        target.weight_plan(options, args.float_weights), target.scale_dtypes, target.min_window,
        args.calibration_text, args.calibration_tokens)
    return path, "calibrated for the device (reused)" if reused else "calibrated for the device", choice


def cmd_run(args: argparse.Namespace) -> int:
    from ..run import run_artifact

    chat = args.chat is not None
    flag, text = ("--chat", args.chat) if chat else ("--prompt", args.prompt)
    if not text:
        raise OscarInputError(f"{flag} is empty: expected text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 arrive as lone surrogates
        raise OscarInputError(f"{flag} is not valid UTF-8: expected text") from None
    result = run_artifact(args.artifact, text, args.max_new_tokens, args.runtime, args.threads, chat=chat)
    print(json.dumps(result) if args.json else result["text"])
    if result.get("stopped_at_context"):
        print(f"oscar-export run: stopped after {len(result['tokens'])} new tokens: the artifact's context of "
              f"{result['stopped_at_context']} tokens is full", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.artifact is not None:
        return _bench_artifact(args)
    if args.what == "memory":
        raise OscarInputError("bench memory measures a shipped artifact: expected --artifact DIR")
    if args.device_memory:
        raise OscarInputError("bench --device-memory judges an artifact's memory: expected bench memory --artifact")
    for flag, value in (("--gguf", args.gguf), ("--profile", args.profile)):
        if value:
            raise OscarInputError(f"bench {flag} measures a shipped artifact: expected --artifact DIR with it")
    owners = {t.runtime: t for t in registry().values()}  # the target whose packages each runtime needs
    if args.runtime is None:  # the first runtime that measures this and can run here
        usable = [r for r in RUNTIMES if args.what in kinds(r) and owners[r].missing() is None]
        args.runtime = (usable or list(RUNTIMES))[0]
    if args.what not in kinds(args.runtime):
        raise OscarInputError(f"bench {args.what} --runtime {args.runtime}: not measured on {args.runtime}: "
                              f"expected one of {kinds(args.runtime)}")
    missing = owners[args.runtime].missing()
    if missing:
        raise OscarInputError(f"bench --runtime {args.runtime}: {missing}")
    request = BenchRequest(contexts(args.context or "4096,32768"), args.model, config_from_args(args),
                           args.threads or None, args.steps or 64, args.float_weights)
    measurer = bench_module(args.runtime, args.what)
    report = measurer.measure(request)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from ..bench.tables import print_report

        print_report(args.what, RUNTIMES[args.runtime].label, request, report, measurer.CONTESTANTS)
    return 0


def _bench_artifact(args: argparse.Namespace) -> int:
    from ..bench.artifact_decode import bench_artifact_decode, print_artifact_decode

    if args.what == "memory":
        return _bench_memory(args)
    if args.what != "decode":
        raise OscarInputError(f"bench {args.what} --artifact: expected 'bench decode' (an artifact's decode speed) "
                              "or 'bench memory' (its run-time memory)")
    report = bench_artifact_decode(args.artifact, args.context and contexts(args.context), args.steps or 64,
                                   args.threads or None,
                                   args.repeats, args.gguf, args.runtime, args.profile)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_artifact_decode(report)
    return 0


def _bench_memory(args: argparse.Namespace) -> int:
    from ..bench.memory import bench_artifact_memory, print_artifact_memory

    context = contexts(args.context) if args.context else [None]
    if len(context) != 1:
        raise OscarInputError(f"bench memory --context {args.context}: expected one context")
    report = bench_artifact_memory(args.artifact, context[0], args.steps or 4, args.threads or None, args.runtime,
                                   args.device_memory)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_artifact_memory(report)
    return 0


def add_target_commands(sub) -> None:
    targets = registry().values()
    p = sub.add_parser("run", help="generate text from an exported artifact",
                       description="Greedy generation from an artifact written by --target.")
    p.add_argument("--artifact", required=True, type=Path, help="directory written by --target")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="prompt text, as the model reads it")
    text.add_argument("--chat", metavar="QUESTION",
                      help="a question, put in the chat template the artifact's tokenizer carries")
    p.add_argument("--max-new-tokens", type=context_tokens, default=64,
                   help="tokens to generate, at most what the artifact's context leaves (default %(default)s)")
    p.add_argument("--runtime", choices=tuple(dict.fromkeys(r for t in targets for r in t.run_runtimes())),
                   help="default: the target's runtime. " + "; ".join(f"{t.name}: {', '.join(t.run_runtimes())}"
                                                                     for t in targets)
                        + ". reference runs the eager graph (PyTorch) with the artifact's own weights, config and "
                          "rotations (it needs the source checkpoint)")
    p.add_argument("--threads", type=thread_count, default=0, help="runtime threads (0: its default)")
    p.add_argument("--json", action="store_true", help='print {"tokens": [...], "text": "..."}')
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("bench", help="benchmark the OSCAR attention kernels and decoding",
                       description="attention: decode-attention latency of the OSCAR op against the runtime's own "
                                   "attention over the same context. decode: end-to-end decode tokens/s of the "
                                   "exported model with the OSCAR cache against the same weights with the runtime's "
                                   "own KV caches (ONNX Runtime: fp32 past/present and GroupQueryAttention; "
                                   "ExecuTorch: custom_sdpa's fp32 cache and its int8 quantized cache). Same "
                                   "threads, measured in one run. memory (--artifact): the artifact's peak run-time memory "
                                   "with its cache full, in a fresh process, against the planner's numbers.")
    p.add_argument("what", choices=(*dict.fromkeys(k for r in RUNTIMES for k in kinds(r)), "memory"))
    p.add_argument("--steps", type=greedy_steps,
                   help="decode: timed greedy steps per context (default 64); memory: decode steps (default 4)")
    p.add_argument("--device-memory", help="memory: judge the peak against this device (e.g. 8GB) less the "
                                           "planner's reserve (default: the artifact's plan)")
    p.add_argument("--runtime", choices=tuple(RUNTIMES),
                   help="runtime whose kernels and baselines are timed (default: the first installed one that "
                        "measures WHAT: " + ", ".join(f"{r} ({'/'.join(kinds(r))})" for r in RUNTIMES)
                        + ")")
    p.add_argument("--context", help="comma-separated contexts (default 4096,32768; with --artifact a quarter "
                                      "of its context and all of it)")
    p.add_argument("--artifact", type=Path,
                   help="decode: time this exported artifact as shipped (its weights, its target's runtime; "
                        "--runtime picks another of them), prefilling a real prompt, instead of the float-weight "
                        "graphs built from --model")
    p.add_argument("--gguf", type=Path, help="with --artifact: also time this GGUF of the same model in llama.cpp "
                                             "with f16, q8_0 and q4_0 K/V caches (needs llama-cpp-python)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="with --artifact: timed turns of --steps per contestant, median reported (default "
                        "%(default)s)")
    p.add_argument("--float-weights", action="store_true",
                   help="decode with --model: float32 weights in every variant (default: the target artifact's "
                        "4-bit weights, the baselines quantized by the same tool)")
    p.add_argument("--profile", action="store_true",
                   help="with --artifact: then profile the artifact's decode step per op type (laptop: ONNX "
                        "Runtime's profiler)")
    p.add_argument("--model", default="bundled", help="model whose attention shape is used: 'bundled', a preset "
                                                      "(llama-3-8b, ...), a local checkpoint or a .gguf file")
    p.add_argument("--threads", type=thread_count, help="threads for both (default or 0: every core)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p, scale_dtypes=True)
    p.set_defaults(func=cmd_bench)

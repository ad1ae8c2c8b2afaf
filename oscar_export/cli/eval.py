"""`oscar-export eval`: quality of the packed cache against the baselines at the same bit budget.

cli.py wires it in with `add_eval_command(subparsers)`; the command's function raises
OscarInputError for bad input, which the CLI's main turns into a one-line error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .flags import add_cache_flags, calibration_config, config_from_args, number_list, positive_int
from ..config import OscarConfig, OscarInputError
from ..evaluate.specs import DEFAULT_METHODS, METHODS, METRICS, method_config


def _names(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if not names or bad or len(set(names)) != len(names):
        raise OscarInputError(f"{flag}={text!r}: expected distinct comma-separated names from {','.join(allowed)}")
    return names


def _method_specs(text: str) -> list[str]:
    specs = [m.strip() for m in text.split(",") if m.strip()]
    try:
        for spec in specs:
            method_config(spec, OscarConfig())
    except OscarInputError as err:
        raise OscarInputError(f"--methods={text!r}: {err}") from None
    if not specs or len(set(specs)) != len(specs):
        raise OscarInputError(f"--methods={text!r}: expected distinct comma-separated method specs")
    return specs


def _ints(text: str, flag: str) -> list[int]:
    return number_list(text, flag, int, lambda v: v > 0, "comma-separated positive integers, e.g. 512,1024,2048")


def _floats(text: str, flag: str) -> list[float]:
    return number_list(text, flag, float, lambda v: 0.0 <= v <= 1.0,
                       "comma-separated fractions in [0, 1], e.g. 0.1,0.5,0.9")


def cmd_eval(args: argparse.Namespace) -> int:
    from ..evaluate.driver import evaluate
    from ..evaluate.tables import plot, print_table

    metadata = None
    if args.rotations is not None:  # a budget-chosen file sets the format every method is evaluated at
        from ..calibration.files import load_rotations

        metadata = load_rotations(args.rotations).metadata
    config = config_from_args(args, metadata)
    if metadata is None:  # `oscar` is calibrated here, for the K rounding calibrations default to
        config = calibration_config(args, config)
    result = evaluate(
        args.model,
        methods=_method_specs(args.methods),
        config=config,
        rotations=args.rotations,
        contexts=_ints(args.contexts, "--contexts") if args.contexts else None,
        text=args.text,
        metrics=_names(args.metrics, METRICS, "--metrics"),
        chunk=args.chunk,
        ppl_tokens=args.ppl_tokens,
        attn_tokens=args.attn_tokens,
        needle_context=args.needle_context,
        needle_depths=_floats(args.needle_depths, "--needle-depths"),
        needle_seeds=args.needle_seeds,
        calibration_tokens=args.calibration_tokens,
        match_clip=args.match_clip,
        per_head=args.per_head,
    )
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def add_eval_command(subparsers) -> argparse.ArgumentParser:
    """Register `eval` on the CLI's subparsers; returns the new parser."""
    p = subparsers.add_parser(
        "eval",
        help="quality of the packed cache against the baselines",
        description="Perplexity at several context lengths, decode attention-output error per layer and needle "
                    "retrieval, for fp16, naive INT, Hadamard, KIVI, OSCAR (and online OSCAR) caches with the same "
                    "sink and recent windows. The first part of the text is reserved for calibration and never "
                    "evaluated.",
    )
    p.add_argument("--model", default="bundled", help="'bundled', a local HF checkpoint directory or a .gguf file")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {','.join(METHODS)}; a quantized one may name its bits: "
                        f"oscar-3, oscar-k3v2 (default %(default)s)")
    p.add_argument("--rotations", type=Path,
                   help="rotation file for 'oscar' (default: calibrate on the reserved first part of the text)")
    p.add_argument("--text", type=Path, help="UTF-8 evaluation text (default: the bundled held-out text)")
    p.add_argument("--metrics", default=",".join(METRICS), help="comma-separated subset of %(default)s")
    p.add_argument("--contexts", help="perplexity context lengths (default: P/4, P/2 and P, P the model's "
                                      "max_position_embeddings up to 8192)")
    p.add_argument("--ppl-tokens", type=positive_int, default=4096,
                   help="tokens of text in windows of the longest context (whole windows, at least one; shorter "
                        "contexts read the windows' first tokens; default %(default)s)")
    p.add_argument("--chunk", type=positive_int, default=64, help="tokens per forward chunk (default %(default)s)")
    p.add_argument("--attn-tokens", type=positive_int, default=1024,
                   help="tokens captured for the attention error (default %(default)s)")
    p.add_argument("--needle-context", type=positive_int,
                   help="haystack tokens of the needle task (default P/2, see --contexts)")
    p.add_argument("--needle-depths", default="0.1,0.3,0.5,0.7,0.9",
                   help="needle depths, one needle each in the same haystack (default %(default)s)")
    p.add_argument("--needle-seeds", type=positive_int, default=1,
                   help="haystack/needle draws, one sequence each (default %(default)s)")
    p.add_argument("--calibration-tokens", type=positive_int, default=4096,
                   help="tokens for on-the-fly calibration of 'oscar' (default %(default)s)")
    p.add_argument("--match-clip", action="store_true",
                   help="give naive, hadamard, kivi and online the clip ratios oscar uses (default: the cache flags')")
    p.add_argument("--per-head", action="store_true",
                   help="calibrated 'oscar' fits one rotation per KV head (default: one per layer)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", type=Path, help="write a PNG with the three panels")
    add_cache_flags(p, scale_dtypes=True)
    p.set_defaults(func=cmd_eval)
    return p

"""The oscar-export command line: the parser, and main(), which turns every failure into one line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .. import __version__
from ..calibration.cached import DEFAULT_HELDOUT_TOKENS, DEFAULT_TOKENS
from ..config import OscarInputError
from ..targets import names
from . import commands
from .eval import add_eval_command
from .flags import Parser, add_cache_flags, context_tokens, greedy_steps, kl_tokens, positive_int
from .rotations import add_rotations_command
from .targets import add_target_commands

def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="oscar-export", description="Export language models with a 2-bit OSCAR KV cache.")
    parser.add_argument("--version", action="version", version=f"oscar-export {__version__}")
    parser.add_argument("--target", choices=names(), help="export the model for a device family")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)

    p = sub.add_parser("plan", help="does a model and context fit a device?",
                       description="Memory plan: weights + OSCAR KV cache + reserve against device memory.")
    p.add_argument("--model", default="bundled",
                   help="'bundled', a preset (llama-2-7b, llama-3-8b, qwen2.5-7b, mistral-7b), a local HF checkpoint "
                        "or a .gguf file")
    p.add_argument("--device-memory", default="8GB", help="device memory, e.g. 8GB (binary units)")
    p.add_argument("--context", type=positive_int, default=4096, help="tokens of context (default %(default)s)")
    p.add_argument("--target", choices=names(),
                   help="plan the weights as this target stores them; without format flags, also the bit budget "
                        "its export chooses the cache format within")
    p.add_argument("--weight-bits", type=int, choices=(4, 8, 16), help="bits of the linear weights (default 4)")
    p.add_argument("--embedding-bits", type=int, choices=(4, 8, 16), help="bits of the embedding table (default 16)")
    p.add_argument("--weight-group", type=positive_int,
                   help="input channels per weight scale/zero (default 32)")
    p.add_argument("--reserve", help="memory kept for OS, runtime and activations (default 20%% of device memory)")
    p.add_argument("--rotations", type=Path,
                   help="a rotation file whose cache format (one chosen by calibrate --budget-bits) the plan uses "
                        "where no flag is given")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p, scale_dtypes=True)
    p.set_defaults(func=commands.cmd_plan)

    p = sub.add_parser("info", help="what is installed and which runtimes are available",
                       description="Installed runtimes, native op libraries and the bundled model; with "
                                   "--artifact, what an exported artifact holds and how its rotations were made.")
    p.add_argument("--artifact", type=Path, help="an exported artifact directory to describe")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=commands.cmd_info)

    p = sub.add_parser("report", help="memory plan and codec report on a model's real K/V",
                       description="Plan for the model, then bits per element and reconstruction error of the "
                                   "packed cache at 2, 3 and 4 bits on the model's captured K/V.")
    p.add_argument("--model", default="bundled", help="'bundled', a local HF checkpoint directory or a .gguf file")
    p.add_argument("--text", type=Path, help="UTF-8 text to run (default: the bundled held-out text)")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens of text (default %(default)s)")
    p.add_argument("--device-memory", default="8GB", help="device memory for the plan (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p, scale_dtypes=True)
    p.set_defaults(func=commands.cmd_report)

    p = sub.add_parser("calibrate", help="fit OSCAR rotations from a local checkpoint",
                       description="Fit K and V rotations (R = U.H.P_br), clip ratios and optional Lloyd-Max "
                                   "levels from the model's own activations; writes a rotation file.")
    p.add_argument("--model", default="bundled", help="'bundled', a local HF checkpoint directory or a .gguf file")
    p.add_argument("--out", required=True, type=Path, help="rotation file to write (.safetensors)")
    p.add_argument("--text", type=Path, help="UTF-8 calibration text (default: the bundled held-out text)")
    p.add_argument("--tokens", type=positive_int, default=DEFAULT_TOKENS,
                   help="calibration tokens (default %(default)s)")
    p.add_argument("--heldout-tokens", type=positive_int, default=DEFAULT_HELDOUT_TOKENS,
                   help="further tokens for the clip search and Lloyd-Max fit (default %(default)s)")
    p.add_argument("--zoo-out", type=Path, help="also write the official RotationZoo K/V pair into this directory "
                                                "(k_rotation_qqt_h_pbr.pt, v_rotation_sst_h_pbr.pt)")
    p.add_argument("--per-head", action="store_true", help="one rotation per (layer, KV head) (format v2)")
    p.add_argument("--lloyd-max", action="store_true", help="fit Lloyd-Max levels per layer for K and V")
    p.add_argument("--budget-bits", type=float, metavar="B",
                   help="choose the cache format (K/V bits, group, fp16 windows) that fits B bits per K/V element at "
                        "--context and loses least on the calibration text; the file carries it, and export and eval "
                        "use it unless a flag overrides")
    p.add_argument("--context", type=positive_int,
                   help="with --budget-bits: the context the budget holds at (default: the model's "
                        "max_position_embeddings, at most 8192)")
    p.add_argument("--offload-folder", type=Path, help="offload weights that do not fit in memory to this folder")
    p.add_argument("--max-memory", help="memory the weights may use before offloading, e.g. 4GB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p, scale_dtypes=True)
    p.set_defaults(func=commands.cmd_calibrate)

    p = sub.add_parser("parity", help="compare codes, outputs and tokens across runtimes",
                       description="Run the same prompt through every runtime available here and compare "
                                   "codes, attention outputs, logits and greedy tokens with the reference. "
                                   "Exit code 1 on any mismatch beyond the thresholds in docs/parity.md.")
    p.add_argument("--model", default="bundled", help="'bundled', a local HF checkpoint directory or a .gguf file")
    p.add_argument("--text", type=Path, help="UTF-8 text whose first tokens are the prompt (default: held-out text)")
    p.add_argument("--prompt-tokens", type=context_tokens, default=400, help="prompt length (default %(default)s)")
    p.add_argument("--steps", type=greedy_steps, default=16, help="greedy steps (default %(default)s)")
    p.add_argument("--rotations", default="hadamard",
                   help="hadamard, online, none, calibrate (a cached calibration, as export makes) or a rotation "
                        "file (default %(default)s)")
    p.add_argument("--artifact", type=Path,
                   help="an exported artifact: compare its runtimes with the eager graph instead "
                        "(--model, --rotations and the cache flags then come from its manifest)")
    p.add_argument("--kl-tokens", type=kl_tokens, default=2048, metavar="N",
                   help="with --artifact: positions of --text teacher-forced through the reference, the float model "
                        "and every runtime, whose next-token distributions are compared (KL divergence, top-1 "
                        "agreement, perplexity); at most the artifact's context (default %(default)s; 0: skip)")
    p.add_argument("--no-answers", action="store_true",
                   help="with --artifact: skip the known questions of the artifact's model (oscar_export/parity/answers.py)")
    p.add_argument("--save-trace", type=Path, metavar="FILE",
                   help="with --artifact: record the reference run (prompt, tokens, logits, codes; on CUDA when "
                        "present) into FILE instead of comparing, to check a runtime on another machine")
    p.add_argument("--against", type=Path, metavar="FILE",
                   help="with --artifact: compare the runtimes here with a trace saved by --save-trace elsewhere "
                        "(its prompt and steps apply)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p)
    p.set_defaults(func=commands.cmd_parity)

    add_rotations_command(sub)
    add_eval_command(sub)
    add_target_commands(sub)
    parser.commands = tuple(sub.choices)  # a subcommand first: its own flags follow, even "--target"
    return parser


def _quiet_third_party_logs() -> None:
    # torchao (loaded by transformers) logs about CUDA-only extensions and deprecated pytree
    # registrations at import; none of it concerns this CLI's users.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _prompt_values_joined(argv: list[str]) -> list[str]:
    """`--prompt VALUE` as `--prompt=VALUE` (and --chat), so a prompt that looks like a flag ("--target") stays
    a prompt."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in ("--prompt", "--chat") and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


# Commands that never load a model, a runtime or Triton: they answer without importing torch first.
WITHOUT_TORCH = ("plan", "info", "rotations")


def _triton_interprets_without_a_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        # Without a GPU, Triton kernels run through the interpreter; the flag must be set before
        # triton is first imported (transformers may import it through torchao).
        os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv: list[str] | None = None) -> int:
    _quiet_third_party_logs()
    argv = _prompt_values_joined(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if (not argv or argv[0] not in parser.commands) and any(arg.split("=")[0] == "--target" for arg in argv):
        from .targets import export_target  # each target has its own flags (--model, --out, ...)

        _triton_interprets_without_a_gpu()
        return _reporting("--target", lambda: export_target(argv))
    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command is None:
        parser.print_help()
        return 0
    if args.command not in WITHOUT_TORCH:
        _triton_interprets_without_a_gpu()
    return _reporting(args.command, lambda: args.func(args))


def _reporting(command: str, run) -> int:
    """Expected failures are one line and exit 2; anything else is an internal error: one line, the
    traceback in a log file, exit 1."""
    try:
        return run()
    except OscarInputError as err:
        print(f"oscar-export {command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"oscar-export {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the last resort that keeps tracebacks off the user's screen
        import tempfile
        import traceback

        fd, log = tempfile.mkstemp(prefix="oscar-export-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            traceback.print_exc(file=f)
        first = str(err).splitlines()[0] if str(err) else ""
        print(f"oscar-export {command}: internal error: {type(err).__name__}: {first[:300]} (traceback in {log}; "
              f"please report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""The oscar-export command line."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import __version__
from .cli_rotations import add_rotations_command
from .calibrations import DEFAULT_HELDOUT_TOKENS, DEFAULT_TOKENS
from .config import SUPPORTED_BITS, SUPPORTED_CLUSTER_DIMS, OscarConfig, OscarInputError, default_cluster_dim
from .targets import TARGETS, available

# Runtime name -> Python distribution that provides it.
RUNTIMES = {
    "torch": "torch",
    "transformers": "transformers",
    "onnxruntime": "onnxruntime",
    "executorch": "executorch",
    "coremltools": "coremltools",
    "triton": "triton",
}

# Piped output (CI logs, files) gets room for the wide tables instead of the 80-column default.
out = Console(width=None if sys.stdout.isatty() else 132)


class _Parser(argparse.ArgumentParser):
    """Bad arguments give one line and exit code 2, never a usage dump."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: expected a positive integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive: expected a positive integer")
    return value


def thread_count(text: str) -> int:
    """--threads: 0 (the runtime's default) up to four per core; more only thrashes, and huge counts hang."""
    limit = 4 * (os.cpu_count() or 1)
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: expected 0..{limit}") from None
    if not 0 <= value <= limit:
        raise argparse.ArgumentTypeError(f"{value}: expected 0 (the runtime's default) .. {limit} (4 per core)")
    return value


def context_tokens(text: str) -> int:
    """--context: a positive token count within what a cache can be planned for."""
    from .export.artifact import MAX_CONTEXT

    value = positive_int(text)
    if value > MAX_CONTEXT:
        raise argparse.ArgumentTypeError(f"{value} tokens: expected at most {MAX_CONTEXT}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: expected a token count >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: expected a token count >= 0")
    return value


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    defaults = OscarConfig()
    g = p.add_argument_group("KV cache format")
    g.add_argument("--bits", type=int, choices=SUPPORTED_BITS, default=defaults.k_bits, help="bits per K and V code")
    g.add_argument("--k-bits", type=int, choices=SUPPORTED_BITS, help="bits per K code (overrides --bits)")
    g.add_argument("--v-bits", type=int, choices=SUPPORTED_BITS, help="bits per V code (overrides --bits)")
    g.add_argument("--cluster-dim", type=int, choices=SUPPORTED_CLUSTER_DIMS,
                   help=f"quantization group along head_dim (default {defaults.cluster_dim}, or the largest group "
                        f"that divides the model's head_dim when {defaults.cluster_dim} does not)")
    g.add_argument("--k-clip", type=float,
                   help=f"fraction of each K group's range kept (default: a rotation file's, else {defaults.k_clip})")
    g.add_argument("--v-clip", type=float,
                   help=f"fraction of each V group's range kept (default: a rotation file's, else {defaults.v_clip})")
    g.add_argument("--sink", type=_count, default=defaults.sink, help="fp16 sink tokens (default %(default)s)")
    g.add_argument("--recent", type=_count, default=defaults.recent, help="fp16 recent window (default %(default)s)")


def config_from_args(args: argparse.Namespace, rotation_metadata: dict | None = None) -> OscarConfig:
    """The cache flags; clip ratios and codebook a calibrated rotation file carries apply unless overridden."""
    meta = rotation_metadata or {}
    defaults = OscarConfig()
    cluster_dim = args.cluster_dim
    if cluster_dim is None:
        from .models import model_shape

        cluster_dim = default_cluster_dim(model_shape(args.model).head_dim if getattr(args, "model", None) else None)
    return OscarConfig(
        k_bits=args.k_bits or args.bits,
        v_bits=args.v_bits or args.bits,
        cluster_dim=cluster_dim,
        k_clip=args.k_clip if args.k_clip is not None else meta.get("k_clip") or defaults.k_clip,
        v_clip=args.v_clip if args.v_clip is not None else meta.get("v_clip") or defaults.v_clip,
        codebook=meta.get("codebook") or defaults.codebook,
        sink=args.sink,
        recent=args.recent,
    )


def _gib(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _print_plan(p: dict) -> None:
    table = Table(title=f"Memory plan: {p['model']} at {p['context']} tokens on {_gib(p['device_memory_bytes'])}")
    table.add_column("item")
    table.add_column("OSCAR cache", justify="right")
    table.add_column("fp16 cache", justify="right")
    w = p["weights_breakdown"]
    table.add_row(f"weights ({p['weight_bits']}-bit linear, {p['embedding_bits']}-bit embeddings)",
                  _gib(p["weights_bytes"]), _gib(p["weights_bytes"]))
    table.add_row("  linear layers / embeddings / lm_head / K rotations",
                  f"{_gib(w['linear'])} / {_gib(w['embeddings'])} / {_gib(w['lm_head'])} / {_gib(w['rotations'])}", "")
    table.add_row("KV bytes per token", f"{p['kv_bytes_per_token']:,}", f"{p['kv_bytes_per_token_fp16']:,}")
    table.add_row(f"KV cache at {p['context']} tokens", _gib(p["kv_bytes"]), _gib(p["kv_bytes_fp16"]))
    table.add_row("bits per K/V element", f"{p['bits_per_element']:.3f}", "16.000")
    table.add_row("runtime/OS reserve", _gib(p["reserve_bytes"]), _gib(p["reserve_bytes"]))
    table.add_row("largest context that fits", f"{p['max_context']:,}", f"{p['max_context_fp16']:,}")
    table.add_row("verdict", "fits" if p["fits"] else "does NOT fit", "fits" if p["fits_fp16"] else "does NOT fit")
    out.print(table)
    for warning in p["warnings"]:
        out.print(f"[yellow]warning:[/yellow] {warning}")


def cmd_plan(args: argparse.Namespace) -> int:
    from .models import model_shape
    from .planner import parse_bytes, plan

    memory = parse_bytes(args.device_memory, "--device-memory")
    reserve = parse_bytes(args.reserve, "--reserve") if args.reserve else None
    result = plan(
        model_shape(args.model),
        config_from_args(args),
        memory,
        args.context,
        weight_bits=args.weight_bits,
        embedding_bits=args.embedding_bits,
        reserve=reserve,
        weight_group=args.weight_group,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_plan(result)
    return 0


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cmd_artifact_info(directory: Path, as_json: bool) -> int:
    """`info --artifact DIR`: what was exported, with what cache format, and how its rotations were made."""
    from .export.artifact import load_manifest

    manifest = load_manifest(directory, verify=False)  # describes a damaged artifact too
    info = {key: manifest.get(key) for key in ("target", "runtime", "model", "weights", "max_context", "config",
                                               "rotations", "rotations_metadata")}
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    table = Table(title=f"Artifact {directory}")
    table.add_column("item")
    table.add_column("value")
    for key in ("target", "runtime", "weights", "max_context", "rotations"):
        table.add_row(key, str(info[key]))
    table.add_row("model", str(info["model"]["source"]))
    table.add_row("cache format", json.dumps(info["config"]))
    for key, value in sorted((info["rotations_metadata"] or {}).items()):
        table.add_row(f"rotations: {key}", json.dumps(value))
    out.print(table)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    if args.artifact is not None:
        return cmd_artifact_info(args.artifact, args.json)
    from .models import BUNDLED_MODEL_DIR
    from .native import EXECUTORCH_LIBRARY, ORT_LIBRARY, ROOT

    native_build = ROOT / "build" / "native"

    versions = {name: _installed(dist) for name, dist in RUNTIMES.items()}
    runtimes = {name: v is not None and importlib.util.find_spec(name) is not None for name, v in versions.items()}
    info = {
        "version": __version__,
        "python": sys.version.split()[0],
        "bundled_model": str(BUNDLED_MODEL_DIR),
        "bundled_model_present": (BUNDLED_MODEL_DIR / "model.safetensors").is_file(),
        "runtimes": runtimes,
        "versions": versions,
        # Built by the set-up (or on first use).
        "native_op_libraries": {"onnxruntime": (native_build / ORT_LIBRARY).is_file(),
                                "executorch": (native_build / EXECUTORCH_LIBRARY).is_file()},
        "targets": {target: available(target) for target in TARGETS},
        # What `run --runtime` offers for a laptop artifact, and what each costs.
        "laptop_runtimes": {"onnxruntime": "native OscarAttention op library (fused 2-bit decode kernels)",
                            "onnx-fallback": "stock ONNX Runtime, no native library: the op runs as a "
                                             "pure-ONNX function and the cache is copied every step (slower)"},
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    table = Table(title=f"oscar-export {__version__}")
    table.add_column("item")
    table.add_column("status")
    table.add_row("bundled model", f"{info['bundled_model']} ({'present' if info['bundled_model_present'] else 'missing'})")
    for name, ok in runtimes.items():
        table.add_row(f"runtime {name}", versions[name] if ok else "not installed")
    for name, ok in info["native_op_libraries"].items():
        table.add_row(f"native ops for {name}", "built" if ok else "not built yet")
    for name, ok in info["targets"].items():
        table.add_row(f"target {name}", "available" if ok else "not available yet")
    for name, text in info["laptop_runtimes"].items():
        table.add_row(f"laptop runtime {name}", text)
    out.print(table)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .models import model_shape
    from .planner import parse_bytes, plan
    from .report import codec_report

    config = config_from_args(args)
    if args.text is not None and not args.text.is_file():
        raise OscarInputError(f"text file {str(args.text)!r} does not exist: expected a UTF-8 text file")
    shape = model_shape(args.model)
    planned = plan(shape, config, parse_bytes(args.device_memory, "--device-memory"),
                   shape.max_position_embeddings or 4096)
    report = codec_report(args.model, config, args.text, args.tokens)
    if args.json:
        print(json.dumps({"plan": planned, "codec": report}, indent=2))
        return 0
    _print_plan(planned)
    table = Table(title=f"Codec on real K/V of {report['model']}: {report['tokens']} tokens, "
                        f"{report['layers']} layers, head_dim {report['head_dim']}, cluster_dim {config.cluster_dim}, "
                        f"sink {config.sink}, recent {config.recent}")
    for col in ("bits", "rotation", f"bits/elem at {report['tokens']}", "bits/elem at 128K", "K rel err",
                "V rel err", "decode attn rel err"):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        table.add_row(str(r["bits"]), r["rotation"], f"{r['bits_per_element']:.3f}",
                      f"{r['bits_per_element_at_128k']:.3f}", f"{r['k_rel_error']:.4f}",
                      f"{r['v_rel_error']:.4f}", f"{r['decode_attn_rel_error']:.4f}")
    out.print(table)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import resource

    from .calibrations import default_text, read_text, run_calibration
    from .models import load_model
    from .rotation_files import check_writable, export_rotation_zoo, save_rotations, zoo_paths

    config = config_from_args(args)
    text_path = args.text or default_text()
    read_text(text_path)  # a missing or non-UTF-8 text, or an unwritable --out, fails before calibrating
    check_writable(args.out)
    model, tokenizer = load_model(args.model, offload_folder=args.offload_folder, max_memory=args.max_memory)
    rotation_set, seconds = run_calibration(args.model, config, text_path, args.tokens, args.heldout_tokens,
                                            per_head=args.per_head, lloyd_max=args.lloyd_max, model=model,
                                            tokenizer=tokenizer)
    save_rotations(args.out, rotation_set)
    zoo = None
    if args.zoo_out is not None:
        zoo = zoo_paths(rotation_set, args.zoo_out)
        export_rotation_zoo(rotation_set, *zoo)
    summary = {
        "out": str(args.out),
        "zoo_out": None if zoo is None else [str(path) for path in zoo],
        "layers": rotation_set.layers,
        "head_dim": rotation_set.head_dim,
        "per_head": args.per_head,
        "k_clip": rotation_set.metadata["k_clip"],
        "v_clip": rotation_set.metadata["v_clip"],
        "seconds": seconds,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        if zoo is not None:
            out.print(f"wrote the RotationZoo pair {zoo[0]} and {zoo[1]}")
        out.print(f"wrote {summary['out']}: {summary['layers']} layers, head_dim {summary['head_dim']}, "
                  f"clip K {summary['k_clip']} V {summary['v_clip']}, {summary['seconds']} s, "
                  f"peak RSS {summary['peak_rss_bytes'] / 2**20:.0f} MiB")
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    import torch

    from .models import load_model
    from .parity import run_parity
    from .report import read_tokens

    if args.artifact is not None:  # the artifact's runtimes against the eager graph (parity.py)
        from .parity import artifact_parity_command

        return artifact_parity_command(args, out)
    model, tokenizer = load_model(args.model)
    if torch.cuda.is_available():
        model = model.cuda()
    rotations, metadata = args.rotations, None
    if rotations == "calibrate":
        from .calibrations import calibrated_rotations

        rotations = calibrated_rotations(args.model, config_from_args(args))[0]
    if rotations not in ("hadamard", "online", "none"):
        from .rotation_files import load_rotations

        rotations = load_rotations(rotations)
        metadata = rotations.metadata
    prompt = read_tokens(tokenizer, args.text, args.prompt_tokens).to(model.device)
    report = run_parity(model, prompt, args.steps, config_from_args(args, metadata), rotations=rotations)
    if args.json:
        print(json.dumps({**report, "model": args.model}, indent=2))
    else:
        table = Table(title=f"Parity on {args.model}: {args.prompt_tokens}-token prompt, {args.steps} greedy steps, "
                            f"rotations {args.rotations}")
        for col in ("runtime", "codes mismatch", "windows/scales/zeros", "attn max rel err",
                    "attn mean rel err", "logits max rel err", "tokens", "verdict"):
            table.add_column(col)
        for name, r in report["runtimes"].items():
            table.add_row(f"{name} ({r['how']})", f"{r['codes_mismatch_fraction']:.2e} ({r['codes_mismatched']})",
                          "exact" if r["windows_scales_zeros_exact"] else "DIFFER",
                          f"{r['max_rel_error']:.2e}", f"{r['mean_rel_error']:.2e}",
                          f"{r['logits_max_rel_error']:.2e}", "match" if r["tokens_match"] else "DIFFER",
                          "ok" if r["ok"] else "FAIL")
        out.print(table)
    return 0 if report["ok"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="oscar-export", description="Export language models with a 2-bit OSCAR KV cache.")
    parser.add_argument("--version", action="version", version=f"oscar-export {__version__}")
    parser.add_argument("--target", choices=TARGETS, help="export the model for a device family")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)

    p = sub.add_parser("plan", help="does a model and context fit a device?",
                       description="Memory plan: weights + OSCAR KV cache + reserve against device memory.")
    p.add_argument("--model", default="bundled",
                   help="'bundled', a preset (llama-2-7b, llama-3-8b, qwen2.5-7b, mistral-7b) or a local HF checkpoint")
    p.add_argument("--device-memory", default="8GB", help="device memory, e.g. 8GB (binary units)")
    p.add_argument("--context", type=positive_int, default=4096, help="tokens of context (default %(default)s)")
    p.add_argument("--weight-bits", type=int, choices=(4, 8, 16), default=4, help="bits of the linear weights")
    p.add_argument("--embedding-bits", type=int, choices=(4, 8, 16), default=16, help="bits of the embedding table")
    p.add_argument("--weight-group", type=positive_int, default=32,
                   help="input channels per weight scale/zero (default %(default)s)")
    p.add_argument("--reserve", help="memory kept for OS, runtime and activations (default 20%% of device memory)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("info", help="what is installed and which runtimes are available",
                       description="Installed runtimes, native op libraries and the bundled model; with "
                                   "--artifact, what an exported artifact holds and how its rotations were made.")
    p.add_argument("--artifact", type=Path, help="an exported artifact directory to describe")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("report", help="memory plan and codec report on a model's real K/V",
                       description="Plan for the model, then bits per element and reconstruction error of the "
                                   "packed cache at 2, 3 and 4 bits on the model's captured K/V.")
    p.add_argument("--model", default="bundled", help="'bundled' or a local HF checkpoint directory")
    p.add_argument("--text", type=Path, help="UTF-8 text to run (default: the bundled held-out text)")
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens of text (default %(default)s)")
    p.add_argument("--device-memory", default="8GB", help="device memory for the plan (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("calibrate", help="fit OSCAR rotations from a local checkpoint",
                       description="Fit K and V rotations (R = U.H.P_br), clip ratios and optional Lloyd-Max "
                                   "levels from the model's own activations; writes a rotation file.")
    p.add_argument("--model", default="bundled", help="'bundled' or a local HF checkpoint directory")
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
    p.add_argument("--offload-folder", type=Path, help="offload weights that do not fit in memory to this folder")
    p.add_argument("--max-memory", help="memory the weights may use before offloading, e.g. 4GB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("parity", help="compare codes, outputs and tokens across runtimes",
                       description="Run the same prompt through every runtime available here and compare "
                                   "codes, attention outputs, logits and greedy tokens with the reference. "
                                   "Exit code 1 on any mismatch beyond the thresholds in docs/parity.md.")
    p.add_argument("--model", default="bundled", help="'bundled' or a local HF checkpoint directory")
    p.add_argument("--text", type=Path, help="UTF-8 text whose first tokens are the prompt (default: held-out text)")
    p.add_argument("--prompt-tokens", type=positive_int, default=400, help="prompt length (default %(default)s)")
    p.add_argument("--steps", type=positive_int, default=16, help="greedy steps (default %(default)s)")
    p.add_argument("--rotations", default="hadamard",
                   help="hadamard, online, none, calibrate (a cached calibration, as export makes) or a rotation "
                        "file (default %(default)s)")
    p.add_argument("--artifact", type=Path,
                   help="an exported artifact: compare its runtimes with the eager graph instead "
                        "(--model, --rotations and the cache flags then come from its manifest)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_cache_flags(p)
    p.set_defaults(func=cmd_parity)

    add_rotations_command(sub)
    from .cli_eval import add_eval_command  # cli_eval imports the cache flags from this module

    add_eval_command(sub)
    from .cli_targets import add_target_commands  # run and bench, dispatched to each target's module

    add_target_commands(sub)
    parser.commands = tuple(sub.choices)  # a subcommand first: its own flags follow, even "--target"
    return parser


def _quiet_third_party_logs() -> None:
    # torchao (loaded by transformers) logs about CUDA-only extensions and deprecated pytree
    # registrations at import; none of it concerns this CLI's users.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _prompt_values_joined(argv: list[str]) -> list[str]:
    """`--prompt VALUE` as `--prompt=VALUE`, so a prompt that looks like a flag ("--target") stays a prompt."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--prompt" and i + 1 < len(argv):
            out.append(f"--prompt={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    _quiet_third_party_logs()
    import torch

    if not torch.cuda.is_available():
        # Without a GPU, Triton kernels run through the interpreter; the flag must be set before
        # triton is first imported (transformers may import it through torchao).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    argv = _prompt_values_joined(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if (not argv or argv[0] not in parser.commands) and any(arg.split("=")[0] == "--target" for arg in argv):
        from .cli_targets import export_target  # each target has its own flags (--model, --out, ...)

        return _reporting("--target", lambda: export_target(argv))
    args, rest = parser.parse_known_args(argv)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command is None:
        parser.print_help()
        return 0
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

"""What the commands share: the argument parser class, argument types, the KV cache flags and how
they merge with a rotation file's settings into an OscarConfig, and the flags every export takes."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from ..calibration.cached import CALIBRATED_K_ROUNDING, DEFAULT_TOKENS
from ..config import SUPPORTED_BITS, OscarConfig, OscarInputError, config_for
from ..sizes import MAX_CONTEXT, MAX_STEPS


class Parser(argparse.ArgumentParser):
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


def kl_tokens(text: str) -> int:
    """--kl-tokens: 0 (no distribution check) up to 32768 scored positions, each a decode step of every runtime."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: expected 0..32768") from None
    if not 0 <= value <= 32768:
        raise argparse.ArgumentTypeError(f"{value} is out of range: expected 0..32768")
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
    value = positive_int(text)
    if value > MAX_CONTEXT:
        raise argparse.ArgumentTypeError(f"{value} tokens: expected at most {MAX_CONTEXT}")
    return value


def greedy_steps(text: str) -> int:
    """--steps of parity and bench: each keeps a step's logits (parity) or times it (bench), so a count beyond
    a few thousand only exhausts memory or patience."""
    value = positive_int(text)
    if value > MAX_STEPS:
        raise argparse.ArgumentTypeError(f"{value} steps: expected at most {MAX_STEPS}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: expected a token count >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: expected a token count >= 0")
    return value


def add_cache_flags(p: argparse.ArgumentParser, scale_dtypes: bool = False) -> None:
    """The cache format's flags: one per OscarConfig.flag_fields(), and --bits for both widths; `scale_dtypes` adds
    the flags of the fields only the commands that store scales take (--scale-dtype)."""
    g = p.add_argument_group("KV cache format")
    g.add_argument("--bits", type=int, choices=SUPPORTED_BITS,
                   help=f"bits per K and V code (default: a budget-chosen rotation file's, else {OscarConfig.k_bits})")
    for f in OscarConfig.flag_fields(scales=scale_dtypes):
        kind = _count if f.metadata["count"] else _FIELD_TYPES[f.type]
        g.add_argument("--" + f.name.replace("_", "-"), type=kind, choices=f.metadata["choices"],
                       help=f.metadata["help"].format(default=f.default))


# OscarConfig's annotations are strings (postponed evaluation): the argparse type of each.
_FIELD_TYPES = {"int": int, "float": float, "str": str}


def cache_flag_values(args: argparse.Namespace) -> dict:
    """OscarConfig fields as the flags give them, None where a flag is unset (--bits stands for both widths)."""
    values = {f.name: getattr(args, f.name, None) for f in OscarConfig.flag_fields()}
    values["k_bits"] = values["k_bits"] or args.bits
    values["v_bits"] = values["v_bits"] or args.bits
    return values


def cache_flags_given(args: argparse.Namespace) -> bool:
    """Whether any flag names a part of the cache format (without one, an export chooses it for the device)."""
    return any(value is not None for value in cache_flag_values(args).values())


def config_from_args(args: argparse.Namespace, rotation_metadata: dict | None = None) -> OscarConfig:
    """The cache flags; what a rotation file's metadata carries (config.with_metadata_defaults) applies where a flag
    is unset, then the defaults."""
    fields = cache_flag_values(args)
    head_dim = None
    if fields["cluster_dim"] is None and getattr(args, "model", None):
        from ..models import model_shape

        head_dim = model_shape(args.model).head_dim
    return config_for(rotation_metadata, head_dim, **fields)


def calibration_config(args: argparse.Namespace, config: OscarConfig, lloyd_max: bool = False) -> OscarConfig:
    """The format a calibration is made for: K rounded as CALIBRATED_K_ROUNDING unless --k-rounding says otherwise
    or the levels are Lloyd-Max (fitted for nearest rounding)."""
    if args.k_rounding is None and not lloyd_max:
        return replace(config, k_rounding=CALIBRATED_K_ROUNDING)
    return config


def export_parser(target) -> argparse.ArgumentParser:
    """The flags every target's export takes; the target adds its own (android: --group-size)."""
    p = Parser(prog=f"oscar-export --target {target.name}", description=f"Export a model: {target.description}.")
    p.add_argument("--target", choices=(target.name,), required=True)
    p.add_argument("--model", default="bundled",
                   help="'bundled', a local Hugging Face checkpoint directory or a .gguf file")
    p.add_argument("--rotations", default="calibrate",
                   help="calibrate (OSCAR rotations and clips fitted on --calibration-text, cached), a rotation "
                        "file, hadamard (data-free) or none (default %(default)s)")
    p.add_argument("--calibration-text", type=Path,
                   help="UTF-8 text for --rotations calibrate (default: the bundled public-domain text)")
    p.add_argument("--calibration-tokens", type=positive_int, default=DEFAULT_TOKENS,
                   help="tokens for --rotations calibrate (default %(default)s)")
    p.add_argument("--context", type=context_tokens,
                   help="max tokens of the cache (default: the model's max_position_embeddings, at most 4096)")
    p.add_argument("--out", type=Path, default=target.default_out,
                   help="artifact directory (default %(default)s)")
    p.add_argument("--float-weights", action="store_true", help=target.float_weights_help)
    p.add_argument("--device-memory", default=target.options.device_memory,
                   help="memory for the manifest's plan (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the manifest")
    add_cache_flags(p, scale_dtypes=True)
    p.set_defaults(k_clip=None, v_clip=None)  # unset: a rotation file's clip ratios apply
    target.add_export_flags(p)
    return p


def export_rotations(args: argparse.Namespace) -> tuple[object, str]:
    """--rotations as the export takes it, and a few words on where it came from. `calibrate` is a cached
    calibration for the model, text and cache format (calibration.cached.calibrated_rotations)."""
    if args.rotations != "calibrate":
        if args.calibration_text is not None:
            raise OscarInputError(f"--calibration-text is for --rotations calibrate, not {args.rotations!r}")
        return args.rotations, args.rotations
    from ..calibration.cached import calibrated_rotations

    config = calibration_config(args, config_from_args(args))
    path, reused = calibrated_rotations(args.model, config, args.calibration_text, args.calibration_tokens)
    return path, "calibrated (reused)" if reused else "calibrated"


def number_list(text: str, flag: str, convert, valid, expected: str) -> list:
    """Comma-separated numbers, at least one, each converted and valid; else one error naming the flag."""
    try:
        values = [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(valid(v) for v in values):
        raise OscarInputError(f"{flag}={text!r}: expected {expected}")
    return values


def contexts(text: str) -> list[int]:
    return number_list(text, "--context", int, lambda v: v > 0,
                       "comma-separated positive token counts, e.g. 4096,32768")

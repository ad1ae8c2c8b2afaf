"""The commands that are not per target: plan, info, report, calibrate and parity."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .. import __version__
from ..config import OscarConfig, OscarInputError
from ..targets import registry
from .flags import cache_flags_given, calibration_config, config_from_args

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
    c = OscarConfig.from_dict(p["config"])
    table.add_row("cache format", f"{c.describe()}, group {c.cluster_dim}, sink {c.sink}, recent {c.recent}", "")
    table.add_row("bits per K/V element", f"{p['bits_per_element']:.3f}", "16.000")
    table.add_row("runtime/OS reserve", _gib(p["reserve_bytes"]), _gib(p["reserve_bytes"]))
    table.add_row("largest context that fits", f"{p['max_context']:,}", f"{p['max_context_fp16']:,}")
    table.add_row("verdict", "fits" if p["fits"] else "does NOT fit", "fits" if p["fits_fp16"] else "does NOT fit")
    table.add_row("cache budget the device leaves", f"{p['cache_budget_bits']:.3f} bits per element", "")
    choice = p.get("format_choice")
    if choice and "error" in choice:
        table.add_row(f"--target {choice['target']} without format flags", "no format fits", "")
    elif choice:
        table.add_row(f"--target {choice['target']} without format flags",
                      f"the best format within {choice['budget_bits']:g} bits, {choice['scale_dtype']} scales", "")
    out.print(table)
    if choice and "error" in choice:
        out.print(f"[yellow]--target {choice['target']}:[/yellow] {choice['error']}")
    for warning in p["warnings"]:
        out.print(f"[yellow]warning:[/yellow] {warning}")


def cmd_plan(args: argparse.Namespace) -> int:
    from ..models import model_shape
    from ..planner import parse_bytes, plan

    memory = parse_bytes(args.device_memory, "--device-memory")
    reserve = parse_bytes(args.reserve, "--reserve") if args.reserve else None
    metadata = None
    if args.rotations is not None:
        from ..calibration.files import load_rotations

        metadata = load_rotations(args.rotations).metadata
    weight_flags = {"weight_bits": args.weight_bits, "embedding_bits": args.embedding_bits,
                    "weight_group": args.weight_group}
    weights = {key: value for key, value in weight_flags.items() if value is not None}  # plan's defaults otherwise
    if args.target is not None:
        if weights:
            given = [f"--{key.replace('_', '-')}" for key in weights]
            raise OscarInputError(f"{', '.join(given)} with --target {args.target}: expected one of them: the "
                                  "target stores its weights its own way")
        target = registry()[args.target]
        weights = target.weight_plan(target.options, False)
    shape = model_shape(args.model)
    result = plan(shape, config_from_args(args, metadata), memory, args.context, reserve=reserve, **weights)
    if args.target is not None and metadata is None and not cache_flags_given(args):
        result["format_choice"] = _format_choice(shape, memory, args.context, reserve, weights, target)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_plan(result)
    return 0


def _format_choice(shape, memory: int, context: int, reserve, weights: dict, target) -> dict:
    """What `--target T` without format flags searches within for this device and context (the export calibrates the
    format inside it), or why nothing fits."""
    from ..calibration.cached import CALIBRATED_K_ROUNDING
    from ..evaluate.budget import device_budget, device_scale_dtype

    scale_dtype = device_scale_dtype(target.scale_dtypes)
    try:
        choice = device_budget(shape, memory, context, weights, scale_dtype, CALIBRATED_K_ROUNDING, reserve=reserve,
                               min_window=target.min_window)
    except OscarInputError as err:
        return {"target": target.name, "error": str(err)}
    return {"target": target.name, "scale_dtype": scale_dtype, **choice}


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cmd_artifact_info(directory: Path, as_json: bool) -> int:
    """`info --artifact DIR`: what was exported, with what cache format, and how its rotations were made."""
    from ..export.artifact import load_manifest

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
    from ..models import BUNDLED_MODEL_DIR
    from ..native import EXECUTORCH_LIBRARY, ORT_LIBRARY, build_root, simd_kernels

    native_build = build_root() / "native"

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
        # The fused decode kernels the native ops run on this CPU.
        "native_kernels": simd_kernels(native_build),
        # Each target: whether it can export here, and what `run --runtime` offers for its artifacts.
        "targets": {name: {"available": target.missing() is None, "why_not": target.missing(),
                           "runtime": target.runtime, "run_runtimes": target.runtimes}
                    for name, target in registry().items()},
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
    kernels = info["native_kernels"]
    if kernels is not None:
        others = [k for k in kernels["available"] if k != kernels["decode"]]
        table.add_row("native decode kernels", (kernels["decode"] or "scalar") + (
            f" (this CPU also runs {', '.join(others)}: OSCAR_SIMD=NAME picks one)" if others else ""))
    for name, target in info["targets"].items():
        table.add_row(f"target {name}", f"{target['runtime']}: available" if target["available"]
                      else f"not available: {target['why_not']}")
        for runtime, how in target["run_runtimes"].items():
            table.add_row(f"  run --runtime {runtime}", how)
    out.print(table)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ..models import model_shape
    from ..planner import parse_bytes, plan
    from ..report import codec_report

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

    from ..calibration.cached import default_text, read_text, run_calibration
    from ..models import load_model
    from ..calibration.files import check_writable, export_rotation_zoo, save_rotations, zoo_paths

    config = calibration_config(args, config_from_args(args), args.lloyd_max)
    text_path = args.text or default_text()
    read_text(text_path)  # a missing or non-UTF-8 text, or an unwritable --out, fails before calibrating
    check_writable(args.out)
    if args.context is not None and args.budget_bits is None:
        raise OscarInputError("--context is the context --budget-bits holds at: expected --budget-bits with it")
    model, tokenizer = load_model(args.model, offload_folder=args.offload_folder, max_memory=args.max_memory)
    choose = None
    if args.budget_bits is not None:
        from ..evaluate.budget import format_chooser
        from ..evaluate.specs import DEFAULT_LONGEST_CONTEXT
        from ..hf_cache import attention_shape

        positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        context = args.context or min(positions or DEFAULT_LONGEST_CONTEXT, DEFAULT_LONGEST_CONTEXT)
        choose = format_chooser(args.budget_bits, context, attention_shape(model)[2], args.lloyd_max,
                                config.k_rounding, config.scale_dtype)
    rotation_set, seconds = run_calibration(args.model, config, text_path, args.tokens, args.heldout_tokens,
                                            per_head=args.per_head, lloyd_max=args.lloyd_max, model=model,
                                            tokenizer=tokenizer, choose=choose)
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
        "format": {key: rotation_set.metadata.get(key) for key in ("k_bits", "v_bits", "cluster_dim", "sink", "recent",
                                                                     "k_bits_by_layer", "bits_per_element",
                                                                     "budget_bits", "budget_context")},
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
        f = summary["format"]
        if f["budget_bits"] is not None:
            meta = rotation_set.metadata
            bits = OscarConfig.from_dict({key: meta[key] for key in ("k_bits", "v_bits", "k_bits_by_layer",
                                                                     "k_clip_by_layer") if key in meta})
            out.print(f"format within {f['budget_bits']:g} bits per element at {f['budget_context']} tokens: "
                      f"{bits.describe()}, group {f['cluster_dim']}, sink {f['sink']}, recent "
                      f"{f['recent']}: {f['bits_per_element']:.3f} bits (export and eval take it from the file)")
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    import torch

    from ..models import load_model
    from ..parity import run_parity
    from ..report import read_tokens

    if args.artifact is not None:  # the artifact's runtimes against the eager graph (parity.py)
        from ..parity import artifact_parity_command

        return artifact_parity_command(args, out)
    if args.save_trace is not None or args.against is not None:
        raise OscarInputError("--save-trace and --against compare an exported artifact: expected --artifact DIR")
    model, tokenizer = load_model(args.model)
    if torch.cuda.is_available():
        model = model.cuda()
    from ..calibration.files import ROTATION_MODES, load_rotations

    rotations, metadata = args.rotations, None
    if rotations == "calibrate":
        from ..calibration.cached import calibrated_rotations

        rotations = calibrated_rotations(args.model, config_from_args(args))[0]
    if rotations not in ROTATION_MODES:
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

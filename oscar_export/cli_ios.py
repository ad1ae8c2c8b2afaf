"""The ios target's CLI (targets/ios.toml): export to Core ML, run, and the parity hooks.

cli_targets.py dispatches here. Bad input raises OscarInputError, which becomes a one-line error.
"""

from __future__ import annotations

from .cli_targets import export_parser, run_export


def export_target(argv: list[str]) -> int:
    """Run `oscar-export --target ios ...`; argv is the whole command line."""
    from .export.ios import export_ios

    p = export_parser("ios", "Export a model for Core ML on iPhone, iPad and Mac (iOS 18 / macOS 15): an .mlpackage "
                             "whose packed cache is app-held int32 buffers, the tokenizer and manifest.json.",
                      "keep fp16 weights (default: 4-bit, coremltools.optimize linear quantization)", "8GB")
    return run_export("ios", p.parse_args(argv), export_ios,
                      ", cache {cache[bits_per_element_at_max_context]:.3f} bits per K/V element")


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

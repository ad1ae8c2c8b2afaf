"""`bench`: the OSCAR op and whole-model decode against each runtime's own attention and KV caches
(<runtime>_<what>.py), and an artifact as shipped: its decode speed beside llama.cpp (artifact_decode.py) and its
run-time memory (memory.py). tables.py prints every report of the first kind.

RUNTIMES is the one table of what is measured on which runtime (a registered target's `runtime`, whose packages
it needs); this module loads none of the runtimes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass
class BenchRequest:
    """What `bench` was asked: contexts, the model whose shape is used, the cache config, threads, steps."""

    contexts: list[int]
    model: str
    config: object
    threads: int | None
    steps: int
    float_weights: bool = False  # decode: float32 weights in every variant instead of the target's own format


@dataclass(frozen=True)
class RuntimeBench:
    label: str
    modules: dict[str, str]  # what is measured -> the module measuring it (its measure(request) and CONTESTANTS)


RUNTIMES = {
    "onnxruntime": RuntimeBench("ONNX Runtime", {"attention": "ort_attention", "decode": "ort_decode"}),
    "executorch": RuntimeBench("ExecuTorch", {"attention": "et_attention", "decode": "et_decode"}),
}


def kinds(runtime: str) -> tuple[str, ...]:
    return tuple(RUNTIMES[runtime].modules)


def measurer(runtime: str, what: str):
    """The module measuring `what` on `runtime`: measure(request) -> report, CONTESTANTS for tables.print_report."""
    return importlib.import_module(f"{__name__}.{RUNTIMES[runtime].modules[what]}")

"""What the benches of every runtime share: argument checks, stored scales, copy bandwidth and traffic, decode turns."""

from __future__ import annotations

import os
import time

import numpy as np

from ..config import OscarConfig, OscarInputError
from ..ops.attention import BUFFER_SCALE_DTYPES

COPY_BYTES = 256 << 20  # far past any cache level, as a long context's cache is
# A target's `bench decode` (its artifact against the same weights with its runtime's own caches, from synthetic
# cache states): every variant runs WARMUP untimed steps, then all take turns of BLOCK timed steps.
WARMUP = 4
BLOCK = 8


def check_bench_args(contexts, q_heads: int, kv_heads: int, head_dim: int, config: OscarConfig | None,
                     threads: int | None) -> tuple[OscarConfig, int]:
    """The checks both runtimes' attention benches make; returns the config and thread count to use."""
    config = config or OscarConfig()
    config.check_head_dim(head_dim)
    if q_heads % kv_heads:
        raise OscarInputError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    for context in contexts:
        if context <= config.sink + config.recent:
            raise OscarInputError(f"--context {context}: expected more than sink + recent = "
                                  f"{config.sink + config.recent} tokens, so the packed body is used")
    if config.scale_dtype not in BUFFER_SCALE_DTYPES:
        raise OscarInputError(f"scale_dtype={config.scale_dtype!r}: expected one of {tuple(BUFFER_SCALE_DTYPES)}, "
                              "the scales the op stores")
    return config, threads or os.cpu_count()


def stored_scales(x, scale_dtype: str):
    """x (a float tensor) as the op's scale and zero buffers hold it: fp16, or fp8 E4M3 bits in uint8."""
    import torch

    if scale_dtype == "float8_e4m3fn":
        return x.to(torch.float8_e4m3fn).view(torch.uint8)
    return x.half()


def copy_bandwidth(threads: int) -> float:
    """GB/s of a large copy in memory on `threads` threads (torch's copy_), counting bytes read plus bytes
    written as STREAM's Copy does: the rate a decode step that streams its cache once could approach."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(COPY_BYTES, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch: page faults are not bandwidth
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * COPY_BYTES / best / 1e9


def add_traffic(row: dict, name: str, nbytes: int, copy_gbps: float) -> None:
    """Puts in a result row the bytes one step of `name` reads (its whole cache) and the rate it read them at,
    also as a fraction of the copy bandwidth measured in the same run."""
    gbps = nbytes / (row[f"{name}_ms"] * 1e6)
    row.update({f"{name}_bytes": nbytes, f"{name}_GBps": round(gbps, 3),
                f"{name}_fraction_of_copy": round(gbps / copy_gbps, 3)})


def traffic_text(row: dict, name: str) -> str:
    return (f"reads {row[f'{name}_bytes'] / 2**20:.1f} MiB at {row[f'{name}_GBps']:.1f} GB/s "
            f"({row[f'{name}_fraction_of_copy']:.0%} of copy)")


def bench_setup(contexts, config, steps: int, threads, model_name: str):
    """(config, contexts, threads, model, rng) a target's `bench decode` starts from: the contexts checked, the
    default config and thread count filled in, the model loaded, a seeded generator for the synthetic states."""
    from ..models import load_model

    config = config or OscarConfig()
    contexts = list(contexts)
    check_contexts(contexts, config, steps)
    model, _ = load_model(model_name)
    return config, contexts, threads or os.cpu_count(), model, np.random.default_rng(0)


def check_contexts(contexts, config, steps: int) -> None:
    """Each context must leave a starting state that already uses the packed body."""
    least = config.sink + config.recent + WARMUP + steps + 2
    for context in contexts:
        if context < least:
            raise OscarInputError(f"--context {context}: expected at least sink + recent + {WARMUP} warm-up + "
                                  f"{steps} steps + 2 = {least} tokens, so the packed body is used")


def step_times(steppers: dict, token: int, steps: int) -> dict[str, list[float]]:
    """Greedy decode with each stepper (token -> logits), alternating turns of BLOCK steps; seconds per step."""
    tokens = dict.fromkeys(steppers, token)
    times = {name: [] for name in steppers}

    def run(name, n, record):
        for _ in range(n):
            t0 = time.perf_counter()
            tokens[name] = int(np.argmax(steppers[name](tokens[name])))
            if record:
                times[name].append(time.perf_counter() - t0)

    for name in steppers:
        run(name, WARMUP, False)
    for done in range(0, steps, BLOCK):
        for name in steppers:
            run(name, min(BLOCK, steps - done), True)
    return times

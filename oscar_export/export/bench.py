"""What the attention benches of every runtime share."""

from __future__ import annotations

import os

from ..config import OscarConfig, OscarInputError


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
    return config, threads or os.cpu_count()

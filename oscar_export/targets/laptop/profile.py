"""Where a decode step of a laptop artifact goes: ONNX Runtime's own profiler, per op type.

The artifact is loaded with profiling on, prefilled, then decodes `steps` greedy tokens. Of the
profile, only the decode runs count (the last `steps` model_run events); each node event inside one
is charged to its op type. The rest of a step's wall time is outside ONNX Runtime's nodes: session
overhead between nodes, binding inputs, copying logits out and the argmax in Python.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from .runner import OrtLM


def profile_decode(directory: Path, runtime: str, max_chunk: int, ids: list[int], steps: int, threads: int) -> dict:
    """Per op type: milliseconds per decode step and nodes per step; the rest of the step's wall time."""
    with tempfile.TemporaryDirectory(prefix="oscar-ort-profile-") as temp:
        lm = OrtLM(directory, runtime, threads, max_chunk, profile_prefix=str(Path(temp) / "decode"))
        token = int(np.argmax(lm.prefill(ids)))
        start = time.perf_counter()
        for _ in range(steps):
            token = int(np.argmax(lm.step([token])))
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
        events = json.loads(Path(lm.session.end_profiling()).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[-steps:]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in runs]
    per_op, count = defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if any(lo <= e["ts"] <= hi for lo, hi in windows):
            op = e.get("args", {}).get("op_name", "?")
            per_op[op] += e["dur"] / 1e3 / steps
            count[op] += 1
    run_ms = sum(e["dur"] for e in runs) / 1e3 / steps
    nodes_ms = sum(per_op.values())
    ops = sorted(per_op, key=per_op.get, reverse=True)
    return {"steps": steps, "step_wall_ms": round(wall_ms, 3),
            "ops": {op: {"ms": round(per_op[op], 3), "nodes_per_step": count[op] // steps} for op in ops},
            "other_ms": {"ONNX Runtime between nodes": round(run_ms - nodes_ms, 3),
                         "outside the run (bind, copy, argmax)": round(wall_ms - run_ms, 3)}}


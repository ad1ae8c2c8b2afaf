"""Run-time memory of an artifact as shipped: what the process takes with its cache full.

bench_artifact_memory runs the measurement in a fresh Python process (`python -m
oscar_export.bench.memory`), so nothing of the caller counts: it loads the artifact with its
target's runner, writes a synthetic valid cache state of `context - steps` tokens
(runner.fill_synthetic: prefilling 32K tokens of an 8B model on a laptop CPU takes hours; the state's
bytes and what a decode step reads are a real one's), decodes `steps` greedy tokens and reads the
kernel's accounting of the process: resident memory after loading, after filling and its peak
(VmRSS, VmHWM). Beside it, the manifest's memory plan: what the planner promised for these weights
and this cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..config import OscarConfig, OscarInputError


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OscarInputError(f"/proc/self/status has no {field}: expected Linux")


def measure(directory, context: int, steps: int, threads: int, runtime: str | None) -> dict:
    """In this process: load, fill, decode; memory and times (run by bench_artifact_memory in a fresh one)."""
    from ..run import check_runtime, open_artifact

    directory, manifest, target = open_artifact(directory)
    runtime = check_runtime(target, runtime)
    before_load = _status("VmRSS")  # the interpreter with torch: a cost of measuring from Python, not of the artifact
    start = time.perf_counter()
    runner = target.runner(directory, manifest, runtime, threads)
    load_s = time.perf_counter() - start
    after_load = _status("VmRSS")
    runner.fill_synthetic(context - steps, OscarConfig.from_dict(manifest["config"]), np.random.default_rng(0))
    after_fill = _status("VmRSS")
    token, times = 1, []
    for _ in range(steps):
        start = time.perf_counter()
        token = int(np.argmax(runner.step([token])))
        times.append(time.perf_counter() - start)
    return {"runtime": runtime, "load_s": round(load_s, 2), "rss_before_load": before_load,
            "rss_after_load": after_load,
            "rss_after_fill": after_fill, "rss_after_decode": _status("VmRSS"), "peak_rss": _status("VmHWM"),
            "step_ms": [round(t * 1e3, 2) for t in times],
            "decode_tokens_per_s": round(1 / float(np.median(times[1:] or times)), 3)}


def bench_artifact_memory(directory, context: int | None = None, steps: int = 4, threads: int | None = None,
                          runtime: str | None = None, device_memory: str | None = None) -> dict:
    """Peak memory of the artifact decoding `steps` tokens at `context` (default: its full context), measured in
    a fresh process, with the manifest's plan beside it. device_memory: the device to judge the peak against
    (default: the plan's), less the planner's reserve."""
    from ..planner import DEFAULT_RESERVE_FRACTION, parse_bytes
    from ..run import open_artifact

    directory, manifest, _ = open_artifact(directory)
    top = manifest["max_context"]
    context = context or top
    if not steps < context <= top:
        raise OscarInputError(f"--context {context}: expected steps = {steps} < context <= {top} (the artifact's)")
    threads = threads or os.cpu_count()
    child = subprocess.run([sys.executable, "-m", __name__, str(directory), str(context), str(steps), str(threads),
                            runtime or ""], capture_output=True, text=True)
    if child.returncode:
        tail = (child.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise OscarInputError(f"bench memory: the measuring process failed ({tail[:400]})")
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    plan = dict(manifest["plan"])
    if device_memory:
        plan["device_memory_bytes"] = parse_bytes(device_memory, "--device-memory")
        plan["reserve_bytes"] = int(plan["device_memory_bytes"] * DEFAULT_RESERVE_FRACTION)
    planned = plan["weights_bytes"] + plan["kv_bytes"]
    return {"artifact": str(directory), "target": manifest["target"], "weights": manifest["weights"],
            "context": context, "max_context": top, "threads": threads, "steps": steps, **measured,
            "plan": {key: plan[key] for key in ("weights_bytes", "kv_bytes", "kv_bytes_fp16", "reserve_bytes",
                                                "device_memory_bytes")},
            "planned_bytes": planned,
            "overhead_bytes": measured["peak_rss"] - planned,
            "budget_bytes": plan["device_memory_bytes"] - plan["reserve_bytes"],
            "fits_budget": measured["peak_rss"] <= plan["device_memory_bytes"] - plan["reserve_bytes"],
            "method": f"fresh process; synthetic cache state of context - {steps} tokens, then {steps} greedy "
                      "steps; peak is VmHWM of the process"}


def print_artifact_memory(report: dict) -> None:
    gib = 2**30
    plan = report["plan"]
    print(f"{report['artifact']} ({report['target']}, {report['runtime']}, {report['threads']} threads), cache "
          f"for {report['max_context']} tokens filled to {report['context'] - report['steps']}, "
          f"{report['steps']} decode steps")
    print(f"  planner: weights {plan['weights_bytes'] / gib:.2f} GiB + cache {plan['kv_bytes'] / gib:.2f} GiB = "
          f"{report['planned_bytes'] / gib:.2f} GiB (an fp16 cache: {plan['kv_bytes_fp16'] / gib:.2f} GiB)")
    print(f"  measured: before load {report['rss_before_load'] / gib:.2f} GiB (this Python process), after load "
          f"{report['rss_after_load'] / gib:.2f} GiB, after fill "
          f"{report['rss_after_fill'] / gib:.2f} GiB, peak {report['peak_rss'] / gib:.2f} GiB "
          f"(runtime overhead {report['overhead_bytes'] / gib:+.2f} GiB over the plan)")
    verdict = "within" if report["fits_budget"] else "OVER"
    print(f"  {verdict} the device budget: {plan['device_memory_bytes'] / gib:.2f} GiB minus the planner's reserve "
          f"{plan['reserve_bytes'] / gib:.2f} GiB = {report['budget_bytes'] / gib:.2f} GiB")
    print(f"  load {report['load_s']:.1f} s; decode {report['decode_tokens_per_s']:.2f} tokens/s (steps "
          f"{', '.join(f'{t:.0f}' for t in report['step_ms'])} ms)")


if __name__ == "__main__":
    directory, context, steps, threads, runtime = sys.argv[1:6]
    print(json.dumps(measure(directory, int(context), int(steps), int(threads), runtime or None)))

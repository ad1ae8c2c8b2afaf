"""The cache format an export without format flags chooses for a device and context (issue 53's table), and what it
costs on SmolLM2-135M-Instruct against fp16 and KIVI-2 at the same windows.

    nice -n 10 .venv/bin/python -m benchmarks.quality.device_default        # about an hour on 2 cores

Each row is a target, a device memory and a context. Its format is chosen the way the export chooses it
(evaluate.budget.device_calibration: the bits the device leaves, at most 3.0, the budget search with the target's
scales and window floor, calibrated on the bundled text's first 16,384 tokens and cached), then scored by `eval
--rotations` on the rest of that text (`--calibration-tokens 16384` keeps eval off the calibration tokens):
perplexity of one 8K window at 2K / 4K / 8K and needle retrieval at 4K (four sequences). fp16 is scored once, KIVI-2
(per-channel K, per-token V, 2 bits) at each row's windows. The calibration's seconds are its wall time, the model
load, rotation fit and search included (0 where an earlier run left it cached: set OSCAR_EXPORT_CACHE to a fresh
directory to time it).

Results: benchmarks/results/quality/device_default_smollm2.json and .md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from oscar_export.calibration.cached import DEFAULT_TOKENS
from oscar_export.calibration.files import load_rotations
from oscar_export.evaluate.budget import device_calibration
from oscar_export.models import model_shape
from oscar_export.planner import parse_bytes
from oscar_export.targets import registry

from benchmarks.common import GGUF, log, machine

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("laptop:8GB:8192", "android:8GB:8192", "ios:8GB:8192", "android:197MB:8192")


def evaluate(rotations: Path, methods: str) -> dict:
    command = [sys.executable, "-m", "oscar_export", "eval", "--model", str(GGUF), "--rotations", str(rotations),
               "--calibration-tokens", str(DEFAULT_TOKENS), "--methods", methods, "--contexts", "2048,4096,8192",
               "--metrics", "perplexity,needle", "--needle-seeds", "4", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["methods"]


def scores(method: dict, fp16: dict) -> dict:
    ppl = method["perplexity_by_context"]
    return {"bits_per_element": method["bits_per_element_by_context"]["8192"], "perplexity": ppl,
            "vs_fp16_percent": {c: 100 * (p / fp16["perplexity_by_context"][c] - 1) for c, p in ppl.items()},
            "needle": method["needle_accuracy"],
            "needle_vs_fp16_points": 100 * (method["needle_accuracy"] - fp16["needle_accuracy"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated TARGET:MEMORY:CONTEXT")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/quality")
    args = p.parse_args()
    shape = model_shape(str(GGUF))
    rows, fp16, evaluated = [], None, {}
    for row in args.rows.split(","):
        name, memory, context = row.split(":")
        target = registry()[name]
        started = time.perf_counter()
        path, reused, choice = device_calibration(str(GGUF), shape, parse_bytes(memory), int(context),
                                                  target.weight_plan(target.options, False), target.scale_dtypes,
                                                  target.min_window)
        seconds = round(time.perf_counter() - started, 1)
        meta = load_rotations(path).metadata
        log(f"{row}: {meta['k_bits']}/{meta['v_bits']} {meta.get('k_bits_by_layer')} sink {meta['sink']} recent "
            f"{meta['recent']} {meta['scale_dtype']}, {choice['bits_per_element']:.3f} bits ({seconds} s)")
        key = meta["cache_key"]
        if key not in evaluated:  # targets whose choice is the same share one evaluation
            methods = evaluate(path, "kivi,oscar" if fp16 else "fp16,kivi,oscar")
            fp16 = fp16 or methods["fp16"]
            evaluated[key] = {"oscar": scores(methods["oscar"], fp16), "kivi-2": scores(methods["kivi"], fp16)}
        rows.append({"target": name, "device_memory": memory, "context": int(context), "choice": choice,
                     "format": {k: meta.get(k) for k in ("k_bits", "v_bits", "cluster_dim", "k_bits_by_layer", "sink",
                                                          "recent", "k_clip", "v_clip", "scale_dtype", "k_rounding")},
                     "calibration_seconds": seconds, "calibration_reused": reused, **evaluated[key]})
    report = {"model": GGUF.name, "machine": machine(), "fp16": scores(fp16, fp16), "rows": rows}
    stem = args.out / "device_default_smollm2"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"SmolLM2-135M-Instruct, the format each export chooses without format flags; {machine()}. Perplexity of "
             "one 8K window of the bundled text after its first 16,384 tokens (the calibration's), needle at 4K "
             "(four sequences); command in benchmarks/quality/device_default.py.", "",
             "| target | device, context | budget (bits) | chosen format | bits at 8K | ppl 2K / 4K / 8K vs fp16 | "
             "needle vs fp16 (points) | KIVI-2 at its windows: bits, ppl 8K, needle |", "|---|---|---|---|---|---|---|---|"]
    f = report["fp16"]
    lines.append(f"| fp16 | - | - | - | 16 | {' / '.join(f'{v:.2f}' for v in f['perplexity'].values())} | "
                 f"{100 * f['needle']:.1f}% | - |")
    for r in rows:
        c, o, k = r["format"], r["oscar"], r["kivi-2"]
        wide = [i for i, b in enumerate(c["k_bits_by_layer"] or []) if b > c["k_bits"]]
        shape_text = (f"K{c['k_bits']}" + (f" (K{c['k_bits'] + 1} in layers {wide})" if wide else "")
                      + f"/V{c['v_bits']} g{c['cluster_dim']}, sink {c['sink']}, recent {c['recent']}, "
                      f"{'fp8' if c['scale_dtype'] == 'float8_e4m3fn' else 'fp16'} scales")
        lines.append(f"| {r['target']} | {r['device_memory']}, {r['context']} | {r['choice']['budget_bits']:g} | "
                     f"{shape_text} | {o['bits_per_element']:.3f} | "
                     f"{' / '.join(f'{v:+.1f}%' for v in o['vs_fp16_percent'].values())} | "
                     f"{o['needle_vs_fp16_points']:+.1f} | {k['bits_per_element']:.3f}, "
                     f"{k['vs_fp16_percent']['8192']:+.1f}%, {k['needle_vs_fp16_points']:+.1f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

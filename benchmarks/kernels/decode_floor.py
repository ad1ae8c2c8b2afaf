"""How far the native decode kernels are from their arithmetic floor, on this x86-64 core.

    nice -n 10 .venv/bin/python -m benchmarks.kernels.decode_floor [--context 32768] [--steps 100]

A decode step over C cached rows does Q * C * D multiply-accumulates for the scores and as many
for the values (Q query heads, head_dim D). benchmarks/kernels/mac_peak.cc measures how many of them one
core retires per second in each instruction form; dividing gives three floors:
  - fp32: both sides as fp32 FMAs (what fp32 attention must do, whatever its cache);
  - exact: the kernel set's arithmetic (docs/kernels.md): three int8 query terms against u8
    codes (vpmaddubsw) on the score side; on the value side 16-bit weights (vpmaddwd) for the
    AVX-512 set, fp32 FMAs for the others;
  - int8/int16: one int8 query term and 16-bit value weights, the precision trade the score
    side does not make.
The rows run oscar_decode_bench (the core alone, one thread, 2-bit K/V) between two measurements
of the peak rates, so the fraction of floor (against the step's p10: shared machines
are noisy) is measured side by side. Writes benchmarks/results/kernels/decode_floor.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from oscar_export.native import build_native

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[2]

SHAPES = {"bundled": (4, 2, 64), "smollm2": (9, 3, 64), "llama-3-8b": (32, 8, 128)}  # q heads, KV heads, D
SCORE_TERMS = 3  # int8 terms of the query on the exact score path (oscar_kernels.h, SplitQuery)
BENCH_LINE = re.compile(r"median ([0-9.]+) ms, p10 ([0-9.]+), min ([0-9.]+)")


def mac_rates(exe: Path, repeats: int = 20) -> dict:
    return json.loads(subprocess.run([str(exe), str(repeats)], check=True, capture_output=True, text=True).stdout)


def step_ms(bench: Path, shape: tuple, context: int, cluster_dim: int, steps: int, scale_dtype: int = 0) -> dict:
    """One thread's decode step of the core (oscar_decode_bench); scale_dtype 0: fp16 scales, 1: fp8 E4M3."""
    q, kv, d = shape
    out = subprocess.run([str(bench), str(q), str(kv), str(d), str(context), "1", str(cluster_dim), "0", str(steps),
                          str(scale_dtype)], check=True, capture_output=True, text=True)
    line = (out.stdout + out.stderr).strip().splitlines()[-1]
    match = BENCH_LINE.search(line)
    if match is None:
        raise RuntimeError(f"oscar_decode_bench printed no timing: {line!r}")
    kernel = line.split(":", 1)[0]
    return {"kernel": kernel, "median_ms": float(match[1]), "p10_ms": float(match[2]), "min_ms": float(match[3])}


def write_result(out: Path, result: dict) -> None:
    """result as JSON at out, written whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768, help="cached rows in the packed body")
    parser.add_argument("--cluster-dim", type=int, default=64, help="group size of the scales and zeros")
    parser.add_argument("--steps", type=int, default=100, help="decode steps per oscar_decode_bench run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kernels/decode_floor.json")
    args = parser.parse_args()
    if platform.machine() not in ("x86_64", "AMD64"):
        sys.exit(f"decode_floor: mac_peak.cc measures x86-64 instructions; this machine is {platform.machine()}")

    where = machine()  # before the runs: it reports the load average at the start
    build = build_native()
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp) / "mac_peak"
        subprocess.run(["g++", "-O2", "-o", str(peak), str(ROOT / "benchmarks/kernels/mac_peak.cc")], check=True)
        # Peaks before and after the steps, the best of each: a busy neighbour lowers a peak, never raises it.
        before = mac_rates(peak)
        steps = {name: step_ms(build / "oscar_decode_bench", shape, args.context, min(args.cluster_dim, shape[2]),
                               args.steps) for name, shape in SHAPES.items()}
        rates = {k: max(v, mac_rates(peak)[k]) for k, v in before.items()}
    fp32, int16, int8 = rates["fp32_macs_per_s"], rates["int16_macs_per_s"], rates["int8_macs_per_s"]
    rows = []
    print(f"peak MACs/s on one core: fp32 FMA {fp32:.3g}, int16 vpmaddwd {int16:.3g}, int8 vpmaddubsw {int8:.3g}")
    print("| shape (q / KV heads, D) | context | step p10 (median) ms | fp32 floor | exact floor | "
          "int8/int16 floor | step / exact floor |")
    print("|---|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        side = shape[0] * args.context * shape[2]  # MACs on each of the score and value sides
        step = steps[name]
        values_rate = int16 if step["kernel"] == "avx512" else fp32  # the AVX-512 set's values are 16-bit
        floors = {"fp32_ms": 2 * side / fp32 * 1e3, "exact_ms": (side / values_rate + SCORE_TERMS * side / int8) * 1e3,
                  "int8_int16_ms": (side / int16 + side / int8) * 1e3}
        row = {"shape": name, "q_heads": shape[0], "kv_heads": shape[1], "head_dim": shape[2],
               "context": args.context, "macs_per_side": side, **step,
               **{k: round(v, 4) for k, v in floors.items()},
               "fraction_of_exact_floor": round(floors["exact_ms"] / step["p10_ms"], 3)}
        rows.append(row)
        print(f"| {name} ({shape[0]} / {shape[1]}, {shape[2]}) | {args.context} | {step['p10_ms']:.3f} "
              f"({step['median_ms']:.3f}) | {floors['fp32_ms']:.3f} | {floors['exact_ms']:.3f} | "
              f"{floors['int8_int16_ms']:.3f} | {row['fraction_of_exact_floor']:.2f} |")
    result = {"command": "nice -n 10 .venv/bin/python -m benchmarks.kernels.decode_floor " + " ".join(sys.argv[1:]),
              "machine": f"{where}; one thread", "cluster_dim": args.cluster_dim,
              "peak_macs_per_s": rates, "rows": rows}
    write_result(args.out, result)


if __name__ == "__main__":
    main()

"""What fp8 scales cost a decode step: the core's fused kernel with fp16 and with fp8 E4M3 scales and zeros, side
by side, one thread, 2-bit K/V, group 64, per shape.

    nice -n 10 .venv/bin/python -m benchmarks.kernels.scale_dtype_speed [--context 32768] [--rounds 4] [--steps 150]

Each round runs oscar_decode_bench once per scale dtype and shape, so the two alternate on the same machine and a
busy neighbour slows both; a dtype's time is the best p10 over the rounds. fp8 scales are widened to fp16 a
256-row block at a time (docs/kernels.md), then the same kernel runs: the ratio is that widening's cost against
the quarter bit per element it saves. OSCAR_SIMD=avx2 times another kernel set. Writes
benchmarks/results/kernels/scale_dtype_speed.json (--out).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


from benchmarks.kernels.decode_floor import SHAPES, step_ms, write_result

from oscar_export.native import build_native

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[2]

DTYPES = {"float16": 0, "float8_e4m3fn": 1}  # oscar_decode_bench's SCALE_DTYPE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768, help="cached rows in the packed body")
    parser.add_argument("--rounds", type=int, default=4, help="alternating runs of both dtypes")
    parser.add_argument("--steps", type=int, default=150, help="decode steps per oscar_decode_bench run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kernels/scale_dtype_speed.json")
    args = parser.parse_args()
    where = machine()
    bench = build_native() / "oscar_decode_bench"
    best: dict[str, dict[str, dict]] = {name: {} for name in SHAPES}
    for _ in range(args.rounds):
        for name, shape in SHAPES.items():
            for dtype, number in DTYPES.items():
                run = step_ms(bench, shape, args.context, 64, args.steps, number)
                if dtype not in best[name] or run["p10_ms"] < best[name][dtype]["p10_ms"]:
                    best[name][dtype] = run
    rows = []
    print("| shape (q / KV heads, D) | kernel set | fp16 scales p10 ms | fp8 scales p10 ms | fp8 / fp16 |")
    print("|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        fp16, fp8 = best[name]["float16"], best[name]["float8_e4m3fn"]
        ratio = round(fp8["p10_ms"] / fp16["p10_ms"], 3)
        rows.append({"shape": name, "q_heads": shape[0], "kv_heads": shape[1], "head_dim": shape[2],
                     "context": args.context, "runs": best[name], "fp8_over_fp16": ratio})
        print(f"| {name} ({shape[0]} / {shape[1]}, {shape[2]}) | {fp16['kernel']} | {fp16['p10_ms']:.3f} | "
              f"{fp8['p10_ms']:.3f} | {ratio:.2f}x |")
    simd = f"OSCAR_SIMD={os.environ['OSCAR_SIMD']} " if os.environ.get("OSCAR_SIMD") else ""
    result = {"command": f"{simd}nice -n 10 .venv/bin/python -m benchmarks.kernels.scale_dtype_speed " + " ".join(sys.argv[1:]),
              "machine": f"{where}; one thread", "rounds": args.rounds, "steps": args.steps, "cluster_dim": 64,
              "rows": rows}
    write_result(args.out, result)


if __name__ == "__main__":
    main()

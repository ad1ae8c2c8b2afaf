"""Every fused kernel set this CPU runs, side by side: one decode step of the core alone per shape.

    nice -n 10 .venv/bin/python -m benchmarks.kernels.kernel_sets [--context 32768] [--rounds 4] [--steps 150]

Each round runs oscar_decode_bench (one thread, 2-bit K/V, group 64) once per set, OSCAR_SIMD naming it, so
the sets alternate on the same machine and a busy neighbour slows all of them; a set's time is the best p10
over the rounds, and its speed-up is against the AVX2 set's. The sets compute the same floats (oscar_core_test
compares them bit for bit), so only time differs. Writes benchmarks/results/kernels/kernel_sets.json (--out).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


from benchmarks.kernels.decode_floor import SHAPES, step_ms, write_result

from oscar_export.native import build_native, simd_kernels

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[2]

BASELINE = "avx2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768, help="cached rows in the packed body")
    parser.add_argument("--rounds", type=int, default=4, help="alternating runs of every set")
    parser.add_argument("--steps", type=int, default=150, help="decode steps per oscar_decode_bench run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kernels/kernel_sets.json")
    args = parser.parse_args()
    where = machine()
    build = build_native()
    sets = simd_kernels(build)["available"]
    if BASELINE not in sets or len(sets) < 2:
        sys.exit(f"kernel_sets: this CPU runs {sets or 'no fused set'}: nothing to compare with {BASELINE}")
    best: dict[str, dict[str, dict]] = {name: {} for name in SHAPES}
    for _ in range(args.rounds):
        for name, shape in SHAPES.items():
            for kernel in sets:
                os.environ["OSCAR_SIMD"] = kernel
                run = step_ms(build / "oscar_decode_bench", shape, args.context, 64, args.steps)
                if run["kernel"] != kernel:
                    raise RuntimeError(f"OSCAR_SIMD={kernel} ran {run['kernel']}")
                if kernel not in best[name] or run["p10_ms"] < best[name][kernel]["p10_ms"]:
                    best[name][kernel] = run
    os.environ.pop("OSCAR_SIMD")
    rows = []
    print("| shape (q / KV heads, D) | " + " | ".join(f"{k} p10 ms" for k in sets) + " | "
          + " | ".join(f"{k} vs {BASELINE}" for k in sets if k != BASELINE) + " |")
    print("|---|" + "---|" * (2 * len(sets) - 1))
    for name, shape in SHAPES.items():
        times = {k: best[name][k]["p10_ms"] for k in sets}
        speedup = {k: round(times[BASELINE] / times[k], 3) for k in sets if k != BASELINE}
        rows.append({"shape": name, "q_heads": shape[0], "kv_heads": shape[1], "head_dim": shape[2],
                     "context": args.context, "runs": best[name], "speedup_over_avx2": speedup})
        print(f"| {name} ({shape[0]} / {shape[1]}, {shape[2]}) | " + " | ".join(f"{times[k]:.3f}" for k in sets)
              + " | " + " | ".join(f"{v:.2f}x" for v in speedup.values()) + " |")
    result = {"command": "nice -n 10 .venv/bin/python -m benchmarks.kernels.kernel_sets " + " ".join(sys.argv[1:]),
              "machine": f"{where}; one thread", "sets": sets, "rounds": args.rounds, "steps": args.steps,
              "cluster_dim": 64, "rows": rows}
    write_result(args.out, result)


if __name__ == "__main__":
    main()

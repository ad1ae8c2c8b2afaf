"""Decode attention at the shapes people run, on both CPU runtimes: one decode step of one layer, OSCAR
against each runtime's own attention, with the bytes each step reads and the share of this machine's
copy bandwidth (docs/kernels.md, "Bytes per step").

    nice -n 10 .venv/bin/python -m benchmarks.kernels.attention_tables [--contexts 4096,32768,131072] [--threads 1,2]

Shapes: the bundled model (4 q / 2 KV heads, head_dim 64), SmolLM2-135M (9 q / 3 KV, 64) and
Llama-3-8B (32 q / 8 KV, 128). Each (runtime, shape, threads) is one `bench attention` run, so its
ratios are measured side by side. Writes benchmarks/results/kernels/{laptop,android}_attention.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from oscar_export.config import OscarConfig
from oscar_export.native import simd_kernels
from oscar_export.bench import RUNTIMES, BenchRequest, measurer
from oscar_export.bench.tables import print_report
from oscar_export.targets import get

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[2]

SMOLLM2 = ROOT / ".cache/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # scripts/fetch_smollm2.sh
SHAPES = {"bundled": "bundled", "smollm2": str(SMOLLM2), "llama-3-8b": "llama-3-8b"}
FILES = {"laptop": "laptop_attention.json", "android": "android_attention.json"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--targets", default=",".join(FILES))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kernels")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    for name in args.targets.split(","):
        runtime = get(name).runtime
        attention = measurer(runtime, "attention")
        report = {"command": f"nice -n 10 .venv/bin/python -m benchmarks.kernels.attention_tables --targets {name}",
                  "commit": commit, "machine": machine(), "kernels": simd_kernels(), "runs": {}}
        args.out.mkdir(parents=True, exist_ok=True)
        for shape in args.shapes.split(","):
            if shape == "smollm2" and not SMOLLM2.is_file():
                sys.exit(f"{SMOLLM2} missing: bash scripts/fetch_smollm2.sh, or leave smollm2 out of --shapes")
            for threads in (int(t) for t in args.threads.split(",")):
                request = BenchRequest(contexts, SHAPES[shape], OscarConfig(), threads, 0)
                run = attention.measure(request)
                report["runs"][f"{shape}_threads{threads}"] = run
                print(f"{name} {shape} threads {threads}:", file=sys.stderr)
                print_report("attention", RUNTIMES[runtime].label, request, run, attention.CONTESTANTS)
                path = args.out / FILES[name]
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(report, indent=2) + "\n")
                tmp.replace(path)


if __name__ == "__main__":
    main()

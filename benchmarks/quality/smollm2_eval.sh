#!/usr/bin/env bash
# The default eval on SmolLM2-135M-Instruct (its GGUF, fetched by scripts/fetch_smollm2.sh): every
# method (fp16, naive-2, hadamard-2, kivi-2, oscar-2 calibrated, online-2, oscar-3, oscar K3/V2) at
# 2K/4K/8K perplexity, attention error and needle retrieval at 4K, on the bundled public-domain text.
# Writes benchmarks/results/quality/$NAME.json, .png and .log (the progress lines with their timings).
# Usage: [NAME=smollm2] bash benchmarks/quality/smollm2_eval.sh [extra eval flags]   (about 9 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$(bash scripts/fetch_smollm2.sh)
out=benchmarks/results/quality
name=${NAME:-smollm2}
mkdir -p "$out"
start=$(date +%s)
.venv/bin/oscar-export eval --model "$model" --json --plot "$out/$name.png" "$@" \
    > "$out/$name.json.tmp" 2> >(grep --line-buffered -v -i "warn\|converting" | tee "$out/$name.log" >&2)
mv "$out/$name.json.tmp" "$out/$name.json"
echo "wall time: $(( $(date +%s) - start )) s" | tee -a "$out/$name.log"
.venv/bin/python -c 'import json, sys; from rich.console import Console; from oscar_export.evaluate.tables import print_table
print_table(json.load(open(sys.argv[1])), Console(width=200))' "$out/$name.json"

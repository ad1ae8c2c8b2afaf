#!/usr/bin/env bash
# SmolLM2-135M-Instruct (its GGUF, fetched by scripts/fetch_smollm2.sh) through every target with
# calibrated rotations (the default): export wall time and peak RSS, artifact bytes beside the
# planner's, a chat answer, decode tokens/s, and parity against the eager graph with the artifact's
# own weights. Usage: [TARGETS="laptop ios"] bash benchmarks/targets/smollm2_targets.sh [OUT_DIR]
# (default /tmp/smollm2-targets; about 25 minutes on 2 cores for the three targets)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/smollm2-targets}
mkdir -p "$out"
model=$(bash scripts/fetch_smollm2.sh)
cli=.venv/bin/oscar-export
py=.venv/bin/python
for target in ${TARGETS:-laptop android ios}; do
    dir="$out/smollm2-$target"
    echo "== $target"
    /usr/bin/time -f "export: %e s wall, peak RSS %M KiB" \
        "$cli" --target "$target" --model "$model" --context 2048 --out "$dir" 2>&1 | grep -E "^(wrote|export:)"
    du -sb "$dir" | awk '{printf "artifact: %d bytes (%.1f MiB)\n", $1, $1 / 1048576}'
    "$py" -c 'import json,sys; p=json.load(open(sys.argv[1]))["plan"]; print("planner: weights", p["weights_bytes"], "bytes, cache at", p["context"], "tokens", p["kv_bytes"], "bytes")' "$dir/manifest.json"
    echo "chat: $("$cli" run --artifact "$dir" --chat "What is the capital of France?" --max-new-tokens 12 2>/dev/null | tail -1)"
    # Decode speed: two runs from the same prompt, 8 and 72 new tokens; load and prefill cancel.
    "$py" - "$dir" 2>/dev/null <<'PY'
import sys, time
from oscar_export.run import run_artifact
runs = []
run_artifact(sys.argv[1], "Once", 2)  # warm-up: first loads (native libraries, page cache) out of the timing
for steps in (8, 72):
    t0 = time.perf_counter()
    tokens = run_artifact(sys.argv[1], "Once upon a time, in a small village by the sea,", steps)["tokens"]
    runs.append((time.perf_counter() - t0, len(tokens)))
(t8, n8), (t72, n72) = runs
print(f"decode: {(n72 - n8) / (t72 - t8):.1f} tokens/s ({n72} tokens; default runtime and threads)")
PY
    "$cli" parity --artifact "$dir" --prompt-tokens 200 --steps 16 2>&1 | grep -E "│|skipped" || true
done

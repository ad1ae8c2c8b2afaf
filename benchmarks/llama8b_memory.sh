#!/usr/bin/env bash
# Llama-3-8B-shaped export and run-time memory (docs/laptop.md, "Larger than memory").
#
#   bash benchmarks/llama8b_memory.sh [WORK_DIR]
#
# 1. Seeded random checkpoints of Llama-3-8B's shape (bf16 safetensors, one shard a layer) with 2, 4, 8 and 32
#    layers, and the laptop export of each (streamed, 4-bit weights in blocks of 128, a 32K cache), timed by
#    /usr/bin/time: peak RSS and wall time per depth.
# 2. The 32-layer artifact, and the same weights with an fp16 cache (--recent 32704: every token in the fp16
#    window), loaded in ONNX Runtime, the cache filled to 4K, to the longest context an fp16 cache fits in 8 GB
#    by the planner, and to 32K, 8 decode steps each: peak RSS and tokens/s (bench memory).
# 3. The android (ExecuTorch) export of the 2, 4 and 8-layer checkpoints (streamed too, torchao 4-bit weights in
#    groups of 32; 32 layers need about 28 GiB, see the results), and bench memory of the 4 and 8-layer programs
#    and of the 8-layer one with an fp16 cache, at 4K and 32K.
# About 75 minutes on 2 cores and 50 GB of disk under WORK_DIR. Results: benchmarks/results/llama8b/.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-work-llama8b}
out=benchmarks/results/llama8b
cli=.venv/bin/oscar-export
mkdir -p "$work" "$out"
for layers in 2 4 8 32; do
  ckpt=$work/llama-3-8b-${layers}l
  [ -d "$ckpt" ] || .venv/bin/python -m oscar_export.random_checkpoint --out "$ckpt" --layers "$layers"
  rm -rf "$work/laptop-${layers}l"
  /usr/bin/time -o "$out/export_laptop_${layers}l.json" -f "{\"layers\": $layers, \"peak_rss_kib\": %M, \"wall_s\": %e}" \
    "$cli" --target laptop --model "$ckpt" --context 32768 --rotations hadamard --group-size 128 \
      --device-memory 8GB --out "$work/laptop-${layers}l" > /dev/null
  cat "$out/export_laptop_${layers}l.json"
  [ "$layers" = 32 ] || rm -rf "$work/laptop-${layers}l"
done
rm -rf "$work/laptop-fp16"
"$cli" --target laptop --model "$work/llama-3-8b-32l" --context 32768 --rotations hadamard --group-size 128 \
  --recent 32704 --device-memory 8GB --out "$work/laptop-fp16" > /dev/null
fits=$(.venv/bin/python -c "import json; print(json.load(open('$work/laptop-32l/manifest.json'))['plan']['max_context_fp16'] // 256 * 256)")
for context in 4096 "$fits" 32768; do
  for artifact in 32l fp16; do
    "$cli" bench memory --artifact "$work/laptop-$artifact" --context "$context" --steps 8 --threads 2 \
      --device-memory 8GB --json > "$out/runtime_${artifact}_${context}.json"
    .venv/bin/python -c "import json; r = json.load(open('$out/runtime_${artifact}_${context}.json')); \
print('$artifact', $context, 'peak GiB', round(r['peak_rss'] / 2**30, 2), 'tokens/s', r['decode_tokens_per_s'])"
  done
done
for layers in 2 4 8; do
  rm -rf "$work/android-${layers}l"
  /usr/bin/time -o "$out/export_android_${layers}l.json" -f "{\"layers\": $layers, \"peak_rss_kib\": %M, \"wall_s\": %e}" \
    "$cli" --target android --model "$work/llama-3-8b-${layers}l" --context 32768 --rotations hadamard \
      --device-memory 8GB --out "$work/android-${layers}l" > /dev/null
  cat "$out/export_android_${layers}l.json"
done
rm -rf "$work/android-8l-fp16"
"$cli" --target android --model "$work/llama-3-8b-8l" --context 32768 --rotations hadamard --recent 32704 \
  --device-memory 8GB --out "$work/android-8l-fp16" > /dev/null
for context in 4096 32768; do
  for artifact in 4l 8l 8l-fp16; do
    name=runtime_android_${artifact/-/_}_${context}.json
    "$cli" bench memory --artifact "$work/android-$artifact" --context "$context" --steps 8 --threads 2 \
      --device-memory 8GB --json > "$out/$name"
    .venv/bin/python -c "import json; r = json.load(open('$out/$name')); \
print('android $artifact', $context, 'peak GiB', round(r['peak_rss'] / 2**30, 2), 'tokens/s', r['decode_tokens_per_s'])"
  done
done

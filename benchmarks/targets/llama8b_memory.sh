#!/usr/bin/env bash
# Llama-3-8B-shaped export and run-time memory (docs/laptop.md, "Larger than memory").
#
#   bash benchmarks/targets/llama8b_memory.sh [WORK_DIR]
#
# 1. Seeded random checkpoints of Llama-3-8B's shape (bf16 safetensors, one shard a layer) with 2, 4, 8 and 32
#    layers, and the laptop export of each (streamed, 4-bit weights in blocks of 128, a 32K cache), timed by
#    /usr/bin/time: peak RSS and wall time per depth.
# 2. The 32-layer artifact, and the same weights with an fp16 cache (--recent 32704: every token in the fp16
#    window), loaded in ONNX Runtime, the cache filled to 4K, to the longest context an fp16 cache fits in 8 GB
#    by the planner, and to 32K, 8 decode steps each: peak RSS and tokens/s (bench memory).
# 3. The android (ExecuTorch) export of the 2, 4, 8 and 32-layer checkpoints (streamed too, torchao 4-bit weights
#    in groups of 32), timed the same way, and the 32-layer program, and the same weights with an fp16 cache, in
#    ExecuTorch at 4K and 32K (bench memory).
# About 2 hours on 2 cores and 60 GB of disk under WORK_DIR. Results: benchmarks/results/targets/llama8b/.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=${1:-work-llama8b}
out=benchmarks/results/targets/llama8b
cli=.venv/bin/oscar-export
mkdir -p "$work" "$out"

# export_timed TARGET LAYERS [FLAGS...]: exports the LAYERS-layer checkpoint to $work/TARGET-LAYERSl under
# /usr/bin/time, into $out/export_TARGET_LAYERSl.json.
export_timed() {
  local target=$1 layers=$2
  shift 2
  rm -rf "$work/$target-${layers}l"
  /usr/bin/time -o "$out/export_${target}_${layers}l.json" -f "{\"layers\": $layers, \"peak_rss_kib\": %M, \"wall_s\": %e}" \
    "$cli" --target "$target" --model "$work/llama-3-8b-${layers}l" --context 32768 --rotations hadamard \
      --device-memory 8GB --out "$work/$target-${layers}l" "$@" > /dev/null
  cat "$out/export_${target}_${layers}l.json"
}

# bench_memory ARTIFACT CONTEXT NAME: bench memory of $work/ARTIFACT filled to CONTEXT, into $out/NAME.
bench_memory() {
  "$cli" bench memory --artifact "$work/$1" --context "$2" --steps 8 --threads 2 --device-memory 8GB --json \
    > "$out/$3"
  .venv/bin/python -c "import json; r = json.load(open('$out/$3')); \
print('$1', $2, 'peak GiB', round(r['peak_rss'] / 2**30, 2), 'tokens/s', r['decode_tokens_per_s'])"
}

for layers in 2 4 8 32; do
  ckpt=$work/llama-3-8b-${layers}l
  [ -d "$ckpt" ] || .venv/bin/python -m oscar_export.models.random_checkpoint --out "$ckpt" --layers "$layers"
  export_timed laptop "$layers" --group-size 128
  [ "$layers" = 32 ] || rm -rf "$work/laptop-${layers}l"
done
rm -rf "$work/laptop-fp16"
"$cli" --target laptop --model "$work/llama-3-8b-32l" --context 32768 --rotations hadamard --group-size 128 \
  --recent 32704 --device-memory 8GB --out "$work/laptop-fp16" > /dev/null
fits=$(.venv/bin/python -c "import json; print(json.load(open('$work/laptop-32l/manifest.json'))['plan']['max_context_fp16'] // 256 * 256)")
for context in 4096 "$fits" 32768; do
  for artifact in 32l fp16; do
    bench_memory "laptop-$artifact" "$context" "runtime_${artifact}_${context}.json"
  done
done
for layers in 2 4 8 32; do
  export_timed android "$layers"
  [ "$layers" = 32 ] || rm -rf "$work/android-${layers}l"
done
rm -rf "$work/android-32l-fp16"
"$cli" --target android --model "$work/llama-3-8b-32l" --context 32768 --rotations hadamard --recent 32704 \
  --device-memory 8GB --out "$work/android-32l-fp16" > /dev/null
for context in 4096 32768; do
  for artifact in 32l 32l-fp16; do
    bench_memory "android-$artifact" "$context" "runtime_android_${artifact/-/_}_${context}.json"
  done
done

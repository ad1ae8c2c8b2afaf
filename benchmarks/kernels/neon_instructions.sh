#!/usr/bin/env bash
# NEON decode cost without arm64 hardware: aarch64 instructions executed per decode step by
# oscar_decode_bench (one thread, 2-bit K/V, group 64) under qemu-aarch64, on a Cortex-A72 model
# (plain NEON) and qemu's "max" CPU (with the dot-product extension), counted by a qemu plugin
# (benchmarks/kernels/qemu_insn_count.c). A count is not a time (no caches, latencies or issue width),
# but it is exact and repeatable, so it compares kernel builds where no phone is at hand.
#
#   bash benchmarks/kernels/neon_instructions.sh [BENCH [BENCH ...]]
#
# BENCH defaults to the aarch64 build of this checkout (built here: needs g++-aarch64-linux-gnu
# and qemu-user). Pass another build's oscar_decode_bench to compare; an x86-64 build (e.g.
# build/native/oscar_decode_bench) is counted under qemu-x86_64's "max" CPU, which runs the AVX2
# kernels, for scale. Each count is a run of 3 steps minus a run of 1, halved (the set-up and
# warm-up cancel). About two minutes per BENCH.
set -euo pipefail
cd "$(dirname "$0")/../.."
plugin=build/qemu_insn_count.so
mkdir -p build
gcc -shared -fPIC -O2 -o "$plugin" benchmarks/kernels/qemu_insn_count.c
if [ $# -eq 0 ]; then
  dir=$(.venv/bin/python -c "from oscar_export.native import build_native; print(build_native(target='aarch64'))")
  set -- "$dir/oscar_decode_bench"
fi
count() {  # BENCH CPU Q KV D CONTEXT STEPS
  local qemu=(qemu-aarch64 -L /usr/aarch64-linux-gnu)
  [ "$2" = x86-64-max ] && qemu=(qemu-x86_64)
  "${qemu[@]}" -plugin "$PWD/$plugin" -cpu "${2#x86-64-}" "$1" "$3" "$4" "$5" "$6" 1 64 3 "$7" \
    2>&1 >/dev/null | awk '/^instructions/ {print $2}'
}
echo "| build | cpu | shape (q / kv heads, head_dim) | context | instructions per step | per cached row and KV head |"
echo "|---|---|---|---|---|---|"
for bench in "$@"; do
  cpus="cortex-a72 max"
  readelf -h "$bench" | grep -q "X86-64" && cpus=x86-64-max
  for cpu in $cpus; do
    for shape in "4 2 64" "9 3 64" "32 8 128"; do
      read -r q kv d <<< "$shape"
      for ctx in 4096 32768; do
        one=$(count "$bench" $cpu $q $kv $d $ctx 1)
        three=$(count "$bench" $cpu $q $kv $d $ctx 3)
        step=$(( (three - one) / 2 ))
        echo "| $bench | $cpu | $q / $kv, $d | $ctx | $step | $(( step / (kv * ctx) )) |"
      done
    done
  done
done

// Peak multiply-accumulate rate of one x86-64 core for the three instruction forms a decode
// kernel can spend its arithmetic on, each measured as independent chains in inline assembly so
// the compiler can neither hoist nor fuse them (benchmarks/decode_floor.sh divides a decode step's
// multiply-accumulates by these rates):
//   fp32   vfmadd231ps                 8 fp32 products per instruction
//   int16  vpmaddwd + vpaddd          16 int16 products (pairs summed into int32)
//   int8   vpmaddubsw + vpaddw        32 u8 x s8 products (pairs summed into int16)
// Prints one JSON object: MACs per second per core, best of REPEATS runs (default 5).
// Build: g++ -O2 -o mac_peak benchmarks/kernels/mac_peak.cc   (needs a CPU with AVX2 and FMA)
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr long kIterations = 20000000;

// Ten FMA chains: latency 4-5 cycles at two per cycle needs at least ten in flight.
void fp32_loop(long n) {
  __asm__ volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n vxorps %%ymm1, %%ymm1, %%ymm1\n vxorps %%ymm2, %%ymm2, %%ymm2\n"
      "vxorps %%ymm3, %%ymm3, %%ymm3\n vxorps %%ymm4, %%ymm4, %%ymm4\n vxorps %%ymm5, %%ymm5, %%ymm5\n"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n vxorps %%ymm7, %%ymm7, %%ymm7\n vxorps %%ymm8, %%ymm8, %%ymm8\n"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n vxorps %%ymm14, %%ymm14, %%ymm14\n vxorps %%ymm15, %%ymm15, %%ymm15\n"
      "1:\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n vfmadd231ps %%ymm14, %%ymm15, %%ymm1\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n vfmadd231ps %%ymm14, %%ymm15, %%ymm3\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n"
      "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n vfmadd231ps %%ymm14, %%ymm15, %%ymm9\n"
      "dec %0\n jnz 1b\n vzeroupper\n"
      : "+r"(n)
      :
      : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm14", "xmm15");
}

// Six products into six accumulators: a kernel's multiply and its accumulate, as it would issue them.
#define MAC_LOOP(NAME, MUL, ADD)                                                                          \
  void NAME(long n) {                                                                                     \
    __asm__ volatile(                                                                                     \
        "vpxor %%ymm6, %%ymm6, %%ymm6\n vpxor %%ymm7, %%ymm7, %%ymm7\n vpxor %%ymm8, %%ymm8, %%ymm8\n"    \
        "vpxor %%ymm9, %%ymm9, %%ymm9\n vpxor %%ymm10, %%ymm10, %%ymm10\n vpxor %%ymm11, %%ymm11, %%ymm11\n" \
        "vpxor %%ymm14, %%ymm14, %%ymm14\n vpxor %%ymm15, %%ymm15, %%ymm15\n"                             \
        "1:\n" MUL " %%ymm14, %%ymm15, %%ymm0\n " MUL " %%ymm14, %%ymm15, %%ymm1\n " MUL                 \
        " %%ymm14, %%ymm15, %%ymm2\n " MUL " %%ymm14, %%ymm15, %%ymm3\n " MUL " %%ymm14, %%ymm15, %%ymm4\n " \
        MUL " %%ymm14, %%ymm15, %%ymm5\n " ADD " %%ymm0, %%ymm6, %%ymm6\n " ADD " %%ymm1, %%ymm7, %%ymm7\n " \
        ADD " %%ymm2, %%ymm8, %%ymm8\n " ADD " %%ymm3, %%ymm9, %%ymm9\n " ADD " %%ymm4, %%ymm10, %%ymm10\n " \
        ADD " %%ymm5, %%ymm11, %%ymm11\n"                                                                  \
        "dec %0\n jnz 1b\n vzeroupper\n"                                                                   \
        : "+r"(n)                                                                                          \
        :                                                                                                  \
        : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",   \
          "xmm11", "xmm14", "xmm15");                                                                      \
  }
MAC_LOOP(int16_loop, "vpmaddwd", "vpaddd")
MAC_LOOP(int8_loop, "vpmaddubsw", "vpaddw")
#undef MAC_LOOP

double best_rate(void (*loop)(long), double macs_per_iteration, int repeats) {
  double best = 0.0;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    loop(kIterations);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double rate = macs_per_iteration * double(kIterations) / s;
    best = rate > best ? rate : best;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 5;
  if (repeats <= 0) {
    std::fprintf(stderr, "mac_peak: REPEATS must be a positive integer, got %s\n", argv[1]);
    return 2;
  }
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::fprintf(stderr, "mac_peak: this CPU lacks AVX2 or FMA\n");
    return 2;
  }
  std::printf("{\"fp32_macs_per_s\": %.4g, \"int16_macs_per_s\": %.4g, \"int8_macs_per_s\": %.4g}\n",
              best_rate(fp32_loop, 10 * 8, repeats), best_rate(int16_loop, 6 * 16, repeats),
              best_rate(int8_loop, 6 * 32, repeats));
}

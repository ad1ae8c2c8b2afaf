// One decode step of the native core alone, at one shape: the kernel without a runtime around it,
// for comparing two builds of the core on one machine (run them alternately; shared machines are
// noisy, so compare the p10 and min columns).
//
//   oscar_decode_bench Q_HEADS KV_HEADS HEAD_DIM CONTEXT THREADS [CLUSTER_DIM] [KERNEL] [STEPS]
//
// The body holds CONTEXT rows of random 2-bit codes with positive scales, behind a full sink of 64
// and a ring of 256; each step writes one ring row and one body row (the same ones every step).
// KERNEL: 0 auto, 1 dense, 2 scalar, 3 simd (oscar::Kernel).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "oscar_core.h"

using namespace oscar;

namespace {

struct KindBuffers {
  std::vector<uint16_t> sink, recent;
  std::vector<uint8_t> codes, scale, zero;  // scale and zero: fp16 or E4M3 bits
};

int usage(const char* why) {
  std::fprintf(stderr,
               "oscar_decode_bench: %s\nusage: oscar_decode_bench Q_HEADS KV_HEADS HEAD_DIM CONTEXT THREADS "
               "[CLUSTER_DIM=64] [KERNEL=0] [STEPS=200] [SCALE_DTYPE=0 (fp16), 1 (fp8 E4M3)]\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) return usage("expected at least 5 arguments");
  std::vector<long long> a;
  for (int i = 1; i < argc; ++i) {
    char* end = nullptr;
    a.push_back(std::strtoll(argv[i], &end, 10));
    if (*end) return usage((std::string("not an integer: ") + argv[i]).c_str());
  }
  const int64_t hq = a[0], hkv = a[1], D = a[2], ctx = a[3];
  const int cd = argc > 6 ? int(a[5]) : 64, kernel = argc > 7 ? int(a[6]) : 0, steps = argc > 8 ? int(a[7]) : 200;
  const int scale_dtype = argc > 9 ? int(a[8]) : 0;
  if (ctx <= 0 || steps <= 0 || kernel < 0 || kernel > 3) return usage("CONTEXT and STEPS must be positive, KERNEL 0-3");
  if (scale_dtype != 0 && scale_dtype != 1) return usage("SCALE_DTYPE must be 0 (fp16) or 1 (fp8 E4M3)");

  AttentionConfig cfg;
  cfg.cluster_dim = cd, cfg.threads = int(a[4]), cfg.scaling = 1.0f / std::sqrt(float(D)), cfg.kernel = Kernel(kernel);
  cfg.scale_dtype = ScaleDtype(scale_dtype);
  AttentionDims dims;
  dims.q_heads = hq, dims.kv_heads = hkv, dims.tokens = 1, dims.head_dim = D;
  dims.sink_cap = cfg.sink, dims.recent_cap = cfg.recent, dims.body_cap = ctx + 1;
  BufferShape shapes[kNumBuffers];
  if (Status s = buffer_shapes(cfg, dims, shapes); !s.ok()) return usage(s.error.c_str());

  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto halves = [&](size_t n, float sd, float offset) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = f32_to_f16(offset + sd * normal(rng));
    return v;
  };
  auto scales = [&](size_t n, float sd, float offset) {  // n values in the cache's scale dtype, as bytes
    std::vector<uint8_t> v(n * (scale_dtype ? 1 : 2));
    for (size_t i = 0; i < n; ++i) {
      const float x = offset + sd * normal(rng);
      if (scale_dtype) {
        v[i] = f32_to_e4m3(x);
      } else {
        const uint16_t h = f32_to_f16(x);
        std::memcpy(&v[2 * i], &h, sizeof h);
      }
    }
    return v;
  };
  const size_t rows = size_t(hkv) * size_t(ctx + 1), groups = size_t(D / cd);
  KindBuffers kinds[2];
  for (auto& k : kinds) {
    k.sink = halves(size_t(hkv * cfg.sink * D), 1.0f, 0.0f);
    k.recent = halves(size_t(hkv * cfg.recent * D), 1.0f, 0.0f);
    k.codes.resize(rows * size_t(D) * 2 / 8);
    for (auto& x : k.codes) x = uint8_t(rng());
    k.scale = scales(rows * groups, 0.0f, 0.05f);
    k.zero = scales(rows * groups, 0.1f, 0.0f);
  }
  const float levels[4] = {0, 1, 2, 3};
  std::vector<float> q(size_t(hq * D)), out(q.size());
  for (auto& x : q) x = normal(rng);
  const std::vector<uint16_t> k_new = halves(size_t(hkv * D), 1.0f, 0.0f), v_new = halves(size_t(hkv * D), 1.0f, 0.0f);

  AttentionArgs args;
  args.config = cfg, args.dims = dims, args.q = q.data(), args.k_new = k_new.data(), args.v_new = v_new.data();
  KindCache* caches[2] = {&args.k, &args.v};
  for (int i = 0; i < 2; ++i) {
    *caches[i] = {kinds[i].sink.data(), kinds[i].recent.data(), kinds[i].codes.data(),
                  kinds[i].scale.data(), kinds[i].zero.data(), levels};
  }
  args.length = cfg.sink + ctx + cfg.recent;  // body full but one row: each step moves a ring row there
  args.out = out.data();

  std::vector<double> ms;
  for (int step = 0; step < steps + 10; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const Status s = oscar_attention(args);
    const auto t1 = std::chrono::steady_clock::now();
    if (!s.ok()) return usage(s.error.c_str());
    if (step >= 10) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%s: %lld q / %lld kv heads, head_dim %lld, cluster_dim %d, %s scales, context %lld, threads %lld: "
              "median %.3f ms, p10 %.3f, min %.3f\n",
              kernel == 0 || kernel == 3 ? (simd_kernel_name()[0] ? simd_kernel_name() : "scalar")
                                         : kernel == 1 ? "dense" : "scalar",
              (long long)hq, (long long)hkv, (long long)D, cd, scale_dtype ? "fp8" : "fp16", (long long)ctx, a[4],
              ms[ms.size() / 2],
              ms[ms.size() / 10], ms[0]);
}

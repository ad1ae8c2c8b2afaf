// Tests of the native core that need no Python: built with sanitizers and cross-built for
// aarch64 (run under qemu-aarch64) by tests/runtime_ops/test_native_core.py.
//
//   oscar_core_test [--random N] [CASE_DIR ...]
//
// Always: fp16 and fp8 E4M3 conversions, the packing examples of docs/format.md, bad input (an error and no
// write), and N (default 200) random decode states where every fused kernel must match the
// dense path within 1e-4 relative. Each CASE_DIR is a golden case exported by the Python test
// (case.txt + raw little-endian .bin files): codec bit-exact, then the prefill and decode
// replay with every kernel, outputs within 1e-3 of the reference, final cache bit-exact.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "oscar_core.h"
#include "oscar_kernels.h"

using namespace oscar;

namespace {

std::atomic<int> failures{0};  // the slices test checks from two threads

#define EXPECT(cond, ...)                                         \
  do {                                                            \
    if (!(cond)) {                                                \
      ++failures;                                                 \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);   \
      std::fprintf(stderr, __VA_ARGS__);                          \
      std::fprintf(stderr, "\n");                                 \
    }                                                             \
  } while (0)

const Kernel kKernels[] = {Kernel::kDense, Kernel::kScalar, Kernel::kSimd};
const char* kKernelNames[] = {"auto", "dense", "scalar", "simd"};

bool simd_runs() {  // kSimd is an error on a CPU without AVX2/NEON
  AttentionConfig c;
  c.kernel = Kernel::kSimd;
  AttentionDims d{1, 1, 1, 64, 0, 0, 0};
  BufferShape s[kNumBuffers];
  return buffer_shapes(c, d, s).ok();
}

double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0, ref = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {  // plain comparisons: aarch64 gcc 12 -O3 crashes vectorizing fmax
    const double d = std::fabs(double(got[i]) - want[i]), w = std::fabs(double(want[i]));
    if (d > err) err = d;
    if (w > ref) ref = w;
  }
  return err / ref;
}

// One layer's cache buffers for a config and capacity, plus the call that uses them.
struct Cache {
  AttentionConfig cfg;
  AttentionDims dims;
  std::vector<uint16_t> sink[2], recent[2];
  std::vector<uint8_t> codes[2], scale[2], zero[2];  // scale and zero: raw bits of cfg.scale_dtype
  std::vector<float> levels[2];
  std::vector<float> feedback;  // K's error-feedback weights [Hkv, D, D] with cfg.k_rounding 1

  Cache(const AttentionConfig& c, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t max_context,
        const std::vector<float>& k_levels, const std::vector<float>& v_levels)
      : cfg(c) {
    const int64_t S = std::min(c.sink, max_context), W = std::min(c.recent, std::max<int64_t>(max_context - c.sink, 0)),
                  B = std::max<int64_t>(max_context - c.sink - c.recent, 0), G = head_dim / c.cluster_dim;
    dims = {q_heads, kv_heads, 1, head_dim, S, W, B};
    const int bits[2] = {c.k_bits, c.v_bits};
    levels[0] = k_levels, levels[1] = v_levels;
    for (int i = 0; i < 2; ++i) {
      sink[i].assign(kv_heads * S * head_dim, 0);
      recent[i].assign(kv_heads * W * head_dim, 0);
      codes[i].assign(kv_heads * B * head_dim * bits[i] / 8, 0);
      scale[i].assign(kv_heads * B * G * bytes(), 0);
      zero[i].assign(kv_heads * B * G * bytes(), 0);
    }
  }

  size_t bytes() const { return cfg.scale_dtype == ScaleDtype::kFloat16 ? 2 : 1; }

  // Element i of a scale or zero buffer set to x, rounded to cfg.scale_dtype.
  void store(std::vector<uint8_t>& buf, size_t i, float x) const {
    if (cfg.scale_dtype == ScaleDtype::kFloat16) {
      const uint16_t h = f32_to_f16(x);
      std::memcpy(buf.data() + 2 * i, &h, 2);
    } else {
      buf[i] = f32_to_e4m3(x);
    }
  }

  // A runtime's pool for config.threads == 0 (AttentionArgs::parallel_for); null: the core's workers.
  void (*parallel_for)(void*, void (*)(void*, size_t), size_t, void*) = nullptr;
  int32_t pool_threads = 0;

  Status run(const float* q, const uint16_t* k, const uint16_t* v, int64_t tokens, int64_t length, float* out) {
    AttentionArgs a;
    a.parallel_for = parallel_for, a.pool_threads = pool_threads;
    a.config = cfg;
    a.dims = dims;
    a.dims.tokens = tokens;
    a.q = q, a.k_new = k, a.v_new = v, a.length = length, a.out = out;
    a.k = {sink[0].data(), recent[0].data(), codes[0].data(), scale[0].data(), zero[0].data(), levels[0].data()};
    a.v = {sink[1].data(), recent[1].data(), codes[1].data(), scale[1].data(), zero[1].data(), levels[1].data()};
    a.k_feedback = feedback.data();
    return oscar_attention(a);
  }

  bool operator==(const Cache& o) const {
    for (int i = 0; i < 2; ++i)
      if (sink[i] != o.sink[i] || recent[i] != o.recent[i] || codes[i] != o.codes[i] || scale[i] != o.scale[i] ||
          zero[i] != o.zero[i])
        return false;
    return true;
  }
};

std::vector<float> uniform(int bits) {
  std::vector<float> l(1 << bits);
  for (size_t i = 0; i < l.size(); ++i) l[i] = float(i);
  return l;
}

void test_fp16() {
  // Every finite fp16 survives f16 -> f32 -> f16; NaN stays NaN.
  for (uint32_t h = 0; h < 65536; ++h) {
    const float x = f16_to_f32(uint16_t(h));
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) {
      EXPECT(std::isnan(x) && std::isnan(f16_to_f32(f32_to_f16(x))), "NaN %04x", h);
    } else {
      EXPECT(f32_to_f16(x) == h, "round trip %04x -> %g -> %04x", h, x, f32_to_f16(x));
    }
  }
  // Round to nearest even at the normal, subnormal and overflow boundaries.
  const struct { float x; uint16_t h; } cases[] = {
      {1.0f + 0x1p-11f, 0x3c00},  {1.0f + 0x1.8p-11f, 0x3c01}, {1.0f + 0x1p-10f + 0x1p-11f, 0x3c02},
      {65504.0f, 0x7bff},         {65519.99f, 0x7bff},          {65520.0f, 0x7c00},
      {0x1p-24f, 0x0001},         {0x1p-25f, 0x0000},           {0x1.000002p-25f, 0x0001},
      {0x1.8p-24f, 0x0002},       {-0x1p-14f, 0x8400},          {-0.0f, 0x8000}, {1e-30f, 0x0000}};
  for (const auto& c : cases) EXPECT(f32_to_f16(c.x) == c.h, "f32_to_f16(%a) = %04x, expected %04x", c.x, f32_to_f16(c.x), c.h);
}

// docs/format.md section 4: codes of one group built so u lands exactly on each code.
void test_packing_examples() {
  const struct { int bits; std::vector<int> codes; std::vector<uint8_t> bytes; } cases[] = {
      {2, {1, 2, 3, 0, 3, 3, 3, 3}, {0x39, 0xFF}},
      {3, {1, 2, 3, 4, 5, 6, 7, 0}, {0xD1, 0x58, 0x1F}},
      {4, {1, 15, 10, 2, 0, 0, 0, 0}, {0xF1, 0x2A, 0x00, 0x00}}};
  for (const auto& c : cases) {
    const int top = (1 << c.bits) - 1;
    std::vector<float> x(32, 0.0f);  // codes 0 .. top with lo = 0, hi = top: scale 1, zero 0
    for (size_t i = 0; i < c.codes.size(); ++i) x[i] = float(c.codes[i]);
    x[31] = float(top);
    std::vector<uint8_t> codes(32 * c.bits / 8);
    uint16_t scale, zero;
    EXPECT(quantize_pack(x.data(), 1, 32, c.bits, 32, 1.0f, nullptr, codes.data(), &scale, &zero).ok(), "pack");
    EXPECT(scale == f32_to_f16(1.0f) && zero == 0, "scale %04x zero %04x", scale, zero);
    for (size_t i = 0; i < c.bytes.size(); ++i)
      EXPECT(codes[i] == c.bytes[i], "%d-bit byte %zu = %02x, expected %02x", c.bits, i, codes[i], c.bytes[i]);
  }
}

// Bad input: an error naming the problem, and no buffer written.
void test_bad_input() {
  AttentionConfig cfg;
  cfg.sink = 2, cfg.recent = 2, cfg.cluster_dim = 32, cfg.scaling = 0.25f;
  auto expect_error = [&](const AttentionConfig& c, int64_t T, int64_t length, const char* what,
                          void (*spoil)(std::vector<float>&, std::vector<uint16_t>&, Cache&)) {
    Cache cache(c, 2, 1, 32, 8, uniform(c.k_bits >= 2 && c.k_bits <= 4 ? c.k_bits : 2),
                uniform(c.v_bits >= 2 && c.v_bits <= 4 ? c.v_bits : 2));
    for (auto* buf : {&cache.sink[0], &cache.recent[1]}) std::fill(buf->begin(), buf->end(), 0x1234);
    std::fill(cache.scale[0].begin(), cache.scale[0].end(), 0x34);
    std::vector<float> q(2 * T * 32, 0.5f), out(2 * T * 32, 7.0f);
    std::vector<uint16_t> kv(T * 32, f32_to_f16(0.25f));
    if (spoil) spoil(q, kv, cache);
    const Cache before = cache;
    const Status st = cache.run(q.data(), kv.data(), kv.data(), T, length, out.data());
    EXPECT(!st.ok() && st.error.find(what) != std::string::npos, "expected an error about '%s', got '%s'", what,
           st.error.c_str());
    EXPECT(cache == before && out == std::vector<float>(out.size(), 7.0f), "a failing call wrote a buffer (%s)", what);
  };
  expect_error(cfg, 3, 6, "cache capacity exceeded", nullptr);
  expect_error(cfg, 1, -1, "length", nullptr);
  AttentionConfig c = cfg;
  c.k_bits = 5;
  expect_error(c, 1, 0, "k_bits", nullptr);
  c = cfg, c.v_clip = 0.3f;
  expect_error(c, 1, 0, "v_clip", nullptr);
  c = cfg, c.scaling = NAN;
  expect_error(c, 1, 0, "scaling", nullptr);
  expect_error(cfg, 1, 0, "q contains NaN", [](auto& q, auto&, auto&) { q[5] = NAN; });
  expect_error(cfg, 1, 0, "k_new contains inf", [](auto&, auto& kv, auto&) { kv[3] = 0x7c00; });
  expect_error(cfg, 1, 0, "k_levels", [](auto&, auto&, Cache& cc) { cc.levels[0] = {0, 2, 1, 3}; });
  expect_error(cfg, 1, 0, "v_levels", [](auto&, auto&, Cache& cc) { cc.levels[1] = {0, 1, 2, 3.5f}; });
  expect_error(cfg, 1, 0, "cache capacities", [](auto&, auto&, Cache& cc) { cc.dims.sink_cap -= 1; });
  expect_error(cfg, 1, 0, "kv_heads", [](auto&, auto&, Cache& cc) { cc.dims.q_heads = 3, cc.dims.kv_heads = 2; });
  expect_error(cfg, 1, 0, "is null", [](auto&, auto&, Cache& cc) { std::vector<uint8_t>().swap(cc.codes[0]); });

  // fp8 scales: a K or V vector whose group the placement rule quantizes in this call (position 2 of a
  // 5-token prefill with sink 2, recent 2) with a zero below -448 is refused before anything is written.
  c = cfg, c.scale_dtype = ScaleDtype::kFloat8E4M3;
  expect_error(c, 5, 0, "a K vector at position 2 exceeds the range of scale_dtype=float8_e4m3fn",
               [](auto&, auto& kv, auto&) { kv[2 * 32 + 4] = f32_to_f16(-500.0f); });
  c.scale_dtype = ScaleDtype(2);
  expect_error(c, 1, 0, "scale_dtype=2", nullptr);

  float x[64];
  for (int i = 0; i < 64; ++i) x[i] = float(i);
  uint8_t codes[16];
  uint16_t s[2], z[2];
  x[7] = INFINITY;
  EXPECT(quantize_pack(x, 1, 64, 2, 32, 1.0f, nullptr, codes, s, z).error.find("inf") != std::string::npos, "inf");
  x[7] = 1e30f;
  EXPECT(quantize_pack(x, 1, 64, 2, 32, 1.0f, nullptr, codes, s, z).error.find("float16") != std::string::npos,
         "overflow");
  EXPECT(quantize_pack(x, 1, 48, 2, 32, 1.0f, nullptr, codes, s, z).error.find("head_dim") != std::string::npos,
         "head_dim");
  // E4M3 has no inf: a group past 448 (its scale, or its zero's magnitude) is refused, and nothing is written.
  uint8_t s8[2] = {7, 7}, z8[2] = {7, 7};
  x[7] = 1000.0f;  // scale 1000 / 3 = 333: stored
  EXPECT(quantize_pack(x, 1, 64, 2, 32, 1.0f, nullptr, codes, s8, z8, nullptr, ScaleDtype::kFloat8E4M3).ok(), "fp8 in range");
  x[7] = 7.0f, x[40] = -449.0f;  // zero -449 in group 1
  s8[0] = z8[0] = 7;
  const Status st = quantize_pack(x, 1, 64, 2, 32, 1.0f, nullptr, codes, s8, z8, nullptr, ScaleDtype::kFloat8E4M3);
  EXPECT(st.error.find("float8_e4m3fn (max 448)") != std::string::npos, "fp8 zero range: '%s'", st.error.c_str());
  EXPECT(s8[0] == 7 && z8[0] == 7, "a refused fp8 quantize_pack wrote its outputs");
}

// E4M3 (float8_e4m3fn): every byte but the two NaNs survives e4m3 -> f32 -> e4m3, and so does its fp16
// widening; round to nearest even at the subnormal, exponent and top boundaries.
void test_fp8() {
  for (int b = 0; b < 256; ++b) {
    const float x = e4m3_to_f32(uint8_t(b));
    if ((b & 0x7f) == 0x7f) {
      EXPECT(std::isnan(x), "E4M3 %02x is NaN", b);
      continue;
    }
    EXPECT(f32_to_e4m3(x) == b, "round trip %02x -> %g -> %02x", b, x, f32_to_e4m3(x));
    EXPECT(f16_to_f32(f32_to_f16(x)) == x, "E4M3 %02x = %g is not an fp16 value", b, x);
  }
  const struct { float x; uint8_t b; } cases[] = {
      {1.0f + 0x1p-4f, 0x38},  {1.0f + 0x1.8p-3f, 0x3a}, {0x1.11p+0f, 0x39},            {448.0f, 0x7e},
      {0x1p-9f, 0x01},         {0x1p-10f, 0x00},          {0x1.8p-9f, 0x02},             {0x1.000002p-10f, 0x01},
      {0x1.ep-7f, 0x08},       {0x1p-6f, 0x08},           {-0.0f, 0x80},                 {-2.5f, 0xc2},
      {1e-30f, 0x00},          {0.0f, 0x00}};
  for (const auto& c : cases) EXPECT(f32_to_e4m3(c.x) == c.b, "f32_to_e4m3(%a) = %02x, expected %02x", c.x, f32_to_e4m3(c.x), c.b);

  // Every kernel set this CPU runs widens every byte (NaN ones included) to the same fp16 bits, from an
  // unaligned start and with a tail shorter than a vector.
  std::vector<const BodyKernels*> sets = {&kScalarKernels};
#if defined(OSCAR_HAVE_AVX2)
  sets.push_back(&kAvx2Kernels);
#endif
#if defined(OSCAR_HAVE_AVXVNNI)
  sets.push_back(&kAvxVnniKernels);
#endif
#if defined(OSCAR_HAVE_AVX512)
  sets.push_back(&kAvx512Kernels);
#endif
#if defined(__aarch64__)
  sets.push_back(&kNeonKernels);
#endif
#if defined(OSCAR_HAVE_NEON_DOTPROD)
  sets.push_back(&kNeonDotprodKernels);
#endif
  std::vector<uint8_t> bytes(3 + 256 + 13);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(i * 37 + 11);  // 37 is odd: every byte appears
  const int64_t n = int64_t(bytes.size()) - 3;
  int widened = 0;
  for (const BodyKernels* set : sets) {
    if (set != &kScalarKernels && simd_kernel_sets().find(set->name) == std::string::npos) continue;
    std::vector<uint16_t> out(size_t(n), 0xdead);
    set->widen_e4m3(bytes.data() + 3, n, out.data());
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t b = bytes[size_t(i) + 3];
      EXPECT(out[size_t(i)] == f32_to_f16(e4m3_to_f32(b)), "%s widens E4M3 %02x to %04x, expected %04x", set->name,
             b, out[size_t(i)], f32_to_f16(e4m3_to_f32(b)));
    }
    ++widened;
  }
  std::printf("fp8: %d kernel set(s) widen every E4M3 byte exactly\n", widened);
}

// The integer score path at its bound (oscar_kernels.h, SplitQuery): a query of equal elements gives
// every channel the top digit, and rows whose codes are all the top code but one make the int32 sums
// as large as a group can. Half the rows are like that, half the opposite, so a sum that wrapped
// would move the softmax to the wrong rows. Fused kernels against the dense path, 1e-4 relative.
void test_extreme_scores() {
  const int64_t D = 128, C = 40;
  for (int bits : {2, 4})
    for (int cd : {32, 64, 128})
      for (float sign : {1.0f, -1.0f}) {
        AttentionConfig cfg;
        cfg.k_bits = bits, cfg.v_bits = 2, cfg.cluster_dim = cd, cfg.sink = 0, cfg.recent = 0;
        cfg.scaling = 1.0f / std::sqrt(float(D));
        std::vector<uint16_t> k(C * D), v(C * D);
        for (int64_t t = 0; t < C; ++t)
          for (int64_t i = 0; i < D; ++i) {
            const bool first = i % cd == 0, high = t % 2 == 0;
            k[t * D + i] = f32_to_f16(first == high ? 0.0f : 1.0f);  // high rows: codes all top but one
            v[t * D + i] = f32_to_f16(high ? 1.0f + float(i % 7) : -1.0f - float(i % 5));
          }
        std::vector<float> q_prefill((C - 1) * D, 0.0f), out((C - 1) * D), q(D, sign), want(D);
        Cache base(cfg, 1, 1, D, C, uniform(bits), uniform(2));
        EXPECT(base.run(q_prefill.data(), k.data(), v.data(), C - 1, 0, out.data()).ok(), "extreme prefill");
        Cache dense = base;
        dense.cfg.kernel = Kernel::kDense;
        EXPECT(dense.run(q.data(), k.data() + (C - 1) * D, v.data() + (C - 1) * D, 1, C - 1, want.data()).ok(),
               "extreme dense decode");
        for (Kernel kernel : {Kernel::kScalar, Kernel::kAuto}) {
          Cache c = base;
          c.cfg.kernel = kernel;
          std::vector<float> got(D);
          EXPECT(c.run(q.data(), k.data() + (C - 1) * D, v.data() + (C - 1) * D, 1, C - 1, got.data()).ok(),
                 "extreme decode");
          const double err = rel_err(got, want);
          EXPECT(err <= 1e-4, "extreme scores: %d-bit, cluster_dim %d, query %+g, kernel %s: relative error %g", bits,
                 cd, double(sign), kKernelNames[int(kernel)], err);
        }
      }
}

// Random decode states: every fused kernel against the dense path, 1e-4 relative (one fp16 ulp,
// 2^-11, for the AVX-512 set, whose values are 16-bit fixed point: fixed_point_bound); same cache after.
void test_random(int count) {
  const double simd_tolerance = std::string(simd_kernel_name()) == "avx512" ? 0x1p-11 : 1e-4;
  std::mt19937 rng(1234);
  auto pick = [&](std::initializer_list<int> xs) { return *(xs.begin() + rng() % xs.size()); };
  std::normal_distribution<float> normal;
  const bool simd = simd_runs();
  double worst = 0;
  for (int n = 0; n < count; ++n) {
    AttentionConfig cfg;
    cfg.k_bits = pick({2, 3, 4}), cfg.v_bits = pick({2, 3, 4});
    cfg.cluster_dim = pick({32, 64, 128});
    const int64_t D = cfg.cluster_dim * (cfg.cluster_dim == 128 ? 1 : pick({1, 2}));
    cfg.sink = pick({0, 1, 3}), cfg.recent = pick({0, 1, 4, 9});
    cfg.k_clip = pick({0, 1}) ? 1.0f : 0.9f, cfg.v_clip = pick({0, 1}) ? 1.0f : 0.8f;
    cfg.scaling = 1.0f / std::sqrt(float(D));
    cfg.threads = pick({1, 2});
    cfg.scale_dtype = pick({0, 0, 1}) ? ScaleDtype::kFloat8E4M3 : ScaleDtype::kFloat16;
    const int64_t kv_heads = pick({1, 2, 3}), q_heads = kv_heads * pick({1, 2, 3, 5}), C = pick({20, 90, 150});
    std::vector<float> lv[2];
    for (int i = 0; i < 2; ++i) {
      const int bits = i ? cfg.v_bits : cfg.k_bits;
      lv[i] = uniform(bits);
      if (rng() % 2)  // Lloyd-Max-like: ascending, inside [0, L-1]
        for (size_t j = 1; j + 1 < lv[i].size(); ++j) lv[i][j] = float(j) + 0.4f * (normal(rng) > 0 ? 1.0f : -1.0f) * 0.5f;
    }
    Cache base(cfg, q_heads, kv_heads, D, C, lv[0], lv[1]);
    const int64_t length = rng() % C;  // the decode step lands at position `length`
    std::vector<float> q(q_heads * std::max<int64_t>(length, 1) * D), out(q.size());
    std::vector<uint16_t> k(kv_heads * std::max<int64_t>(length, 1) * D), v(k.size());
    const float mag = pick({1, 30});
    for (auto& x : q) x = normal(rng);
    for (auto& x : k) x = f32_to_f16(normal(rng) * mag);
    for (auto& x : v) x = f32_to_f16(normal(rng) * mag);
    if (length) EXPECT(base.run(q.data(), k.data(), v.data(), length, 0, out.data()).ok(), "prefill");
    std::vector<float> qd(q_heads * D);
    std::vector<uint16_t> kd(kv_heads * D), vd(kv_heads * D);
    for (auto& x : qd) x = normal(rng);
    for (auto& x : kd) x = f32_to_f16(normal(rng) * mag);
    for (auto& x : vd) x = f32_to_f16(normal(rng) * mag);
    std::vector<float> want(q_heads * D);
    Cache dense = base;
    dense.cfg.kernel = Kernel::kDense;
    const Status st = dense.run(qd.data(), kd.data(), vd.data(), 1, length, want.data());
    EXPECT(st.ok(), "dense decode: %s", st.error.c_str());
    for (Kernel kernel : {Kernel::kScalar, Kernel::kSimd, Kernel::kAuto}) {
      if (kernel == Kernel::kSimd && !simd) continue;
      Cache c = base;
      c.cfg.kernel = kernel;
      std::vector<float> got(want.size());
      EXPECT(c.run(qd.data(), kd.data(), vd.data(), 1, length, got.data()).ok(), "decode");
      const double err = rel_err(got, want);
      worst = std::fmax(worst, err);
      const double tolerance = kernel == Kernel::kScalar ? 1e-4 : simd_tolerance;
      EXPECT(err <= tolerance, "random case %d kernel %s: relative error %g", n, kKernelNames[int(kernel)], err);
      EXPECT(c == dense, "random case %d kernel %s: cache differs from the dense path", n, kKernelNames[int(kernel)]);
    }
  }
  std::printf("random: %d decode states, fused vs dense max relative error %.3g (simd %s%s)\n", count, worst,
              simd ? "on: " : "unavailable", simd_kernel_name());
}

// A stand-in for a runtime's pool: every item, in reverse order, on the calling thread.
void reverse_pool(void*, void (*fn)(void*, size_t), size_t items, void* data) {
  for (size_t i = items; i-- > 0;) fn(data, i);
}

// A decode step over a long body, cut into slices: every thread count of the core's workers and a
// runtime pool give the dense path's output within 1e-4 relative and the same cache; two callers at
// once (the second finds the workers busy and runs alone) too.
void test_slices(ScaleDtype scale_dtype) {
  std::mt19937 rng(99);
  std::normal_distribution<float> normal;
  AttentionConfig cfg;
  cfg.cluster_dim = 64, cfg.sink = 16, cfg.recent = 64, cfg.scaling = 0.125f, cfg.scale_dtype = scale_dtype;
  const int64_t kv_heads = 3, q_heads = 9, D = 64, C = 3000, length = 2900;
  Cache base(cfg, q_heads, kv_heads, D, C, uniform(2), uniform(2));
  for (int i = 0; i < 2; ++i) {  // a random valid state: any codes, small positive scales
    for (auto& x : base.sink[i]) x = f32_to_f16(normal(rng));
    for (auto& x : base.recent[i]) x = f32_to_f16(normal(rng));
    for (auto& x : base.codes[i]) x = uint8_t(rng());
    for (size_t j = 0; j < base.scale[i].size() / base.bytes(); ++j) {
      base.store(base.scale[i], j, 0.05f + 0.01f * std::fabs(normal(rng)));
      base.store(base.zero[i], j, -0.1f + 0.02f * normal(rng));
    }
  }
  std::vector<float> q(q_heads * D), want(q_heads * D);
  std::vector<uint16_t> k(kv_heads * D), v(kv_heads * D);
  for (auto& x : q) x = 2.0f * normal(rng);
  for (auto& x : k) x = f32_to_f16(normal(rng));
  for (auto& x : v) x = f32_to_f16(normal(rng));
  Cache dense = base;
  dense.cfg.kernel = Kernel::kDense;
  EXPECT(dense.run(q.data(), k.data(), v.data(), 1, length, want.data()).ok(), "slices: dense decode");
  std::atomic<int> checked{0};
  auto check = [&](Cache c, const char* what) {
    std::vector<float> got(want.size());
    const Status st = c.run(q.data(), k.data(), v.data(), 1, length, got.data());
    ++checked;
    EXPECT(st.ok(), "slices %s: %s", what, st.error.c_str());
    EXPECT(rel_err(got, want) <= 1e-4, "slices %s: relative error %g", what, rel_err(got, want));
    EXPECT(c == dense, "slices %s: cache differs from the dense path", what);
  };
  for (int threads : {1, 2, 3, 4, 8}) {
    Cache c = base;
    c.cfg.threads = threads;
    const std::string what = std::to_string(threads) + " threads";
    check(c, what.c_str());
  }
  Cache pooled = base;
  pooled.cfg.threads = 0, pooled.parallel_for = reverse_pool, pooled.pool_threads = 4;
  check(pooled, "runtime pool");
  Cache own = base;
  own.cfg.threads = 0;
  check(own, "one per core");
  std::thread other([&] {
    Cache c = base;
    c.cfg.threads = 2;
    check(c, "concurrent caller");
  });
  Cache two = base;
  two.cfg.threads = 2;
  check(two, "concurrent caller");
  other.join();
  std::printf("slices: %d sliced decode steps of %lld body rows (%s scales) checked against the dense path\n",
              checked.load(), (long long)(length - cfg.sink - cfg.recent),
              scale_dtype == ScaleDtype::kFloat16 ? "fp16" : "fp8");
}

// ---- golden cases ------------------------------------------------------------------------

template <typename T>
std::vector<T> read_bin(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    std::exit(2);
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

void test_golden(const std::string& dir) {
  std::map<std::string, std::string> meta;
  std::ifstream f(dir + "/case.txt");
  for (std::string key, value; f >> key >> value;) meta[key] = value;
  auto num = [&](const char* key) { return std::strtod(meta.at(key).c_str(), nullptr); };  // hex floats too
  AttentionConfig cfg;
  cfg.k_bits = int(num("k_bits")), cfg.v_bits = int(num("v_bits")), cfg.cluster_dim = int(num("cluster_dim"));
  cfg.sink = int64_t(num("sink")), cfg.recent = int64_t(num("recent"));
  cfg.k_clip = float(num("k_clip")), cfg.v_clip = float(num("v_clip")), cfg.scaling = float(num("scaling"));
  cfg.k_rounding = int(num("k_rounding"));
  cfg.scale_dtype = ScaleDtype(int(num("scale_dtype")));
  const size_t sbytes = cfg.scale_dtype == ScaleDtype::kFloat16 ? 2 : 1;
  const int64_t Hq = int64_t(num("q_heads")), Hkv = int64_t(num("kv_heads")), D = int64_t(num("head_dim")),
                N = int64_t(num("tokens")), P = int64_t(num("prefill"));
  const std::string name = meta["name"];
  // K's error-feedback weights [Hkv, D, D]; the codec vectors use KV head 0's.
  const std::vector<float> feedback = cfg.k_rounding ? read_bin<float>(dir + "/k_feedback.bin") : std::vector<float>{};

  // Codec: bit-exact.
  const auto x = read_bin<float>(dir + "/codec_input.bin");
  const auto codec_levels = read_bin<float>(dir + "/codec_levels.bin");
  const int64_t rows = int64_t(x.size()) / D, G = D / cfg.cluster_dim;
  const int cbits = int(num("codec_bits"));
  std::vector<uint8_t> codes(rows * D * cbits / 8);
  std::vector<uint8_t> scale(rows * G * sbytes), zero(rows * G * sbytes);
  const Status st = quantize_pack(x.data(), rows, D, cbits, cfg.cluster_dim, float(num("codec_clip")),
                                  codec_levels.data(), codes.data(), scale.data(), zero.data(),
                                  cfg.k_rounding ? feedback.data() : nullptr, cfg.scale_dtype);
  EXPECT(st.ok(), "%s codec: %s", name.c_str(), st.error.c_str());
  EXPECT(codes == read_bin<uint8_t>(dir + "/codec_codes.bin"), "%s: codec codes differ", name.c_str());
  EXPECT(scale == read_bin<uint8_t>(dir + "/codec_scale.bin"), "%s: codec scales differ", name.c_str());
  EXPECT(zero == read_bin<uint8_t>(dir + "/codec_zero.bin"), "%s: codec zeros differ", name.c_str());

  // Replay: prefill of P tokens, then one decode step per remaining token.
  const auto q = read_bin<float>(dir + "/q.bin");  // [Hq, N, D] rotated
  const auto k = read_bin<uint16_t>(dir + "/k.bin"), v = read_bin<uint16_t>(dir + "/v.bin");  // [Hkv, N, D]
  const auto want_prefill = read_bin<float>(dir + "/prefill_out.bin"), want_decode = read_bin<float>(dir + "/decode_out.bin");
  auto slice = [&](const auto& src, int64_t heads, int64_t t0, int64_t t1) {
    std::vector<typename std::decay_t<decltype(src)>::value_type> out;
    for (int64_t h = 0; h < heads; ++h)
      out.insert(out.end(), src.begin() + (h * N + t0) * D, src.begin() + (h * N + t1) * D);
    return out;
  };
  const bool simd = simd_runs();
  double worst = 0;
  for (Kernel kernel : kKernels) {
    if (kernel == Kernel::kSimd && !simd) continue;
    cfg.kernel = kernel;
    cfg.threads = kernel == Kernel::kScalar ? 2 : 1;
    Cache cache(cfg, Hq, Hkv, D, N, read_bin<float>(dir + "/k_levels.bin"), read_bin<float>(dir + "/v_levels.bin"));
    cache.feedback = feedback;
    std::vector<float> out(Hq * P * D);
    const auto qp = slice(q, Hq, 0, P);
    const auto kp = slice(k, Hkv, 0, P), vp = slice(v, Hkv, 0, P);
    Status s = cache.run(qp.data(), kp.data(), vp.data(), P, 0, out.data());
    EXPECT(s.ok(), "%s prefill: %s", name.c_str(), s.error.c_str());
    worst = std::fmax(worst, rel_err(out, want_prefill));
    EXPECT(rel_err(out, want_prefill) <= 1e-3, "%s prefill (%s): relative error %g", name.c_str(),
           kKernelNames[int(kernel)], rel_err(out, want_prefill));
    for (int64_t t = P; t < N; ++t) {
      const auto qt = slice(q, Hq, t, t + 1);
      const auto kt = slice(k, Hkv, t, t + 1), vt = slice(v, Hkv, t, t + 1);
      std::vector<float> o(Hq * D);
      s = cache.run(qt.data(), kt.data(), vt.data(), 1, t, o.data());
      EXPECT(s.ok(), "%s decode %lld: %s", name.c_str(), (long long)t, s.error.c_str());
      const std::vector<float> want(want_decode.begin() + (t - P) * Hq * D, want_decode.begin() + (t - P + 1) * Hq * D);
      worst = std::fmax(worst, rel_err(o, want));
      EXPECT(rel_err(o, want) <= 1e-3, "%s decode step %lld (%s): relative error %g", name.c_str(), (long long)t,
             kKernelNames[int(kernel)], rel_err(o, want));
    }
    const char* kinds[2] = {"k", "v"};
    for (int i = 0; i < 2; ++i) {
      const std::string p = dir + "/final_" + kinds[i] + "_";
      EXPECT(cache.sink[i] == read_bin<uint16_t>(p + "sink.bin"), "%s: final %s sink differs", name.c_str(), kinds[i]);
      EXPECT(cache.recent[i] == read_bin<uint16_t>(p + "recent.bin"), "%s: final %s ring differs", name.c_str(), kinds[i]);
      EXPECT(cache.codes[i] == read_bin<uint8_t>(p + "codes.bin"), "%s: final %s codes differ", name.c_str(), kinds[i]);
      EXPECT(cache.scale[i] == read_bin<uint8_t>(p + "scale.bin"), "%s: final %s scales differ", name.c_str(), kinds[i]);
      EXPECT(cache.zero[i] == read_bin<uint8_t>(p + "zero.bin"), "%s: final %s zeros differ", name.c_str(), kinds[i]);
    }
  }
  std::printf("golden %s: max relative error %.3g\n", name.c_str(), worst);
}


#if defined(OSCAR_HAVE_AVX2)
// The most a value accumulator may differ from the AVX2 set's when `other` adds the values in 16-bit
// fixed point (oscar_avx512.cc): per head and group, every weight w = p * scale is off by at most
// unit / 2 with unit = max|w| / 32767, times a code of at most 2^bits - 1, over n rows; plus the fp32
// roundings of both sums, 1e-5 of their magnitude (n <= 256 terms at 2^-24 each, with room).
double fixed_point_bound(const std::vector<float>& p, const std::vector<uint16_t>& scale,
                         const std::vector<uint16_t>& zero, int n, int row0, int G, int bits, int h, int g) {
  double top = 0, magnitude = 0;
  const int cmax = (1 << bits) - 1;
  for (int j = 0; j < n; ++j) {
    const float w = p[h * n + j] * f16_to_f32(scale[(row0 + j) * G + g]);
    top = std::max(top, double(std::fabs(w)));
    magnitude += std::fabs(w) * cmax + std::fabs(p[h * n + j] * f16_to_f32(zero[(row0 + j) * G + g]));
  }
  return 0.5 * (top / 32767.0) * cmax * n + 1e-5 * magnitude;
}

// A set against the AVX2 set, kernel by kernel, on random body blocks of every planar shape (bits,
// head_dim, cluster_dim, query heads, rows, block start) and some that fall back: scores and softmax
// pieces must be the same floats, bit for bit (oscar_avx512.cc and oscar_avxvnni.cc say why); value
// accumulators too, or within fixed_point_bound where `fixed_point_values`.
void compare_with_avx2(const BodyKernels& other, int count, bool fixed_point_values) {
  if (simd_kernel_sets().find(other.name) == std::string::npos) {
    std::printf("kernel sets: this CPU runs %s, not %s: it is not compared\n", simd_kernel_sets().c_str(), other.name);
    return;
  }
  double worst = 0;  // the largest value difference as a share of its bound
  std::mt19937 rng(31);
  std::normal_distribution<float> normal;
  const BodyKernels* sets[2] = {&kAvx2Kernels, &other};
  int compared = 0;
  for (int n_case = 0; n_case < count; ++n_case) {
    const int bits = std::vector<int>{2, 2, 4, 4, 3}[rng() % 5];
    const int D = 32 * int(1 + rng() % 4);
    std::vector<int> cds;
    for (int cd : {32, 64, 128})
      if (D % cd == 0) cds.push_back(cd);
    const int cd = cds[rng() % cds.size()], G = D / cd, heads = int(1 + rng() % 9);
    const int n = rng() % 4 ? int(1 + rng() % 256) : 256, row0 = int(rng() % 40), rows = row0 + n;
    std::vector<uint8_t> codes(size_t(rows) * D * bits / 8);
    for (auto& x : codes) x = uint8_t(rng());
    std::vector<uint16_t> scale(size_t(rows) * G), zero(scale.size());
    for (auto& x : scale) x = f32_to_f16(0.01f + std::fabs(normal(rng)));
    for (auto& x : zero) x = f32_to_f16(normal(rng));
    const std::vector<float> levels = uniform(bits);
    const BodyView b{codes.data(), scale.data(), zero.data(), levels.data(), bits, D, cd, G};
    std::vector<float> q(size_t(heads) * D), qsum(size_t(heads) * G, 0.0f), p(size_t(heads) * n);
    for (auto& x : q) x = 3.0f * normal(rng);
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < D; ++i) qsum[h * G + i / cd] += q[h * D + i];
    for (auto& x : p) x = std::fabs(normal(rng));
    std::vector<float> score[2], acc[2], soft[2], sums[2];
    for (int s = 0; s < 2; ++s) {
      std::vector<float> prepared(size_t(heads) * kPreparedBytes / 4 + 16), scratch(size_t(n + 1) * heads * G);
      void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(prepared.data()) + 63) & ~uintptr_t(63));
      score[s].assign(size_t(heads) * n, 0.0f);
      acc[s].assign(size_t(heads) * D, 0.0f);
      sets[s]->prepare(b, q.data(), heads, aligned);
      sets[s]->scores(b, row0, n, q.data(), qsum.data(), heads, score[s].data(), aligned);
      sets[s]->values(b, row0, n, p.data(), heads, acc[s].data(), scratch.data());
      soft[s] = score[s];
      const float m = sets[s]->scale_max(soft[s].data(), n, 0.125f);
      sums[s] = {m, sets[s]->exp_sum(soft[s].data(), n, m)};
    }
    bool values_ok = fixed_point_values || acc[0] == acc[1];
    if (fixed_point_values)
      for (int h = 0; h < heads; ++h)
        for (int g = 0; g < G; ++g) {
          const double bound = fixed_point_bound(p, scale, zero, n, row0, G, bits, h, g);
          for (int i = g * cd; i < (g + 1) * cd; ++i) {
            const double diff = std::fabs(double(acc[0][h * D + i]) - acc[1][h * D + i]);
            worst = std::max(worst, diff / bound);
            if (!(diff <= bound)) values_ok = false;
          }
        }
    const bool same = score[0] == score[1] && values_ok && soft[0] == soft[1] && sums[0] == sums[1];
    EXPECT(same, "kernel sets: avx2 and %s differ at bits %d, head_dim %d, cluster_dim %d, %d heads, %d rows "
                 "from %d", other.name, bits, D, cd, heads, n, row0);
    compared += same;
  }
  if (fixed_point_values)
    std::printf("kernel sets: %s equals avx2 bit for bit in scores and softmax, values within %.3g of the "
                "fixed-point bound, on %d random body blocks\n", other.name, worst, compared);
  else
    std::printf("kernel sets: %s equals avx2 bit for bit on %d random body blocks\n", other.name, compared);
}
#endif

void test_kernel_sets(int count) {
#if defined(OSCAR_HAVE_AVXVNNI)
  compare_with_avx2(kAvxVnniKernels, count, false);
#endif
#if defined(OSCAR_HAVE_AVX512)
  compare_with_avx2(kAvx512Kernels, count, true);
#endif
#if !defined(OSCAR_HAVE_AVX2)
  (void)count;
  std::printf("kernel sets: no x86 sets to compare in this build (%s)\n", simd_kernel_sets().c_str());
#endif
}

}  // namespace

int main(int argc, char** argv) {
  int random = 200;
  std::vector<std::string> cases;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--random" && i + 1 < argc) {
      random = std::atoi(argv[++i]);
    } else {
      cases.push_back(argv[i]);
    }
  }
  test_fp16();
  test_fp8();
  test_packing_examples();
  test_bad_input();
  test_extreme_scores();
  test_random(random);
  test_slices(ScaleDtype::kFloat16);
  test_slices(ScaleDtype::kFloat8E4M3);
  test_kernel_sets(random);
  for (const std::string& dir : cases) test_golden(dir);
  std::printf("%s: %d failure(s)\n", failures ? "FAILED" : "OK", failures.load());
  return failures ? 1 : 0;
}

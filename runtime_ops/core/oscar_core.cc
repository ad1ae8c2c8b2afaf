// The codec, the placement rule and the attention driver; scalar body kernels.
// Built with -ffp-contract=off: the codec must round every fp32 step exactly as the
// PyTorch reference does, so no multiply-add may be fused behind our back.
#include "oscar_core.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <system_error>
#include <thread>
#include <vector>

#include "oscar_kernels.h"

#if defined(OSCAR_HAVE_NEON_DOTPROD) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace oscar {
namespace {

constexpr int kBlock = 64;  // keys per online-softmax block: scores and fp32 rows stay in L1
constexpr int kBodyBlock = 256;  // body rows per fused decode block: amortizes per-block query set-up
constexpr int64_t kMaxDim = int64_t(1) << 31;

template <typename... Args>
Status fail(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return Status{s.str()};
}

bool f16_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

// f16_to_f32 for hot loops: normal numbers inline (rebias the exponent), the rest out of line.
inline float half_to_float(uint16_t h) {
  const uint32_t e = h & 0x7c00u;
  if (e == 0 || e == 0x7c00u) return f16_to_f32(h);
  const uint32_t u = uint32_t(h & 0x8000u) << 16 | ((uint32_t(h & 0x7fffu) << 13) + 0x38000000u);
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

constexpr float kE4M3Max = 448.0f;

int64_t scale_bytes(ScaleDtype t) { return t == ScaleDtype::kFloat16 ? 2 : 1; }
const char* scale_dtype_name(ScaleDtype t) { return t == ScaleDtype::kFloat16 ? "float16" : "float8_e4m3fn"; }

// E4M3 bits -> the same value's fp16 bits (exact): how the fused kernels read fp8 scales and zeros.
const uint16_t* e4m3_to_f16_table() {
  static const std::array<uint16_t, 256> table = [] {
    std::array<uint16_t, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = f32_to_f16(e4m3_to_f32(uint8_t(b)));
    return t;
  }();
  return table.data();
}

// Element i of a scale or zero buffer as fp32.
float stored_value(ScaleDtype t, const void* p, int64_t i) {
  return t == ScaleDtype::kFloat16 ? f16_to_f32(static_cast<const uint16_t*>(p)[i])
                                   : e4m3_to_f32(static_cast<const uint8_t*>(p)[i]);
}

Status check_scale_dtype(ScaleDtype t) {
  if (t != ScaleDtype::kFloat16 && t != ScaleDtype::kFloat8E4M3)
    return fail("scale_dtype=", int32_t(t), ": expected 0 (float16) or 1 (float8_e4m3fn)");
  return {};
}

// The error for a vector whose group scale or zero its scale_dtype cannot store (storable()).
Status out_of_range(const char* what, int64_t index, ScaleDtype t) {
  return fail(what, index, " exceeds the range of scale_dtype=", scale_dtype_name(t), " (max ",
              t == ScaleDtype::kFloat16 ? 65504 : 448, "): expected smaller magnitudes");
}

Status check_bits(const char* name, int bits) {
  if (bits < 2 || bits > 4) return fail(name, "=", bits, ": expected 2, 3 or 4");
  return {};
}

Status check_clip(const char* name, float clip) {
  if (!(clip >= 0.5f && clip <= 1.0f)) return fail(name, "=", clip, ": expected 0.5 <= clip <= 1.0");
  return {};
}

Status check_levels(const char* name, const float* levels, int bits) {
  const int n = 1 << bits;
  for (int i = 0; i < n; ++i) {
    const float x = levels[i];
    if (!std::isfinite(x) || x < 0.0f || x > float(n - 1) || (i > 0 && x <= levels[i - 1])) {
      std::ostringstream s;
      s << name << "=[";
      for (int j = 0; j < n; ++j) s << (j ? ", " : "") << levels[j];
      s << "]: expected " << n << " strictly ascending values in [0, " << n - 1 << "]";
      return Status{s.str()};
    }
  }
  return {};
}

// Decision thresholds: fp32 midpoints of consecutive levels (format.md section 3, step 4).
void thresholds(const float* levels, int bits, float* thr) {
  for (int j = 0; j + 1 < (1 << bits); ++j) thr[j] = (levels[j] + levels[j + 1]) * 0.5f;
}

// A group's fp32 scale and zero before storage rounding (format.md section 3, steps 1-3).
void group_scale_zero(const float* xs, int cluster_dim, float clip, int bits, float& scale, float& zero) {
  float lo = xs[0], hi = xs[0];
  for (int i = 1; i < cluster_dim; ++i) {
    lo = xs[i] < lo ? xs[i] : lo;
    hi = xs[i] > hi ? xs[i] : hi;
  }
  if (clip < 1.0f) {
    const float half_clip = 0.5f * clip;  // "c = 0.5 * clip rounded once to fp32": exact for an fp32 clip
    const float mid = (hi + lo) * 0.5f;
    const float half = (hi - lo) * half_clip;
    lo = mid - half;
    hi = mid + half;
  }
  scale = (hi - lo) / float((1 << bits) - 1);
  zero = lo;
}

// Whether every group of a vector has a scale and zero that scale_dtype stores: fp16 rounds a finite
// value to inf past 65504; E4M3 has no inf, so the codec refuses a scale or |zero| above 448 before rounding.
bool storable(const float* x, int64_t head_dim, int bits, int cluster_dim, float clip, ScaleDtype dtype) {
  for (int64_t g = 0; g < head_dim / cluster_dim; ++g) {
    float s, z;
    group_scale_zero(x + g * cluster_dim, cluster_dim, clip, bits, s, z);
    const bool ok = dtype == ScaleDtype::kFloat16 ? f16_finite(f32_to_f16(s)) && f16_finite(f32_to_f16(z))
                                                  : s <= kE4M3Max && std::fabs(z) <= kE4M3Max;
    if (!ok) return false;
  }
  return true;
}

// One vector -> packed codes, scale and zero per group in scale_dtype (format.md sections 3-4); callers
// check storable() first. levels: the 2^bits code-unit levels thr was made from. feedback ([head_dim,
// head_dim] row-major, or nullptr): codes chosen with error feedback (section 3, step 5), on running values
// in `work` (head_dim floats).
void quantize_vector(const float* x, int64_t head_dim, int bits, int cluster_dim, float clip, const float* levels,
                     const float* thr, const float* feedback, float* work, uint8_t* codes, void* scale, void* zero,
                     ScaleDtype dtype) {
  const int thresholds_count = (1 << bits) - 1;
  for (int64_t g = 0; g < head_dim / cluster_dim; ++g) {
    float s, z;
    group_scale_zero(x + g * cluster_dim, cluster_dim, clip, bits, s, z);
    if (dtype == ScaleDtype::kFloat16) {
      static_cast<uint16_t*>(scale)[g] = f32_to_f16(s);
      static_cast<uint16_t*>(zero)[g] = f32_to_f16(z);
    } else {
      static_cast<uint8_t*>(scale)[g] = f32_to_e4m3(s);
      static_cast<uint8_t*>(zero)[g] = f32_to_e4m3(z);
    }
  }
  // The codes of each element, in channel order, against the stored scale and zero: 8 codes form one
  // bits-byte little-endian word.
  const float* values = x;
  if (feedback) {
    std::copy(x, x + head_dim, work);
    values = work;
  }
  uint32_t word = 0;
  for (int64_t i = 0; i < head_dim; ++i) {
    const float s = stored_value(dtype, scale, i / cluster_dim), z = stored_value(dtype, zero, i / cluster_dim);
    uint32_t code = 0;  // the number of thresholds u strictly exceeds; 0 in a group of scale 0
    if (s != 0.0f) {
      const float u = (values[i] - z) / s;
      for (int t = 0; t < thresholds_count; ++t) code += u > thr[t];
    }
    word |= code << (bits * (i % 8));
    if (i % 8 == 7) {
      for (int b = 0; b < bits; ++b) codes[(i / 8) * bits + b] = uint8_t(word >> (8 * b));
      word = 0;
    }
    if (feedback) {  // the later channels take this one's error, each product and difference rounded
      const float error = work[i] - (z + s * levels[code]);
      const float* f = feedback + i * head_dim;
#pragma omp simd  // lane by lane the same two roundings: vectors change nothing but the speed
      for (int64_t j = i + 1; j < head_dim; ++j) work[j] = work[j] - error * f[j];
    }
  }
}

// K's error-feedback weights: finite, |w| <= 64 (codec.FEEDBACK_LIMIT).
Status check_feedback(const float* w, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    if (!std::isfinite(w[i]) || std::fabs(w[i]) > 64.0f)
      return fail("k_feedback holds ", w[i], " at ", i, ": expected finite weights, |w| <= 64");
  return {};
}

void uniform_levels(int bits, float* levels) {
  for (int i = 0; i < (1 << bits); ++i) levels[i] = float(i);
}

bool simd_available() {
#if defined(OSCAR_HAVE_AVX2)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#elif defined(__aarch64__)
  return true;
#else
  return false;
#endif
}

#if defined(OSCAR_HAVE_NEON_DOTPROD)
bool cpu_has_dotprod() {
#if defined(__linux__)  // Linux and Android report the extension in the auxiliary vector
  return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
  return false;  // no portable query elsewhere: keep the plain NEON set
#endif
}
#endif

#if defined(OSCAR_HAVE_AVX512)
bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}
#endif

// The fused kernel sets this CPU can run, fastest first.
std::vector<const BodyKernels*> simd_sets() {
  std::vector<const BodyKernels*> sets;
#if defined(OSCAR_HAVE_AVX512)
  if (cpu_has_avx512()) sets.push_back(&kAvx512Kernels);
#endif
#if defined(OSCAR_HAVE_AVXVNNI)
  if (simd_available() && __builtin_cpu_supports("avxvnni")) sets.push_back(&kAvxVnniKernels);
#endif
#if defined(OSCAR_HAVE_AVX2)
  if (simd_available()) sets.push_back(&kAvx2Kernels);
#elif defined(__aarch64__)
#if defined(OSCAR_HAVE_NEON_DOTPROD)
  if (cpu_has_dotprod()) sets.push_back(&kNeonDotprodKernels);
#endif
  sets.push_back(&kNeonKernels);
#endif
  return sets;
}

// The set kSimd and kAuto run: the fastest, or the one the environment variable OSCAR_SIMD names
// (to compare two sets on one machine); nullptr when OSCAR_SIMD names none this CPU runs.
const BodyKernels* chosen_simd_set() {
  static const BodyKernels* chosen = [] {
    const std::vector<const BodyKernels*> sets = simd_sets();
    const char* want = std::getenv("OSCAR_SIMD");
    if (!want || !*want) return sets.empty() ? &kScalarKernels : sets.front();
    for (const BodyKernels* k : sets)
      if (std::strcmp(k->name, want) == 0) return k;
    return static_cast<const BodyKernels*>(nullptr);
  }();
  return chosen;
}

std::string set_names(const char* separator) {
  std::string names;
  for (const BodyKernels* k : simd_sets()) names += (names.empty() ? "" : separator) + std::string(k->name);
  return names;
}

Status check_simd_choice() {
  if (chosen_simd_set()) return {};
  const std::string names = set_names(", ");
  return fail("OSCAR_SIMD=", std::getenv("OSCAR_SIMD"), ": expected a kernel set this CPU runs (",
              names.empty() ? "none" : names, ") or no value");
}

const BodyKernels& simd_kernels() { return *chosen_simd_set(); }

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpy(float* acc, float w, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += w * x[i];
}

// Online softmax over one block of raw dot products s[0..n): scales them, rescales the running
// sum l and accumulator acc if the running max m grows, and leaves the weights exp(s - m) in s.
void softmax_block(const BodyKernels& k, float scaling, float* s, int n, float& m, float& l, float* acc,
                   int64_t head_dim) {
  const float block_max = k.scale_max(s, n, scaling);
  if (block_max > m) {
    const float r = std::exp(m - block_max);  // 0 on the first block (m = -inf)
    l *= r;
    for (int64_t i = 0; i < head_dim; ++i) acc[i] *= r;
    m = block_max;
  }
  l += k.exp_sum(s, n, m);
}

// Levels of one group's codes, unpacked from its 8-code words.
void group_levels(const BodyView& b, const uint8_t* codes, float* lv) {
  const uint32_t mask = (1u << b.bits) - 1;
  for (int w = 0; w < b.cluster_dim / 8; ++w) {
    uint32_t word = 0;
    for (int k = 0; k < b.bits; ++k) word |= uint32_t(codes[w * b.bits + k]) << (8 * k);
    for (int k = 0; k < 8; ++k) lv[w * 8 + k] = b.levels[(word >> (b.bits * k)) & mask];
  }
}

// One kind (K or V) of the layer, with everything derived from the validated arguments.
struct Kind {
  KindCache cache;
  const uint16_t* chunk;  // [Hkv, T, D]
  int bits;
  float clip;
  int64_t code_bytes;
  float levels[16];
  float thr[15];
  const float* feedback;  // [Hkv, D, D] error-feedback weights (K with k_rounding 1), else nullptr
};

struct Layer {
  const AttentionArgs& a;
  int64_t S, W, D, T, G, n0, sink_cap, recent_cap, body_cap, group;  // group: query heads per KV head
  ScaleDtype scale_dtype;
  int64_t sbytes;  // bytes of one stored scale or zero
  Kind kind[2];

  explicit Layer(const AttentionArgs& args)
      : a(args), scale_dtype(args.config.scale_dtype), sbytes(scale_bytes(args.config.scale_dtype)) {
    const AttentionDims& d = a.dims;
    S = a.config.sink, W = a.config.recent, D = d.head_dim, T = d.tokens, n0 = a.length;
    G = D / a.config.cluster_dim;
    sink_cap = d.sink_cap, recent_cap = d.recent_cap, body_cap = d.body_cap, group = d.q_heads / d.kv_heads;
    const int bits[2] = {a.config.k_bits, a.config.v_bits};
    const float clips[2] = {a.config.k_clip, a.config.v_clip};
    const KindCache* caches[2] = {&a.k, &a.v};
    const uint16_t* chunks[2] = {a.k_new, a.v_new};
    for (int i = 0; i < 2; ++i) {
      Kind& k = kind[i];
      k.cache = *caches[i], k.chunk = chunks[i], k.bits = bits[i], k.clip = clips[i];
      k.code_bytes = D * k.bits / 8;
      k.feedback = i == 0 && a.config.k_rounding == 1 ? a.k_feedback : nullptr;
      std::copy(k.cache.levels, k.cache.levels + (1 << k.bits), k.levels);
      thresholds(k.levels, k.bits, k.thr);
    }
  }

  // Where body row r of KV head h keeps its scales and zeros.
  void* scale_at(const Kind& k, int64_t h, int64_t r) const {
    return static_cast<uint8_t*>(k.cache.scale) + (h * body_cap + r) * G * sbytes;
  }
  void* zero_at(const Kind& k, int64_t h, int64_t r) const {
    return static_cast<uint8_t*>(k.cache.zero) + (h * body_cap + r) * G * sbytes;
  }

  // The view the fused kernels read body rows [r0, r0 + n) of KV head h through, with the row they start
  // at in it: fp16 scales in place (row r0); fp8 ones widened into `widened` (2 n G values, the rows'
  // scales then zeros; row 0), so every kernel set reads fp16 bits either way.
  BodyView block(const Kind& k, int64_t h, int64_t r0, int n, uint16_t* widened, int64_t& row0,
                 const BodyKernels& kernels) const {
    const uint8_t* codes = k.cache.codes + h * body_cap * k.code_bytes;
    if (scale_dtype == ScaleDtype::kFloat16) {
      row0 = r0;
      return BodyView{codes, static_cast<const uint16_t*>(scale_at(k, h, 0)),
                      static_cast<const uint16_t*>(zero_at(k, h, 0)), k.levels, k.bits, int(D), a.config.cluster_dim,
                      int(G)};
    }
    kernels.widen_e4m3(static_cast<const uint8_t*>(scale_at(k, h, r0)), n * G, widened);
    kernels.widen_e4m3(static_cast<const uint8_t*>(zero_at(k, h, r0)), n * G, widened + n * G);
    row0 = 0;
    return BodyView{codes + r0 * k.code_bytes, widened, widened + n * G, k.levels, k.bits, int(D),
                    a.config.cluster_dim, int(G)};
  }

  // The fp32 values at positions p .. p+n-1 of KV head h as this chunk's attention sees them: the
  // cache before the chunk (sink, ring fp16; body dequantized) or the chunk's own fp16 rows. Rows
  // that lie contiguously in one fp16 buffer are converted in one call.
  void load_rows(const Kind& k, int64_t h, int64_t p, int n, float* dst, const BodyKernels& kernels) const {
    for (int j = 0; j < n;) {
      const int64_t q = p + j;
      const uint16_t* src;
      int64_t run;  // rows from q on in the same buffer, in order
      if (q >= n0) {
        src = k.chunk + (h * T + q - n0) * D, run = n0 + T - q;
      } else if (q < S) {
        src = k.cache.sink + (h * sink_cap + q) * D, run = std::min(S, n0) - q;
      } else if (q >= std::max(S, n0 - W)) {
        const int64_t slot = (q - S) % W;
        src = k.cache.recent + (h * recent_cap + slot) * D, run = std::min(n0 - q, W - slot);
      } else {
        body_row(k, h, q - S, dst + j * D);
        ++j;
        continue;
      }
      run = std::min<int64_t>(run, n - j);
      kernels.load_f16(src, run * D, dst + j * D);
      j += int(run);
    }
  }

  // Body row `row` of KV head h, dequantized to fp32 (the dense path's view of the packed body).
  void body_row(const Kind& k, int64_t h, int64_t row, float* dst) const {
    const int cd = a.config.cluster_dim;
    const BodyView b{nullptr, nullptr, nullptr, k.levels, k.bits, int(D), cd, int(G)};  // group_levels' fields
    const uint8_t* codes = k.cache.codes + (h * body_cap + row) * k.code_bytes;
    const void *scale = scale_at(k, h, row), *zero = zero_at(k, h, row);
    for (int64_t g = 0; g < G; ++g) {
      group_levels(b, codes + g * cd * k.bits / 8, dst + g * cd);
      const float s = stored_value(scale_dtype, scale, g), z = stored_value(scale_dtype, zero, g);
      for (int i = 0; i < cd; ++i) dst[g * cd + i] = z + s * dst[g * cd + i];
    }
  }

  // Dense path for any T: fp32 blocks of K/V rows, causal mask. Queries go in tiles of kBlock
  // tokens so the scratch stays small however long the prefill chunk is.
  void attend_dense(int64_t h, const BodyKernels& kernels, float* scratch) const {
    const int64_t states = kBlock * group;
    float* m = scratch;
    float* l = m + states;
    float* acc = l + states;
    float* kb = acc + states * D;
    float* vb = kb + kBlock * D;
    float* s = vb + kBlock * D;
    for (int64_t t0 = 0; t0 < T; t0 += kBlock) {
      const int64_t t1 = std::min(T, t0 + kBlock);
      std::fill(m, m + states, -std::numeric_limits<float>::infinity());
      std::fill(l, l + states, 0.0f);
      std::fill(acc, acc + states * D, 0.0f);
      for (int64_t b0 = 0; b0 < n0 + t1; b0 += kBlock) {
        const int n = int(std::min<int64_t>(kBlock, n0 + t1 - b0));
        load_rows(kind[0], h, b0, n, kb, kernels);
        load_rows(kind[1], h, b0, n, vb, kernels);
        for (int64_t t = t0; t < t1; ++t) {
          const int visible = int(std::min<int64_t>(n, n0 + t + 1 - b0));  // keys at positions <= n0 + t
          for (int64_t hh = 0; hh < group && visible > 0; ++hh) {
            const int64_t st = hh * kBlock + t - t0;
            const float* q = a.q + ((h * group + hh) * T + t) * D;
            kernels.dots(q, kb, visible, D, s);
            softmax_block(kernels, a.config.scaling, s, visible, m[st], l[st], acc + st * D, D);
            kernels.axpys(acc + st * D, s, vb, visible, D);
          }
        }
      }
      for (int64_t hh = 0; hh < group; ++hh)
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t st = hh * kBlock + t - t0;
          float* out = a.out + ((h * group + hh) * T + t) * D;
          for (int64_t i = 0; i < D; ++i) out[i] = acc[st * D + i] / l[st];
        }
    }
  }

  // Decode (T == 1): fp32 rows for the windows and the new token, fused kernels for the body.
  // The body rows (positions sink_end() .. tail_from() - 1) a decode step reads from the packed body.
  int64_t sink_end() const { return std::min(S, n0); }
  int64_t tail_from() const { return std::max(sink_end(), n0 - W); }  // first ring position (or the new token)
  int64_t body_rows() const { return tail_from() - sink_end(); }
  int64_t state_floats() const { return group * (2 + D); }

  // One slice of a decode step (T == 1) for KV head h: the online softmax over body rows
  // [row_from, row_to) and, with `windows`, over the sink, the ring and the new token, left in
  // `state` (m [group], l [group], acc [group, D]) for finish() to merge with the other slices.
  void attend_slice(int64_t h, int64_t row_from, int64_t row_to, bool windows, const BodyKernels& kernels,
                    float* scratch, float* state) const {
    float* m = state;
    float* l = m + group;
    float* acc = l + group;
    float* qsum = scratch;
    float* kb = qsum + group * G;
    float* vb = kb + kBlock * D;
    float* s = vb + kBlock * D;  // group * kBodyBlock
    float* weights = s + group * kBodyBlock;  // group * (kBodyBlock + 1) * G
    // kBodyBlock * G floats: one block's fp8 scales and zeros widened to fp16 (block())
    uint16_t* widened = reinterpret_cast<uint16_t*>(weights + group * (kBodyBlock + 1) * G);
    // group * kPreparedBytes, 32-byte aligned (scratch_floats leaves 32 bytes of slack)
    void* prepared = reinterpret_cast<void*>(
        (reinterpret_cast<uintptr_t>(weights + group * (kBodyBlock + 1) * G + kBodyBlock * G) + 31) & ~uintptr_t(31));
    const float* q = a.q + h * group * D;  // the group's query heads are contiguous when T == 1
    std::fill(m, m + group, -std::numeric_limits<float>::infinity());
    std::fill(l, l + group, 0.0f);
    std::fill(acc, acc + group * D, 0.0f);
    const int cd = a.config.cluster_dim;
    for (int64_t hh = 0; hh < group; ++hh)
      for (int64_t g = 0; g < G; ++g) {
        float sum = 0.0f;
        for (int i = 0; i < cd; ++i) sum += q[hh * D + g * cd + i];
        qsum[hh * G + g] = sum;
      }

    auto dense = [&](int64_t from, int64_t to) {
      for (int64_t b0 = from; b0 < to; b0 += kBlock) {
        const int n = int(std::min<int64_t>(kBlock, to - b0));
        load_rows(kind[0], h, b0, n, kb, kernels);
        load_rows(kind[1], h, b0, n, vb, kernels);
        for (int64_t hh = 0; hh < group; ++hh) {
          kernels.dots(q + hh * D, kb, n, D, s);
          softmax_block(kernels, a.config.scaling, s, n, m[hh], l[hh], acc + hh * D, D);
          kernels.axpys(acc + hh * D, s, vb, n, D);
        }
      }
    };
    if (windows) dense(0, sink_end());
    if (row_from < row_to) {
      int64_t row0;
      kernels.prepare(block(kind[0], h, row_from, 0, widened, row0, kernels), q, int(group), prepared);
      for (int64_t r0 = row_from; r0 < row_to; r0 += kBodyBlock) {
        const int n = int(std::min<int64_t>(kBodyBlock, row_to - r0));
        const BodyView kbody = block(kind[0], h, r0, n, widened, row0, kernels);
        kernels.scores(kbody, row0, n, q, qsum, int(group), s, prepared);
        for (int64_t hh = 0; hh < group; ++hh)
          softmax_block(kernels, a.config.scaling, s + hh * n, n, m[hh], l[hh], acc + hh * D, D);
        const BodyView vbody = block(kind[1], h, r0, n, widened, row0, kernels);
        kernels.values(vbody, row0, n, s, int(group), acc, weights);
      }
    }
    if (windows) dense(tail_from(), n0 + 1);
  }

  // Merges the `slices` partial states of KV head h (slice 0 saw the windows, so every l > 0 there)
  // and writes its query heads' outputs.
  void finish(int64_t h, const float* states, int64_t slices) const {
    for (int64_t hh = 0; hh < group; ++hh) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < slices; ++s) m = std::max(m, states[s * state_floats() + hh]);
      float* out = a.out + (h * group + hh) * D;
      std::fill(out, out + D, 0.0f);
      float l = 0.0f;
      for (int64_t s = 0; s < slices; ++s) {
        const float* st = states + s * state_floats();
        if (st[group + hh] == 0.0f) continue;  // an empty slice
        const float w = std::exp(st[hh] - m);
        l += w * st[group + hh];
        const float* acc = st + 2 * group + hh * D;
        for (int64_t i = 0; i < D; ++i) out[i] += w * acc[i];
      }
      for (int64_t i = 0; i < D; ++i) out[i] /= l;
    }
  }

  // The fp16 value at position p (< n0 + T) that the placement rule quantizes when it leaves the ring
  // or skips it: a ring slot (read before this call overwrites it) or a row of the chunk.
  const uint16_t* leaving(const Kind& k, int64_t h, int64_t p) const {
    return p < n0 ? k.cache.recent + (h * recent_cap + (p - S) % W) * D : k.chunk + (h * T + p - n0) * D;
  }

  // With fp8 scales, whether every vector this call quantizes has storable groups (fp16 ones always do):
  // checked before anything is written, so a refused call leaves the cache as it was.
  Status storable_rows() const {
    if (scale_dtype == ScaleDtype::kFloat16) return {};
    std::vector<float> row;
    try {
      row.resize(D);
    } catch (const std::bad_alloc&) {
      return fail("out of memory for ", D, " floats of range-check scratch");
    }
    const int64_t n1 = n0 + T;
    for (const Kind& k : kind)
      for (int64_t h = 0; h < a.dims.kv_heads; ++h)
        for (int64_t p = std::max(S, n0 - W); p < std::max(S, n1 - W); ++p) {
          const uint16_t* src = leaving(k, h, p);
          for (int64_t i = 0; i < D; ++i) row[i] = half_to_float(src[i]);
          if (!storable(row.data(), D, k.bits, a.config.cluster_dim, k.clip, scale_dtype))
            return out_of_range(&k == &kind[0] ? "a K vector at position " : "a V vector at position ", p, scale_dtype);
        }
    return {};
  }

  // The placement rule (format.md section 5) for KV head h; row is 2 D floats of scratch.
  void append(int64_t h, float* row) const {
    const int64_t n1 = n0 + T;
    for (const Kind& k : kind) {
      const uint16_t* chunk = k.chunk + h * T * D;
      for (int64_t p = n0; p < std::min(S, n1); ++p)
        std::memcpy(k.cache.sink + (h * sink_cap + p) * D, chunk + (p - n0) * D, D * sizeof(uint16_t));
      // Leaving (or skipping) the ring: quantize the fp16 value, reading the ring before it is overwritten.
      for (int64_t p = std::max(S, n0 - W); p < std::max(S, n1 - W); ++p) {
        const uint16_t* src = leaving(k, h, p);
        for (int64_t i = 0; i < D; ++i) row[i] = half_to_float(src[i]);
        const int64_t r = p - S;
        // Storable (unchecked): fp16 because a finite fp16 group has range <= 131008, so scale <= 43670 <
        // 65504; fp8 because oscar_attention checked every row this call quantizes (storable_rows).
        quantize_vector(row, D, k.bits, a.config.cluster_dim, k.clip, k.levels, k.thr,
                        k.feedback ? k.feedback + h * D * D : nullptr, row + D,
                        k.cache.codes + (h * body_cap + r) * k.code_bytes, scale_at(k, h, r), zero_at(k, h, r),
                        scale_dtype);
      }
      for (int64_t p = std::max({S, n1 - W, n0}); p < n1; ++p)
        std::memcpy(k.cache.recent + (h * recent_cap + (p - S) % W) * D, chunk + (p - n0) * D, D * sizeof(uint16_t));
    }
  }

  bool fused() const {
    return T == 1 && a.config.kernel != Kernel::kDense;
  }

  int64_t scratch_floats() const {
    const int64_t rows = 2 * kBlock * D;
    if (fused()) return group * (G + kBodyBlock + (kBodyBlock + 1) * G + kPreparedBytes / 4) + kBodyBlock * G + 8 + rows;
    return kBlock * group * (2 + D) + rows + kBlock;
  }
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

constexpr int64_t kMinSliceRows = 512;  // body rows below which a decode slice costs more to hand out than it saves

// This thread's attention scratch, grown on demand and kept: a decode step allocates nothing.
std::vector<float>& thread_scratch(int64_t floats) {
  thread_local std::vector<float> scratch;
  if (int64_t(scratch.size()) < floats) scratch.resize(floats);
  return scratch;
}

// The work of one call, in items: decode item i is slice i % slices of KV head i / slices; prefill item
// h is KV head h, attended and appended (its rows are only its own).
struct Job {
  const Layer& layer;
  const BodyKernels& kernels;
  int64_t slices = 1, slice_rows = 0;
  std::vector<float> states;  // decode: [kv_heads, slices, state_floats]
  std::atomic<bool> failed{false};

  static void run(void* data, size_t item) {
    Job& job = *static_cast<Job*>(data);
    const Layer& layer = job.layer;
    try {
      float* mem = thread_scratch(layer.scratch_floats() + 2 * layer.D).data();
      if (!layer.fused()) {
        layer.attend_dense(int64_t(item), job.kernels, mem);
        layer.append(int64_t(item), mem + layer.scratch_floats());
        return;
      }
      const int64_t h = int64_t(item) / job.slices, s = int64_t(item) % job.slices;
      const int64_t from = s * job.slice_rows, to = std::min(layer.body_rows(), from + job.slice_rows);
      layer.attend_slice(h, from, to, s == 0, job.kernels, mem,
                         job.states.data() + (h * job.slices + s) * layer.state_floats());
    } catch (const std::bad_alloc&) {
      job.failed = true;
    }
  }
};

// Persistent workers (one per extra core), started at first use and kept for the process, so a
// decode step pays a wake-up rather than a thread start per layer. One call runs at a time; a
// caller that finds the workers busy runs its items alone. The caller always works too, and waits
// only for workers that joined before it ran out of items.
class WorkerPool {
 public:
  static WorkerPool& get() {
    static WorkerPool* pool = new WorkerPool;  // never destroyed: workers may outlive static destructors
    return *pool;
  }

  void run(void (*fn)(void*, size_t), size_t items, void* data, int64_t threads) {
    std::unique_lock<std::mutex> turn(turn_mu_, std::try_to_lock);
    if (turn.owns_lock()) start_workers();
    if (!turn.owns_lock() || workers_ == 0) {
      for (size_t i = 0; i < items; ++i) fn(data, i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = fn, data_ = data, items_ = items, next_ = 0;
      wanted_ = int(std::min<int64_t>(threads - 1, workers_)), joined_ = 0, closed_ = false;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock<std::mutex> lock(mu_);
    closed_ = true;
    done_.wait(lock, [&] { return active_ == 0; });
  }

 private:
  void start_workers() {
    if (started_) return;
    started_ = true;
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 1; i < cores; ++i) {
      try {
        std::thread(&WorkerPool::loop, this).detach();
        ++workers_;
      } catch (const std::system_error&) {
        break;  // fewer workers: the caller does the rest
      }
    }
  }

  void drain() {
    for (size_t i; (i = next_.fetch_add(1)) < items_;) fn_(data_, i);
  }

  void loop() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (closed_ || joined_ >= wanted_) continue;
      ++joined_, ++active_;
      lock.unlock();
      drain();
      lock.lock();
      if (--active_ == 0) done_.notify_all();
    }
  }

  std::mutex turn_mu_;  // held by the caller whose items run now
  bool started_ = false;
  int workers_ = 0;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  uint64_t generation_ = 0;
  void (*fn_)(void*, size_t) = nullptr;
  void* data_ = nullptr;
  size_t items_ = 0;
  std::atomic<size_t> next_{0};
  int wanted_ = 0, joined_ = 0, active_ = 0;
  bool closed_ = true;
};

Status check_finite_f16(const char* name, const uint16_t* x, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    if (!f16_finite(x[i])) return fail(name, " contains ", (x[i] & 0x3ff) ? "NaN" : "inf", ": expected finite values");
  return {};
}

// A finite fp32 magnitude `a` (its bits) rounded to nearest even into a narrower float with `mantissa` bits whose
// smallest normal has fp32 exponent field `min_exp`: the narrow format's bits. The caller handles overflow.
uint32_t narrow_magnitude(uint32_t a, uint32_t min_exp, uint32_t mantissa) {
  const uint32_t drop = 23 - mantissa;
  uint32_t q, rem, mid;
  if (a >= min_exp << 23) {  // normal: rebias the exponent, drop the low mantissa bits
    const uint32_t r = a - ((min_exp - 1) << 23);
    q = r >> drop, rem = r & ((1u << drop) - 1), mid = 1u << (drop - 1);
  } else {  // subnormal: counts units of the smallest subnormal, the hidden bit made explicit
    const uint32_t shift = drop + min_exp - (a >> 23);
    if (shift > 24) return 0;  // below half the smallest subnormal
    const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    q = mant >> shift, rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
  }
  if (rem > mid || (rem == mid && (q & 1u))) ++q;  // a carry into the exponent is correct
  return q;
}

}  // namespace

uint16_t f32_to_f16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return uint16_t(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));  // NaN, inf
  if (a >= 0x47800000u) return uint16_t(sign | 0x7c00u);  // >= 65536: overflow
  return uint16_t(sign | narrow_magnitude(a, 113, 10));  // smallest normal fp16 2^-14
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  int32_t e = (h >> 10) & 0x1f;
  uint32_t m = h & 0x3ffu, u;
  if (e == 0x1f) {
    u = sign | 0x7f800000u | (m << 13);
  } else if (e == 0) {
    if (m == 0) {
      u = sign;
    } else {  // subnormal: normalize
      e = 1;
      while (!(m & 0x400u)) m <<= 1, --e;
      u = sign | uint32_t(e + 112) << 23 | (m & 0x3ffu) << 13;
    }
  } else {
    u = sign | uint32_t(e + 112) << 23 | m << 13;
  }
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

uint8_t f32_to_e4m3(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t sign = (u >> 24) & 0x80u;
  return uint8_t(sign | narrow_magnitude(u & 0x7fffffffu, 121, 3));  // smallest normal E4M3 2^-6
}

float e4m3_to_f32(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24, e = (b >> 3) & 0xfu, m = b & 0x7u;
  uint32_t u;
  if (e == 0xf && m == 0x7) {
    u = sign | 0x7fc00000u;  // the only NaN encodings; E4M3 has no inf
  } else if (e == 0) {
    const float x = float(m) * 0.001953125f;  // subnormal: m units of 2^-9, exact
    std::memcpy(&u, &x, sizeof u);
    u |= sign;
  } else {
    u = sign | (e + 120) << 23 | m << 20;
  }
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

Status quantize_pack(const float* x, int64_t rows, int64_t head_dim, int bits, int cluster_dim, float clip,
                     const float* levels, uint8_t* codes, void* scale, void* zero, const float* feedback,
                     ScaleDtype scale_dtype) {
  if (Status st = check_bits("bits", bits); !st.ok()) return st;
  if (Status st = check_scale_dtype(scale_dtype); !st.ok()) return st;
  if (cluster_dim != 32 && cluster_dim != 64 && cluster_dim != 128)
    return fail("cluster_dim=", cluster_dim, ": expected 32, 64 or 128");
  if (head_dim <= 0 || head_dim >= kMaxDim || head_dim % cluster_dim)
    return fail("head_dim=", head_dim, ": expected a positive multiple of cluster_dim=", cluster_dim);
  if (rows < 0 || rows >= kMaxDim) return fail("rows=", rows, ": expected 0 <= rows < 2^31");
  if (rows * head_dim >= (int64_t(1) << 48)) return fail("rows x head_dim = ", rows * head_dim, ": too many elements");
  if (Status st = check_clip("clip", clip); !st.ok()) return st;
  if (rows > 0 && (!x || !codes || !scale || !zero)) return fail("quantize_pack: null buffer");
  float lv[16], thr[15];
  if (levels) {
    if (Status st = check_levels("levels", levels, bits); !st.ok()) return st;
    std::copy(levels, levels + (1 << bits), lv);
  } else {
    uniform_levels(bits, lv);
  }
  thresholds(lv, bits, thr);
  for (int64_t i = 0; i < rows * head_dim; ++i)
    if (!std::isfinite(x[i]))
      return fail("input row ", i / head_dim, " contains ", std::isnan(x[i]) ? "NaN" : "inf", ": expected finite values");
  if (feedback)
    if (Status st = check_feedback(feedback, head_dim * head_dim); !st.ok()) return st;
  std::vector<float> work;
  try {
    work.resize(feedback ? head_dim : 0);
  } catch (const std::bad_alloc&) {
    return fail("out of memory for ", head_dim, " floats of feedback scratch");
  }
  for (int64_t r = 0; r < rows; ++r)  // before any write: a refused input leaves the outputs untouched
    if (!storable(x + r * head_dim, head_dim, bits, cluster_dim, clip, scale_dtype))
      return out_of_range("input row ", r, scale_dtype);
  const int64_t groups = head_dim / cluster_dim, sb = scale_bytes(scale_dtype);
  for (int64_t r = 0; r < rows; ++r)
    quantize_vector(x + r * head_dim, head_dim, bits, cluster_dim, clip, lv, thr, feedback, work.data(),
                    codes + r * head_dim * bits / 8, static_cast<uint8_t*>(scale) + r * groups * sb,
                    static_cast<uint8_t*>(zero) + r * groups * sb, scale_dtype);
  return {};
}

const char* const kBufferNames[kNumBuffers] = {"q",        "k_new",    "v_new",      "k_sink",  "v_sink",   "k_recent",
                                               "v_recent", "k_codes",  "k_scale",    "k_zero",  "v_codes",  "v_scale",
                                               "v_zero",   "k_levels", "v_levels",   "k_feedback", "out"};

int64_t BufferShape::count() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= dim[i];
  return n;
}

Status buffer_shapes(const AttentionConfig& c, const AttentionDims& d, BufferShape shapes[kNumBuffers]) {
  if (Status st = check_bits("k_bits", c.k_bits); !st.ok()) return st;
  if (Status st = check_bits("v_bits", c.v_bits); !st.ok()) return st;
  if (c.cluster_dim != 32 && c.cluster_dim != 64 && c.cluster_dim != 128)
    return fail("cluster_dim=", c.cluster_dim, ": expected 32, 64 or 128");
  if (c.sink < 0 || c.recent < 0 || c.sink >= kMaxDim || c.recent >= kMaxDim)
    return fail("sink=", c.sink, ", recent=", c.recent, ": expected token counts >= 0");
  if (Status st = check_clip("k_clip", c.k_clip); !st.ok()) return st;
  if (Status st = check_clip("v_clip", c.v_clip); !st.ok()) return st;
  if (!std::isfinite(c.scaling)) return fail("scaling=", c.scaling, ": expected a finite number");
  if (c.threads < 0) return fail("threads=", c.threads, ": expected >= 0 (0 = one per core)");
  if (Status st = check_scale_dtype(c.scale_dtype); !st.ok()) return st;
  if (c.k_rounding != 0 && c.k_rounding != 1)
    return fail("k_rounding=", c.k_rounding, ": expected 0 (nearest) or 1 (feedback: k_feedback given)");
  if (c.codebook != 0 && c.codebook != 1)
    return fail("codebook=", c.codebook, ": expected 0 (uniform) or 1 (lloyd-max)");
  if (c.kernel < Kernel::kAuto || c.kernel > Kernel::kSimd)
    return fail("kernel=", int(c.kernel), ": expected 0 (auto), 1 (dense), 2 (scalar) or 3 (simd)");
  if (c.kernel == Kernel::kSimd && !simd_available())
    return fail("kernel=simd: this CPU has neither AVX2+FMA+F16C nor NEON");
  if (Status st = check_simd_choice(); !st.ok()) return st;

  const struct { const char* name; int64_t value, min; } dims[] = {
      {"q_heads", d.q_heads, 1},     {"kv_heads", d.kv_heads, 1}, {"tokens", d.tokens, 1},
      {"head_dim", d.head_dim, 1},   {"sink capacity", d.sink_cap, 0}, {"recent capacity", d.recent_cap, 0},
      {"body capacity", d.body_cap, 0}};
  for (const auto& x : dims)
    if (x.value < x.min || x.value >= kMaxDim) return fail(x.name, "=", x.value, ": expected ", x.min, " <= value < 2^31");
  if (d.q_heads % d.kv_heads)
    return fail("q_heads=", d.q_heads, " is not a multiple of kv_heads=", d.kv_heads, ": expected grouped-query heads");
  if (d.head_dim % c.cluster_dim)
    return fail("head_dim=", d.head_dim, " is not a multiple of cluster_dim=", c.cluster_dim);
  // The capacities must be those of some max_context C (format.md section 5).
  const int64_t C = d.sink_cap + d.recent_cap + d.body_cap;
  const int64_t want_sink = std::min(c.sink, C), want_recent = std::min(c.recent, std::max<int64_t>(C - c.sink, 0)),
                want_body = std::max<int64_t>(C - c.sink - c.recent, 0);
  if (d.sink_cap != want_sink || d.recent_cap != want_recent || d.body_cap != want_body)
    return fail("cache capacities sink=", d.sink_cap, ", recent=", d.recent_cap, ", body=", d.body_cap,
                " do not match sink=", c.sink, ", recent=", c.recent, ": a cache of ", C, " tokens has sink=", want_sink,
                ", recent=", want_recent, ", body=", want_body);

  const int64_t H = d.kv_heads, D = d.head_dim, G = D / c.cluster_dim;
  const BufferShape all[kNumBuffers] = {
      {3, {d.q_heads, d.tokens, D}},      {3, {H, d.tokens, D}},          {3, {H, d.tokens, D}},
      {3, {H, d.sink_cap, D}},            {3, {H, d.sink_cap, D}},        {3, {H, d.recent_cap, D}},
      {3, {H, d.recent_cap, D}},          {3, {H, d.body_cap, D * c.k_bits / 8}}, {3, {H, d.body_cap, G}},
      {3, {H, d.body_cap, G}},            {3, {H, d.body_cap, D * c.v_bits / 8}}, {3, {H, d.body_cap, G}},
      {3, {H, d.body_cap, G}},            {1, {int64_t(1) << c.k_bits}},  {1, {int64_t(1) << c.v_bits}},
      c.k_rounding ? BufferShape{3, {H, D, D}} : BufferShape{1, {0}}, {3, {d.q_heads, d.tokens, D}}};
  for (int i = 0; i < kNumBuffers; ++i) {
    int64_t n = 1;
    for (int j = 0; j < all[i].rank; ++j)
      if (__builtin_mul_overflow(n, all[i].dim[j], &n) || n >= (int64_t(1) << 48))
        return fail(kBufferNames[i], " would hold too many elements: expected smaller dims");
    shapes[i] = all[i];
  }
  return {};
}

const char* simd_kernel_name() { return simd_available() && chosen_simd_set() ? simd_kernels().name : ""; }

std::string simd_kernel_sets() { return set_names(","); }

Status oscar_attention(const AttentionArgs& a) {
  BufferShape shapes[kNumBuffers];
  if (Status st = buffer_shapes(a.config, a.dims, shapes); !st.ok()) return st;
  const AttentionDims& d = a.dims;
  const int64_t C = d.sink_cap + d.recent_cap + d.body_cap;
  if (a.length < 0) return fail("length=", a.length, ": expected >= 0");
  if (a.length + d.tokens > C)
    return fail("cache capacity exceeded: length ", a.length, " + ", d.tokens, " tokens > max_context ", C);
  const void* ptrs[kNumBuffers] = {a.q,       a.k_new,    a.v_new,    a.k.sink,  a.v.sink,  a.k.recent,
                                   a.v.recent, a.k.codes,  a.k.scale,  a.k.zero,  a.v.codes, a.v.scale,
                                   a.v.zero,   a.k.levels, a.v.levels, a.k_feedback, a.out};
  for (int i = 0; i < kNumBuffers; ++i)
    if (!ptrs[i] && shapes[i].count() > 0) return fail(kBufferNames[i], " is null: expected ", shapes[i].count(), " elements");
  if (Status st = check_levels("k_levels", a.k.levels, a.config.k_bits); !st.ok()) return st;
  if (Status st = check_levels("v_levels", a.v.levels, a.config.v_bits); !st.ok()) return st;
  if (a.config.codebook == 0) {
    const struct { const char* name; const float* levels; int bits; } kinds[] = {
        {"k_levels", a.k.levels, a.config.k_bits}, {"v_levels", a.v.levels, a.config.v_bits}};
    for (const auto& k : kinds)
      for (int i = 0; i < (1 << k.bits); ++i)
        if (k.levels[i] != float(i))
          return fail(k.name, "[", i, "] is ", k.levels[i], ": expected the uniform levels 0 .. ", (1 << k.bits) - 1,
                      " with codebook 0 (uniform)");
  }
  if (Status st = check_feedback(a.k_feedback, shapes[15].count()); !st.ok()) return st;
  for (int64_t i = 0; i < shapes[0].count(); ++i)
    if (!std::isfinite(a.q[i])) return fail("q contains ", std::isnan(a.q[i]) ? "NaN" : "inf", ": expected finite values");
  if (Status st = check_finite_f16("k_new", a.k_new, shapes[1].count()); !st.ok()) return st;
  if (Status st = check_finite_f16("v_new", a.v_new, shapes[2].count()); !st.ok()) return st;

  const Layer layer(a);
  if (Status st = layer.storable_rows(); !st.ok()) return st;
  // kernel=dense keeps the whole step scalar: the in-tree reference.
  const Kernel kind = a.config.kernel;
  const BodyKernels& kernels =
      kind == Kernel::kDense || kind == Kernel::kScalar || !simd_available() ? kScalarKernels : simd_kernels();
  // Threads: config.threads, or for 0 every core (or the runtime pool's), fewer when the call is too
  // small to pay for handing out work (key rows x queries).
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const bool runtime_pool = a.config.threads == 0 && a.parallel_for != nullptr;
  int64_t threads = a.config.threads;
  if (threads == 0)
    threads = std::min<int64_t>(a.pool_threads > 0 ? a.pool_threads : cores,
                                1 + d.kv_heads * (a.length + d.tokens) * d.tokens / 4096);
  // Decode: each KV head's body in slices of whole kBodyBlocks (at least kMinSliceRows rows), about four
  // items per thread so uneven heads balance. Prefill: one item per KV head.
  Job job{layer, kernels};
  if (layer.fused()) {
    const int64_t rows = layer.body_rows();
    int64_t slices = threads == 1 ? 1 : std::min(ceil_div(rows, kMinSliceRows), ceil_div(4 * threads, d.kv_heads));
    slices = std::max<int64_t>(1, slices);
    job.slice_rows = std::max<int64_t>(kBodyBlock, ceil_div(ceil_div(rows, slices), kBodyBlock) * kBodyBlock);
    job.slices = std::max<int64_t>(1, ceil_div(rows, job.slice_rows));
    try {
      job.states.assign(d.kv_heads * job.slices * layer.state_floats(), 0.0f);
    } catch (const std::bad_alloc&) {
      return fail("out of memory for ", d.kv_heads * job.slices, " partial attention states");
    }
  }
  const size_t items = size_t(d.kv_heads * job.slices);
  if (threads <= 1) {
    for (size_t i = 0; i < items; ++i) Job::run(&job, i);
  } else if (runtime_pool) {
    a.parallel_for(a.pool, Job::run, items, &job);
  } else {
    WorkerPool::get().run(Job::run, items, &job, threads);
  }
  if (job.failed) return fail("out of memory for ", layer.scratch_floats(), " floats of attention scratch");
  if (layer.fused()) {  // the ring slot the new token takes is read above: append only after every slice
    std::vector<float>& row = thread_scratch(2 * d.head_dim);
    for (int64_t h = 0; h < d.kv_heads; ++h) {
      layer.finish(h, job.states.data() + h * job.slices * layer.state_floats(), job.slices);
      layer.append(h, row.data());
    }
  }
  return {};
}

// ---- scalar body kernels ---------------------------------------------------------------

void body_value_weights(const BodyView& b, int64_t row0, int n, const float* p, int heads, float* acc,
                        float* scratch) {
  float* zsum = scratch + int64_t(n) * heads * b.groups;  // [heads, groups]: sum_j p * zero
  std::fill(zsum, zsum + heads * b.groups, 0.0f);
  for (int j = 0; j < n; ++j) {
    const int64_t row = row0 + j;
    for (int g = 0; g < b.groups; ++g) {
      const float s = half_to_float(b.scale[row * b.groups + g]), z = half_to_float(b.zero[row * b.groups + g]);
      for (int h = 0; h < heads; ++h) {
        scratch[(j * heads + h) * b.groups + g] = p[h * n + j] * s;
        zsum[h * b.groups + g] += p[h * n + j] * z;
      }
    }
  }
  for (int h = 0; h < heads; ++h)
    for (int g = 0; g < b.groups; ++g)
      for (int i = 0; i < b.cluster_dim; ++i) acc[h * b.head_dim + g * b.cluster_dim + i] += zsum[h * b.groups + g];
}

namespace {

void scalar_scores(const BodyView& b, int64_t row0, int n, const float* q, const float* qsum, int heads,
                   float* scores, const void* /*prepared*/) {
  const int64_t code_bytes = b.head_dim * b.bits / 8;
  float lv[128];
  for (int j = 0; j < n; ++j) {
    const int64_t row = row0 + j;
    for (int h = 0; h < heads; ++h) scores[h * n + j] = 0.0f;
    for (int g = 0; g < b.groups; ++g) {
      group_levels(b, b.codes + row * code_bytes + g * b.cluster_dim * b.bits / 8, lv);
      const float s = half_to_float(b.scale[row * b.groups + g]), z = half_to_float(b.zero[row * b.groups + g]);
      for (int h = 0; h < heads; ++h)
        scores[h * n + j] += s * dot(q + h * b.head_dim + g * b.cluster_dim, lv, b.cluster_dim) + z * qsum[h * b.groups + g];
    }
  }
}

void scalar_values(const BodyView& b, int64_t row0, int n, const float* p, int heads, float* acc, float* scratch) {
  body_value_weights(b, row0, n, p, heads, acc, scratch);
  const int64_t code_bytes = b.head_dim * b.bits / 8;
  float lv[128];
  for (int j = 0; j < n; ++j)
    for (int g = 0; g < b.groups; ++g) {
      group_levels(b, b.codes + (row0 + j) * code_bytes + g * b.cluster_dim * b.bits / 8, lv);
      for (int h = 0; h < heads; ++h)
        axpy(acc + h * b.head_dim + g * b.cluster_dim, scratch[(j * heads + h) * b.groups + g], lv, b.cluster_dim);
    }
}

float scalar_scale_max(float* s, int n, float scaling) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < n; ++j) {
    s[j] *= scaling;
    block_max = std::max(block_max, s[j]);
  }
  return block_max;
}

float scalar_exp_sum(float* s, int n, float m) {
  float sum = 0.0f;
  for (int j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

void scalar_load_f16(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
}

void scalar_dots(const float* q, const float* x, int n, int64_t d, float* s) {
  for (int j = 0; j < n; ++j) s[j] = dot(q, x + j * d, d);
}

void scalar_axpys(float* acc, const float* w, const float* x, int n, int64_t d) {
  for (int j = 0; j < n; ++j) axpy(acc, w[j], x + j * d, d);
}

}  // namespace

void no_prepare(const BodyView&, const float*, int, void*) {}

void scalar_widen_e4m3(const uint8_t* src, int64_t n, uint16_t* dst) {
  const uint16_t* table = e4m3_to_f16_table();
  for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
}

const BodyKernels kScalarKernels = {scalar_scores,   scalar_values,     scalar_scale_max, scalar_exp_sum,
                                    scalar_load_f16, scalar_widen_e4m3, scalar_dots,      scalar_axpys,
                                    no_prepare,      "scalar"};

}  // namespace oscar

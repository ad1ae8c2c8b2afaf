// Internal: the fused decode kernels over the packed body, one set per instruction set.
// They read codes on the fly and never expand the body into a float buffer:
//   q . (zero + scale * level[c]) = scale * sum_i q_i level[c_i] + zero * sum_i q_i
// and, on the value side, sum_t p_t (zero_t + scale_t level[c]) = sum_t p_t zero_t
// + sum_t (p_t scale_t) level[c]. Callers pass validated, in-bounds views.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace oscar {

// One 8-code word of a packed vector: BITS bytes, little-endian (format.md section 4).
template <int BITS>
inline uint32_t load_word(const uint8_t* p) {
  uint32_t w = uint32_t(p[0]) | uint32_t(p[1]) << 8;
  if constexpr (BITS > 2) w |= uint32_t(p[2]) << 16;
  if constexpr (BITS > 3) w |= uint32_t(p[3]) << 24;
  return w;
}

struct BodyView {
  const uint8_t* codes;   // [rows, head_dim*bits/8] of one KV head
  const uint16_t* scale;  // [rows, groups] fp16
  const uint16_t* zero;
  const float* levels;    // [2^bits]
  int bits, head_dim, cluster_dim, groups;
};

struct BodyKernels {
  // scores[h*n + j] = q_h . dequant(row0 + j) for heads h < heads; q [heads, head_dim],
  // qsum [heads, groups] = sum of q_h over each group.
  // prepared: what prepare() wrote for these heads.
  void (*scores)(const BodyView& body, int64_t row0, int n, const float* q, const float* qsum, int heads,
                 float* scores, const void* prepared);
  // acc[h*head_dim + i] += sum_j p[h*n + j] * dequant(row0 + j)[i]; scratch holds (n+1)*heads*groups floats.
  void (*values)(const BodyView& body, int64_t row0, int n, const float* p, int heads, float* acc, float* scratch);
  // Online softmax pieces: s[j] *= scaling, returning the max; then s[j] = exp(s[j] - m), returning the sum.
  float (*scale_max)(float* s, int n, float scaling);
  float (*exp_sum)(float* s, int n, float m);
  // The fp16 windows and the dense path, over n rows x[j * d .. j * d + d) in fp32:
  // dst[i] = src[i] as fp32; s[j] = q . row j; acc += sum_j w[j] * row j.
  void (*load_f16)(const uint16_t* src, int64_t n, float* dst);
  // fp8 scales and zeros: dst[i] = the fp16 bits of E4M3 value src[i] (exact; NaN bytes give fp16 NaN).
  void (*widen_e4m3)(const uint8_t* src, int64_t n, uint16_t* dst);
  void (*dots)(const float* q, const float* x, int n, int64_t d, float* s);
  void (*axpys)(float* acc, const float* w, const float* x, int n, int64_t d);
  // Query set-up done once per call rather than per block: writes kPreparedBytes per head
  // (32-byte aligned) that every scores() call of the call reads.
  void (*prepare)(const BodyView& body, const float* q, int heads, void* prepared);
  const char* name;  // what simd_kernel_name() reports
};

// No per-call query set-up (the scalar kernels and the non-planar SIMD paths).
void no_prepare(const BodyView& body, const float* q, int heads, void* prepared);

extern const BodyKernels kScalarKernels;
#if defined(OSCAR_HAVE_AVX2)
extern const BodyKernels kAvx2Kernels;  // oscar_avx2.cc, built with -mavx2 -mfma -mf16c
#endif
#if defined(OSCAR_HAVE_AVXVNNI)
extern const BodyKernels kAvxVnniKernels;  // oscar_avxvnni.cc: the AVX2 set with AVX-VNNI score dots
#endif
#if defined(OSCAR_HAVE_AVX512)
extern const BodyKernels kAvx512Kernels;  // oscar_avx512.cc: AVX-512 F/BW/VL/DQ + VNNI
#endif
#if defined(__aarch64__)
extern const BodyKernels kNeonKernels;  // oscar_neon.cc
#endif
#if defined(OSCAR_HAVE_NEON_DOTPROD)
extern const BodyKernels kNeonDotprodKernels;  // oscar_neon_dotprod.cc: the same with sdot score dots
#endif

// Value side, shared by every kernel set: scratch[(j*heads + h)*groups + g] = p[h*n + j] * scale
// of (row0 + j, g); the zero terms sum_j p * zero (one per head and group) are added to acc.
void body_value_weights(const BodyView& body, int64_t row0, int n, const float* p, int heads, float* acc,
                        float* scratch);

// ---- planar path, shared by the SIMD kernel sets ---------------------------------------------
// For uniform 2- and 4-bit codes, a group's packed bytes are spread to one byte per code in
// "plane order": within a group, position k * seg + j holds the code of channel j * cpb + k
// (cpb codes per byte, seg = cd / cpb bytes), so spreading is a shift and a mask per byte plane.
// Query and accumulators are permuted to match. Scores run as integer dot products of u8 codes
// with the query split into int8 terms (SplitQuery). Unnamed namespace: each kernel file gets
// its own copy, compiled with its own ISA flags.
namespace {

constexpr int kPlanarMaxDim = 128;  // one block's spread codes (at most 32 KiB) live on the stack
constexpr int kPlanarRows = 256;    // the driver's decode block

inline int min_int(int a, int b) { return a < b ? a : b; }

inline bool planar(const BodyView& b) {
  if ((b.bits != 2 && b.bits != 4) || b.head_dim > kPlanarMaxDim) return false;
  for (int i = 0; i < (1 << b.bits); ++i)
    if (b.levels[i] != float(i)) return false;
  return true;
}

// Channel of plane-order position p (same group). cluster_dim and codes per byte are powers of two.
inline int plane_channel(int p, int bits, int cluster_dim) {
  const int cpb_log = bits == 2 ? 2 : 1, seg_log = __builtin_ctz(unsigned(cluster_dim)) - cpb_log;
  const int r = p & (cluster_dim - 1);
  return (p - r) + ((r & ((1 << seg_log) - 1)) << cpb_log) + (r >> seg_log);
}

// Channel of position p when the packed bytes of a group are read as dwords and spread by bit
// plane (the AVX-512 kernels): position 4 * u + b is byte b of dword u = c * cpb + k, the plane-k
// code of packed byte 4c + b, i.e. channel cpb * (4c + b) + k (cpb codes per byte).
inline int quad_channel(int p, int bits, int cluster_dim) {
  const int cpb = 8 / bits, r = p & (cluster_dim - 1), u = r >> 2;
  return (p - r) + cpb * (4 * (u / cpb) + (r & 3)) + u % cpb;
}

// The query as an integer per group, q ~ unit * Q, written as three balanced base-181 digits
// Q = t[0] * 181^2 + t[1] * 181 + t[2] (|t[1]|, |t[2]| <= 90), each an int8 term the codes meet
// in integer dot products. A kernel adds the terms' dots with weights 181^2, 181 and 1 (each fits
// int16) and scales once by unit: no rounding until then, because the largest digit is chosen so
// that cluster_dim * max code * max|Q| < 2^31 (127 for 2-bit codes; 4-bit codes in groups of 64
// or 128 give up one or two bits of it). What is left is below max|q| / 2^23 per element for
// 2-bit codes, near the rounding of the fp32 reference itself.
constexpr int kTerms = 3;
constexpr int kDigit = 181;  // 181^2 = 32761 still fits int16
constexpr int kHalfDigits = (kDigit * kDigit - 1) / 2;  // the largest |t[1] * 181 + t[2]|

// `channel` maps a position of the terms to the query channel it holds (same group): plane_channel
// for the planes the AVX2 and NEON kernels spread, quad_channel for the AVX-512 kernels' dwords.
struct SplitQuery {
  alignas(32) int8_t t[kTerms][kPlanarMaxDim];
  float unit[kPlanarMaxDim / 32];

  void set(const float* q, int bits, int head_dim, int cd, int (*channel)(int, int, int) = plane_channel) {
    const int64_t q_limit = int64_t(INT32_MAX) / (int64_t(cd) * ((1 << bits) - 1));  // max|Q| for int32 sums
    const int64_t digits_limit = (q_limit - kHalfDigits) / (kDigit * kDigit);
    const int64_t top = digits_limit < 127 ? digits_limit : 127;
    const int64_t q_top = top * kDigit * kDigit + kHalfDigits;
    for (int g = 0; g < head_dim / cd; ++g) {
      float amax = 0.0f;
      for (int i = g * cd; i < (g + 1) * cd; ++i) amax = std::fabs(q[i]) > amax ? std::fabs(q[i]) : amax;
      unit[g] = amax / float(top * kDigit * kDigit);
      for (int p = g * cd; p < (g + 1) * cd; ++p) {
        const float x = q[channel(p, bits, cd)];
        int64_t v = unit[g] > 0.0f ? int64_t(std::nearbyint(x / unit[g])) : 0;
        v = v > q_top ? q_top : v < -q_top ? -q_top : v;
        for (int i = kTerms - 1; i > 0; --i) {  // balanced digits, lowest first
          const int64_t up = (v + (v >= 0 ? kDigit / 2 : -(kDigit / 2))) / kDigit;
          t[i][p] = int8_t(v - up * kDigit);
          v = up;
        }
        t[0][p] = int8_t(v);
      }
    }
  }
};

}  // namespace

constexpr int64_t kPreparedBytes = sizeof(SplitQuery);

// The softmax's exp in every SIMD set: exp(x) = 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 (ln 2 in
// two parts, so r is exact), then a degree-6 polynomial for e^r (relative error about 2e-7), in Horner's order
// from kExpPoly[0]. Inputs are clamped to [kExpMin, kExpMax]: the softmax only sees x <= 0, and weights below
// exp(-87) ~ 1.6e-38 add nothing to a sum that is at least 1.
constexpr float kExpMin = -87.0f, kExpMax = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// A SIMD kernel set is a class template Impl<BITS, NH> with static scores() and values() for NH
// (1..4) query heads at a time, so each unpacked word feeds NH register accumulators. These
// instantiate it for bits 2..4 and walk the heads in chunks of 4. Impl must have internal
// linkage (an anonymous namespace): its code is compiled with that file's ISA flags.
template <template <int, int> class Impl, int BITS, typename F>
void with_heads(int nh, F&& f) {
  switch (nh) {
    case 1: f(Impl<BITS, 1>{}); break;
    case 2: f(Impl<BITS, 2>{}); break;
    case 3: f(Impl<BITS, 3>{}); break;
    default: f(Impl<BITS, 4>{}); break;
  }
}

template <template <int, int> class Impl, typename F>
void with_impl(int bits, int nh, F&& f) {
  switch (bits) {
    case 2: with_heads<Impl, 2>(nh, f); break;
    case 3: with_heads<Impl, 3>(nh, f); break;
    default: with_heads<Impl, 4>(nh, f); break;
  }
}

template <template <int, int> class Impl>
void fused_scores(const BodyView& b, int64_t row0, int n, const float* q, const float* qsum, int heads, float* scores,
                  const void* /*prepared*/) {
  for (int h0 = 0; h0 < heads; h0 += 4)
    with_impl<Impl>(b.bits, heads - h0, [&](auto impl) { impl.scores(b, row0, n, q, qsum, h0, scores); });
}

template <template <int, int> class Impl>
void fused_values(const BodyView& b, int64_t row0, int n, const float* p, int heads, float* acc, float* scratch) {
  body_value_weights(b, row0, n, p, heads, acc, scratch);
  for (int h0 = 0; h0 < heads; h0 += 4)
    with_impl<Impl>(b.bits, heads - h0, [&](auto impl) { impl.values(b, row0, n, heads, h0, acc, scratch); });
}

}  // namespace oscar

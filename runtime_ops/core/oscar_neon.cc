// NEON body kernels for aarch64 (NEON is part of the base ISA there), tested under qemu-aarch64.
// Same structure as oscar_avx2.cc, with 8 channels as two float32x4 halves. oscar_neon_dotprod.cc
// compiles this file a second time with the ARMv8.2 dot-product extension, under another name.
#include <arm_neon.h>

#include <cstring>

#include "oscar_kernels.h"

namespace oscar {
namespace {

inline float half_to_float(uint16_t h) {  // one fcvt instruction
  __fp16 x;
  std::memcpy(&x, &h, sizeof x);
  return float(x);
}

// 8 codes (one bits-byte little-endian word) -> two uint32x4 halves.
template <int BITS>
inline void unpack8(const uint8_t* p, uint32x4_t& c0, uint32x4_t& c1) {
  const uint32_t word = load_word<BITS>(p);
  const uint32x4_t v = vdupq_n_u32(word), mask = vdupq_n_u32((1u << BITS) - 1);
  const int32x4_t s0 = {0, -BITS, -2 * BITS, -3 * BITS}, s1 = {-4 * BITS, -5 * BITS, -6 * BITS, -7 * BITS};
  c0 = vandq_u32(vshlq_u32(v, s0), mask);  // a negative shift count shifts right
  c1 = vandq_u32(vshlq_u32(v, s1), mask);
}

// levels[code] per lane: one table lookup of bytes 4c .. 4c+3 in a 16-float (64-byte) table.
struct Levels {
  uint8x16x4_t table;
  explicit Levels(const BodyView& b) {
    float t[16] = {};
    for (int i = 0; i < (1 << b.bits); ++i) t[i] = b.levels[i];
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(t);
    table = uint8x16x4_t{{vld1q_u8(bytes), vld1q_u8(bytes + 16), vld1q_u8(bytes + 32), vld1q_u8(bytes + 48)}};
  }
  float32x4_t operator()(uint32x4_t codes) const {
    const uint32x4_t idx = vaddq_u32(vmulq_n_u32(codes, 0x04040404u), vdupq_n_u32(0x03020100u));
    return vreinterpretq_f32_u8(vqtbl4q_u8(table, vreinterpretq_u8_u32(idx)));
  }
};

template <int BITS, int NH>
struct Neon {
  static void scores(const BodyView& b, int64_t row0, int n, const float* q, const float* qsum, int h0,
                     float* scores) {
    const Levels level(b);
    const int64_t code_bytes = b.head_dim * BITS / 8;
    const int words = b.cluster_dim / 8;
    for (int j = 0; j < n; ++j) {
      const int64_t row = row0 + j;
      const uint8_t* codes = b.codes + row * code_bytes;
      float score[NH] = {};
      for (int g = 0; g < b.groups; ++g) {
        float32x4_t acc[NH];
        for (int k = 0; k < NH; ++k) acc[k] = vdupq_n_f32(0.0f);
        for (int w = 0; w < words; ++w) {
          uint32x4_t c0, c1;
          unpack8<BITS>(codes + (g * words + w) * BITS, c0, c1);
          const float32x4_t l0 = level(c0), l1 = level(c1);
          const float* qw = q + g * b.cluster_dim + w * 8;
          for (int k = 0; k < NH; ++k) {
            acc[k] = vfmaq_f32(acc[k], vld1q_f32(qw + (h0 + k) * b.head_dim), l0);
            acc[k] = vfmaq_f32(acc[k], vld1q_f32(qw + (h0 + k) * b.head_dim + 4), l1);
          }
        }
        const float s = half_to_float(b.scale[row * b.groups + g]), z = half_to_float(b.zero[row * b.groups + g]);
        for (int k = 0; k < NH; ++k) score[k] += s * vaddvq_f32(acc[k]) + z * qsum[(h0 + k) * b.groups + g];
      }
      for (int k = 0; k < NH; ++k) scores[(h0 + k) * n + j] = score[k];
    }
  }

  // Channel-major: one 8-channel slice of NH accumulators stays in registers across the rows.
  static void values(const BodyView& b, int64_t row0, int n, int heads, int h0, float* acc, const float* weights) {
    const Levels level(b);
    const int64_t code_bytes = b.head_dim * BITS / 8;
    const int words = b.cluster_dim / 8;
    for (int g = 0; g < b.groups; ++g)
      for (int w = 0; w < words; ++w) {
        const int64_t col = g * b.cluster_dim + w * 8;
        float32x4_t a0[NH], a1[NH];
        for (int k = 0; k < NH; ++k) {
          a0[k] = vld1q_f32(acc + (h0 + k) * b.head_dim + col);
          a1[k] = vld1q_f32(acc + (h0 + k) * b.head_dim + col + 4);
        }
        const uint8_t* codes = b.codes + row0 * code_bytes + (g * words + w) * BITS;
        for (int j = 0; j < n; ++j) {
          uint32x4_t c0, c1;
          unpack8<BITS>(codes + j * code_bytes, c0, c1);
          const float32x4_t l0 = level(c0), l1 = level(c1);
          const float* wj = weights + (int64_t(j) * heads + h0) * b.groups + g;
          for (int k = 0; k < NH; ++k) {
            a0[k] = vfmaq_n_f32(a0[k], l0, wj[k * b.groups]);
            a1[k] = vfmaq_n_f32(a1[k], l1, wj[k * b.groups]);
          }
        }
        for (int k = 0; k < NH; ++k) {
          vst1q_f32(acc + (h0 + k) * b.head_dim + col, a0[k]);
          vst1q_f32(acc + (h0 + k) * b.head_dim + col + 4, a1[k]);
        }
      }
  }
};

// ---- planar path (oscar_kernels.h): uniform 2- and 4-bit codes --------------------------------

// One group's codes (cd / (8 / BITS) bytes at src) in plane order, as cd / 16 byte vectors.
template <int BITS>
inline void expand_group(const uint8_t* src, int cd, uint8x16_t* out) {
  constexpr int cpb = 8 / BITS;
  const uint8x16_t mask = vdupq_n_u8((1 << BITS) - 1);
  const int seg = cd / cpb;
  if (seg == 8) {  // 2-bit codes in groups of 32: four 8-byte planes
    const uint8x8_t x = vld1_u8(src), m = vget_low_u8(mask);
    out[0] = vcombine_u8(vand_u8(x, m), vand_u8(vshr_n_u8(x, 2), m));
    out[1] = vcombine_u8(vand_u8(vshr_n_u8(x, 4), m), vshr_n_u8(x, 6));
    return;
  }
  const int pieces = seg / 16;
  for (int i = 0; i < pieces; ++i) {
    const uint8x16_t x = vld1q_u8(src + 16 * i);
    for (int k = 0; k < cpb; ++k)  // a negative count shifts right
      out[k * pieces + i] = vandq_u8(vshlq_u8(x, vdupq_n_s8(int8_t(-BITS * k))), mask);
  }
}

// Dot of one row's expanded group with the int8 query terms: u8 codes (< 16) read as s8.
// With the dot-product extension one sdot takes 16 byte products into four int32 lanes; without
// it, vmull_s8 and vpadalq_s16 take two instructions per 8. Same integer sums either way. The
// terms' sums are added as base-181 digits in int32 (exact: SplitQuery bounds them), then
// reduced and scaled once.
inline float group_dot(const uint8x16_t* c, int vectors, const SplitQuery& sq, int g, int cd) {
  int32x4_t total = vdupq_n_s32(0);
  for (int i = 0; i < kTerms; ++i) {
    const int8_t* t = sq.t[i] + g * cd;
    int32x4_t acc = vdupq_n_s32(0);
    for (int o = 0; o < vectors; ++o) {
      const int8x16_t x = vreinterpretq_s8_u8(c[o]), y = vld1q_s8(t + 16 * o);
#if defined(__ARM_FEATURE_DOTPROD)
      acc = vdotq_s32(acc, x, y);
#else
      acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(x), vget_low_s8(y)));
      acc = vpadalq_s16(acc, vmull_high_s8(x, y));
#endif
    }
    total = vmlaq_n_s32(acc, total, kDigit);  // Horner: (d0 * 181 + d1) * 181 + d2
  }
  return float(vaddvq_s32(total)) * sq.unit[g];
}

template <int BITS>
void planar_scores(const BodyView& b, int64_t row0, int n, const float* qsum, int heads, float* scores,
                   const SplitQuery* sq) {
  const int D = b.head_dim, cd = b.cluster_dim, G = b.groups, group_bytes = cd * BITS / 8, code_bytes = D * BITS / 8;
  for (int j = 0; j < n; ++j) {
    const int64_t row = row0 + j;
    for (int h = 0; h < heads; ++h) scores[h * n + j] = 0.0f;
    for (int g = 0; g < G; ++g) {
      uint8x16_t c[8];
      expand_group<BITS>(b.codes + row * code_bytes + g * group_bytes, cd, c);
      const float s = half_to_float(b.scale[row * G + g]), z = half_to_float(b.zero[row * G + g]);
      for (int h = 0; h < heads; ++h) scores[h * n + j] += s * group_dot(c, cd / 16, sq[h], g, cd) + z * qsum[h * G + g];
    }
  }
}

// Channel-major over plane positions, as in oscar_avx2.cc; weights from body_value_weights.
template <int BITS, int NH>
void planar_values_heads(const BodyView& b, const uint8_t* codes, int n, int heads, int h0, float* acc,
                         const float* weights) {
  const int D = b.head_dim, cd = b.cluster_dim, G = b.groups;
  for (int p0 = 0; p0 < D; p0 += 8) {
    const int g = p0 / cd;
    float32x4_t a0[NH], a1[NH];
    for (int k = 0; k < NH; ++k) a0[k] = a1[k] = vdupq_n_f32(0.0f);
    for (int j = 0; j < n; ++j) {
      const uint16x8_t c = vmovl_u8(vld1_u8(codes + j * D + p0));
      const float32x4_t lo = vcvtq_f32_u32(vmovl_u16(vget_low_u16(c))), hi = vcvtq_f32_u32(vmovl_high_u16(c));
      const float* wj = weights + (int64_t(j) * heads + h0) * G + g;
      for (int k = 0; k < NH; ++k) {
        a0[k] = vfmaq_n_f32(a0[k], lo, wj[k * G]);
        a1[k] = vfmaq_n_f32(a1[k], hi, wj[k * G]);
      }
    }
    for (int k = 0; k < NH; ++k) {
      float t[8];
      vst1q_f32(t, a0[k]);
      vst1q_f32(t + 4, a1[k]);
      float* dst = acc + (h0 + k) * D;
      for (int l = 0; l < 8; ++l) dst[plane_channel(p0 + l, BITS, cd)] += t[l];
    }
  }
}

template <int BITS>
void planar_values(const BodyView& b, int64_t row0, int n, const float* p, int heads, float* acc, float* scratch) {
  const int D = b.head_dim, cd = b.cluster_dim, group_bytes = cd * BITS / 8, code_bytes = D * BITS / 8;
  body_value_weights(b, row0, n, p, heads, acc, scratch);
  alignas(16) uint8_t codes[kPlanarRows * kPlanarMaxDim];
  for (int j = 0; j < n; ++j)
    for (int g = 0; g < D / cd; ++g) {
      uint8x16_t c[8];
      expand_group<BITS>(b.codes + (row0 + j) * code_bytes + g * group_bytes, cd, c);
      for (int i = 0; i < cd / 16; ++i) vst1q_u8(codes + j * D + g * cd + 16 * i, c[i]);
    }
  for (int h0 = 0; h0 < heads; h0 += 4) {
    switch (min_int(4, heads - h0)) {
      case 1: planar_values_heads<BITS, 1>(b, codes, n, heads, h0, acc, scratch); break;
      case 2: planar_values_heads<BITS, 2>(b, codes, n, heads, h0, acc, scratch); break;
      case 3: planar_values_heads<BITS, 3>(b, codes, n, heads, h0, acc, scratch); break;
      default: planar_values_heads<BITS, 4>(b, codes, n, heads, h0, acc, scratch); break;
    }
  }
}

void neon_prepare(const BodyView& b, const float* q, int heads, void* prepared) {
  if (!planar(b)) return;
  SplitQuery* sq = static_cast<SplitQuery*>(prepared);
  for (int h = 0; h < heads; ++h) sq[h].set(q + h * b.head_dim, b.bits, b.head_dim, b.cluster_dim);
}

void neon_scores(const BodyView& b, int64_t row0, int n, const float* q, const float* qsum, int heads, float* scores,
                 const void* prepared) {
  if (n > kPlanarRows || !planar(b)) return fused_scores<Neon>(b, row0, n, q, qsum, heads, scores, prepared);
  const SplitQuery* sq = static_cast<const SplitQuery*>(prepared);
  if (b.bits == 2) return planar_scores<2>(b, row0, n, qsum, heads, scores, sq);
  planar_scores<4>(b, row0, n, qsum, heads, scores, sq);
}

void neon_values(const BodyView& b, int64_t row0, int n, const float* p, int heads, float* acc, float* scratch) {
  if (n > kPlanarRows || !planar(b)) return fused_values<Neon>(b, row0, n, p, heads, acc, scratch);
  if (b.bits == 2) return planar_values<2>(b, row0, n, p, heads, acc, scratch);
  planar_values<4>(b, row0, n, p, heads, acc, scratch);
}

}  // namespace

#if !defined(OSCAR_NEON_KERNELS)
#define OSCAR_NEON_KERNELS kNeonKernels
#endif
#if defined(__ARM_FEATURE_DOTPROD)
#define OSCAR_NEON_NAME "neon+dotprod"
#else
#define OSCAR_NEON_NAME "neon"
#endif
const BodyKernels OSCAR_NEON_KERNELS = {neon_scores,     neon_values, scalar_scale_max, scalar_exp_sum, scalar_load_f16,
                                        scalar_dots,     scalar_axpys, neon_prepare,    OSCAR_NEON_NAME};

}  // namespace oscar

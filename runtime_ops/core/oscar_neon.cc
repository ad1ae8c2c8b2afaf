// NEON body kernels for aarch64 (NEON is part of the base ISA there), tested under qemu-aarch64.
// Same structure as oscar_avx2.cc, with 8 channels as two float32x4 halves.
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

}  // namespace

const BodyKernels kNeonKernels = {fused_scores<Neon>, fused_values<Neon>, scalar_scale_max, scalar_exp_sum,
                                  scalar_load_f16,     scalar_dot,         scalar_axpy};

}  // namespace oscar

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

// One group's codes (CD / (8 / BITS) bytes at src) in plane order, as CD / 16 byte vectors.
template <int BITS, int CD>
inline void expand_group(const uint8_t* src, uint8x16_t* out) {
  constexpr int cpb = 8 / BITS, seg = CD / cpb, pieces = seg / 16;
  const uint8x16_t mask = vdupq_n_u8((1 << BITS) - 1);
  if constexpr (seg == 8) {  // 2-bit codes in groups of 32: four 8-byte planes
    const uint8x8_t x = vld1_u8(src), m = vget_low_u8(mask);
    out[0] = vcombine_u8(vand_u8(x, m), vand_u8(vshr_n_u8(x, 2), m));
    out[1] = vcombine_u8(vand_u8(vshr_n_u8(x, 4), m), vshr_n_u8(x, 6));
  } else {
#pragma GCC unroll 8
    for (int i = 0; i < pieces; ++i) {
      const uint8x16_t x = vld1q_u8(src + 16 * i);
#pragma GCC unroll 4
      for (int k = 0; k < cpb; ++k)  // a negative count shifts right
        out[k * pieces + i] = vandq_u8(vshlq_u8(x, vdupq_n_s8(int8_t(-BITS * k))), mask);
    }
  }
}

// Codes of rows row0 .. row0+n-1 -> out[j * head_dim + plane position], one byte per code.
template <int BITS, int CD>
void spread(const BodyView& b, int64_t row0, int n, uint8_t* out) {
  constexpr int kVectors = CD / 16, kGroupBytes = CD * BITS / 8;
  const int D = b.head_dim, code_bytes = D * BITS / 8;
  const uint8_t* src = b.codes + row0 * code_bytes;
  for (int j = 0; j < n; ++j, src += code_bytes, out += D)
    for (int g = 0; g < D / CD; ++g) {
      uint8x16_t c[kVectors];
      expand_group<BITS, CD>(src + g * kGroupBytes, c);
#pragma GCC unroll 8
      for (int i = 0; i < kVectors; ++i) vst1q_u8(out + g * CD + 16 * i, c[i]);
    }
}

// out[g * stride + j] = v[j * G + g] as fp32, rows j < n, zero up to the next multiple of 4: a
// block's fp16 scales (or zeros) regrouped so each group's rows are contiguous.
inline void rows_by_group(const uint16_t* v, int n, int G, float* out, int stride) {
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < n; ++j) out[g * stride + j] = half_to_float(v[j * G + g]);
    for (int j = n; j % 4; ++j) out[g * stride + j] = 0.0f;
  }
}

// R rows' values from p (rows_by_group's padding covers them), in the low lanes of a vector.
template <int R>
inline float32x4_t row_lanes(const float* p) {
  if constexpr (R == 4) return vld1q_f32(p);
  return vcombine_f32(vld1_f32(p), vdup_n_f32(0.0f));
}

// Scores of NH query heads, R rows at a time: the rows' expanded codes stay in registers while
// every head's terms pass over them (each term vector loaded once for R rows). Codes (u8, < 16)
// meet the int8 terms as s8: with the dot-product extension one sdot takes 16 byte products into
// four int32 lanes; without it, vmlal_s8 accumulates them in int16 lanes (2 * CD / 16 products
// of at most 15 * 127 each: below 2^15) and one vpaddlq widens. The terms' sums are added as
// base-181 digits in int32 (exact: SplitQuery bounds them); pairwise adds then put the R rows'
// sums in the lanes of one vector, scaled once per group.
template <int BITS, int CD, int NH>
void planar_scores_heads(const BodyView& b, int64_t row0, int n, const SplitQuery* sq, const float* qsum, int h0,
                         float* scores) {
  constexpr int kVectors = CD / 16, R = CD == 128 ? 2 : 4, kGroupBytes = CD * BITS / 8;
  const int G = b.groups, code_bytes = b.head_dim * BITS / 8;
  const uint8_t* codes = b.codes + row0 * code_bytes;
  alignas(16) float scale[kPlanarMaxDim / 32][kPlanarRows], zero[kPlanarMaxDim / 32][kPlanarRows];
  rows_by_group(b.scale + row0 * G, n, G, scale[0], kPlanarRows);
  rows_by_group(b.zero + row0 * G, n, G, zero[0], kPlanarRows);
  for (int j0 = 0; j0 < n; j0 += R) {
    const int rows = min_int(R, n - j0);
    float32x4_t total[NH];
#pragma GCC unroll 8
    for (int k = 0; k < NH; ++k) total[k] = vdupq_n_f32(0.0f);
    for (int g = 0; g < G; ++g) {
      uint8x16_t c[R][8];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if (r < rows) {
          expand_group<BITS, CD>(codes + (j0 + r) * code_bytes + g * kGroupBytes, c[r]);
        } else {
#pragma GCC unroll 8
          for (int o = 0; o < kVectors; ++o) c[r][o] = vdupq_n_u8(0);
        }
      }
      const float32x4_t s = row_lanes<R>(scale[g] + j0), z = row_lanes<R>(zero[g] + j0);
      for (int k = 0; k < NH; ++k) {
        int32x4_t sum[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) sum[r] = vdupq_n_s32(0);
#pragma GCC unroll 8
        for (int i = 0; i < kTerms; ++i) {
          const int8_t* t = sq[k].t[i] + g * CD;
          int32x4_t d[R];
#if defined(__ARM_FEATURE_DOTPROD)
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) d[r] = vdupq_n_s32(0);
#pragma GCC unroll 8
          for (int o = 0; o < kVectors; ++o) {
            const int8x16_t y = vld1q_s8(t + 16 * o);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) d[r] = vdotq_s32(d[r], vreinterpretq_s8_u8(c[r][o]), y);
          }
#else
          int16x8_t e[R];
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) e[r] = vdupq_n_s16(0);
#pragma GCC unroll 8
          for (int o = 0; o < kVectors; ++o) {
            const int8x16_t y = vld1q_s8(t + 16 * o);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const int8x16_t x = vreinterpretq_s8_u8(c[r][o]);
              e[r] = vmlal_high_s8(vmlal_s8(e[r], vget_low_s8(x), vget_low_s8(y)), x, y);
            }
          }
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) d[r] = vpaddlq_s16(e[r]);
#endif
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) sum[r] = vmlaq_n_s32(d[r], sum[r], kDigit);  // Horner: (t0 * 181 + t1) * 181 + t2
        }
        int32x4_t dot;  // lane r: row j0 + r
        if constexpr (R == 4) {
          dot = vpaddq_s32(vpaddq_s32(sum[0], sum[1]), vpaddq_s32(sum[2], sum[3]));
        } else {
          const int32x4_t pair = vpaddq_s32(sum[0], sum[1]);
          dot = vpaddq_s32(pair, pair);
        }
        const float32x4_t dotf = vmulq_n_f32(vcvtq_f32_s32(dot), sq[k].unit[g]);
        total[k] = vfmaq_f32(vfmaq_n_f32(total[k], z, qsum[(h0 + k) * G + g]), s, dotf);
      }
    }
#pragma GCC unroll 8
    for (int k = 0; k < NH; ++k) {
      float t[4];
      vst1q_f32(t, total[k]);
      for (int r = 0; r < rows; ++r) scores[(h0 + k) * n + j0 + r] = t[r];
    }
  }
}

template <int BITS, int CD>
void planar_scores_cd(const BodyView& b, int64_t row0, int n, const float* qsum, int heads, float* scores,
                      const SplitQuery* sq) {
  for (int h0 = 0; h0 < heads; h0 += 4) {
    switch (min_int(4, heads - h0)) {
      case 1: planar_scores_heads<BITS, CD, 1>(b, row0, n, sq + h0, qsum, h0, scores); break;
      case 2: planar_scores_heads<BITS, CD, 2>(b, row0, n, sq + h0, qsum, h0, scores); break;
      case 3: planar_scores_heads<BITS, CD, 3>(b, row0, n, sq + h0, qsum, h0, scores); break;
      default: planar_scores_heads<BITS, CD, 4>(b, row0, n, sq + h0, qsum, h0, scores); break;
    }
  }
}

template <int BITS>
void planar_scores(const BodyView& b, int64_t row0, int n, const float* qsum, int heads, float* scores,
                   const SplitQuery* sq) {
  switch (b.cluster_dim) {  // 32, 64 or 128 (validated)
    case 32: return planar_scores_cd<BITS, 32>(b, row0, n, qsum, heads, scores, sq);
    case 64: return planar_scores_cd<BITS, 64>(b, row0, n, qsum, heads, scores, sq);
    default: return planar_scores_cd<BITS, 128>(b, row0, n, qsum, heads, scores, sq);
  }
}

// weights[(h * groups + g) * n + j] = p[h * n + j] * scale of (row0 + j, g), and acc gets the
// zero terms sum_j p[h * n + j] * zero of (row0 + j, g) on every channel of group g.
void planar_weights(const BodyView& b, int64_t row0, int n, const float* p, int heads, float* acc, float* weights) {
  const int D = b.head_dim, cd = b.cluster_dim, G = b.groups;
  alignas(16) float scale[kPlanarMaxDim / 32][kPlanarRows], zero[kPlanarMaxDim / 32][kPlanarRows];
  rows_by_group(b.scale + row0 * G, n, G, scale[0], kPlanarRows);
  rows_by_group(b.zero + row0 * G, n, G, zero[0], kPlanarRows);
  for (int h = 0; h < heads; ++h)
    for (int g = 0; g < G; ++g) {
      float* w = weights + int64_t(h * G + g) * n;
      const float* ph = p + h * n;
      float32x4_t zsum = vdupq_n_f32(0.0f);
      int j = 0;
      for (; j + 4 <= n; j += 4) {
        const float32x4_t pv = vld1q_f32(ph + j);
        vst1q_f32(w + j, vmulq_f32(pv, vld1q_f32(scale[g] + j)));
        zsum = vfmaq_f32(zsum, pv, vld1q_f32(zero[g] + j));
      }
      float z = vaddvq_f32(zsum);
      for (; j < n; ++j) {
        w[j] = ph[j] * scale[g][j];
        z += ph[j] * zero[g][j];
      }
      const float32x4_t zv = vdupq_n_f32(z);
      for (int i = 0; i < cd; i += 4) {
        float* dst = acc + h * D + g * cd + i;
        vst1q_f32(dst, vaddq_f32(vld1q_f32(dst), zv));
      }
    }
}

// Channel-major over plane positions, as in oscar_avx2.cc: 16 positions x NH heads of
// accumulators (16 of the 32 vector registers at NH = 4) stay in registers across the block's
// rows, so each weight feeds four FMAs; then they land on their channels. weights as
// planar_weights writes them; cluster_dim >= 32, so 16 positions never straddle a group.
template <int BITS, int NH>
void planar_values_heads(const BodyView& b, const uint8_t* codes, int n, int h0, float* acc, const float* weights) {
  const int D = b.head_dim, cd = b.cluster_dim, G = b.groups;
  const int64_t head_stride = int64_t(G) * n;
  for (int p0 = 0; p0 < D; p0 += 16) {
    const float* w = weights + int64_t(h0 * G + p0 / cd) * n;  // head h0 + k: w + k * head_stride
    float32x4_t a[NH][4];
#pragma GCC unroll 4
    for (int k = 0; k < NH; ++k) a[k][0] = a[k][1] = a[k][2] = a[k][3] = vdupq_n_f32(0.0f);
    for (int j = 0; j < n; ++j) {
      const uint8x16_t c = vld1q_u8(codes + j * D + p0);
      const uint16x8_t lo = vmovl_u8(vget_low_u8(c)), hi = vmovl_high_u8(c);
      const float32x4_t c0 = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), c1 = vcvtq_f32_u32(vmovl_high_u16(lo));
      const float32x4_t c2 = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), c3 = vcvtq_f32_u32(vmovl_high_u16(hi));
#pragma GCC unroll 4
      for (int k = 0; k < NH; ++k) {
        const float wk = w[k * head_stride + j];
        a[k][0] = vfmaq_n_f32(a[k][0], c0, wk);
        a[k][1] = vfmaq_n_f32(a[k][1], c1, wk);
        a[k][2] = vfmaq_n_f32(a[k][2], c2, wk);
        a[k][3] = vfmaq_n_f32(a[k][3], c3, wk);
      }
    }
#pragma GCC unroll 4
    for (int k = 0; k < NH; ++k) {
      float t[16];
      for (int i = 0; i < 4; ++i) vst1q_f32(t + 4 * i, a[k][i]);
      float* dst = acc + (h0 + k) * D;
      for (int l = 0; l < 16; ++l) dst[plane_channel(p0 + l, BITS, cd)] += t[l];
    }
  }
}

template <int BITS>
void planar_values(const BodyView& b, int64_t row0, int n, int heads, float* acc, const float* weights) {
  alignas(16) uint8_t codes[kPlanarRows * kPlanarMaxDim];
  switch (b.cluster_dim) {  // 32, 64 or 128 (validated)
    case 32: spread<BITS, 32>(b, row0, n, codes); break;
    case 64: spread<BITS, 64>(b, row0, n, codes); break;
    default: spread<BITS, 128>(b, row0, n, codes); break;
  }
  for (int h0 = 0; h0 < heads; h0 += 4) {
    switch (min_int(4, heads - h0)) {
      case 1: planar_values_heads<BITS, 1>(b, codes, n, h0, acc, weights); break;
      case 2: planar_values_heads<BITS, 2>(b, codes, n, h0, acc, weights); break;
      case 3: planar_values_heads<BITS, 3>(b, codes, n, h0, acc, weights); break;
      default: planar_values_heads<BITS, 4>(b, codes, n, h0, acc, weights); break;
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
  planar_weights(b, row0, n, p, heads, acc, scratch);
  if (b.bits == 2) return planar_values<2>(b, row0, n, heads, acc, scratch);
  planar_values<4>(b, row0, n, heads, acc, scratch);
}

// ---- softmax pieces ------------------------------------------------------------------------

// exp on 4 lanes (oscar_kernels.h: kExpPoly).
inline float32x4_t exp4(float32x4_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(kExpMin)), vdupq_n_f32(kExpMax));
  const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, kLog2e));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(kLn2Hi));
  r = vfmsq_f32(r, n, vdupq_n_f32(kLn2Lo));
  float32x4_t p = vdupq_n_f32(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = vfmaq_f32(vdupq_n_f32(kExpPoly[i]), p, r);
  const float32x4_t y = vaddq_f32(vfmaq_f32(r, vmulq_f32(p, r), r), vdupq_n_f32(1.0f));
  const int32x4_t pow2n = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(y, vreinterpretq_f32_s32(pow2n));
}

float neon_scale_max(float* s, int n, float scaling) {
  float32x4_t m = vdupq_n_f32(-__builtin_inff());
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float32x4_t x = vmulq_n_f32(vld1q_f32(s + j), scaling);
    vst1q_f32(s + j, x);
    m = vmaxq_f32(m, x);
  }
  float block_max = vmaxvq_f32(m);
  for (; j < n; ++j) {
    s[j] *= scaling;
    block_max = s[j] > block_max ? s[j] : block_max;
  }
  return block_max;
}

float neon_exp_sum(float* s, int n, float m) {
  const float32x4_t shift = vdupq_n_f32(m);
  float32x4_t sum = vdupq_n_f32(0.0f);
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float32x4_t e = exp4(vsubq_f32(vld1q_f32(s + j), shift));
    vst1q_f32(s + j, e);
    sum = vaddq_f32(sum, e);
  }
  float total = vaddvq_f32(sum);
  if (j < n) {  // the last 1..3 weights, through the same exp
    float t[4] = {};
    for (int i = j; i < n; ++i) t[i - j] = s[i] - m;
    vst1q_f32(t, exp4(vld1q_f32(t)));
    for (int i = j; i < n; ++i) total += s[i] = t[i - j];
  }
  return total;
}

// ---- fp16 windows ---------------------------------------------------------------------------

void neon_load_f16(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(src + i));
    vst1q_f32(dst + i, vcvt_f32_f16(vget_low_f16(h)));
    vst1q_f32(dst + i + 4, vcvt_high_f32_f16(h));
  }
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// Four rows at a time, so each load of the query feeds four FMA chains.
void neon_dots(const float* q, const float* x, int n, int64_t d, float* s) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* r = x + j * d;
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 4 <= d; i += 4) {
      const float32x4_t qv = vld1q_f32(q + i);
      a0 = vfmaq_f32(a0, qv, vld1q_f32(r + i));
      a1 = vfmaq_f32(a1, qv, vld1q_f32(r + d + i));
      a2 = vfmaq_f32(a2, qv, vld1q_f32(r + 2 * d + i));
      a3 = vfmaq_f32(a3, qv, vld1q_f32(r + 3 * d + i));
    }
    float t[4] = {vaddvq_f32(a0), vaddvq_f32(a1), vaddvq_f32(a2), vaddvq_f32(a3)};
    for (; i < d; ++i)
      for (int k = 0; k < 4; ++k) t[k] += q[i] * r[k * d + i];
    for (int k = 0; k < 4; ++k) s[j + k] = t[k];
  }
  for (; j < n; ++j) {
    const float* r = x + j * d;
    float32x4_t a0 = vdupq_n_f32(0.0f);
    int64_t i = 0;
    for (; i + 4 <= d; i += 4) a0 = vfmaq_f32(a0, vld1q_f32(q + i), vld1q_f32(r + i));
    float t = vaddvq_f32(a0);
    for (; i < d; ++i) t += q[i] * r[i];
    s[j] = t;
  }
}

// 32 accumulator lanes stay in registers across all n rows, then the next 32.
void neon_axpys(float* acc, const float* w, const float* x, int n, int64_t d) {
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    float32x4_t a[8];
    for (int k = 0; k < 8; ++k) a[k] = vld1q_f32(acc + i + 4 * k);
    for (int j = 0; j < n; ++j) {
      const float* r = x + j * d + i;
      for (int k = 0; k < 8; ++k) a[k] = vfmaq_n_f32(a[k], vld1q_f32(r + 4 * k), w[j]);
    }
    for (int k = 0; k < 8; ++k) vst1q_f32(acc + i + 4 * k, a[k]);
  }
  for (; i < d; ++i) {
    float t = acc[i];
    for (int j = 0; j < n; ++j) t += w[j] * x[j * d + i];
    acc[i] = t;
  }
}

// E4M3 -> fp16 in integers, 16 bytes at a time: a normal value's exponent is rebiased by 8 (15 - 7) in place;
// the seven subnormals (m * 2^-9) are fp16 normals whose high bytes a table lookup gives (their low bytes are 0).
void neon_widen_e4m3(const uint8_t* src, int64_t n, uint16_t* dst) {
  static const uint8_t kSubnormalHigh[16] = {0x00, 0x18, 0x1c, 0x1e, 0x20, 0x21, 0x22, 0x23};
  const uint8x16_t subnormal_high = vld1q_u8(kSubnormalHigh);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const uint8x16_t b = vld1q_u8(src + i);
    const uint8x16_t mag8 = vandq_u8(b, vdupq_n_u8(0x7f)), sign8 = vandq_u8(b, vdupq_n_u8(0x80));
    const uint8x16_t sub8 = vqtbl1q_u8(subnormal_high, mag8);
    const uint16x8_t mags[2] = {vmovl_u8(vget_low_u8(mag8)), vmovl_high_u8(mag8)};
    const uint16x8_t subs[2] = {vshll_n_u8(vget_low_u8(sub8), 8), vshll_high_n_u8(sub8, 8)};
    const uint16x8_t signs[2] = {vshll_n_u8(vget_low_u8(sign8), 8), vshll_high_n_u8(sign8, 8)};
    for (int half = 0; half < 2; ++half) {
      const uint16x8_t normal = vaddq_u16(vshlq_n_u16(mags[half], 7), vdupq_n_u16(0x2000));
      uint16x8_t w = vbslq_u16(vcltq_u16(mags[half], vdupq_n_u16(8)), subs[half], normal);
      w = vbslq_u16(vceqq_u16(mags[half], vdupq_n_u16(0x7f)), vdupq_n_u16(0x7e00), w);
      vst1q_u16(dst + i + 8 * half, vorrq_u16(w, signs[half]));
    }
  }
  kScalarKernels.widen_e4m3(src + i, n - i, dst + i);
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
const BodyKernels OSCAR_NEON_KERNELS = {neon_scores,   neon_values,     neon_scale_max, neon_exp_sum,
                                        neon_load_f16, neon_widen_e4m3, neon_dots,      neon_axpys,
                                        neon_prepare,  OSCAR_NEON_NAME};

}  // namespace oscar

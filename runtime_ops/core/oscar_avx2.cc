// AVX2 + FMA + F16C body kernels. This file alone is compiled with -mavx2 -mfma -mf16c;
// oscar_core.cc calls it only after __builtin_cpu_supports says the CPU has all three.
// Everything here has internal linkage and uses no std:: templates, so no AVX code can be
// picked by the linker for a caller on a CPU without it.
#include <immintrin.h>

#include <cmath>

#include "oscar_x86.h"

namespace oscar {
namespace {

// 8 codes (one bits-byte little-endian word) -> 8 int32 lanes.
template <int BITS>
inline __m256i unpack8(const uint8_t* p) {
  const uint32_t word = load_word<BITS>(p);
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts), _mm256_set1_epi32((1 << BITS) - 1));
}

// levels[code] per lane; 16 levels take two 8-lane permutes and a select on code bit 3.
template <int BITS>
struct Levels {
  __m256 lo, hi;
  explicit Levels(const float* levels) {
    float t[16] = {};
    for (int i = 0; i < (1 << BITS); ++i) t[i] = levels[i];
    lo = _mm256_loadu_ps(t), hi = _mm256_loadu_ps(t + 8);
  }
  __m256 operator()(__m256i codes) const {
    if constexpr (BITS < 4) {
      return _mm256_permutevar8x32_ps(lo, codes);
    } else {
      const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28));
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, codes), _mm256_permutevar8x32_ps(hi, codes), bit3);
    }
  }
};

template <int BITS, int NH>
struct Avx2 {
  static void scores(const BodyView& b, int64_t row0, int n, const float* q, const float* qsum, int h0,
                     float* scores) {
    const Levels<BITS> level(b.levels);
    const int64_t code_bytes = b.head_dim * BITS / 8;
    const int words = b.cluster_dim / 8;
    for (int j = 0; j < n; ++j) {
      const int64_t row = row0 + j;
      const uint8_t* codes = b.codes + row * code_bytes;
      float score[NH] = {};
      for (int g = 0; g < b.groups; ++g) {
        __m256 acc0[NH], acc1[NH];  // two chains (even and odd words) hide the FMA latency
        for (int k = 0; k < NH; ++k) acc0[k] = acc1[k] = _mm256_setzero_ps();
        for (int w = 0; w < words; w += 2) {  // words = cluster_dim / 8 is even
          const uint8_t* c = codes + (g * words + w) * BITS;
          const __m256 l0 = level(unpack8<BITS>(c)), l1 = level(unpack8<BITS>(c + BITS));
          const float* qw = q + h0 * b.head_dim + g * b.cluster_dim + w * 8;
          for (int k = 0; k < NH; ++k) {
            acc0[k] = _mm256_fmadd_ps(_mm256_loadu_ps(qw + k * b.head_dim), l0, acc0[k]);
            acc1[k] = _mm256_fmadd_ps(_mm256_loadu_ps(qw + k * b.head_dim + 8), l1, acc1[k]);
          }
        }
        const float s = _cvtsh_ss(b.scale[row * b.groups + g]), z = _cvtsh_ss(b.zero[row * b.groups + g]);
        for (int k = 0; k < NH; ++k)
          score[k] += s * hsum(_mm256_add_ps(acc0[k], acc1[k])) + z * qsum[(h0 + k) * b.groups + g];
      }
      for (int k = 0; k < NH; ++k) scores[(h0 + k) * n + j] = score[k];
    }
  }

  // Channel-major: one 8-channel slice of NH accumulators stays in registers across the rows.
  static void values(const BodyView& b, int64_t row0, int n, int heads, int h0, float* acc, const float* weights) {
    const Levels<BITS> level(b.levels);
    const int64_t code_bytes = b.head_dim * BITS / 8;
    const int words = b.cluster_dim / 8;
    for (int g = 0; g < b.groups; ++g)
      for (int w = 0; w < words; ++w) {
        const int64_t col = g * b.cluster_dim + w * 8;
        __m256 a0[NH], a1[NH];  // two chains (even and odd rows) hide the FMA latency
        for (int k = 0; k < NH; ++k) {
          a0[k] = _mm256_loadu_ps(acc + (h0 + k) * b.head_dim + col);
          a1[k] = _mm256_setzero_ps();
        }
        const uint8_t* codes = b.codes + row0 * code_bytes + (g * words + w) * BITS;
        const float* wj = weights + int64_t(h0) * b.groups + g;  // row j, head h0 + k: wj[(j * heads + k) * groups]
        const int64_t row_stride = int64_t(heads) * b.groups;
        int j = 0;
        for (; j + 1 < n; j += 2) {
          const __m256 l0 = level(unpack8<BITS>(codes + j * code_bytes));
          const __m256 l1 = level(unpack8<BITS>(codes + (j + 1) * code_bytes));
          for (int k = 0; k < NH; ++k) {
            a0[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(wj + j * row_stride + k * b.groups), l0, a0[k]);
            a1[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(wj + (j + 1) * row_stride + k * b.groups), l1, a1[k]);
          }
        }
        if (j < n) {
          const __m256 l0 = level(unpack8<BITS>(codes + j * code_bytes));
          for (int k = 0; k < NH; ++k)
            a0[k] = _mm256_fmadd_ps(_mm256_broadcast_ss(wj + j * row_stride + k * b.groups), l0, a0[k]);
        }
        for (int k = 0; k < NH; ++k) _mm256_storeu_ps(acc + (h0 + k) * b.head_dim + col, _mm256_add_ps(a0[k], a1[k]));
      }
  }
};

// ---- planar path (oscar_kernels.h): uniform 2- and 4-bit codes ------------------------------

// Sums of the 8 lanes of each of v[0..7], as one vector (lane r = sum of v[r]).
inline __m256i hsum8_epi32(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
}

// Scores of NH query heads over 8-row chunks: per row and group the codes are expanded once and
// meet every head's terms; the terms' integer dots are added in int32 as base-181 digits (no
// rounding: SplitQuery bounds the sum), so each row, head and group costs one 8-lane reduction,
// done for 8 rows together. CD, the group size, is a template argument so the per-group loops
// unroll into straight code.
template <int BITS, int CD, int NH>
void planar_scores_heads(const BodyView& b, int64_t row0, int n, const SplitQuery* sq, const float* qsum, int h0,
                         float* scores) {
  constexpr int kVectors = CD / 32, kGroupBytes = CD * BITS / 8;
  const int D = b.head_dim, G = b.groups, code_bytes = D * BITS / 8;
  const uint8_t* codes = b.codes + row0 * code_bytes;
  alignas(32) float scale[kPlanarMaxDim / 32][kPlanarRows], zero[kPlanarMaxDim / 32][kPlanarRows];
  rows_by_group(b.scale + row0 * G, n, G, scale[0], kPlanarRows);
  rows_by_group(b.zero + row0 * G, n, G, zero[0], kPlanarRows);
  static_assert(kTerms == 3, "digit weights below");
  const __m256i digit[kTerms] = {_mm256_set1_epi16(kDigit * kDigit), _mm256_set1_epi16(kDigit), _mm256_set1_epi16(1)};
  for (int j0 = 0; j0 < n; j0 += 8) {
    const int rows = min_int(8, n - j0);
    __m256 total[NH];
    for (int k = 0; k < NH; ++k) total[k] = _mm256_setzero_ps();
    for (int g = 0; g < G; ++g) {
      __m256i dots[NH][8];
      for (int r = 0; r < 8; ++r) {
        if (r >= rows) {
          for (int k = 0; k < NH; ++k) dots[k][r] = _mm256_setzero_si256();
          continue;
        }
        __m256i c[4];
        expand_group<BITS>(codes + (j0 + r) * code_bytes + g * kGroupBytes, CD, c);
        for (int k = 0; k < NH; ++k) {
          __m256i sum = _mm256_setzero_si256();
          for (int i = 0; i < kTerms; ++i) {
            const __m256i* y = reinterpret_cast<const __m256i*>(sq[k].t[i] + g * CD);
            __m256i m = _mm256_maddubs_epi16(c[0], _mm256_load_si256(y));
            for (int o = 1; o < kVectors; ++o)  // int16 pair sums stay below 4 x 2 x 15 x 127 < 2^15
              m = _mm256_add_epi16(m, _mm256_maddubs_epi16(c[o], _mm256_load_si256(y + o)));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(m, digit[i]));
          }
          dots[k][r] = sum;
        }
      }
      const __m256 s8 = _mm256_load_ps(scale[g] + j0), z8 = _mm256_load_ps(zero[g] + j0);
      for (int k = 0; k < NH; ++k) {
        const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(hsum8_epi32(dots[k])), _mm256_set1_ps(sq[k].unit[g]));
        total[k] = _mm256_fmadd_ps(s8, dot, _mm256_fmadd_ps(z8, _mm256_set1_ps(qsum[(h0 + k) * G + g]), total[k]));
      }
    }
    for (int k = 0; k < NH; ++k) {
      float* out = scores + (h0 + k) * n + j0;
      if (rows == 8) {
        _mm256_storeu_ps(out, total[k]);
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, total[k]);
        for (int r = 0; r < rows; ++r) out[r] = t[r];
      }
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

// Channel-major over plane positions: 16 positions x NH heads of accumulators stay in registers
// across the block's rows (each weight broadcast feeds two FMAs), then land on their channels.
// weights[(h * groups + g) * n + j]; cluster_dim >= 32, so 16 positions never straddle a group.
template <int BITS, int NH>
void planar_values_heads(const BodyView& b, const uint8_t* codes, int n, int h0, float* acc, const float* weights) {
  const int D = b.head_dim, cd = b.cluster_dim, G = b.groups;
  const int64_t head_stride = int64_t(G) * n;
  for (int p0 = 0; p0 < D; p0 += 16) {
    const float* w = weights + int64_t(h0 * G + p0 / cd) * n;  // head h0 + k: w + k * head_stride
    __m256 lo[NH], hi[NH];
#pragma GCC unroll 4
    for (int k = 0; k < NH; ++k) lo[k] = hi[k] = _mm256_setzero_ps();
    for (int j = 0; j < n; ++j) {
      const uint8_t* c = codes + j * D + p0;
      const __m256 c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
      const __m256 c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8))));
#pragma GCC unroll 4
      for (int k = 0; k < NH; ++k) {
        const __m256 wk = _mm256_broadcast_ss(w + k * head_stride + j);
        lo[k] = _mm256_fmadd_ps(wk, c0, lo[k]);
        hi[k] = _mm256_fmadd_ps(wk, c1, hi[k]);
      }
    }
#pragma GCC unroll 4
    for (int k = 0; k < NH; ++k) {
      alignas(32) float t[16];
      _mm256_store_ps(t, lo[k]);
      _mm256_store_ps(t + 8, hi[k]);
      float* dst = acc + (h0 + k) * D;
      for (int l = 0; l < 16; ++l) dst[plane_channel(p0 + l, BITS, cd)] += t[l];
    }
  }
}

template <int BITS>
void planar_values(const BodyView& b, int64_t row0, int n, int heads, float* acc, const float* weights) {
  alignas(32) uint8_t codes[kPlanarRows * kPlanarMaxDim];
  spread<BITS>(b, row0, n, codes);
  for (int h0 = 0; h0 < heads; h0 += 4) {
    switch (min_int(4, heads - h0)) {
      case 1: planar_values_heads<BITS, 1>(b, codes, n, h0, acc, weights); break;
      case 2: planar_values_heads<BITS, 2>(b, codes, n, h0, acc, weights); break;
      case 3: planar_values_heads<BITS, 3>(b, codes, n, h0, acc, weights); break;
      default: planar_values_heads<BITS, 4>(b, codes, n, h0, acc, weights); break;
    }
  }
}

void avx2_prepare(const BodyView& b, const float* q, int heads, void* prepared) {
  if (!planar(b)) return;
  SplitQuery* sq = static_cast<SplitQuery*>(prepared);
  for (int h = 0; h < heads; ++h) sq[h].set(q + h * b.head_dim, b.bits, b.head_dim, b.cluster_dim);
}

void avx2_scores(const BodyView& b, int64_t row0, int n, const float* q, const float* qsum, int heads, float* scores,
                 const void* prepared) {
  if (n > kPlanarRows || !planar(b)) return fused_scores<Avx2>(b, row0, n, q, qsum, heads, scores, prepared);
  const SplitQuery* sq = static_cast<const SplitQuery*>(prepared);
  if (b.bits == 2) return planar_scores<2>(b, row0, n, qsum, heads, scores, sq);
  planar_scores<4>(b, row0, n, qsum, heads, scores, sq);
}

void avx2_values(const BodyView& b, int64_t row0, int n, const float* p, int heads, float* acc, float* scratch) {
  if (n > kPlanarRows || !planar(b)) return fused_values<Avx2>(b, row0, n, p, heads, acc, scratch);
  planar_weights(b, row0, n, p, heads, acc, scratch);
  if (b.bits == 2) return planar_values<2>(b, row0, n, heads, acc, scratch);
  planar_values<4>(b, row0, n, heads, acc, scratch);
}

// ---- softmax pieces ------------------------------------------------------------------------

// exp on 8 lanes (oscar_kernels.h: kExpPoly).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

float avx2_scale_max(float* s, int n, float scaling) {
  const __m256 k = _mm256_set1_ps(scaling);
  __m256 m = _mm256_set1_ps(-__builtin_inff());
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + j), k);
    _mm256_storeu_ps(s + j, x);
    m = _mm256_max_ps(m, x);
  }
  float block_max = hmax(m);
  for (; j < n; ++j) {
    s[j] *= scaling;
    block_max = s[j] > block_max ? s[j] : block_max;
  }
  return block_max;
}

float avx2_exp_sum(float* s, int n, float m) {
  const __m256 shift = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (j < n) {  // the last 1..7 weights, through the same exp
    alignas(32) float t[8] = {};
    for (int i = j; i < n; ++i) t[i - j] = s[i] - m;
    _mm256_store_ps(t, exp8(_mm256_load_ps(t)));
    for (int i = j; i < n; ++i) s[i] = t[i - j];
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    sum = _mm256_add_ps(sum, _mm256_and_ps(_mm256_load_ps(t), _mm256_castsi256_ps(lanes)));
  }
  return hsum(sum);
}

// ---- fp16 windows ---------------------------------------------------------------------------

void avx2_load_f16(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}

// E4M3 -> fp16 in integers, 16 bytes at a time: a normal value's exponent is rebiased by 8 (15 - 7) in place;
// the seven subnormals (m * 2^-9) are fp16 normals whose high bytes a shuffle looks up (their low bytes are 0).
void avx2_widen_e4m3(const uint8_t* src, int64_t n, uint16_t* dst) {
  const __m128i subnormal_high = _mm_setr_epi8(0x00, 0x18, 0x1c, 0x1e, 0x20, 0x21, 0x22, 0x23, 0, 0, 0, 0, 0, 0, 0, 0);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i mag8 = _mm_and_si128(b, _mm_set1_epi8(0x7f));
    const __m256i mag = _mm256_cvtepu8_epi16(mag8);
    const __m256i normal = _mm256_add_epi16(_mm256_slli_epi16(mag, 7), _mm256_set1_epi16(0x2000));
    const __m256i subnormal = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_shuffle_epi8(subnormal_high, mag8)), 8);
    __m256i w = _mm256_blendv_epi8(normal, subnormal, _mm256_cmpgt_epi16(_mm256_set1_epi16(8), mag));
    w = _mm256_blendv_epi8(w, _mm256_set1_epi16(0x7e00), _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7f)));
    const __m256i sign = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(b, _mm_set1_epi8(char(0x80)))), 8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_or_si256(w, sign));
  }
  kScalarKernels.widen_e4m3(src + i, n - i, dst + i);
}

// Four rows at a time, so each load of the query feeds four FMA chains.
void avx2_dots(const float* q, const float* x, int n, int64_t d, float* s) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float* r = x + j * d;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + i), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + d + i), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 2 * d + i), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 3 * d + i), a3);
    }
    float t[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
    for (; i < d; ++i)
      for (int k = 0; k < 4; ++k) t[k] += q[i] * r[k * d + i];
    for (int k = 0; k < 4; ++k) s[j + k] = t[k];
  }
  for (; j < n; ++j) {
    const float* r = x + j * d;
    __m256 a0 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(r + i), a0);
    float t = hsum(a0);
    for (; i < d; ++i) t += q[i] * r[i];
    s[j] = t;
  }
}

// 32 accumulator lanes stay in registers across all n rows, then the next 32.
void avx2_axpys(float* acc, const float* w, const float* x, int n, int64_t d) {
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + i), a1 = _mm256_loadu_ps(acc + i + 8), a2 = _mm256_loadu_ps(acc + i + 16),
           a3 = _mm256_loadu_ps(acc + i + 24);
    for (int j = 0; j < n; ++j) {
      const __m256 wj = _mm256_broadcast_ss(w + j);
      const float* r = x + j * d + i;
      a0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r), a0);
      a1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 8), a1);
      a2 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 16), a2);
      a3 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 24), a3);
    }
    _mm256_storeu_ps(acc + i, a0), _mm256_storeu_ps(acc + i + 8, a1);
    _mm256_storeu_ps(acc + i + 16, a2), _mm256_storeu_ps(acc + i + 24, a3);
  }
  for (; i < d; ++i) {
    float t = acc[i];
    for (int j = 0; j < n; ++j) t += w[j] * x[j * d + i];
    acc[i] = t;
  }
}

}  // namespace

const BodyKernels kAvx2Kernels = {avx2_scores,   avx2_values,     avx2_scale_max, avx2_exp_sum,
                                  avx2_load_f16, avx2_widen_e4m3, avx2_dots,      avx2_axpys,
                                  avx2_prepare,  "avx2"};

}  // namespace oscar

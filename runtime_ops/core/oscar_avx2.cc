// AVX2 + FMA + F16C body kernels. This file alone is compiled with -mavx2 -mfma -mf16c;
// oscar_core.cc calls it only after __builtin_cpu_supports says the CPU has all three.
// Everything here has internal linkage and uses no std:: templates, so no AVX code can be
// picked by the linker for a caller on a CPU without it.
#include <immintrin.h>

#include "oscar_kernels.h"

namespace oscar {
namespace {

// 8 codes (one bits-byte little-endian word) -> 8 int32 lanes.
template <int BITS>
inline __m256i unpack8(const uint8_t* p) {
  const uint32_t word = load_word<BITS>(p);
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts), _mm256_set1_epi32((1 << BITS) - 1));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
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

}  // namespace

const BodyKernels kAvx2Kernels = {fused_scores<Avx2>, fused_values<Avx2>};

}  // namespace oscar

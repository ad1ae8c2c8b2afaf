// x86 pieces shared by the AVX2, AVX-VNNI and AVX-512 kernel sets: the VNNI score path's shapes and
// query layout, the planar path's code spreading, scale regrouping and value weights (oscar_kernels.h).
// Included only by files built with at least -mavx2 -mfma -mf16c; the unnamed namespace gives each of
// them its own copy, compiled with its flags.
#pragma once

#include <immintrin.h>

#include "oscar_kernels.h"

namespace oscar {
namespace {

// The VNNI score path of the AVX-512 and AVX-VNNI sets: uniform 2- or 4-bit codes whose packed row
// is W = head_dim * bits / 32 dwords with W in {2, 4, 8} (head_dim 32, 64 or 128; not 4-bit codes
// at head_dim 128, nor head_dim 96). Other planar shapes take the AVX2 set's scores, and its query layout.
inline int row_dwords(const BodyView& b) { return b.head_dim * b.bits / 32; }

inline bool vnni_scores(const BodyView& b) {
  const int w = row_dwords(b);
  return planar(b) && (w == 2 || w == 4 || w == 8);
}

// The query layout of the VNNI score path: digits in quad order, four per packed code dword's bit plane.
inline void vnni_prepare(const BodyView& b, const float* q, int heads, void* prepared) {
  SplitQuery* sq = static_cast<SplitQuery*>(prepared);
  for (int h = 0; h < heads; ++h) sq[h].set(q + h * b.head_dim, b.bits, b.head_dim, b.cluster_dim, quad_channel);
}

// The VNNI score path's shapes, dispatched to a set's tile kernel Tiles<BITS, W, G, NH>::run(b, row0, n,
// sq, qsum, h0, scores), at most 4 query heads at a time: (bits, head_dim) gives W, cluster_dim gives G.
template <template <int, int, int, int> class Tiles, int BITS, int W, int G>
void vnni_heads(const BodyView& b, int64_t row0, int n, const SplitQuery* sq, const float* qsum, int heads,
                float* scores) {
  for (int h0 = 0; h0 < heads; h0 += 4) {
    switch (min_int(4, heads - h0)) {
      case 1: Tiles<BITS, W, G, 1>::run(b, row0, n, sq + h0, qsum, h0, scores); break;
      case 2: Tiles<BITS, W, G, 2>::run(b, row0, n, sq + h0, qsum, h0, scores); break;
      case 3: Tiles<BITS, W, G, 3>::run(b, row0, n, sq + h0, qsum, h0, scores); break;
      default: Tiles<BITS, W, G, 4>::run(b, row0, n, sq + h0, qsum, h0, scores); break;
    }
  }
}

template <template <int, int, int, int> class Tiles, int BITS, int W>
void vnni_groups(const BodyView& b, int64_t row0, int n, const SplitQuery* sq, const float* qsum, int heads,
                 float* scores) {
  switch (b.groups) {
    case 1: return vnni_heads<Tiles, BITS, W, 1>(b, row0, n, sq, qsum, heads, scores);
    case 2: return vnni_heads<Tiles, BITS, W, 2>(b, row0, n, sq, qsum, heads, scores);
    default: return vnni_heads<Tiles, BITS, W, 4>(b, row0, n, sq, qsum, heads, scores);  // head_dim 128, groups of 32
  }
}

template <template <int, int, int, int> class Tiles>
void vnni_score_shapes(const BodyView& b, int64_t row0, int n, const SplitQuery* sq, const float* qsum, int heads,
                       float* scores) {
  switch (row_dwords(b) * 8 + b.bits) {  // the shapes vnni_scores admits
    case 2 * 8 + 2: return vnni_groups<Tiles, 2, 2>(b, row0, n, sq, qsum, heads, scores);
    case 4 * 8 + 2: return vnni_groups<Tiles, 2, 4>(b, row0, n, sq, qsum, heads, scores);
    case 8 * 8 + 2: return vnni_groups<Tiles, 2, 8>(b, row0, n, sq, qsum, heads, scores);
    case 2 * 8 + 4: return vnni_groups<Tiles, 4, 2>(b, row0, n, sq, qsum, heads, scores);
    case 4 * 8 + 4: return vnni_groups<Tiles, 4, 4>(b, row0, n, sq, qsum, heads, scores);
    default: return vnni_groups<Tiles, 4, 8>(b, row0, n, sq, qsum, heads, scores);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One group's codes (cd / (8 / BITS) bytes at src) in plane order: cd / 32 vectors of one byte per code.
template <int BITS>
inline void expand_group(const uint8_t* src, int cd, __m256i* out) {
  const __m256i mask = _mm256_set1_epi8((1 << BITS) - 1);
  auto bytes16 = [&] { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))); };
  auto bytes32 = [&](int o) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + o)); };
  if constexpr (BITS == 2) {
    if (cd == 32) {  // 8 bytes: all four 8-byte planes in one vector
      int64_t w;
      __builtin_memcpy(&w, src, 8);
      out[0] = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(w), _mm256_setr_epi64x(0, 2, 4, 6)), mask);
    } else if (cd == 64) {  // 16 bytes: planes 0,1 then 2,3
      const __m256i x = bytes16();
      out[0] = _mm256_and_si256(_mm256_srlv_epi64(x, _mm256_setr_epi64x(0, 0, 2, 2)), mask);
      out[1] = _mm256_and_si256(_mm256_srlv_epi64(x, _mm256_setr_epi64x(4, 4, 6, 6)), mask);
    } else {  // 32 bytes: one vector per plane
      const __m256i x = bytes32(0);
      out[0] = _mm256_and_si256(x, mask);
      out[1] = _mm256_and_si256(_mm256_srli_epi16(x, 2), mask);
      out[2] = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
      out[3] = _mm256_and_si256(_mm256_srli_epi16(x, 6), mask);
    }
  } else {
    if (cd == 32) {  // 16 bytes: planes 0 and 1
      out[0] = _mm256_and_si256(_mm256_srlv_epi64(bytes16(), _mm256_setr_epi64x(0, 0, 4, 4)), mask);
    } else if (cd == 64) {
      const __m256i x = bytes32(0);
      out[0] = _mm256_and_si256(x, mask);
      out[1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
    } else {
      const __m256i x0 = bytes32(0), x1 = bytes32(32);
      out[0] = _mm256_and_si256(x0, mask);
      out[1] = _mm256_and_si256(x1, mask);
      out[2] = _mm256_and_si256(_mm256_srli_epi16(x0, 4), mask);
      out[3] = _mm256_and_si256(_mm256_srli_epi16(x1, 4), mask);
    }
  }
}

// Codes of rows row0 .. row0+n-1 -> out[j * head_dim + plane position], one byte per code.
template <int BITS>
void spread(const BodyView& b, int64_t row0, int n, uint8_t* out) {
  const int D = b.head_dim, cd = b.cluster_dim, group_bytes = cd * BITS / 8, code_bytes = D * BITS / 8;
  const uint8_t* src = b.codes + row0 * code_bytes;
  for (int j = 0; j < n; ++j, src += code_bytes, out += D)
    for (int g = 0; g < D / cd; ++g) {
      __m256i v[4];
      expand_group<BITS>(src + g * group_bytes, cd, v);
      __m256i* dst = reinterpret_cast<__m256i*>(out + g * cd);
      _mm256_storeu_si256(dst, v[0]);  // unrolled by hand: a loop here becomes a memcpy call
      if (cd >= 64) _mm256_storeu_si256(dst + 1, v[1]);
      if (cd == 128) _mm256_storeu_si256(dst + 2, v[2]), _mm256_storeu_si256(dst + 3, v[3]);
    }
}

// out[g * stride + j] = v[j * G + g] as fp32 for rows j < n, zero up to the next multiple of 8:
// a block's fp16 scales (or zeros) regrouped so each group's rows are contiguous.
inline void rows_by_group(const uint16_t* v, int n, int G, float* out, int stride) {
  const __m256i idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(G));
  for (int j0 = 0; j0 < n; j0 += 8) {
    const int rows = min_int(8, n - j0);
    if (rows == 8 && G == 1) {
      _mm256_storeu_ps(out + j0, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + j0))));
      continue;
    }
    if (rows == 8 && G == 2) {  // rows 0-3 and 4-7, groups interleaved: split by shuffles (gathers are slow on AMD)
      const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + j0 * 2)));
      const __m256 c = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + j0 * 2 + 8)));
      auto rows_in_order = [](__m256 x) {  // rows 0 1 4 5 | 2 3 6 7 -> 0..7
        return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), 0xD8));
      };
      _mm256_storeu_ps(out + j0, rows_in_order(_mm256_shuffle_ps(a, c, _MM_SHUFFLE(2, 0, 2, 0))));
      _mm256_storeu_ps(out + stride + j0, rows_in_order(_mm256_shuffle_ps(a, c, _MM_SHUFFLE(3, 1, 3, 1))));
      continue;
    }
    alignas(32) float t[8 * (kPlanarMaxDim / 32)] = {};
    if (rows == 8) {
      for (int i = 0; i < G; ++i)
        _mm256_store_ps(t + 8 * i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + j0 * G + 8 * i))));
    } else {
      for (int i = 0; i < rows * G; ++i) t[i] = _cvtsh_ss(v[j0 * G + i]);
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(out + g * stride + j0, _mm256_i32gather_ps(t + g, idx, 4));
  }
}

// weights[(h * groups + g) * n + j] = p[h * n + j] * scale of (row0 + j, g), and acc gets the
// zero terms sum_j p[h * n + j] * zero of (row0 + j, g) on every channel of group g.
inline void planar_weights(const BodyView& b, int64_t row0, int n, const float* p, int heads, float* acc,
                           float* weights) {
  const int D = b.head_dim, cd = b.cluster_dim, G = b.groups;
  alignas(32) float scale[kPlanarMaxDim / 32][kPlanarRows], zero[kPlanarMaxDim / 32][kPlanarRows];
  rows_by_group(b.scale + row0 * G, n, G, scale[0], kPlanarRows);
  rows_by_group(b.zero + row0 * G, n, G, zero[0], kPlanarRows);
  for (int h = 0; h < heads; ++h)
    for (int g = 0; g < G; ++g) {
      float* w = weights + int64_t(h * G + g) * n;
      const float* ph = p + h * n;
      __m256 zsum = _mm256_setzero_ps();
      int j = 0;
      for (; j + 8 <= n; j += 8) {
        const __m256 pv = _mm256_loadu_ps(ph + j);
        _mm256_storeu_ps(w + j, _mm256_mul_ps(pv, _mm256_load_ps(scale[g] + j)));
        zsum = _mm256_fmadd_ps(pv, _mm256_load_ps(zero[g] + j), zsum);
      }
      float z = hsum(zsum);
      for (; j < n; ++j) {
        w[j] = ph[j] * scale[g][j];
        z += ph[j] * zero[g][j];
      }
      const __m256 zv = _mm256_set1_ps(z);
      for (int i = 0; i < cd; i += 8) {
        float* dst = acc + h * D + g * cd + i;
        _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), zv));
      }
    }
}

}  // namespace
}  // namespace oscar

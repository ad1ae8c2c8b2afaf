// AVX-VNNI body kernels: the AVX2 set with its scores computed as the AVX-512 set computes them, on
// 8 lanes. For x86 CPUs with the 256-bit (VEX) VNNI dot products but no AVX-512: Intel Alder Lake
// and later client cores. This file alone is compiled with -mavxvnni -mavx2 -mfma -mf16c;
// oscar_core.cc calls it only after __builtin_cpu_supports says the CPU has AVX-VNNI and AVX2.
// Internal linkage throughout, as in oscar_avx2.cc.
//
// Scores put one body row in each lane: the packed dwords of 8 rows are transposed by unpacks (for
// 2 and 4 dwords a row the lanes hold the rows in a fixed shuffled order, undone at the store), each
// bit plane of a dword is four codes (u8) of its row, and one vpdpbusd adds their products with four
// query digits (s8) to the row's int32 sum: no reductions, no int16 steps. The digits, their bound
// and the int32 sums are SplitQuery's, and each lane does the AVX2 set's float operations in its
// order, so the scores equal the AVX2 set's bit for bit. Everything else is the AVX2 set's.
#include <immintrin.h>

#include "oscar_x86.h"

namespace oscar {

extern const BodyKernels kAvx2Kernels;

namespace {

constexpr int kRows = 8;  // body rows per score tile: one per lane

// The W packed dwords of 8 rows (z: W vectors, memory order) as W columns: lane l of column c
// holds dword c of row kLaneRow[l].
template <int W>
struct Tile;

template <>
struct Tile<2> {  // z[i]: rows 4i .. 4i+3
  static constexpr int kLaneRow[kRows] = {0, 1, 4, 5, 2, 3, 6, 7};
  static void columns(const __m256i* z, __m256i* col) {
    const __m256 a = _mm256_castsi256_ps(z[0]), b = _mm256_castsi256_ps(z[1]);
    col[0] = _mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
    col[1] = _mm256_castps_si256(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
};

template <>
struct Tile<4> {  // z[i]: rows 2i (low half), 2i+1 (high half)
  static constexpr int kLaneRow[kRows] = {0, 2, 4, 6, 1, 3, 5, 7};
  static void columns(const __m256i* z, __m256i* col) {
    const __m256i a0 = _mm256_unpacklo_epi32(z[0], z[1]), a1 = _mm256_unpackhi_epi32(z[0], z[1]);
    const __m256i b0 = _mm256_unpacklo_epi32(z[2], z[3]), b1 = _mm256_unpackhi_epi32(z[2], z[3]);
    col[0] = _mm256_unpacklo_epi64(a0, b0), col[1] = _mm256_unpackhi_epi64(a0, b0);
    col[2] = _mm256_unpacklo_epi64(a1, b1), col[3] = _mm256_unpackhi_epi64(a1, b1);
  }
};

template <>
struct Tile<8> {  // z[i]: row i; an 8 x 8 transpose, rows in order
  static constexpr int kLaneRow[kRows] = {0, 1, 2, 3, 4, 5, 6, 7};
  static void columns(const __m256i* z, __m256i* col) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h+3: u[4h + c] holds columns c and c + 4
      u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
      u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
      u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
      u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      col[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
      col[c + 4] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
  }
};

// Lane l takes element kLaneRow[l] (to_lanes) or the lane holding row l (to_rows).
template <int W>
inline __m256i to_lanes() {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Tile<W>::kLaneRow));
}

template <int W>
inline __m256i to_rows() {
  alignas(32) int32_t inverse[kRows];
  for (int l = 0; l < kRows; ++l) inverse[Tile<W>::kLaneRow[l]] = l;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(inverse));
}

// Scores of NH query heads over the rows of a block, 8 rows a tile. W: packed dwords per row;
// G: groups per row.
template <int BITS, int W, int G, int NH>
void tile_scores(const BodyView& b, int64_t row0, int n, const SplitQuery* sq, const float* qsum, int h0,
                 float* scores) {
  constexpr int kCpb = 8 / BITS, kGroupDwords = W / G;
  const __m256i mask = _mm256_set1_epi8((1 << BITS) - 1), lanes = to_lanes<W>(), rows_back = to_rows<W>();
  const int cd = b.cluster_dim;
  alignas(32) float scale[kPlanarMaxDim / 32][kPlanarRows], zero[kPlanarMaxDim / 32][kPlanarRows];
  rows_by_group(b.scale + row0 * G, n, G, scale[0], kPlanarRows);
  rows_by_group(b.zero + row0 * G, n, G, zero[0], kPlanarRows);
  const int32_t* tile = reinterpret_cast<const int32_t*>(b.codes + row0 * W * 4);
  for (int j0 = 0; j0 < n; j0 += kRows, tile += kRows * W) {
    const int rows = min_int(kRows, n - j0);
    __m256i z[W], col[W];
    for (int i = 0; i < W; ++i) {  // a short tile's missing rows read as zeros (masked loads touch nothing there)
      const int left = rows * W - 8 * i;
      z[i] = left >= 8 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 8 * i))
                       : _mm256_maskload_epi32(tile + 8 * i, _mm256_cmpgt_epi32(_mm256_set1_epi32(left),
                                                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    }
    Tile<W>::columns(z, col);
    __m256 total[NH];
    for (int k = 0; k < NH; ++k) total[k] = _mm256_setzero_ps();
    for (int g = 0; g < G; ++g) {
      __m256i acc[NH][kTerms];
      for (int k = 0; k < NH; ++k)
        for (int t = 0; t < kTerms; ++t) acc[k][t] = _mm256_setzero_si256();
      for (int c = 0; c < kGroupDwords; ++c) {
        const __m256i x = col[g * kGroupDwords + c];
        for (int p = 0; p < kCpb; ++p) {
          const __m256i codes = _mm256_and_si256(_mm256_srli_epi32(x, BITS * p), mask);
          const int quad = g * cd + (c * kCpb + p) * 4;  // SplitQuery position of the four digits
          for (int k = 0; k < NH; ++k)
            for (int t = 0; t < kTerms; ++t) {
              int32_t digits;
              __builtin_memcpy(&digits, sq[k].t[t] + quad, 4);
              acc[k][t] = _mm256_dpbusd_avx_epi32(acc[k][t], codes, _mm256_set1_epi32(digits));
            }
        }
      }
      const __m256 s8 = _mm256_permutevar8x32_ps(_mm256_load_ps(scale[g] + j0), lanes);
      const __m256 z8 = _mm256_permutevar8x32_ps(_mm256_load_ps(zero[g] + j0), lanes);
      static_assert(kTerms == 3, "digit weights below");
      for (int k = 0; k < NH; ++k) {
        const __m256i q = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_mullo_epi32(acc[k][0], _mm256_set1_epi32(kDigit * kDigit)),
                             _mm256_mullo_epi32(acc[k][1], _mm256_set1_epi32(kDigit))),
            acc[k][2]);
        const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(sq[k].unit[g]));
        total[k] = _mm256_fmadd_ps(s8, dot, _mm256_fmadd_ps(z8, _mm256_set1_ps(qsum[(h0 + k) * G + g]), total[k]));
      }
    }
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int k = 0; k < NH; ++k) {
      const __m256 out = _mm256_permutevar8x32_ps(total[k], rows_back);
      if (rows == kRows)
        _mm256_storeu_ps(scores + (h0 + k) * n + j0, out);
      else
        _mm256_maskstore_ps(scores + (h0 + k) * n + j0, keep, out);
    }
  }
}

template <int BITS, int W, int G, int NH>
struct TileScores {
  static void run(const BodyView& b, int64_t row0, int n, const SplitQuery* sq, const float* qsum, int h0,
                  float* scores) {
    tile_scores<BITS, W, G, NH>(b, row0, n, sq, qsum, h0, scores);
  }
};

void avxvnni_prepare(const BodyView& b, const float* q, int heads, void* prepared) {
  if (!vnni_scores(b)) return kAvx2Kernels.prepare(b, q, heads, prepared);
  vnni_prepare(b, q, heads, prepared);
}

void avxvnni_scores(const BodyView& b, int64_t row0, int n, const float* q, const float* qsum, int heads,
                    float* scores, const void* prepared) {
  if (n > kPlanarRows || !vnni_scores(b)) return kAvx2Kernels.scores(b, row0, n, q, qsum, heads, scores, prepared);
  vnni_score_shapes<TileScores>(b, row0, n, static_cast<const SplitQuery*>(prepared), qsum, heads, scores);
}

// The AVX2 set's other kernels, called through its table at run time (a table entry copied here
// would be initialized in an order no one controls).
void avxvnni_values(const BodyView& b, int64_t row0, int n, const float* p, int heads, float* acc, float* scratch) {
  kAvx2Kernels.values(b, row0, n, p, heads, acc, scratch);
}
float avxvnni_scale_max(float* s, int n, float scaling) { return kAvx2Kernels.scale_max(s, n, scaling); }
float avxvnni_exp_sum(float* s, int n, float m) { return kAvx2Kernels.exp_sum(s, n, m); }
void avxvnni_load_f16(const uint16_t* src, int64_t n, float* dst) { kAvx2Kernels.load_f16(src, n, dst); }
void avxvnni_widen_e4m3(const uint8_t* src, int64_t n, uint16_t* dst) { kAvx2Kernels.widen_e4m3(src, n, dst); }
void avxvnni_dots(const float* q, const float* x, int n, int64_t d, float* s) { kAvx2Kernels.dots(q, x, n, d, s); }
void avxvnni_axpys(float* acc, const float* w, const float* x, int n, int64_t d) {
  kAvx2Kernels.axpys(acc, w, x, n, d);
}

}  // namespace

const BodyKernels kAvxVnniKernels = {avxvnni_scores,   avxvnni_values,            avxvnni_scale_max, avxvnni_exp_sum,
                                     avxvnni_load_f16, avxvnni_widen_e4m3,        avxvnni_dots,      avxvnni_axpys,
                                     avxvnni_prepare,  "avxvnni"};

}  // namespace oscar

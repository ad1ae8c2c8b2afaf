// AVX-512 body kernels (F, BW, VL, DQ and VNNI: Ice Lake, Sapphire Rapids, Zen 4 and later). This
// file alone is compiled with those flags; oscar_core.cc calls it only after __builtin_cpu_supports
// says the CPU has all of them. Internal linkage throughout, as in oscar_avx2.cc.
//
// Scores put one body row in each of a vector's 16 lanes: the packed dwords of 16 rows are
// transposed so lane r holds row r's dword c, each bit plane of it is four codes (u8) of row r, and
// one vpdpbusd adds their products with four query digits (s8) to that row's int32 sum. No lane
// ever needs reducing, and the query digits are broadcast from memory. The digits, their bound and
// the int32 sums are SplitQuery's, so the scores equal the AVX2 set's bit for bit. Softmax and the
// fp16 windows are the AVX2 set's too. Values are the one place this set differs: it reads the
// packed rows two at a time and adds code x weight in 16-bit fixed point (vpdpwssd), each weight
// within 2^-16 of its block's largest (fixed_point_weights), where the AVX2 set makes one fp32 FMA
// per code and query head.
#include <immintrin.h>

#include "oscar_x86.h"

namespace oscar {

extern const BodyKernels kAvx2Kernels;

namespace {

constexpr int kRows = 16;  // body rows per score tile: one per lane

// The first `count` of 16 lanes (none for count <= 0, all from 16 on).
inline __mmask16 first_lanes(int count) {
  return count >= 16 ? __mmask16(0xFFFF) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

// Lane r = element W * r + c of the 16 * W elements z[0..W) hold in memory order (16 rows of W
// elements): column c of the tile. Each pair of vectors holds 32 / W rows; one two-source permute
// per pair, and a blend to put its rows in place.
template <int W>
inline __m512i column(const __m512i* z, int c) {
  constexpr int kPairRows = 32 / W;
  alignas(64) static constexpr int32_t kFirst[16] = {  // W * (r mod kPairRows): column 0
      0, W % 32, 2 * W % 32, 3 * W % 32, 4 * W % 32, 5 * W % 32, 6 * W % 32, 7 * W % 32,
      8 * W % 32, 9 * W % 32, 10 * W % 32, 11 * W % 32, 12 * W % 32, 13 * W % 32, 14 * W % 32, 15 * W % 32};
  const __m512i idx = _mm512_add_epi32(_mm512_load_si512(kFirst), _mm512_set1_epi32(c));
  __m512i x = _mm512_permutex2var_epi32(z[0], idx, z[1]);
  for (int m = 1; m < kRows / kPairRows; ++m) {
    const __mmask16 rows = __mmask16(((1u << kPairRows) - 1) << (m * kPairRows));
    x = _mm512_mask_blend_epi32(rows, x, _mm512_permutex2var_epi32(z[2 * m], idx, z[2 * m + 1]));
  }
  return x;
}

// `count` 32-bit elements from src into W vectors, zeros past them (masked loads read nothing there).
template <int W>
inline void load_tile(const void* src, int count, __m512i* z) {
  for (int i = 0; i < W; ++i) {
    z[i] = _mm512_maskz_loadu_epi32(first_lanes(count - 16 * i), static_cast<const int32_t*>(src) + 16 * i);
  }
}

// 16 rows' fp16 scales (or zeros), G per row, as fp32: out[g] holds group g of the 16 rows.
template <int G>
inline void rows_fp32(const uint16_t* src, int rows, __m512* out) {
  if constexpr (G == 1) {
    out[0] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(rows), src));
  } else {
    __m512i f[G];  // f[i]: rows 16i/G .. as fp32 bits, G per row
    for (int i = 0; i < G; ++i)
      f[i] = _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(rows * G - 16 * i), src + 16 * i)));
    for (int g = 0; g < G; ++g) out[g] = _mm512_castsi512_ps(column<G>(f, g));
  }
}

// gcc 12 keeps a second copy of each accumulator for a VNNI intrinsic's result (and spills some),
// which costs as much as the dot products: these add in place, the broadcast folded into the load.
typedef int32_t __attribute__((may_alias)) AliasedInt32;

// acc + the dots of four u8 codes with the four s8 digits at `digits`, in each lane.
inline __m512i dot_quads(__m512i acc, __m512i codes, const int8_t* digits) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*reinterpret_cast<const AliasedInt32*>(digits)));
  return acc;
}

// acc + the dots of two int16 pairs, x and w, in each lane.
inline __m512i dot_pairs(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

// Scores of NH query heads over the rows of a block, 16 rows a tile. W: packed dwords per row;
// G: groups per row.
template <int BITS, int W, int G, int NH>
void tile_scores(const BodyView& b, int64_t row0, int n, const SplitQuery* sq, const float* qsum, int h0,
                 float* scores) {
  constexpr int kCpb = 8 / BITS, kGroupDwords = W / G;
  const __m512i mask = _mm512_set1_epi8((1 << BITS) - 1);
  const int cd = b.cluster_dim;
  for (int j0 = 0; j0 < n; j0 += kRows) {
    const int rows = min_int(kRows, n - j0);
    __m512i z[W];
    load_tile<W>(b.codes + (row0 + j0) * W * 4, rows * W, z);
    __m512 scale[G], zero[G];
    rows_fp32<G>(b.scale + (row0 + j0) * G, rows, scale);
    rows_fp32<G>(b.zero + (row0 + j0) * G, rows, zero);
    __m512 total[NH];
    for (int k = 0; k < NH; ++k) total[k] = _mm512_setzero_ps();
    for (int g = 0; g < G; ++g) {
      __m512i acc[NH][kTerms];
      for (int k = 0; k < NH; ++k)
        for (int t = 0; t < kTerms; ++t) acc[k][t] = _mm512_setzero_si512();
      for (int c = 0; c < kGroupDwords; ++c) {
        const __m512i x = column<W>(z, g * kGroupDwords + c);
        for (int p = 0; p < kCpb; ++p) {
          const __m512i codes = _mm512_and_si512(_mm512_srli_epi32(x, BITS * p), mask);
          const int quad = g * cd + (c * kCpb + p) * 4;  // SplitQuery position of the four digits
          for (int k = 0; k < NH; ++k)
            for (int t = 0; t < kTerms; ++t) acc[k][t] = dot_quads(acc[k][t], codes, sq[k].t[t] + quad);
        }
      }
      static_assert(kTerms == 3, "digit weights below");
      for (int k = 0; k < NH; ++k) {
        const __m512i q = _mm512_add_epi32(
            _mm512_add_epi32(_mm512_mullo_epi32(acc[k][0], _mm512_set1_epi32(kDigit * kDigit)),
                             _mm512_mullo_epi32(acc[k][1], _mm512_set1_epi32(kDigit))),
            acc[k][2]);
        const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(sq[k].unit[g]));
        total[k] = _mm512_fmadd_ps(scale[g], dot, _mm512_fmadd_ps(zero[g], _mm512_set1_ps(qsum[(h0 + k) * G + g]),
                                                                 total[k]));
      }
    }
    for (int k = 0; k < NH; ++k)
      _mm512_mask_storeu_ps(scores + (h0 + k) * n + j0, first_lanes(rows), total[k]);
  }
}

template <int BITS, int W, int G, int NH>
struct TileScores {
  static void run(const BodyView& b, int64_t row0, int n, const SplitQuery* sq, const float* qsum, int h0,
                  float* scores) {
    tile_scores<BITS, W, G, NH>(b, row0, n, sq, qsum, h0, scores);
  }
};

// Values in 16-bit fixed point. Per head and group, a block's weights (p * scale) become integers
// q = round(w / unit) with unit = max|w| / 32767, stored in place as int32 pairs (q of rows 2m and
// 2m+1), so one vpdpwssd adds two rows' code x weight products per lane, exactly, in int32
// (256 rows x 15 x 32767 < 2^31). Each weight is off by at most unit / 2, i.e. 2^-16 of the
// block's largest for that head and group, and the sum is converted once per block: fp32 FMAs
// would round every product to 2^-24 of itself, at twice the instructions.
//
// weights[r * n + j] (r = h * groups + g) -> int32 pairs at the start of the same row; units[r] = unit.
void fixed_point_weights(float* weights, int n, int rows, float* units) {
  for (int r = 0; r < rows; ++r) {
    float* w = weights + int64_t(r) * n;
    __m512 amax = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(first_lanes(n - j), w + j)));
    const float top = _mm512_reduce_max_ps(amax);
    units[r] = top / 32767.0f;
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
    for (int j = 0; j < n; j += 32) {  // reads rows j.. before writing pairs j/2.. (j/2 <= j)
      const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(n - j), w + j), inv));
      const __m512i hi =
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(first_lanes(n - j - 16), w + j + 16), inv));
      const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(lo)),
                                               _mm512_cvtepi32_epi16(hi), 1);
      _mm512_mask_storeu_epi32(reinterpret_cast<int32_t*>(w) + j / 2, first_lanes((n - j + 1) / 2), pairs);
    }
  }
}

// Two rows' 16 packed bytes (a chunk) as the int16 pairs (byte of row a, byte of row b) of 16
// lanes; a shift and a mask per bit plane then give both rows' codes of that plane.
inline __m512i byte_pairs(const uint8_t* a, const uint8_t* b, __mmask16 bytes) {
  const __m128i x = _mm_maskz_loadu_epi8(bytes, a), y = _mm_maskz_loadu_epi8(bytes, b);
  return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(x, y), _mm_unpacklo_epi8(x, y)));
}

// One pair of rows into the accumulators: the codes of every bit plane times each head's weights
// (w: pairs of head 0 at pair m; SPLIT: lanes 8.. take the next group's, at w + next).
template <int BITS, int NH, bool SPLIT>
inline void pair_step(__m512i x, const int32_t* w, int64_t next, int64_t head_stride, __m512i (&a)[NH][8 / BITS]) {
  const __m512i mask = _mm512_set1_epi16((1 << BITS) - 1);
  __m512i codes[8 / BITS];
  for (int p = 0; p < 8 / BITS; ++p) codes[p] = _mm512_and_si512(_mm512_srli_epi16(x, BITS * p), mask);
#pragma GCC unroll 4
  for (int k = 0; k < NH; ++k) {
    __m512i wk = _mm512_set1_epi32(w[k * head_stride]);
    if constexpr (SPLIT) wk = _mm512_mask_blend_epi32(0xFF00, wk, _mm512_set1_epi32(w[k * head_stride + next]));
#pragma GCC unroll 4
    for (int p = 0; p < 8 / BITS; ++p) a[k][p] = dot_pairs(a[k][p], codes[p], wk);
  }
}

// One 16-byte chunk of the rows (bytes c0.. of each) for NH heads: lane l, plane p of the int32
// accumulators holds channel cpb * (c0 + l) + p. Rows go in pairs straight from the packed body.
// pairs[(h * groups + g) * n + m]: see fixed_point_weights. SPLIT: the chunk holds two groups'
// 8 bytes (2-bit codes in groups of 32); otherwise one group's.
template <int BITS, int NH, bool SPLIT>
void values_chunk(const BodyView& b, int64_t row0, int n, int h0, int c0, float* acc, const int32_t* pairs,
                  const float* units) {
  constexpr int kCpb = 8 / BITS;
  const int G = b.groups, row_bytes = b.head_dim * BITS / 8, g0 = c0 * kCpb / b.cluster_dim;
  const int64_t head_stride = int64_t(G) * n;
  const __mmask16 bytes = first_lanes(row_bytes - c0);
  const int32_t* w = pairs + int64_t(h0 * G + g0) * n;
  __m512i a[NH][kCpb];  // every loop over them unrolled, so they stay in registers
#pragma GCC unroll 4
  for (int k = 0; k < NH; ++k)
#pragma GCC unroll 4
    for (int p = 0; p < kCpb; ++p) a[k][p] = _mm512_setzero_si512();
  const uint8_t* row = b.codes + row0 * row_bytes + c0;
  for (int m = 0; 2 * m < n; ++m, row += 2 * row_bytes) {
    const uint8_t* second = 2 * m + 1 < n ? row + row_bytes : row;  // an odd block's last row: weight 0
    pair_step<BITS, NH, SPLIT>(byte_pairs(row, second, bytes), w + m, n, head_stride, a);
  }
  // Scaled out of the registers in one go: a loop the compiler kept rolled over them would hold
  // them in memory, stored on every pair of rows.
  alignas(64) float t[NH][kCpb][16];
#pragma GCC unroll 4
  for (int k = 0; k < NH; ++k) {
    __m512 unit = _mm512_set1_ps(units[(h0 + k) * G + g0]);
    if constexpr (SPLIT) unit = _mm512_mask_blend_ps(0xFF00, unit, _mm512_set1_ps(units[(h0 + k) * G + g0 + 1]));
#pragma GCC unroll 4
    for (int p = 0; p < kCpb; ++p) _mm512_store_ps(t[k][p], _mm512_mul_ps(_mm512_cvtepi32_ps(a[k][p]), unit));
  }
#pragma GCC unroll 4
  for (int k = 0; k < NH; ++k) {
    float* dst = acc + (h0 + k) * b.head_dim + kCpb * c0;
    for (int l = 0; l < 16 && c0 + l < row_bytes; ++l)
      for (int p = 0; p < kCpb; ++p) dst[kCpb * l + p] += t[k][p][l];
  }
}

template <int BITS, bool SPLIT>
void values_heads(const BodyView& b, int64_t row0, int n, int h0, int nh, int c0, float* acc, const int32_t* pairs,
                  const float* units) {
  switch (nh) {
    case 1: return values_chunk<BITS, 1, SPLIT>(b, row0, n, h0, c0, acc, pairs, units);
    case 2: return values_chunk<BITS, 2, SPLIT>(b, row0, n, h0, c0, acc, pairs, units);
    case 3: return values_chunk<BITS, 3, SPLIT>(b, row0, n, h0, c0, acc, pairs, units);
    default: return values_chunk<BITS, 4, SPLIT>(b, row0, n, h0, c0, acc, pairs, units);
  }
}

void avx512_prepare(const BodyView& b, const float* q, int heads, void* prepared) {
  if (!vnni_scores(b)) return kAvx2Kernels.prepare(b, q, heads, prepared);
  vnni_prepare(b, q, heads, prepared);
}

void avx512_scores(const BodyView& b, int64_t row0, int n, const float* q, const float* qsum, int heads, float* scores,
                   const void* prepared) {
  if (n > kPlanarRows || !vnni_scores(b)) return kAvx2Kernels.scores(b, row0, n, q, qsum, heads, scores, prepared);
  vnni_score_shapes<TileScores>(b, row0, n, static_cast<const SplitQuery*>(prepared), qsum, heads, scores);
}

void avx512_values(const BodyView& b, int64_t row0, int n, const float* p, int heads, float* acc, float* scratch) {
  if (n > kPlanarRows || !planar(b)) return kAvx2Kernels.values(b, row0, n, p, heads, acc, scratch);
  planar_weights(b, row0, n, p, heads, acc, scratch);
  float* units = scratch + int64_t(n) * heads * b.groups;  // the scratch's last heads * groups floats
  fixed_point_weights(scratch, n, heads * b.groups, units);
  const int32_t* pairs = reinterpret_cast<const int32_t*>(scratch);
  const int row_bytes = b.head_dim * b.bits / 8, group_bytes = b.cluster_dim * b.bits / 8;
  for (int h0 = 0; h0 < heads; h0 += 4)
    for (int c0 = 0; c0 < row_bytes; c0 += 16) {
      const int nh = min_int(4, heads - h0);
      if (b.bits == 4)
        values_heads<4, false>(b, row0, n, h0, nh, c0, acc, pairs, units);
      else if (group_bytes == 8 && c0 + 8 < row_bytes)  // 2-bit codes in groups of 32: two groups a chunk
        values_heads<2, true>(b, row0, n, h0, nh, c0, acc, pairs, units);
      else
        values_heads<2, false>(b, row0, n, h0, nh, c0, acc, pairs, units);
    }
}

// exp8 of the AVX2 set on 16 lanes: the same operations, so the same result in every lane.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
}

// s[j] = exp(s[j] - m) and their sum, added in the AVX2 set's order (eight lanes, rows in order, the
// last n % 8 as a masked vector), so the sum is the same float.
float avx512_exp_sum(float* s, int n, float m) {
  const __m512 shift = _mm512_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
    _mm512_storeu_ps(s + j, e);
    sum = _mm256_add_ps(_mm256_add_ps(sum, _mm512_castps512_ps256(e)),
                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  for (; j < n; j += 8) {
    const __mmask16 lanes = first_lanes(n - j < 8 ? n - j : 8);
    const __m512 e = exp16(_mm512_maskz_sub_ps(lanes, _mm512_maskz_loadu_ps(lanes, s + j), shift));
    _mm512_mask_storeu_ps(s + j, lanes, e);
    sum = _mm256_add_ps(sum, _mm256_maskz_mov_ps(__mmask8(lanes), _mm512_castps512_ps256(e)));
  }
  return hsum(sum);
}

float avx512_scale_max(float* s, int n, float scaling) {
  const __m512 k = _mm512_set1_ps(scaling);
  __m512 m = _mm512_set1_ps(-__builtin_inff());
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), k);
    _mm512_storeu_ps(s + j, x);
    m = _mm512_max_ps(m, x);
  }
  const float block_max = _mm512_reduce_max_ps(m);
  if (j == n) return block_max;
  const float tail_max = kAvx2Kernels.scale_max(s + j, n - j, scaling);
  return tail_max > block_max ? tail_max : block_max;
}

// The AVX2 set's fp16-window kernels, called through its table at run time (a table entry copied
// here would be initialized in an order no one controls).
void avx512_load_f16(const uint16_t* src, int64_t n, float* dst) { kAvx2Kernels.load_f16(src, n, dst); }
void avx512_widen_e4m3(const uint8_t* src, int64_t n, uint16_t* dst) { kAvx2Kernels.widen_e4m3(src, n, dst); }
void avx512_dots(const float* q, const float* x, int n, int64_t d, float* s) { kAvx2Kernels.dots(q, x, n, d, s); }
void avx512_axpys(float* acc, const float* w, const float* x, int n, int64_t d) { kAvx2Kernels.axpys(acc, w, x, n, d); }

}  // namespace

const BodyKernels kAvx512Kernels = {avx512_scores,   avx512_values,             avx512_scale_max, avx512_exp_sum,
                                    avx512_load_f16, avx512_widen_e4m3,        avx512_dots,      avx512_axpys,
                                    avx512_prepare,  "avx512"};

}  // namespace oscar

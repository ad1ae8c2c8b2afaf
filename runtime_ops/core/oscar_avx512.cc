// AVX-512 body kernels (F, BW, VL, DQ and VNNI: Ice Lake, Sapphire Rapids, Zen 4 and later). This
// file alone is compiled with those flags; oscar_core.cc calls it only after __builtin_cpu_supports
// says the CPU has all of them. Internal linkage throughout, as in oscar_avx2.cc.
//
// Scores put one body row in each of a vector's 16 lanes: the packed dwords of 16 rows are
// transposed so lane r holds row r's dword c, each bit plane of it is four codes (u8) of row r, and
// one vpdpbusd adds their products with four query digits (s8) to that row's int32 sum. No lane
// ever needs reducing, and the query digits are broadcast from memory. The digits, their bound and
// the int32 sums are SplitQuery's, so the scores equal the AVX2 set's bit for bit. Values keep the
// AVX2 set's order per channel (one fp32 FMA per code and query head, rows in order) with 16
// channels a vector, so they equal it too. Softmax and the fp16 windows are the AVX2 set's.
#include <immintrin.h>

#include "oscar_x86.h"

namespace oscar {

extern const BodyKernels kAvx2Kernels;

namespace {

constexpr int kRows = 16;  // body rows per score tile: one per lane

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
    const int left = count - 16 * i;
    const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    z[i] = _mm512_maskz_loadu_epi32(m, static_cast<const int32_t*>(src) + 16 * i);
  }
}

// 16 rows' fp16 scales (or zeros), G per row, as fp32: out[g] holds group g of the 16 rows.
template <int G>
inline void rows_fp32(const uint16_t* src, int rows, __m512* out) {
  if constexpr (G == 1) {
    out[0] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(__mmask16((1u << rows) - 1), src));
  } else {
    __m512i f[G];  // f[i]: rows 16i/G .. as fp32 bits, G per row
    for (int i = 0; i < G; ++i) {
      const int left = rows * G - 16 * i;
      const __mmask16 m = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
      f[i] = _mm512_castps_si512(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + 16 * i)));
    }
    for (int g = 0; g < G; ++g) out[g] = _mm512_castsi512_ps(column<G>(f, g));
  }
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
            for (int t = 0; t < kTerms; ++t) {
              int32_t digits;
              __builtin_memcpy(&digits, sq[k].t[t] + quad, 4);
              acc[k][t] = _mm512_dpbusd_epi32(acc[k][t], codes, _mm512_set1_epi32(digits));
            }
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
      _mm512_mask_storeu_ps(scores + (h0 + k) * n + j0, __mmask16((1u << rows) - 1), total[k]);
  }
}

template <int BITS, int W, int G, int NH>
struct TileScores {
  static void run(const BodyView& b, int64_t row0, int n, const SplitQuery* sq, const float* qsum, int h0,
                  float* scores) {
    tile_scores<BITS, W, G, NH>(b, row0, n, sq, qsum, h0, scores);
  }
};

// A row's codes in plane order (the AVX2 set's spread), 64 positions a vector: each qword of the
// output is the plane-k codes of 8 packed bytes of one group, so one permute of the row's (at most
// 8) packed qwords, one shift per qword and one mask make 64 codes.
class Spreader {
 public:
  explicit Spreader(const BodyView& b)
      : mask_(_mm512_set1_epi8(char((1 << b.bits) - 1))), row_bytes_(b.head_dim * b.bits / 8), dim_(b.head_dim) {
    alignas(64) int64_t idx[2][8] = {}, shift[2][8] = {};
    const int cpb = 8 / b.bits, seg = b.cluster_dim / cpb, group_bytes = b.cluster_dim * b.bits / 8;
    for (int q = 0; q < b.head_dim / 8; ++q) {
      const int p = 8 * q, g = p / b.cluster_dim, r = p % b.cluster_dim;
      idx[q / 8][q % 8] = (g * group_bytes + r % seg) / 8;
      shift[q / 8][q % 8] = b.bits * (r / seg);
    }
    for (int o = 0; o < 2; ++o) idx_[o] = _mm512_load_si512(idx[o]), shift_[o] = _mm512_load_si512(shift[o]);
  }

  // n packed rows from `codes` -> out[j * head_dim + plane position].
  void rows(const uint8_t* codes, int n, uint8_t* out) const {
    switch (dim_ * 64 + row_bytes_) {  // the shapes the kernels see most, with plain loads and stores
      case 64 * 64 + 16: return rows_of<16, 64>(codes, n, out);    // head_dim 64, 2-bit
      case 64 * 64 + 32: return rows_of<32, 64>(codes, n, out);    // head_dim 64, 4-bit
      case 128 * 64 + 32: return rows_of<32, 128>(codes, n, out);  // head_dim 128, 2-bit
      case 128 * 64 + 64: return rows_of<64, 128>(codes, n, out);  // head_dim 128, 4-bit
      default: return rows_of<0, 0>(codes, n, out);
    }
  }

 private:
  // RB packed bytes and DIM codes a row (0, 0: the instance's, with masked loads and stores).
  template <int RB, int DIM>
  void rows_of(const uint8_t* codes, int n, uint8_t* out) const {
    const int row_bytes = RB ? RB : row_bytes_, dim = DIM ? DIM : dim_;
    const __mmask8 packed = __mmask8((1u << (row_bytes / 8)) - 1);
    const __m512i mask = mask_, idx0 = idx_[0], idx1 = idx_[1], shift0 = shift_[0], shift1 = shift_[1];
    for (int j = 0; j < n; ++j, codes += row_bytes, out += dim) {
      __m512i x;
      if constexpr (RB == 16)
        x = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
      else if constexpr (RB == 32)
        x = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
      else if constexpr (RB == 64)
        x = _mm512_loadu_si512(codes);
      else
        x = _mm512_maskz_loadu_epi64(packed, codes);
      const __m512i v0 = _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutexvar_epi64(idx0, x), shift0), mask);
      if constexpr (DIM == 64 || DIM == 128) {
        _mm512_storeu_si512(out, v0);
        if constexpr (DIM == 128)
          _mm512_storeu_si512(out + 64, _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutexvar_epi64(idx1, x), shift1), mask));
      } else {  // head_dim 32, 64, 96 or 128
        const auto part = [](int left) { return left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1; };
        _mm512_mask_storeu_epi8(out, part(dim), v0);
        if (dim > 64)
          _mm512_mask_storeu_epi8(out + 64, part(dim - 64),
                                  _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutexvar_epi64(idx1, x), shift1), mask));
      }
    }
  }

  __m512i idx_[2], shift_[2];
  const __m512i mask_;
  const int row_bytes_, dim_;
};

// Values: SLICES x 16 plane positions x NH heads of accumulators stay in registers across the
// block's rows; per lane the FMAs run in row order from zero, as in the AVX2 set.
// weights[(h * groups + g) * n + j]; codes: spread (one byte per code, plane order, D per row).
template <int NH, int SLICES>
void values_pass(const BodyView& b, const uint8_t* codes, int n, int h0, int p0, float* acc, const float* weights) {
  const int D = b.head_dim, cd = b.cluster_dim, G = b.groups;
  const int64_t head_stride = int64_t(G) * n;
  const float* w[SLICES];  // head h0's weights for slice s: the group of positions p0 + 16 s
  for (int s = 0; s < SLICES; ++s) w[s] = weights + int64_t(h0 * G + (p0 + 16 * s) / cd) * n;
  __m512 a[NH][SLICES];
  for (int k = 0; k < NH; ++k)
    for (int s = 0; s < SLICES; ++s) a[k][s] = _mm512_setzero_ps();
  for (int j = 0; j < n; ++j) {
    const uint8_t* c = codes + j * D + p0;
    __m512 x[SLICES];
    for (int s = 0; s < SLICES; ++s)
      x[s] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * s))));
    for (int k = 0; k < NH; ++k)
      for (int s = 0; s < SLICES; ++s)
        a[k][s] = _mm512_fmadd_ps(_mm512_set1_ps(w[s][k * head_stride + j]), x[s], a[k][s]);
  }
  for (int k = 0; k < NH; ++k) {
    float* dst = acc + (h0 + k) * D;
    for (int s = 0; s < SLICES; ++s) {
      alignas(64) float t[16];
      _mm512_store_ps(t, a[k][s]);
      for (int l = 0; l < 16; ++l) dst[plane_channel(p0 + 16 * s + l, b.bits, cd)] += t[l];
    }
  }
}

// 64 positions a pass (head_dim 96 ends with 32).
template <int NH>
void values_heads(const BodyView& b, const uint8_t* codes, int n, int h0, float* acc, const float* weights) {
  for (int p0 = 0; p0 < b.head_dim; p0 += 64) {
    if (b.head_dim - p0 >= 64)
      values_pass<NH, 4>(b, codes, n, h0, p0, acc, weights);
    else
      values_pass<NH, 2>(b, codes, n, h0, p0, acc, weights);
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
  alignas(64) uint8_t codes[kPlanarRows * kPlanarMaxDim];
  Spreader(b).rows(b.codes + row0 * b.head_dim * b.bits / 8, n, codes);
  for (int h0 = 0; h0 < heads; h0 += 4) {
    switch (min_int(4, heads - h0)) {
      case 1: values_heads<1>(b, codes, n, h0, acc, scratch); break;
      case 2: values_heads<2>(b, codes, n, h0, acc, scratch); break;
      case 3: values_heads<3>(b, codes, n, h0, acc, scratch); break;
      default: values_heads<4>(b, codes, n, h0, acc, scratch); break;
    }
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
    const __mmask16 lanes = __mmask16((1u << (n - j < 8 ? n - j : 8)) - 1);
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

// OSCAR-KV native core: the codec and the per-layer attention op on raw buffers,
// shared by the ONNX Runtime and ExecuTorch adapters. docs/format.md is normative;
// oscar_export/cache.py (OscarKVCache.attend) is the reference this code reproduces.
#pragma once

#include <cstdint>
#include <string>

namespace oscar {

// Empty message = success. Every entry point validates before it touches a buffer.
struct Status {
  std::string error;
  bool ok() const { return error.empty(); }
};

// IEEE binary16 <-> binary32, round to nearest even; integer-only so the host's FP
// environment (flush-to-zero, rounding mode) cannot change a stored bit.
uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t h);

// How a group's scale and zero are stored (format.md section 4's scale_dtype): fp16, or OCP fp8 E4M3
// ("float8_e4m3fn": no inf, largest finite 448). Every E4M3 value is an fp16 value, so the kernels read
// fp8 scales widened to fp16 bits, exactly.
enum class ScaleDtype : int32_t { kFloat16 = 0, kFloat8E4M3 = 1 };
// fp32 -> E4M3 bits, round to nearest even, for |x| <= 448 (callers check the range: E4M3 has no inf).
uint8_t f32_to_e4m3(float x);
float e4m3_to_f32(uint8_t b);

// Quantizes `rows` fp32 vectors of head_dim values (docs/format.md sections 3-4): codes
// [rows, head_dim*bits/8], scale and zero [rows, head_dim/cluster_dim] as fp16 (uint16) or E4M3
// (uint8) bits. levels: 2^bits ascending code-unit levels, or nullptr for uniform.
// feedback: K's error-feedback weights [head_dim, head_dim] (section 3, step 5), or nullptr for nearest rounding.
Status quantize_pack(const float* x, int64_t rows, int64_t head_dim, int bits, int cluster_dim, float clip,
                     const float* levels, uint8_t* codes, void* scale, void* zero, const float* feedback = nullptr,
                     ScaleDtype scale_dtype = ScaleDtype::kFloat16);

// Which path runs. Decode steps (T == 1) take the fused kernels unless kDense; prefill chunks
// (T > 1) always take the dense path, with the SIMD dot/axpy/exp unless kDense or kScalar.
enum class Kernel : int32_t {
  kAuto = 0,    // the fastest fused kernel this CPU has
  kDense = 1,   // dequantize rows into fp32 blocks: the simple path, used as the in-tree reference
  kScalar = 2,  // fused, portable C++
  kSimd = 3,    // fused AVX2+FMA+F16C (x86-64) or NEON (aarch64); an error where neither exists
};

struct AttentionConfig {
  int32_t k_bits = 2, v_bits = 2, cluster_dim = 64;
  int64_t sink = 64, recent = 256;  // S and W of the format
  float k_clip = 1.0f, v_clip = 1.0f;
  float scaling = 0.0f;  // score multiplier, usually head_dim^-0.5
  // Decode splits the body of every KV head into slices run in parallel, prefill runs KV heads in
  // parallel. 0: the adapter's runtime pool when it gives one (AttentionArgs::parallel_for), else one
  // thread per core from the core's persistent workers (fewer for small calls); N: at most N threads.
  int32_t threads = 1;
  Kernel kernel = Kernel::kAuto;
  int32_t k_rounding = 0;  // 0: K codes to the nearest level; 1: with error feedback (AttentionArgs::k_feedback)
  ScaleDtype scale_dtype = ScaleDtype::kFloat16;  // of both kinds' body scales and zeros
  // 0: uniform, the levels must be 0 .. 2^bits-1; 1: Lloyd-Max, any ascending levels in [0, 2^bits-1].
  int32_t codebook = 1;
};

// Tensor sizes of one layer's op call. Capacities are those of a cache of
// max_context = sink_cap + recent_cap + body_cap tokens (format.md section 5).
struct AttentionDims {
  int64_t q_heads = 0, kv_heads = 0, tokens = 0, head_dim = 0;
  int64_t sink_cap = 0, recent_cap = 0, body_cap = 0;
};

// One kind's (K or V) cache of one layer, C-contiguous, fp16 stored as uint16 bits:
// sink [Hkv, sink_cap, D], recent [Hkv, recent_cap, D], codes [Hkv, body_cap, D*bits/8],
// scale and zero [Hkv, body_cap, D/cluster_dim] in config.scale_dtype (uint16 or uint8 elements),
// levels [2^bits] fp32.
struct KindCache {
  uint16_t* sink = nullptr;
  uint16_t* recent = nullptr;
  uint8_t* codes = nullptr;
  void* scale = nullptr;
  void* zero = nullptr;
  const float* levels = nullptr;
};

struct AttentionArgs {
  AttentionConfig config;
  AttentionDims dims;
  const float* q = nullptr;         // [Hq, T, D], already rotated
  const uint16_t* k_new = nullptr;  // [Hkv, T, D] fp16, rotated
  const uint16_t* v_new = nullptr;
  KindCache k, v;
  const float* k_feedback = nullptr;  // [Hkv, D, D] fp32 with config.k_rounding 1 (format.md section 3, step 5)
  int64_t length = 0;  // tokens cached before this chunk
  float* out = nullptr;  // [Hq, T, D] fp32, rotated (V) space
  // The runtime's own thread pool, used when config.threads == 0: runs fn(data, i) for every
  // i < items and returns when all are done (ONNX Runtime: KernelContext_ParallelFor).
  void (*parallel_for)(void* pool, void (*fn)(void*, size_t), size_t items, void* data) = nullptr;
  void* pool = nullptr;
  // With config.threads == 0, the most threads the call uses: how many parallel_for runs on, or without
  // it a cap on the core's workers that the host sets (0: unknown or none, taken as one per core).
  int32_t pool_threads = 0;
};

// The fused kernel set that Kernel::kSimd (and kAuto) runs on this CPU: "avx512", "avx2", "neon" or
// "neon+dotprod"; empty where there is none (kSimd is then an error, kAuto runs the scalar set). The
// environment variable OSCAR_SIMD, read once, picks another set the CPU runs by name (to compare two
// on one machine); naming one it does not run makes every call fail, saying which it runs.
const char* simd_kernel_name();
// The fused kernel sets this CPU runs, fastest first, comma-separated ("avx512,avx2").
std::string simd_kernel_sets();

// Element counts of the op's buffers, in the ONNX op's input order, then `out`.
// Adapters compare what they were given against these before calling oscar_attention.
constexpr int kNumBuffers = 17;
extern const char* const kBufferNames[kNumBuffers];  // "q", "k_new", ..., "v_levels", "k_feedback", "out"
struct BufferShape {
  int rank;
  int64_t dim[3];
  int64_t count() const;
};
// Fails (naming the field) when the config or the dims are invalid.
Status buffer_shapes(const AttentionConfig& config, const AttentionDims& dims, BufferShape shapes[kNumBuffers]);

// Reference attention of a chunk at positions length .. length+T-1 over the cache before it
// plus the chunk itself (causal, grouped-query), then appends the chunk in place by the
// placement rule. Validates config, dims, length, levels and input values first.
Status oscar_attention(const AttentionArgs& args);

}  // namespace oscar

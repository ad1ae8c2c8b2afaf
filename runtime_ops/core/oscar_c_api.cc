// extern "C" wrappers over oscar_core: element counts checked against the expected shapes.
#include "oscar_c_api.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "oscar_core.h"

namespace {

int report(const oscar::Status& st, char* err, size_t err_len) {
  if (st.ok()) return 0;
  if (err && err_len) {
    const size_t n = std::min(st.error.size(), err_len - 1);
    std::memcpy(err, st.error.data(), n);
    err[n] = '\0';
  }
  return -1;
}

oscar::Status count_mismatch(const char* name, int64_t got, int64_t want) {
  return {std::string(name) + " has " + std::to_string(got) + " elements: expected " + std::to_string(want)};
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int oscar_quantize_pack(
    const float* x, int64_t rows, int64_t head_dim, int32_t bits, int32_t cluster_dim, float clip,
    const float* levels, const float* feedback, int64_t feedback_count, uint8_t* codes, int64_t codes_count,
    void* scale, void* zero, int64_t scale_count, int32_t scale_dtype, char* err, size_t err_len) {
  // Counts are compared once the sizes are computable; quantize_pack reports any other bad argument.
  int64_t want_codes, want_scale;
  if (bits >= 2 && bits <= 4 && cluster_dim > 0 && head_dim > 0 && rows >= 0 && head_dim % cluster_dim == 0 &&
      !__builtin_mul_overflow(rows, head_dim * bits / 8, &want_codes) &&
      !__builtin_mul_overflow(rows, head_dim / cluster_dim, &want_scale)) {
    if (codes_count != want_codes) return report(count_mismatch("codes", codes_count, want_codes), err, err_len);
    if (scale_count != want_scale) return report(count_mismatch("scale", scale_count, want_scale), err, err_len);
  }
  if (feedback && head_dim > 0 && head_dim < (int64_t(1) << 31) && feedback_count != head_dim * head_dim)
    return report(count_mismatch("feedback", feedback_count, head_dim * head_dim), err, err_len);
  return report(oscar::quantize_pack(x, rows, head_dim, bits, cluster_dim, clip, levels, codes, scale, zero, feedback,
                                     oscar::ScaleDtype(scale_dtype)),
                err, err_len);
}

extern "C" __attribute__((visibility("default"))) int oscar_attention(const OscarAttentionConfig* config,
                                                                      const int64_t dims[7], void* const buffers[17],
                                                                      const int64_t counts[17], int64_t length,
                                                                      char* err, size_t err_len) {
  if (!config || !dims || !buffers || !counts) return report({"oscar_attention: null argument"}, err, err_len);
  oscar::AttentionArgs a;
  a.config = {config->k_bits, config->v_bits, config->cluster_dim, config->sink,    config->recent,
              config->k_clip, config->v_clip, config->scaling,     config->threads, oscar::Kernel(config->kernel),
              config->k_rounding, oscar::ScaleDtype(config->scale_dtype)};
  a.dims = {dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6]};
  oscar::BufferShape shapes[oscar::kNumBuffers];
  if (oscar::Status st = oscar::buffer_shapes(a.config, a.dims, shapes); !st.ok()) return report(st, err, err_len);
  for (int i = 0; i < oscar::kNumBuffers; ++i)
    if (counts[i] != shapes[i].count())
      return report(count_mismatch(oscar::kBufferNames[i], counts[i], shapes[i].count()), err, err_len);
  auto f16 = [&](int i) { return static_cast<uint16_t*>(buffers[i]); };
  a.q = static_cast<const float*>(buffers[0]);
  a.k_new = f16(1), a.v_new = f16(2);
  a.k = {f16(3), f16(5), static_cast<uint8_t*>(buffers[7]), buffers[8], buffers[9], static_cast<const float*>(buffers[13])};
  a.v = {f16(4), f16(6), static_cast<uint8_t*>(buffers[10]), buffers[11], buffers[12], static_cast<const float*>(buffers[14])};
  a.k_feedback = static_cast<const float*>(buffers[15]);
  a.length = length;
  a.out = static_cast<float*>(buffers[16]);
  return report(oscar::oscar_attention(a), err, err_len);
}

extern "C" __attribute__((visibility("default"))) const char* oscar_simd_kernel_name(void) {
  return oscar::simd_kernel_name();
}

extern "C" __attribute__((visibility("default"))) const char* oscar_simd_kernel_sets(void) {
  static const std::string sets = oscar::simd_kernel_sets();  // the CPU does not change under a process
  return sets.c_str();
}

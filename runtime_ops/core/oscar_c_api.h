/* C ABI of the OSCAR-KV core, for ctypes tests and plain-C hosts. Every function returns 0 on
 * success, or -1 after writing a NUL-terminated message (truncated to err_len) into err;
 * nothing is written to any other buffer when it fails. fp16 data travel as uint16 bits. */
#ifndef OSCAR_C_API_H
#define OSCAR_C_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* rows x head_dim fp32 -> codes [rows, head_dim*bits/8], scale and zero [rows, head_dim/cluster_dim]
 * in scale_dtype (0: fp16 as uint16 bits, 1: fp8 E4M3 as uint8 bits). levels: 2^bits ascending code-unit levels, or NULL for uniform. feedback: error-feedback
 * weights [head_dim, head_dim] (format.md section 3, step 5), or NULL for nearest rounding. The *_count
 * arguments are the element counts of the buffers, checked before anything is written. */
int oscar_quantize_pack(const float* x, int64_t rows, int64_t head_dim, int32_t bits, int32_t cluster_dim,
                        float clip, const float* levels, const float* feedback, int64_t feedback_count,
                        uint8_t* codes, int64_t codes_count, void* scale, void* zero, int64_t scale_count,
                        int32_t scale_dtype, char* err, size_t err_len);

typedef struct {
  int32_t k_bits, v_bits, cluster_dim;
  int64_t sink, recent;
  float k_clip, v_clip, scaling;
  int32_t threads; /* 0 = one per core */
  int32_t kernel;  /* 0 auto, 1 dense, 2 scalar, 3 simd (decode steps only) */
  int32_t k_rounding; /* 0 nearest, 1 error feedback with the k_feedback buffer */
  int32_t scale_dtype; /* of the body scales and zeros: 0 fp16 (uint16 elements), 1 fp8 E4M3 (uint8 elements) */
} OscarAttentionConfig;

/* dims: q_heads, kv_heads, tokens, head_dim, sink_cap, recent_cap, body_cap.
 * buffers / counts: the 17 buffers in the ONNX op's input order (q, k_new, v_new, k_sink,
 * v_sink, k_recent, v_recent, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_levels,
 * v_levels, k_feedback: [kv_heads, head_dim, head_dim] with k_rounding 1, else 0 elements) then out,
 * with their element counts. The cache buffers are updated in place. */
int oscar_attention(const OscarAttentionConfig* config, const int64_t dims[7], void* const buffers[17],
                    const int64_t counts[17], int64_t length, char* err, size_t err_len);

/* The fused kernel set decode steps run on this CPU ("avx512", "avx2", "neon", "neon+dotprod"; "" for none,
 * or when OSCAR_SIMD names a set this CPU does not run), and every set it runs, fastest first ("avx512,avx2"). */
const char* oscar_simd_kernel_name(void);
const char* oscar_simd_kernel_sets(void);

#ifdef __cplusplus
}
#endif

#endif

// ExecuTorch kernel for oscar::attention.out, the one attention op per layer of an exported
// model (oscar_export/ops/attention.py defines its schema; docs/android.md describes its use).
// A thin adapter over the shared C++ core: it checks dtypes, ranks and shapes against
// oscar::buffer_shapes, hands raw pointers to oscar::oscar_attention, and reports failures
// through the kernel context (never an abort). The cache tensors are the program's mutable
// buffers: the op appends the chunk to them in place.
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/platform/log.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "../core/oscar_core.h"

namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

// The last failure's message on this thread: ExecuTorch returns only an error code to the
// host, so hosts (the Python runner, an app's JNI layer) read the reason from here.
thread_local std::string last_error;
// The most core workers a call uses (0: one per core); set by the host, as it sizes ExecuTorch's own pool.
std::atomic<int32_t> max_threads{0};

constexpr int kInputs = oscar::kNumBuffers - 1;  // the buffers before "out"
constexpr ScalarType kInputTypes[kInputs] = {
    ScalarType::Float, ScalarType::Half, ScalarType::Half, ScalarType::Half, ScalarType::Half,
    ScalarType::Half,  ScalarType::Half, ScalarType::Byte, ScalarType::Half, ScalarType::Half,
    ScalarType::Byte,  ScalarType::Half, ScalarType::Half, ScalarType::Float, ScalarType::Float, ScalarType::Float};
// k_scale, k_zero, v_scale, v_zero: Half, or Byte holding fp8 E4M3 bits, as argument scale_dtype says.
bool is_scale(int i) { return i == 8 || i == 9 || i == 11 || i == 12; }

const char* type_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float: return "float32";
    case ScalarType::Half: return "float16";
    case ScalarType::Byte: return "uint8";
    case ScalarType::Long: return "int64";
    default: return "another type";
  }
}

std::string shape_string(const Tensor& t) {
  std::ostringstream o;
  o << "[";
  for (ssize_t i = 0; i < t.dim(); ++i) o << (i ? ", " : "") << t.size(i);
  o << "]";
  return o.str();
}

std::string shape_string(const oscar::BufferShape& s) {
  std::ostringstream o;
  o << "[";
  for (int i = 0; i < s.rank; ++i) o << (i ? ", " : "") << s.dim[i];
  o << "]";
  return o.str();
}

// The reason for the failure, then an empty string: every check below returns through here.
std::string check(const Tensor* in[kInputs], const Tensor& length, Tensor& out, oscar::AttentionArgs& a) {
  for (int i = 0; i < kInputs; ++i) {
    const Tensor& t = *in[i];
    if (!is_scale(i) && t.scalar_type() != kInputTypes[i])
      return std::string("input '") + oscar::kBufferNames[i] + "' has dtype " + type_name(t.scalar_type()) +
             ": expected " + type_name(kInputTypes[i]);
    const bool fp8 = a.config.scale_dtype == oscar::ScaleDtype::kFloat8E4M3;
    if (is_scale(i) && t.scalar_type() != (fp8 ? ScalarType::Byte : ScalarType::Half))
      return std::string("input '") + oscar::kBufferNames[i] + "' has dtype " + type_name(t.scalar_type()) +
             ": expected " + (fp8 ? "uint8 (fp8 E4M3 bits), as argument scale_dtype=1 says"
                                  : "float16, as argument scale_dtype=0 says");
    // An empty region (recent = 0, a cache without a body) carries whatever strides the program gave it.
    if (t.numel() > 0 && !executorch::runtime::tensor_is_contiguous(t))
      return std::string("input '") + oscar::kBufferNames[i] + "' is not contiguous: expected a dense tensor";
  }
  if (length.scalar_type() != ScalarType::Long)
    return std::string("input 'length' has dtype ") + type_name(length.scalar_type()) + ": expected int64";
  if (length.numel() != 1 || length.dim() > 1)
    return "input 'length' has shape " + shape_string(length) + ": expected [1]";
  if (out.scalar_type() != ScalarType::Float)
    return std::string("output 'out' has dtype ") + type_name(out.scalar_type()) + ": expected float32";
  // Sizes come from q, k_new and the three cache regions; every input is then checked against them.
  for (int i : {0, 1, 3, 5, 7})
    if (in[i]->dim() != 3)
      return std::string("input '") + oscar::kBufferNames[i] + "' has shape " + shape_string(*in[i]) +
             ": expected rank 3";
  a.dims = {in[0]->size(0), in[1]->size(0), in[0]->size(1), in[0]->size(2),
            in[3]->size(1), in[5]->size(1), in[7]->size(1)};
  oscar::BufferShape want[oscar::kNumBuffers];
  if (oscar::Status st = oscar::buffer_shapes(a.config, a.dims, want); !st.ok()) return st.error;
  for (int i = 0; i < kInputs; ++i) {
    bool same = in[i]->dim() == want[i].rank;
    for (int d = 0; same && d < want[i].rank; ++d) same = in[i]->size(d) == want[i].dim[d];
    if (!same)
      return std::string("input '") + oscar::kBufferNames[i] + "' has shape " + shape_string(*in[i]) +
             ": expected " + shape_string(want[i]);
  }
  const executorch::aten::SizesType sizes[3] = {
      static_cast<executorch::aten::SizesType>(a.dims.q_heads), static_cast<executorch::aten::SizesType>(a.dims.tokens),
      static_cast<executorch::aten::SizesType>(a.dims.head_dim)};
  if (executorch::runtime::resize_tensor(out, {sizes, 3}) != Error::Ok)
    return "output 'out' cannot be resized to " + shape_string(want[oscar::kNumBuffers - 1]) +
           ": expected a dynamic or matching output";
  return "";
}

Tensor& attention_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k_new, const Tensor& v_new,
                      Tensor& k_sink, Tensor& v_sink, Tensor& k_recent, Tensor& v_recent, Tensor& k_codes,
                      Tensor& k_scale, Tensor& k_zero, Tensor& v_codes, Tensor& v_scale, Tensor& v_zero,
                      const Tensor& k_levels, const Tensor& v_levels, const Tensor& k_feedback,
                      const Tensor& length, int64_t k_bits,
                      int64_t v_bits, int64_t cluster_dim, int64_t sink, int64_t recent, double k_clip, double v_clip,
                      double scaling, int64_t codebook, int64_t k_rounding, int64_t scale_dtype, Tensor& out) {
  const Tensor* in[kInputs] = {&q,       &k_new,   &v_new,  &k_sink,  &v_sink,  &k_recent, &v_recent, &k_codes,
                               &k_scale, &k_zero,  &v_codes, &v_scale, &v_zero, &k_levels, &v_levels,
                               &k_feedback};
  oscar::AttentionArgs a;
  auto narrow = [](int64_t v) { return v < INT32_MIN || v > INT32_MAX ? INT32_MIN : int32_t(v); };
  a.config.k_bits = narrow(k_bits), a.config.v_bits = narrow(v_bits), a.config.cluster_dim = narrow(cluster_dim);
  a.config.sink = sink, a.config.recent = recent;
  a.config.k_clip = float(k_clip), a.config.v_clip = float(v_clip), a.config.scaling = float(scaling);
  // The format's named choices come from the arguments; check() holds the buffers to them.
  a.config.codebook = narrow(codebook), a.config.k_rounding = narrow(k_rounding);
  a.config.scale_dtype = static_cast<oscar::ScaleDtype>(narrow(scale_dtype));
  a.config.threads = 0;  // for calls big enough to pay for a thread start: one per core, or the host's cap
  a.pool_threads = max_threads.load(std::memory_order_relaxed);
  std::string error = check(in, length, out, a);
  if (error.empty()) {
    auto raw = [](const Tensor& t) { return const_cast<void*>(t.const_data_ptr()); };
    auto f16 = [&](const Tensor& t) { return static_cast<uint16_t*>(raw(t)); };
    a.q = q.const_data_ptr<float>();
    a.k_new = f16(k_new), a.v_new = f16(v_new);
    a.k = {f16(k_sink), f16(k_recent), k_codes.mutable_data_ptr<uint8_t>(), raw(k_scale), raw(k_zero),
           k_levels.const_data_ptr<float>()};
    a.v = {f16(v_sink), f16(v_recent), v_codes.mutable_data_ptr<uint8_t>(), raw(v_scale), raw(v_zero),
           v_levels.const_data_ptr<float>()};
    a.k_feedback = k_feedback.const_data_ptr<float>();
    a.length = length.const_data_ptr<int64_t>()[0];
    a.out = out.mutable_data_ptr<float>();
    error = oscar::oscar_attention(a).error;
  }
  last_error = error;
  if (!error.empty()) {
    ET_LOG(Error, "oscar::attention: %s", error.c_str());
    ctx.fail(Error::InvalidArgument);
  }
  return out;
}

}  // namespace

EXECUTORCH_LIBRARY(oscar, "attention.out", attention_out);

// Caps the threads of every later oscar::attention call at n (0: one per core, the default). A host
// that sizes ExecuTorch's thread pool calls this with the same count, so the kernel does not use more.
extern "C" __attribute__((visibility("default"))) void oscar_executorch_set_threads(int32_t n) {
  max_threads.store(n > 0 ? n : 0, std::memory_order_relaxed);
}

// The message of this thread's last oscar::attention call ("" after a success).
extern "C" __attribute__((visibility("default"))) const char* oscar_executorch_last_error() {
  return last_error.c_str();
}

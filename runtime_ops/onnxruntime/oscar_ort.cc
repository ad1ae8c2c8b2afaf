// ONNX Runtime custom op library: op OscarAttention in domain "oscar" (version 1), the one
// attention op per layer for prefill chunks and decode steps. docs/onnx_ops.md describes it.
//
// The cache inputs (k_sink ... v_zero) are UPDATED IN PLACE: the op appends the chunk to the
// buffers it was given. The host keeps one set of persistent cache OrtValues per layer and binds
// them as graph inputs on every run (IOBinding or Run with the same OrtValues), so nothing is
// copied per step. ONNX has no notion of a mutated input, so the graph must feed these tensors
// straight from graph inputs (not initializers or computed values) and no other node may read
// them in the same run.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/oscar_core.h"

namespace {

constexpr int kInputs = 17;  // the 16 buffers of oscar::kBufferNames before "out", then length
constexpr ONNXTensorElementDataType kF32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT,
                                    kF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
                                    kU8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8,
                                    kI64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
constexpr ONNXTensorElementDataType kInputTypes[kInputs] = {kF32, kF16, kF16, kF16, kF16, kF16, kF16, kU8,  kF16,
                                                            kF16, kU8,  kF16, kF16, kF32, kF32, kF32, kI64};
constexpr int kFeedback = 15, kLength = 16;
// k_scale, k_zero, v_scale, v_zero: float16, or uint8 holding fp8 E4M3 bits, as attribute scale_dtype says.
// Declared as any type, so the op checks them itself. k_feedback's shape follows attribute k_rounding.
constexpr int kScales[4] = {8, 9, 11, 12};

bool is_scale(size_t i) { return i == 8 || i == 9 || i == 11 || i == 12; }

const char* type_name(ONNXTensorElementDataType t) {
  switch (t) {
    case kF32: return "float32";
    case kF16: return "float16";
    case kU8: return "uint8";
    case kI64: return "int64";
    default: return "another type";
  }
}

std::string shape_string(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

OrtStatusPtr error(const std::string& message) {
  return Ort::Status(("OscarAttention: " + message).c_str(), ORT_INVALID_ARGUMENT).release();
}

// An attribute, or nullopt when the node does not set it.
template <typename T>
std::optional<T> attribute(const OrtApi& api, const OrtKernelInfo* info, const char* name) {
  T value{};
  OrtStatus* st;
  if constexpr (std::is_same_v<T, float>) {
    st = api.KernelInfoGetAttribute_float(info, name, &value);
  } else {
    st = api.KernelInfoGetAttribute_int64(info, name, &value);
  }
  if (st) {
    api.ReleaseStatus(st);
    return std::nullopt;
  }
  return value;
}

// The core's work items on ONNX Runtime's intra-op pool: the session's threads, no others beside them.
void ort_parallel_for(void* context, void (*fn)(void*, size_t), size_t items, void* data) {
  static_cast<Ort::KernelContext*>(context)->ParallelFor(fn, items, 0, data);
}

struct Kernel {
  oscar::AttentionConfig config;
  std::optional<float> scaling;  // default: head_dim^-0.5

  OrtStatusPtr ComputeV2(OrtKernelContext* context) const {
    try {
      return compute(Ort::KernelContext(context));
    } catch (const std::exception& e) {
      return error(e.what());
    }
  }

  OrtStatusPtr compute(Ort::KernelContext ctx) const {
    if (ctx.GetInputCount() != kInputs)
      return error("got " + std::to_string(ctx.GetInputCount()) + " inputs: expected " + std::to_string(kInputs));
    std::vector<Ort::ConstValue> in;
    std::vector<std::vector<int64_t>> shapes;
    for (int i = 0; i < kInputs; ++i) {
      const char* name = i < kInputs - 1 ? oscar::kBufferNames[i] : "length";
      in.push_back(ctx.GetInput(i));
      if (!in.back() || !in.back().IsTensor()) return error(std::string("input '") + name + "' is missing or not a tensor");
      const auto info = in.back().GetTensorTypeAndShapeInfo();
      // onnxruntime enforces the declared types first; checked again because a narrower
      // element type than expected would let the core read past the buffer.
      if (!is_scale(i) && info.GetElementType() != kInputTypes[i])
        return error(std::string("input '") + name + "' has dtype " + type_name(info.GetElementType()) + ": expected " +
                     type_name(kInputTypes[i]));
      shapes.push_back(info.GetShape());
    }
    const bool fp8 = config.scale_dtype == oscar::ScaleDtype::kFloat8E4M3;
    for (int i : kScales) {
      const ONNXTensorElementDataType t = in[i].GetTensorTypeAndShapeInfo().GetElementType();
      if (t != (fp8 ? kU8 : kF16))
        return error(std::string("input '") + oscar::kBufferNames[i] + "' has dtype " + type_name(t) + ": expected " +
                     (fp8 ? "uint8 (fp8 E4M3 bits), as attribute scale_dtype=1 says"
                          : "float16, as attribute scale_dtype=0 says"));
    }
    if (shapes[kLength].size() > 1 || in[kLength].GetTensorTypeAndShapeInfo().GetElementCount() != 1)
      return error("input 'length' has shape " + shape_string(shapes[kLength]) + ": expected [1]");
    // Sizes come from q, k_new and the three cache regions; every input is then checked against them.
    for (int i : {0, 1, 3, 5, 7})
      if (shapes[i].size() != 3)
        return error(std::string("input '") + oscar::kBufferNames[i] + "' has shape " + shape_string(shapes[i]) +
                     ": expected rank 3");
    oscar::AttentionArgs a;
    a.config = config;
    a.dims = {shapes[0][0], shapes[1][0], shapes[0][1], shapes[0][2], shapes[3][1], shapes[5][1], shapes[7][1]};
    a.config.scaling = scaling ? *scaling : 1.0f / std::sqrt(float(a.dims.head_dim > 0 ? a.dims.head_dim : 1));
    oscar::BufferShape want[oscar::kNumBuffers];
    if (oscar::Status st = oscar::buffer_shapes(a.config, a.dims, want); !st.ok()) return error(st.error);
    for (int i = 0; i < kInputs - 1; ++i) {
      const std::vector<int64_t> expected(want[i].dim, want[i].dim + want[i].rank);
      if (shapes[i] != expected)
        return error(std::string("input '") + oscar::kBufferNames[i] + "' has shape " + shape_string(shapes[i]) +
                     ": expected " + shape_string(expected));
    }
    // The cache buffers are written in place (see the top of this file).
    auto raw = [&](int i) { return const_cast<void*>(in[i].GetTensorRawData()); };
    auto f16 = [&](int i) { return static_cast<uint16_t*>(raw(i)); };
    a.q = in[0].GetTensorData<float>();
    a.k_new = f16(1), a.v_new = f16(2);
    a.k = {f16(3), f16(5), static_cast<uint8_t*>(raw(7)), raw(8), raw(9), in[13].GetTensorData<float>()};
    a.v = {f16(4), f16(6), static_cast<uint8_t*>(raw(10)), raw(11), raw(12), in[14].GetTensorData<float>()};
    a.k_feedback = in[kFeedback].GetTensorData<float>();
    a.length = in[kLength].GetTensorData<int64_t>()[0];
    a.out = ctx.GetOutput(0, {a.dims.q_heads, a.dims.tokens, a.dims.head_dim}).GetTensorMutableData<float>();
    a.parallel_for = ort_parallel_for, a.pool = &ctx;
    if (oscar::Status st = oscar::oscar_attention(a); !st.ok()) return error(st.error);
    return nullptr;
  }
};

struct Op : Ort::CustomOpBase<Op, Kernel, true> {
  const char* GetName() const { return "OscarAttention"; }
  size_t GetInputTypeCount() const { return kInputs; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return is_scale(i) ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : kInputTypes[i];
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return kF32; }

  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const {
    auto k = std::make_unique<Kernel>();
    struct IntAttr { const char* name; bool required; int64_t fallback, min, max; } ints[] = {
        {"k_bits", true, 0, 2, 4},      {"v_bits", true, 0, 2, 4},
        {"cluster_dim", true, 0, 32, 128}, {"sink", true, 0, 0, std::numeric_limits<int32_t>::max()},
        {"recent", true, 0, 0, std::numeric_limits<int32_t>::max()},
        {"threads", false, 0, 0, 1024},   {"codebook", true, 0, 0, 1},
        {"k_rounding", true, 0, 0, 1},    {"scale_dtype", true, 0, 0, 1}};
    constexpr int kInts = sizeof(ints) / sizeof(ints[0]);
    int64_t v[kInts];
    for (int i = 0; i < kInts; ++i) {
      const std::optional<int64_t> got = attribute<int64_t>(api, info, ints[i].name);
      if (!got && ints[i].required)
        return error(std::string("attribute '") + ints[i].name + "' is missing: expected an int");
      v[i] = got.value_or(ints[i].fallback);
      if (v[i] < ints[i].min || v[i] > ints[i].max)
        return error(std::string("attribute ") + ints[i].name + "=" + std::to_string(v[i]) + ": expected " +
                     std::to_string(ints[i].min) + " .. " + std::to_string(ints[i].max));
    }
    k->config.k_bits = int32_t(v[0]), k->config.v_bits = int32_t(v[1]), k->config.cluster_dim = int32_t(v[2]);
    k->config.sink = v[3], k->config.recent = v[4], k->config.threads = int32_t(v[5]);
    // The format's named choices come from the attributes; compute checks the buffers against them.
    k->config.codebook = int32_t(v[6]), k->config.k_rounding = int32_t(v[7]);
    k->config.scale_dtype = v[8] ? oscar::ScaleDtype::kFloat8E4M3 : oscar::ScaleDtype::kFloat16;
    k->config.k_clip = attribute<float>(api, info, "k_clip").value_or(1.0f);
    k->config.v_clip = attribute<float>(api, info, "v_clip").value_or(1.0f);
    k->scaling = attribute<float>(api, info, "scaling");
    // Config errors (cluster_dim 48, clip 0.3) surface at session creation, not at the first run.
    oscar::AttentionDims probe{1, 1, 1, k->config.cluster_dim, 0, 0, 0};
    oscar::AttentionConfig check = k->config;
    check.scaling = k->scaling.value_or(1.0f);
    oscar::BufferShape shapes[oscar::kNumBuffers];
    if (oscar::Status st = oscar::buffer_shapes(check, probe, shapes); !st.ok()) return error(st.error);
    *kernel = k.release();
    return nullptr;
  }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  // The op and its domain must outlive every session that uses them: keep them for the process.
  static const Op op;
  static std::vector<Ort::CustomOpDomain> domains;
  static std::mutex mutex;
  try {
    Ort::CustomOpDomain domain{"oscar"};
    domain.Add(&op);
    Ort::UnownedSessionOptions(options).Add(domain);
    const std::lock_guard<std::mutex> lock(mutex);
    domains.push_back(std::move(domain));
  } catch (const std::exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}

// Test hook for the ExecuTorch adapter: calls the kernel registered as oscar::attention.out
// (looked up in ExecuTorch's operator registry, as a loaded program would) on caller-owned
// buffers, so tests/runtime_ops/test_et_ops.py can replay golden and random cases without exporting a
// program per case. Not part of what an app links.
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/kernel/kernel_runtime_context.h>
#include <executorch/runtime/kernel/operator_registry.h>
#include <executorch/runtime/platform/runtime.h>

#include <cstdint>
#include <cstring>
#include <vector>

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::aten::TensorImpl;
using executorch::runtime::EValue;

namespace {
constexpr int kTensors = 18;  // q .. v_levels, k_feedback, length, out
constexpr int kAttrs = 11;  // k_bits, v_bits, cluster_dim, sink, recent, k_clip, v_clip, scaling, codebook,
                             // k_rounding, scale_dtype
}  // namespace

// tensors: kTensors data pointers; dtypes: ScalarType codes; ranks and dims (3 per tensor).
// int_attrs: k_bits, v_bits, cluster_dim, sink, recent, codebook, k_rounding, scale_dtype; float_attrs: k_clip,
// v_clip, scaling.
// Returns 0, the ExecuTorch error code the kernel set, or -1 when the op is not registered.
extern "C" __attribute__((visibility("default"))) int oscar_et_invoke(void* const* tensors, const int32_t* dtypes,
                                                                       const int32_t* ranks, const int64_t* dims,
                                                                       const int64_t* int_attrs,
                                                                       const double* float_attrs) {
  executorch::runtime::runtime_init();
  auto op = executorch::runtime::get_op_function_from_registry("oscar::attention.out");
  if (!op.ok()) return -1;
  SizesType sizes[kTensors][3];
  uint8_t dim_order[kTensors][3];
  SizesType strides[kTensors][3];
  std::vector<TensorImpl> impls;
  impls.reserve(kTensors);
  std::vector<EValue> values;
  values.reserve(kTensors + kAttrs);
  for (int i = 0; i < kTensors; ++i) {
    const int rank = ranks[i];
    SizesType stride = 1;
    for (int d = rank - 1; d >= 0; --d) {
      sizes[i][d] = SizesType(dims[3 * i + d]);
      dim_order[i][d] = uint8_t(d);
      strides[i][d] = stride;
      // Empty dims count as 1, as torch and the program emitter lay them out (empty cache regions).
      stride *= sizes[i][d] > 0 ? sizes[i][d] : 1;
    }
    // `out` is resized by the kernel: its capacity is what the caller allocated.
    impls.emplace_back(ScalarType(dtypes[i]), rank, sizes[i], tensors[i], dim_order[i], strides[i],
                       i == kTensors - 1 ? executorch::aten::TensorShapeDynamism::DYNAMIC_BOUND
                                         : executorch::aten::TensorShapeDynamism::STATIC);
  }
  // Schema order: q, k_new, v_new, ten cache buffers, k_levels, v_levels, k_feedback, length, attributes, out.
  for (int i = 0; i < kTensors - 1; ++i) values.emplace_back(Tensor(&impls[i]));
  for (int i = 0; i < 5; ++i) values.emplace_back(int_attrs[i]);
  for (int i = 0; i < 3; ++i) values.emplace_back(float_attrs[i]);
  for (int i = 5; i < 8; ++i) values.emplace_back(int_attrs[i]);
  values.emplace_back(Tensor(&impls[kTensors - 1]));
  std::vector<EValue*> stack;
  for (EValue& v : values) stack.push_back(&v);
  executorch::runtime::KernelRuntimeContext ctx;
  op.get()(ctx, {stack.data(), stack.size()});
  return int(ctx.failure_state());
}

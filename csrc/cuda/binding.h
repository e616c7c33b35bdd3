// Host-side helpers shared by the CUDA bindings (torch headers allowed here,
// never in the .cu files).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "cuda/stats.cuh"

namespace effilayers {

inline cuda::DType kernel_dtype(at::ScalarType type, const char* op) {
  switch (type) {
    case at::kHalf:
      return cuda::DType::Half;
    case at::kBFloat16:
      return cuda::DType::BFloat16;
    case at::kFloat:
      return cuda::DType::Float;
    case at::kDouble:
      return cuda::DType::Double;
    default:
      TORCH_CHECK_TYPE(false, op, ": unsupported dtype ", type);
  }
}

}  // namespace effilayers

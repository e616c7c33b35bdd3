// Host-side helpers shared by the CUDA bindings (torch headers allowed here,
// never in the .cu files), and what the bindings need of their device: the
// real one through c10/cuda, or, in the test library effilayers_emulated
// (EFFILAYERS_SIMT_EMULATION), the SIMT emulator on CPU tensors
// (emulation/device.h), so the same binding code drives both.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "cuda/stats.cuh"

#if defined(EFFILAYERS_SIMT_EMULATION)
#include "emulation/device.h"
#else
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#define EFFILAYERS_KERNEL_LIBRARY effilayers
#define EFFILAYERS_KERNEL_DISPATCH_KEY CUDA
#define EFFILAYERS_KERNEL_CHECK(expr) C10_CUDA_CHECK(expr)

namespace effilayers {

constexpr const char* kKernelDevice = "CUDA";
using KernelDeviceGuard = c10::cuda::CUDAGuard;
inline cudaStream_t kernel_stream() { return c10::cuda::getCurrentCUDAStream(); }

}  // namespace effilayers
#endif

namespace effilayers {

// Whether t lives where the kernels run.
inline bool on_kernel_device(const at::Tensor& t) {
  return t.device().type() == c10::DeviceType::EFFILAYERS_KERNEL_DISPATCH_KEY;
}

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

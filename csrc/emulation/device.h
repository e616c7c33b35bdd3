// What the CUDA bindings (csrc/cuda/*_binding.cpp) need of their device, for
// the emulated build: CPU tensors, the emulator's launches, and the library
// effilayers_emulated. cuda/binding.h includes this instead of c10/cuda
// under EFFILAYERS_SIMT_EMULATION.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <cuda_runtime.h>

#define EFFILAYERS_KERNEL_LIBRARY effilayers_emulated
#define EFFILAYERS_KERNEL_DISPATCH_KEY CPU
#define EFFILAYERS_KERNEL_CHECK(expr) ::effilayers::emulation::check((expr), #expr)

namespace effilayers {

constexpr const char* kKernelDevice = "CPU";

// The emulator has one device and one stream; nothing to select.
struct KernelDeviceGuard {
  explicit KernelDeviceGuard(c10::Device) {}
};

inline cudaStream_t kernel_stream() { return nullptr; }

namespace emulation {

inline void check(cudaError_t error, const char* call) {
  TORCH_CHECK(error == cudaSuccess, call, " failed under the SIMT emulator: ", cudaGetErrorString(error), ": ",
              simt::last_error_detail());
}

}  // namespace emulation
}  // namespace effilayers

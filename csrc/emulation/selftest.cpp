// Toy kernels that test the SIMT emulator itself (tests/test_cuda_emulated.py):
// that it catches a missing __syncthreads, a divergent barrier, misused warp
// collectives and accesses next to a buffer, and that the warp collectives
// give CUDA's results. They
// are written in CUDA, like csrc/cuda/*.cu, and exposed as ops of
// effilayers_emulated on CPU tensors.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include "cuda/launch.cuh"
#include "emulation/device.h"

namespace effilayers {
namespace emulation {
namespace {

constexpr int kToyThreads = 256;

// Each block sums its kToyThreads values through shared memory. Without the
// barrier thread 0 may read slots other threads have not written yet.
template <bool kBarrier>
__global__ void toy_block_sum(const float* values, float* sums) {
  __shared__ float staged[kToyThreads];
  staged[threadIdx.x] = values[blockIdx.x * kToyThreads + threadIdx.x];
  if constexpr (kBarrier) __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int i = 0; i < kToyThreads; ++i) sum += staged[i];
    sums[blockIdx.x] = sum;
  }
}

// Lane t of each warp records what each collective hands it, 8 values per
// thread: shfl_down 3, shfl_up 5, shfl_xor 6, shfl from lane 31 - t, the
// ballot of t % 3 == 0, shfl_down 2 within segments of 8, any(t == 7),
// all(t < 40).
__global__ void toy_warp_collectives(int* out) {
  const int t = static_cast<int>(threadIdx.x), lane = t & 31;
  int* mine = out + 8 * t;
  mine[0] = __shfl_down_sync(0xffffffffu, t, 3);
  mine[1] = __shfl_up_sync(0xffffffffu, t, 5);
  mine[2] = __shfl_xor_sync(0xffffffffu, t, 6);
  mine[3] = __shfl_sync(0xffffffffu, t, 31 - lane);
  mine[4] = static_cast<int>(__ballot_sync(0xffffffffu, t % 3 == 0));
  mine[5] = __shfl_down_sync(0xffffffffu, t, 2, 8);
  mine[6] = __any_sync(0xffffffffu, t == 7);
  mine[7] = __all_sync(0xffffffffu, t < 40);
}

// Half the block waits at a barrier the other half never reaches.
__global__ void toy_divergent_barrier(float* out) {
  if (threadIdx.x < kToyThreads / 2) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

// Warp collectives used wrongly, by `mode`: 0, half the lanes wait at a
// barrier while the others shuffle; 1, a full mask in a block whose last
// warp is partial; 2, even lanes shuffle while odd lanes vote.
__global__ void toy_broken_warp(int mode, int* out) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  int v = static_cast<int>(threadIdx.x);
  if (mode == 0) {
    if (lane < 16) {
      __syncthreads();
    } else {
      v = __shfl_down_sync(0xffffffffu, v, 1);
    }
  } else if (mode == 1) {
    v = __shfl_down_sync(0xffffffffu, v, 1);
  } else if (lane % 2 == 0) {
    v = __shfl_down_sync(0xffffffffu, v, 1);
  } else {
    v = static_cast<int>(__ballot_sync(0xffffffffu, v > 3));
  }
  out[threadIdx.x] = v;
}

// out[i + shift] = in[i] for the n elements of `in` (shift 0 is in bounds).
__global__ void toy_shifted_store(const float* in, float* out, int n, int shift) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i + shift] = in[i];
}

// out[i] = in[i + shift] for the n elements of `out`.
__global__ void toy_shifted_load(const float* in, float* out, int n, int shift) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = in[i + shift];
}

void check_float_vector(const at::Tensor& t, const char* op) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.is_contiguous(), op,
                    ": expected a contiguous 1-D float32 CPU tensor, got ", t.scalar_type(), " ", t.sizes());
}

at::Tensor block_sum(const at::Tensor& values, bool barrier) {
  check_float_vector(values, "simt_toy_block_sum");
  TORCH_CHECK_VALUE(values.numel() % kToyThreads == 0 && values.numel() > 0,
                    "simt_toy_block_sum: values must hold whole blocks of ", kToyThreads, ", got ", values.numel());
  const auto blocks = static_cast<unsigned>(values.numel() / kToyThreads);
  at::Tensor sums = at::empty({blocks}, values.options());
  if (barrier) {
    EFFILAYERS_LAUNCH(blocks, kToyThreads, nullptr, toy_block_sum<true>)(values.const_data_ptr<float>(),
                                                                         sums.mutable_data_ptr<float>());
  } else {
    EFFILAYERS_LAUNCH(blocks, kToyThreads, nullptr, toy_block_sum<false>)(values.const_data_ptr<float>(),
                                                                          sums.mutable_data_ptr<float>());
  }
  check(cudaGetLastError(), "toy_block_sum");
  return sums;
}

at::Tensor warp_collectives(int64_t threads) {
  TORCH_CHECK_VALUE(threads > 0 && threads % 32 == 0 && threads <= 1024,
                    "simt_toy_warp_collectives: threads must be whole warps up to 1024, got ", threads);
  at::Tensor out = at::empty({threads, 8}, at::TensorOptions().dtype(at::kInt));
  EFFILAYERS_LAUNCH(1, static_cast<unsigned>(threads), nullptr, toy_warp_collectives)(out.mutable_data_ptr<int>());
  check(cudaGetLastError(), "toy_warp_collectives");
  return out;
}

void divergent_barrier() {
  at::Tensor out = at::empty({kToyThreads}, at::TensorOptions().dtype(at::kFloat));
  EFFILAYERS_LAUNCH(1, kToyThreads, nullptr, toy_divergent_barrier)(out.mutable_data_ptr<float>());
  check(cudaGetLastError(), "toy_divergent_barrier");
}

void broken_warp(int64_t mode, int64_t threads) {
  TORCH_CHECK_VALUE(mode >= 0 && mode <= 2, "simt_toy_broken_warp: mode must be 0, 1 or 2, got ", mode);
  TORCH_CHECK_VALUE(threads > 0 && threads <= 1024, "simt_toy_broken_warp: threads must be in [1, 1024], got ",
                    threads);
  at::Tensor out = at::empty({threads}, at::TensorOptions().dtype(at::kInt));
  EFFILAYERS_LAUNCH(1, static_cast<unsigned>(threads), nullptr, toy_broken_warp)(static_cast<int>(mode),
                                                                                 out.mutable_data_ptr<int>());
  check(cudaGetLastError(), "toy_broken_warp");
}

// Both ops copy `in` with an index shift; the caller sizes `out` to what the
// shift keeps in bounds (or not).
void shifted_copy(const at::Tensor& in, at::Tensor& out, int64_t shift, bool store) {
  const char* op = store ? "simt_toy_shifted_store" : "simt_toy_shifted_load";
  check_float_vector(in, op);
  check_float_vector(out, op);
  const float* source = in.const_data_ptr<float>();
  float* target = out.mutable_data_ptr<float>();
  if (store) {
    EFFILAYERS_LAUNCH(1, 64, nullptr, toy_shifted_store)(source, target, static_cast<int>(in.numel()),
                                                         static_cast<int>(shift));
  } else {
    EFFILAYERS_LAUNCH(1, 64, nullptr, toy_shifted_load)(source, target, static_cast<int>(out.numel()),
                                                        static_cast<int>(shift));
  }
  check(cudaGetLastError(), store ? "toy_shifted_store" : "toy_shifted_load");
}

void shifted_store(const at::Tensor& in, at::Tensor& out, int64_t shift) { shifted_copy(in, out, shift, true); }

void shifted_load(const at::Tensor& in, at::Tensor& out, int64_t shift) { shifted_copy(in, out, shift, false); }

}  // namespace
}  // namespace emulation
}  // namespace effilayers

namespace effilayers {
namespace emulation {
void register_controls(torch::Library& m);  // control.cpp
}  // namespace emulation
}  // namespace effilayers

TORCH_LIBRARY_FRAGMENT(effilayers_emulated, m) {
  effilayers::emulation::register_controls(m);
  m.def("simt_toy_block_sum(Tensor values, bool barrier) -> Tensor", &effilayers::emulation::block_sum);
  m.def("simt_toy_warp_collectives(int threads) -> Tensor", &effilayers::emulation::warp_collectives);
  m.def("simt_toy_divergent_barrier() -> ()", &effilayers::emulation::divergent_barrier);
  m.def("simt_toy_broken_warp(int mode, int threads) -> ()", &effilayers::emulation::broken_warp);
  m.def("simt_toy_shifted_store(Tensor input, Tensor(a!) out, int shift) -> ()",
        &effilayers::emulation::shifted_store);
  m.def("simt_toy_shifted_load(Tensor input, Tensor(a!) out, int shift) -> ()", &effilayers::emulation::shifted_load);
}

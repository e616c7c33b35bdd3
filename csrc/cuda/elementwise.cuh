// Device-side loads and stores between tensor dtypes and the accumulation
// type, and the dtype dispatch, shared by the CUDA kernels. CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "stats.cuh"

namespace effilayers {
namespace cuda {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t load(const scalar_t* p) {
  return static_cast<acc_t>(*p);
}
template <>
__device__ __forceinline__ float load<__half, float>(const __half* p) {
  return __half2float(*p);
}
template <>
__device__ __forceinline__ float load<__nv_bfloat16, float>(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}

// Round to nearest even, as Tensor.to(dtype) does.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ scalar_t to_scalar(acc_t v) {
  return static_cast<scalar_t>(v);
}
template <>
__device__ __forceinline__ __half to_scalar<__half, float>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 to_scalar<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}

// N consecutive elements moved as one access. The vector paths take
// N = Vec<scalar_t>::kSize (the default): 16 bytes as one 128-bit global
// access through uint4, whatever scalar_t is, so the pointer must be
// 16-byte aligned. The scalar fallbacks take N = 1, one element per access:
// one kernel template serves both, and per element they do the same
// operations in the same order.
template <typename scalar_t, int N = 16 / static_cast<int>(sizeof(scalar_t))>
struct alignas(sizeof(scalar_t) * N) Vec {
  static constexpr int kSize = N;
  scalar_t v[N];
};

template <int N, typename scalar_t>
__device__ __forceinline__ Vec<scalar_t, N> load_vec(const scalar_t* p) {
  Vec<scalar_t, N> r;
  if constexpr (sizeof(r) == 16) {
    *reinterpret_cast<uint4*>(&r) = *reinterpret_cast<const uint4*>(p);
  } else {
    static_assert(N == 1, "vectors are 16 bytes or one element");
    r.v[0] = *p;
  }
  return r;
}

template <int N, typename scalar_t>
__device__ __forceinline__ void store_vec(scalar_t* p, const Vec<scalar_t, N>& r) {
  if constexpr (sizeof(r) == 16) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&r);
  } else {
    static_assert(N == 1, "vectors are 16 bytes or one element");
    *p = r.v[0];
  }
}

// Whether every tensor (null: absent) is 16-byte aligned, the first
// condition of a vector path.
inline bool aligned_16(std::initializer_list<const void*> tensors) {
  for (const void* t : tensors) {
    if (reinterpret_cast<uintptr_t>(t) % 16 != 0) return false;
  }
  return true;
}

// f(std::integral_constant<int, N>{}) with N = Vec<scalar_t>::kSize when
// `vector`, else N = 1: the launch of a kernel templated on its width.
template <typename scalar_t, typename F>
cudaError_t with_width(bool vector, F&& f) {
  if (vector) return f(std::integral_constant<int, Vec<scalar_t>::kSize>{});
  return f(std::integral_constant<int, 1>{});
}

template <typename scalar_type, typename acc_type>
struct Types {
  using scalar_t = scalar_type;  // of the full-size tensors
  using acc_t = acc_type;        // float, or double for double tensors
};

// f(Types<scalar_t, acc_t>{}) for a tensor dtype.
template <typename F>
cudaError_t with_types(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Half:
      return f(Types<__half, float>{});
    case DType::BFloat16:
      return f(Types<__nv_bfloat16, float>{});
    case DType::Float:
      return f(Types<float, float>{});
    case DType::Double:
      return f(Types<double, double>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace effilayers

// A SIMT emulator for the CUDA kernels in csrc/cuda: the same kernel bodies
// compile with a host C++ compiler and run on the CPU, for tests. Built only
// into the test library effilayers_emulated (EFFILAYERS_SIMT_EMULATION); the
// shims in emulation/include/ (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h)
// include this header in place of the CUDA toolkit's.
//
// The model (ARCHITECTURE.md says what it leaves out):
//   * the blocks of a grid run one after another, in an order shuffled by
//     the seed; each thread of a block is a fiber with its own stack;
//   * fibers switch only at __syncthreads() and at warp collectives
//     (__shfl*_sync, __ballot_sync, __syncwarp, ...). Between those points
//     the runnable fibers run in a seeded random order, so a missing barrier
//     shows up as a wrong result for some seeds;
//   * a warp collective completes when every lane its mask names has
//     arrived at it with the same mask; a lane waiting for a lane that sits
//     at a __syncthreads or has exited is reported as a deadlock, and so is a
//     __syncthreads that not every thread of the block reaches;
//   * __shared__ variables are static thread_local: a block's fibers all run
//     on one OS thread and one block runs at a time on it, so that is one
//     copy per block;
//   * debug mode (set_debug) backs every CPU tensor with guard
//     pages (simt.cpp); an access next to a buffer fails the launch.
//     Debug mode, seed and multiprocessor count are process-wide settings.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- the language ---------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static thread_local
// __restrict__ is a GCC/Clang keyword already.

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

// The built-in index variables: set by the scheduler for the fiber it is
// about to resume (threadIdx) and for the block it runs (the others).
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ---- runtime API ------------------------------------------------------------------

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;
typedef struct CUstream_st* cudaStream_t;

enum cudaDeviceAttr : int {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
};

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
const char* cudaGetErrorName(cudaError_t error);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device);
cudaError_t cudaMemsetAsync(void* destination, int value, size_t bytes, cudaStream_t stream = nullptr);
// One address space: every kind is a host memcpy.
enum cudaMemcpyKind : int {
  cudaMemcpyHostToHost,
  cudaMemcpyHostToDevice,
  cudaMemcpyDeviceToHost,
  cudaMemcpyDeviceToDevice,
  cudaMemcpyDefault,
};
cudaError_t cudaMemcpyAsync(void* destination, const void* source, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaDeviceSynchronize();

namespace simt {

// A float's bits and back (what the half/bfloat16 stand-ins convert through).
inline uint32_t float_bits(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  return word;
}

inline float bits_float(uint32_t word) {
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

// ---- configuration and reports ----------------------------------------------

// Thread and block order.
void set_seed(uint64_t seed);
// What cudaDevAttrMultiProcessorCount reports: sizes grid-stride launches.
void set_multiprocessors(int count);
// Debug mode: the guard pages and sentinels are checked after every launch.
// The buffers come from guarded_alloc, which emulation/control.cpp makes
// torch's CPU allocator while the mode is on.
void set_debug(bool on);

// Launches per kernel since the last reset: lines "name<TAB>instantiation<TAB>count".
const char* launch_log();
void reset_launch_log();
// The detail of the last failed launch (what cudaGetErrorString cannot say).
const char* last_error_detail();

// Debug-mode buffers: `bytes` readable and writable bytes that end flush
// against an inaccessible page, with another before them (the bytes between
// that page and the start are filled with a sentinel checked after every
// launch), filled with all bits set (NaN in every float dtype). The start is
// aligned to the largest power of two dividing bytes (so to the element size
// of any tensor of that many bytes).
void* guarded_alloc(size_t bytes);
void guarded_free(void* data);

// ---- device-side primitives (simt.cpp) ------------------------------------------

enum class Collective : uint8_t { SyncWarp, Shfl, ShflUp, ShflDown, ShflXor, Ballot, Any, All, ReduceAdd };

void syncthreads();
uint64_t warp_collective(Collective kind, unsigned mask, uint64_t value, int arg, int width);

// ---- launches ---------------------------------------------------------------------

using KernelBody = void (*)(void* closure);

cudaError_t launch(const char* written_name, const char* instantiation, dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t stream, KernelBody body, void* closure);

namespace detail {

template <auto Kernel>
const char* instantiation_name() {
  return __PRETTY_FUNCTION__;  // names Kernel with its template arguments
}

template <typename F>
struct Parameters;
template <typename... P>
struct Parameters<void (*)(P...)> {
  using Tuple = std::tuple<std::decay_t<P>...>;
};

}  // namespace detail

// EFFILAYERS_LAUNCH(grid, block, stream, kernel)(args...) under emulation:
// the arguments are converted to the kernel's parameter types once, as a
// <<<>>> launch does, and every thread gets its own copy of them.
template <auto Kernel>
class Launcher {
 public:
  Launcher(const char* name, dim3 grid, dim3 block, cudaStream_t stream)
      : name_(name), grid_(grid), block_(block), stream_(stream) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    using Tuple = typename detail::Parameters<decltype(Kernel)>::Tuple;
    Tuple parameters(std::forward<Args>(args)...);
    launch(name_, detail::instantiation_name<Kernel>(), grid_, block_, 0, stream_, &run<Tuple>, &parameters);
  }

 private:
  template <typename Tuple>
  static void run(void* parameters) {
    Tuple copy = *static_cast<const Tuple*>(parameters);
    std::apply(Kernel, copy);
  }

  const char* name_;
  dim3 grid_, block_;
  cudaStream_t stream_;
};

template <auto Kernel>
Launcher<Kernel> launcher(const char* name, dim3 grid, dim3 block, cudaStream_t stream) {
  return Launcher<Kernel>(name, grid, block, stream);
}

template <typename T>
uint64_t to_word(const T& v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "warp collectives move up to 64 bits");
  uint64_t word = 0;
  std::memcpy(&word, &v, sizeof(T));
  return word;
}

template <typename T>
T from_word(uint64_t word) {
  T v;
  std::memcpy(&v, &word, sizeof(T));
  return v;
}

}  // namespace simt

// ---- synchronisation and warp collectives --------------------------------------

inline void __syncthreads() { simt::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  simt::warp_collective(simt::Collective::SyncWarp, mask, 0, 0, 32);
}
inline void __threadfence() {}
inline void __threadfence_block() {}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  return simt::from_word<T>(simt::warp_collective(simt::Collective::Shfl, mask, simt::to_word(var), src_lane, width));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return simt::from_word<T>(
      simt::warp_collective(simt::Collective::ShflUp, mask, simt::to_word(var), static_cast<int>(delta), width));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return simt::from_word<T>(
      simt::warp_collective(simt::Collective::ShflDown, mask, simt::to_word(var), static_cast<int>(delta), width));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return simt::from_word<T>(
      simt::warp_collective(simt::Collective::ShflXor, mask, simt::to_word(var), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return static_cast<unsigned>(simt::warp_collective(simt::Collective::Ballot, mask, predicate != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int predicate) {
  return static_cast<int>(simt::warp_collective(simt::Collective::Any, mask, predicate != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int predicate) {
  return static_cast<int>(simt::warp_collective(simt::Collective::All, mask, predicate != 0, 0, 32));
}
inline unsigned __reduce_add_sync(unsigned mask, unsigned value) {
  return static_cast<unsigned>(simt::warp_collective(simt::Collective::ReduceAdd, mask, value, 0, 32));
}
inline int __reduce_add_sync(unsigned mask, int value) {
  return static_cast<int>(
      simt::warp_collective(simt::Collective::ReduceAdd, mask, static_cast<unsigned>(value), 0, 32));
}

// ---- atomics (blocks may one day run on several OS threads: real atomics) -----

template <typename T>
T atomicAdd(T* address, T value) {
  if constexpr (std::is_integral_v<T>) {
    return __atomic_fetch_add(address, value, __ATOMIC_RELAXED);
  } else {
    T old, desired;
    __atomic_load(address, &old, __ATOMIC_RELAXED);
    do {
      desired = old + value;
    } while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return old;
  }
}
template <typename T>
T atomicMax(T* address, T value) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (old < value && !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
T atomicMin(T* address, T value) {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (value < old && !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
T atomicExch(T* address, T value) {
  return __atomic_exchange_n(address, value, __ATOMIC_RELAXED);
}
template <typename T>
T atomicCAS(T* address, T compare, T value) {
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}

// ---- loads and math -------------------------------------------------------------

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

// CUDA's global min/max overloads (host std::min needs equal types too).
#define SIMT_MIN_MAX(T)                          \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
SIMT_MIN_MAX(int)
SIMT_MIN_MAX(unsigned)
SIMT_MIN_MAX(long)
SIMT_MIN_MAX(unsigned long)
SIMT_MIN_MAX(long long)
SIMT_MIN_MAX(unsigned long long)
#undef SIMT_MIN_MAX
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }

// The float overloads CUDA declares in the global namespace.
using std::fabs;
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
inline float __fdividef(float a, float b) { return a / b; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz(static_cast<unsigned>(v)); }

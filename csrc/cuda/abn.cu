// Activated BatchNorm on CUDA (kernels only; the torch binding is
// abn_binding.cpp). The math, edge cases included, is the reference in
// effilayers/ops/abn/reference.py; acc_t is float (double for double input).
//
//   * fold: a tiny launch turns weight/bias/invstd into per-channel s, 1/s,
//     beta and s*invstd in the workspace, so the element loops neither clamp
//     the weight nor divide by it per element.
//   * forward and backward_elemt: flat grid-stride loops over the whole
//     tensor, so consecutive threads touch consecutive addresses in either
//     layout, whatever C and S are. Each thread finds its channel with one
//     division when it starts and then follows it with adds. Per-channel
//     values are separate arrays, so the 32 channels a channels_last warp
//     reads form one cache line per value. Where every tensor is 16-byte
//     aligned and a 16-byte vector lies in one channel (S a multiple of it)
//     or spans whole consecutive channels (channels_last, C a multiple of
//     it), forward_kernel / elemt_kernel take V = Vec<scalar_t>::kSize and
//     move one vector per access; V = 1 is the scalar fallback, the same
//     template, so both give the same bits.
//   * backward_reduce: the chunk plan of batch_stats (stats.cu). Partial
//     (sum dy, sum dy*x_hat) per (chunk, channel) in acc_t, then one block per
//     channel adds its chunks in double. channels_first chunks are read in
//     16-byte vectors under vector_chunks' rule (reduce.cuh), else one
//     element at a time; the two sum in different orders (equal to
//     rounding, not to the bit). Fixed partition and fixed order: the
//     result does not depend on scheduling (no atomics).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "abn.cuh"
#include "common/activation.h"
#include "elementwise.cuh"
#include "launch.cuh"
#include "reduce.cuh"

namespace effilayers {
namespace cuda {
namespace {

constexpr int kThreads = 256;  // fold and element loops (the reduce uses the chunk shapes of reduce.cuh)
// Grid of the element loops: about two resident waves. More blocks would
// only repeat the per-thread channel division on fewer elements; fewer
// would leave SMs idle.
constexpr int kBlocksPerSm = 16;
constexpr int64_t kMaxGridX = 0x7fffffff;

// ---- per-channel constants --------------------------------------------------------

// The workspace starts with kFolded arrays of C values each.
constexpr int64_t kFolded = 4;

template <typename acc_t>
struct ChannelPtrs {
  const acc_t* mean;
  const acc_t* invstd;
  const acc_t* scale;      // s
  const acc_t* inv_scale;  // 1 / s
  const acc_t* shift;      // beta
  const acc_t* gain;       // s * invstd
  acc_t param;
};

// The values one element of channel c needs to get dy and x_hat; only the
// ones its mode reads are loaded.
template <typename acc_t>
struct ChannelValues {
  acc_t mean, invstd, scale, inv_scale, shift;
};

template <bool kFromOutput, typename acc_t>
__device__ __forceinline__ ChannelValues<acc_t> load_channel(const ChannelPtrs<acc_t>& p, int64_t c) {
  ChannelValues<acc_t> v{acc_t(0), acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
  if constexpr (kFromOutput) {
    v.inv_scale = __ldg(p.inv_scale + c);
  } else {
    v.mean = __ldg(p.mean + c);
    v.invstd = __ldg(p.invstd + c);
    v.scale = __ldg(p.scale + c);
  }
  v.shift = __ldg(p.shift + c);
  return v;
}

template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    fold_channels(int64_t C, const acc_t* __restrict__ invstd, const acc_t* __restrict__ weight,
                  const acc_t* __restrict__ bias, bool clamp_weight, acc_t weight_eps, acc_t* __restrict__ folded) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; c < C;
       c += static_cast<int64_t>(gridDim.x) * kThreads) {
    acc_t s = acc_t(1);
    if (weight != nullptr) {
      s = weight[c];
      if (clamp_weight) {
        // effective_weight: the sign is kept (sign(0) = +1, -0.0 included)
        // and a NaN weight stays NaN, as clamp_min leaves it.
        const acc_t magnitude = fabs(s) < weight_eps ? weight_eps : fabs(s);
        s = s < acc_t(0) ? -magnitude : magnitude;
      }
    }
    folded[c] = s;
    folded[C + c] = acc_t(1) / s;
    folded[2 * C + c] = bias != nullptr ? bias[c] : acc_t(0);
    folded[3 * C + c] = s * invstd[c];
  }
}

// Folds the per-channel constants into `folded` (the workspace's start) and
// points p at them.
template <typename acc_t>
cudaError_t fold(const StatsPlan& plan, const AbnChannels& ch, acc_t* folded, cudaStream_t stream,
                 ChannelPtrs<acc_t>& p) {
  const int64_t C = plan.channels;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(C, kThreads), 1024));
  EFFILAYERS_LAUNCH(blocks, kThreads, stream, fold_channels<acc_t>)(
      C, static_cast<const acc_t*>(ch.invstd), static_cast<const acc_t*>(ch.weight),
      static_cast<const acc_t*>(ch.bias), ch.weight_eps > 0.0, static_cast<acc_t>(ch.weight_eps), folded);
  p = {static_cast<const acc_t*>(ch.mean),
       static_cast<const acc_t*>(ch.invstd),
       folded,
       folded + C,
       folded + 2 * C,
       folded + 3 * C,
       static_cast<acc_t>(ch.activation_param)};
  return cudaGetLastError();
}

// dy and x_hat from the loaded values (grad g, saved value, residual r).
template <Activation A, bool kFromOutput, typename acc_t>
__device__ __forceinline__ void dy_and_xhat_of(acc_t g, acc_t value, acc_t r, const ChannelValues<acc_t>& v,
                                               acc_t param, acc_t& dy, acc_t& x_hat) {
  if constexpr (kFromOutput) {
    const acc_t y = invert<A>(value, param);
    x_hat = (y - r - v.shift) * v.inv_scale;
    dy = g * derivative_from_output<A>(value, param);
  } else {
    x_hat = (value - v.mean) * v.invstd;
    const acc_t y = x_hat * v.scale + v.shift + r;
    dy = g * derivative<A>(y, param);
  }
}

// dy and x_hat of element i, from the saved output z or the saved input x
// (_dy_and_xhat). Without a residual r is 0: subtracting or adding a zero
// changes no comparison the activations make.
template <Activation A, bool kFromOutput, typename scalar_t, typename acc_t>
__device__ __forceinline__ void dy_and_xhat(const scalar_t* grad, const scalar_t* saved, const scalar_t* residual,
                                            int64_t i, const ChannelValues<acc_t>& v, acc_t param, acc_t& dy,
                                            acc_t& x_hat) {
  const acc_t g = load<scalar_t, acc_t>(grad + i), value = load<scalar_t, acc_t>(saved + i);
  const acc_t r = residual != nullptr ? load<scalar_t, acc_t>(residual + i) : acc_t(0);
  dy_and_xhat_of<A, kFromOutput>(g, value, r, v, param, dy, x_hat);
}

// ---- element loops ---------------------------------------------------------------

// Flat index i of a dense (N, C, S) tensor lies in channel (i / inner) % C,
// with inner = S for channels_first and 1 for channels_last. The host
// splits the grid stride the same way so threads can advance with adds.
struct FlatWalk {
  int64_t numel = 0, inner = 1, channels = 1;
  int64_t step = 0;          // threads in the grid
  int64_t step_inner = 0;    // step % inner
  int64_t step_channel = 0;  // (step / inner) % channels
  // The vector kernels walk vectors of V elements: the first channel of
  // vector k is cursor.c * channel_scale, lane j's is that plus
  // j * lane_step (channels_first: scale 1, step 0; channels_last: V, 1).
  // lane_step is an int so the per-lane offsets stay 32-bit (64-bit ones
  // made ptxas spill in the unrolled 8-lane half loops).
  int64_t channel_scale = 1;
  int lane_step = 0;
};

struct ChannelCursor {
  int64_t s, c;  // i % inner, (i / inner) % channels

  __device__ __forceinline__ ChannelCursor(int64_t i, const FlatWalk& w) {
    const int64_t q = i / w.inner;
    s = i - q * w.inner;
    c = q % w.channels;
  }
  // Each of s and c gains less than its modulus (plus a carry of one), so
  // one subtraction brings it back into range.
  __device__ __forceinline__ void advance(const FlatWalk& w) {
    s += w.step_inner;
    c += w.step_channel;
    if (s >= w.inner) {
      s -= w.inner;
      ++c;
    }
    if (c >= w.channels) c -= w.channels;
  }
};

// The element loops walk vectors of V elements (V = Vec<scalar_t>::kSize:
// one 16-byte load or store per tensor; V = 1: the scalar fallback, see
// with_element_loop). Per element both do the same operations in the same
// order, so they give the same bits.
//
// x, residual and out may all be the same memory (in place, residual=x):
// no __restrict__, and each element is read before it is written, by the
// same thread.
template <int V, Activation A, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const scalar_t* x, const scalar_t* residual, scalar_t* out, FlatWalk w, ChannelPtrs<acc_t> p) {
  int64_t k = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  ChannelCursor cursor(k, w);
  for (; k < w.numel; k += w.step, cursor.advance(w)) {
    const int64_t c0 = cursor.c * w.channel_scale;
    const Vec<scalar_t, V> xv = load_vec<V>(x + k * V);
    Vec<scalar_t, V> rv = xv;
    if (residual != nullptr) rv = load_vec<V>(residual + k * V);
    Vec<scalar_t, V> yv;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t c = c0 + j * w.lane_step;
      // (x - mean) * (s * invstd) + beta, grouped as in the reference: x - mean
      // is exact for large-mean data, where x * a + (beta - mean * a) is not.
      acc_t y = (load<scalar_t, acc_t>(&xv.v[j]) - __ldg(p.mean + c)) * __ldg(p.gain + c) + __ldg(p.shift + c);
      if (residual != nullptr) y += load<scalar_t, acc_t>(&rv.v[j]);
      yv.v[j] = to_scalar<scalar_t, acc_t>(activate<A>(y, p.param));
    }
    store_vec<V>(out + k * V, yv);
  }
}

// Two resident blocks (at most 128 registers) steer ptxas as for the
// reductions below: without it the double gelu_tanh instances spilled 8 bytes.
template <int V, Activation A, bool kFromOutput, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads, 2)
    elemt_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ saved,
                 const scalar_t* __restrict__ residual, scalar_t* __restrict__ grad_input,
                 scalar_t* __restrict__ grad_residual, FlatWalk w, ChannelPtrs<acc_t> p,
                 const acc_t* __restrict__ mean_dy, const acc_t* __restrict__ mean_dy_xhat) {
  int64_t k = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  ChannelCursor cursor(k, w);
  for (; k < w.numel; k += w.step, cursor.advance(w)) {
    const int64_t c0 = cursor.c * w.channel_scale;
    const Vec<scalar_t, V> gv = load_vec<V>(grad + k * V), sv = load_vec<V>(saved + k * V);
    Vec<scalar_t, V> rv = sv;
    if (residual != nullptr) rv = load_vec<V>(residual + k * V);
    Vec<scalar_t, V> gi, gr;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const int64_t c = c0 + j * w.lane_step;
      const ChannelValues<acc_t> v = load_channel<kFromOutput>(p, c);
      const acc_t r = residual != nullptr ? load<scalar_t, acc_t>(&rv.v[j]) : acc_t(0);
      acc_t dy, x_hat;
      dy_and_xhat_of<A, kFromOutput>(load<scalar_t, acc_t>(&gv.v[j]), load<scalar_t, acc_t>(&sv.v[j]), r, v,
                                     p.param, dy, x_hat);
      gi.v[j] = to_scalar<scalar_t, acc_t>(__ldg(p.gain + c) *
                                           (dy - __ldg(mean_dy + c) - x_hat * __ldg(mean_dy_xhat + c)));
      gr.v[j] = to_scalar<scalar_t, acc_t>(dy);
    }
    store_vec<V>(grad_input + k * V, gi);
    if (grad_residual != nullptr) store_vec<V>(grad_residual + k * V, gr);
  }
}

// The walk in units of `vec` elements (1: the scalar kernels).
cudaError_t plan_flat_walk(const StatsPlan& plan, int64_t vec, FlatWalk& w, unsigned& blocks) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  w.numel = plan.batch * plan.channels * plan.spatial / vec;
  w.inner = plan.channels_last ? 1 : plan.spatial / vec;
  w.channels = plan.channels_last ? plan.channels / vec : plan.channels;
  w.channel_scale = plan.channels_last ? vec : 1;
  w.lane_step = plan.channels_last ? 1 : 0;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(ceil_div(w.numel, kThreads),
                                                              static_cast<int64_t>(std::max(sms, 1)) * kBlocksPerSm));
  blocks = static_cast<unsigned>(grid);
  w.step = grid * kThreads;
  w.step_inner = w.step % w.inner;
  w.step_channel = (w.step / w.inner) % w.channels;
  return cudaSuccess;
}

// ---- reduce ------------------------------------------------------------------------

template <typename T>
struct Pair {
  T dy, dy_xhat;
};

template <typename T>
__device__ __forceinline__ Pair<T> operator+(const Pair<T>& a, const Pair<T>& b) {
  return {a.dy + b.dy, a.dy_xhat + b.dy_xhat};
}

// V: as in the element loops, vectors of 16 bytes or single elements
// (vector_chunks, reduce.cuh, says when a plan's chunks allow vectors).
//
// The second launch bound (two resident blocks, so at most 128 registers)
// only steers ptxas: without it, it spilled a few bytes in the double ELU
// vector instance while using 64 registers; with it, none and 52.
template <int V, Activation A, bool kFromOutput, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kChunkThreads, 2)
    reduce_partial_channels_first(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ saved,
                                  const scalar_t* __restrict__ residual, StatsPlan plan, ChannelPtrs<acc_t> p,
                                  acc_t* __restrict__ part_dy, acc_t* __restrict__ part_dy_xhat) {
  const int64_t C = plan.channels, S = plan.spatial, plane_stride = C * S;
  const PlaneChunk chunk = plane_chunk(plan);
  const int64_t c = chunk.c;
  // A row's width in vectors; as in partial_channels_first, a chunk's
  // vectors (planes * width <= kChunkElements) count in 32 bits: with 64-bit
  // counters ptxas spilled in the unrolled 8-lane fp16 loops.
  const uint32_t width = static_cast<uint32_t>(chunk.width / V);
  const ChannelValues<acc_t> v = load_channel<kFromOutput>(p, c);
  Pair<acc_t> sum{};
  if (width > 0) {
    // Vector e of the chunk is (plane e / width, vector e % width of its
    // row); the thread steps e by kChunkThreads, carrying like
    // ChannelCursor, so the loop has no division. offset counts elements.
    const uint32_t plane_step = kChunkThreads / width, pos_step = kChunkThreads - plane_step * width;
    uint32_t plane = threadIdx.x / width, pos = threadIdx.x - plane * width;
    int64_t offset = (chunk.plane0 * C + c) * S + chunk.s0 + plane * plane_stride + static_cast<int64_t>(pos) * V;
    const int64_t jump = plane_step * plane_stride + static_cast<int64_t>(pos_step) * V,
                  wrap = plane_stride - static_cast<int64_t>(width) * V;
    const uint32_t len = static_cast<uint32_t>(chunk.planes * width);
    for (uint32_t e = threadIdx.x; e < len; e += kChunkThreads) {
      const Vec<scalar_t, V> gv = load_vec<V>(grad + offset), sv = load_vec<V>(saved + offset);
      Vec<scalar_t, V> rv = sv;
      if (residual != nullptr) rv = load_vec<V>(residual + offset);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const acc_t r = residual != nullptr ? load<scalar_t, acc_t>(&rv.v[j]) : acc_t(0);
        acc_t dy, x_hat;
        dy_and_xhat_of<A, kFromOutput>(load<scalar_t, acc_t>(&gv.v[j]), load<scalar_t, acc_t>(&sv.v[j]), r, v,
                                       p.param, dy, x_hat);
        sum.dy += dy;
        sum.dy_xhat += dy * x_hat;
      }
      pos += pos_step;
      offset += jump;
      if (pos >= width) {
        pos -= width;
        offset += wrap;
      }
    }
  }
  sum = block_reduce<kChunkThreads>(sum, Add{});
  if (threadIdx.x == 0) {
    part_dy[chunk.j * C + c] = sum.dy;
    part_dy_xhat[chunk.j * C + c] = sum.dy_xhat;
  }
}

// Two resident blocks, as for the plane chunks above: without it ptxas
// spilled a few bytes in the double silu and mish instances.
template <Activation A, bool kFromOutput, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kTileChannels* kTileRows, 2)
    reduce_partial_channels_last(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ saved,
                                 const scalar_t* __restrict__ residual, StatsPlan plan, ChannelPtrs<acc_t> p,
                                 acc_t* __restrict__ part_dy, acc_t* __restrict__ part_dy_xhat) {
  const int64_t C = plan.channels;
  const RowChunk rows = row_chunk(plan);
  const int64_t c = rows.c;
  Pair<acc_t> sum{};
  if (c < C) {
    const ChannelValues<acc_t> v = load_channel<kFromOutput>(p, c);
    for (int64_t row = rows.first + threadIdx.y; row < rows.last; row += kTileRows) {
      const int64_t offset = row * C + c;
      acc_t dy, x_hat;
      dy_and_xhat<A, kFromOutput>(grad, saved, residual, offset, v, p.param, dy, x_hat);
      sum.dy += dy;
      sum.dy_xhat += dy * x_hat;
    }
  }
  sum = column_reduce<kTileChannels, kTileRows>(sum, Add{});
  if (threadIdx.y == 0 && c < C) {
    part_dy[rows.j * C + c] = sum.dy;
    part_dy_xhat[rows.j * C + c] = sum.dy_xhat;
  }
}

template <typename acc_t>
__global__ void __launch_bounds__(kChunkThreads)
    reduce_merge(int64_t chunks, int64_t C, const acc_t* __restrict__ part_dy, const acc_t* __restrict__ part_dy_xhat,
                 acc_t* __restrict__ sum_dy, acc_t* __restrict__ sum_dy_xhat) {
  const int64_t c = blockIdx.x;
  const Pair<double> sum = combine_chunks<Pair<double>>(
      chunks,
      [&](int64_t j) {
        return Pair<double>{static_cast<double>(part_dy[j * C + c]), static_cast<double>(part_dy_xhat[j * C + c])};
      },
      Add{});
  if (threadIdx.x == 0) {
    sum_dy[c] = static_cast<acc_t>(sum.dy);
    sum_dy_xhat[c] = static_cast<acc_t>(sum.dy_xhat);
  }
}

// ---- dispatch ------------------------------------------------------------------------

// Whether the vector element loops can run: every tensor 16-byte aligned
// and each vector of `vec` elements in one channel (channels_first) or in
// `vec` consecutive channels (channels_last). Else the scalar loops run.
bool vectorizable(const StatsPlan& plan, int64_t vec, std::initializer_list<const void*> tensors) {
  return aligned_16(tensors) && (plan.channels_last ? plan.channels % vec == 0 : plan.spatial % vec == 0);
}

// The setup of the element loops (forward, backward_elemt): folds the
// per-channel constants and plans the flat walk (in vectors where
// vectorizable), then returns launch(types, w, blocks, p, vector) for the
// dtype's Types. `tensors`: the full-size tensors' pointers (null: absent).
template <typename Launch>
cudaError_t with_element_loop(const StatsPlan& plan, const AbnChannels& channels, void* workspace,
                              cudaStream_t stream, std::initializer_list<const void*> tensors, Launch&& launch) {
  if (plan.batch * plan.channels * plan.spatial == 0) return cudaSuccess;
  return with_types(channels.dtype, [&](auto types) {
    using acc_t = typename decltype(types)::acc_t;
    ChannelPtrs<acc_t> p;
    cudaError_t err = fold<acc_t>(plan, channels, static_cast<acc_t*>(workspace), stream, p);
    if (err != cudaSuccess) return err;
    using scalar_t = typename decltype(types)::scalar_t;
    constexpr int64_t kVec = Vec<scalar_t>::kSize;
    const bool vector = vectorizable(plan, kVec, tensors);
    FlatWalk w;
    unsigned blocks = 0;
    err = plan_flat_walk(plan, vector ? kVec : 1, w, blocks);
    if (err != cudaSuccess) return err;
    return launch(types, w, blocks, p, vector);
  });
}

// Only the invertible activations are instantiated from the output (the
// binding refuses the others first: parse_backward_activation).
template <Activation A, typename F>
cudaError_t with_source(bool from_output, F&& f) {
  if constexpr (invertible(A)) {
    if (from_output) return f(std::true_type{});
  } else if (from_output) {
    return cudaErrorInvalidValue;
  }
  return f(std::false_type{});
}

}  // namespace

int64_t abn_workspace_elements(const StatsPlan& plan, bool reduce) {
  return kFolded * plan.channels + (reduce ? 2 * plan.chunks * plan.channels : 0);
}

cudaError_t abn_forward(const void* x, const void* residual, void* out, const StatsPlan& plan,
                        const AbnChannels& channels, void* workspace, cudaStream_t stream) {
  return with_element_loop(plan, channels, workspace, stream, {x, residual, out},
                           [&](auto types, const FlatWalk& w, unsigned blocks, const auto& p, bool vector) {
    using scalar_t = typename decltype(types)::scalar_t;
    using acc_t = typename decltype(types)::acc_t;
    return with_activation(channels.activation, [&](auto act) {
      const auto* xs = static_cast<const scalar_t*>(x);
      const auto* rs = static_cast<const scalar_t*>(residual);
      auto* outs = static_cast<scalar_t*>(out);
      return with_width<scalar_t>(vector, [&](auto width) {
        EFFILAYERS_LAUNCH(blocks, kThreads, stream,
                          forward_kernel<decltype(width)::value, decltype(act)::value, scalar_t, acc_t>)(
            xs, rs, outs, w, p);
        return cudaGetLastError();
      });
    });
  });
}

cudaError_t abn_backward_reduce(const void* grad, const void* saved, const void* residual, bool saved_is_output,
                                const StatsPlan& plan, const AbnChannels& channels, void* sum_dy,
                                void* sum_dy_xhat, void* workspace, cudaStream_t stream) {
  const int64_t C = plan.channels;
  if (C == 0) return cudaSuccess;
  return with_types(channels.dtype, [&](auto types) {
    using scalar_t = typename decltype(types)::scalar_t;
    using acc_t = typename decltype(types)::acc_t;
    if (plan.batch * plan.spatial == 0) return zero_outputs(sum_dy, sum_dy_xhat, C * sizeof(acc_t), stream);
    // grid.x of the partial and merge launches: refuse rather than wrap.
    const int64_t partial_blocks = plan.channels_last ? ceil_div(C, kTileChannels) : C * plan.chunks;
    if (std::max(partial_blocks, C) > kMaxGridX) return cudaErrorInvalidConfiguration;
    auto* folded = static_cast<acc_t*>(workspace);
    acc_t* part_dy = folded + kFolded * C;
    acc_t* part_dy_xhat = part_dy + plan.chunks * C;
    ChannelPtrs<acc_t> p;
    cudaError_t err = fold<acc_t>(plan, channels, folded, stream, p);
    if (err != cudaSuccess) return err;
    const auto* g = static_cast<const scalar_t*>(grad);
    const auto* s = static_cast<const scalar_t*>(saved);
    const auto* r = static_cast<const scalar_t*>(residual);
    err = with_activation(channels.activation, [&](auto act) {
      return with_source<decltype(act)::value>(saved_is_output, [&](auto from_output) {
        constexpr Activation A = decltype(act)::value;
        constexpr bool kFromOutput = decltype(from_output)::value;
        if (plan.channels_last) {
          // plan_batch_stats keeps chunks <= 65535 for grid.y.
          const dim3 block(kTileChannels, kTileRows);
          const dim3 grid(static_cast<unsigned>(ceil_div(C, kTileChannels)), static_cast<unsigned>(plan.chunks));
          EFFILAYERS_LAUNCH(grid, block, stream, reduce_partial_channels_last<A, kFromOutput, scalar_t, acc_t>)(
              g, s, r, plan, p, part_dy, part_dy_xhat);
        } else {
          return with_width<scalar_t>(vector_chunks(plan, Vec<scalar_t>::kSize, {g, s, r}), [&](auto width) {
            EFFILAYERS_LAUNCH(static_cast<unsigned>(C * plan.chunks), kChunkThreads, stream,
                              reduce_partial_channels_first<decltype(width)::value, A, kFromOutput, scalar_t, acc_t>)(
                g, s, r, plan, p, part_dy, part_dy_xhat);
            return cudaGetLastError();
          });
        }
        return cudaGetLastError();
      });
    });
    if (err != cudaSuccess) return err;
    EFFILAYERS_LAUNCH(static_cast<unsigned>(C), kChunkThreads, stream, reduce_merge<acc_t>)(
        plan.chunks, C, part_dy, part_dy_xhat, static_cast<acc_t*>(sum_dy), static_cast<acc_t*>(sum_dy_xhat));
    return cudaGetLastError();
  });
}

cudaError_t abn_backward_elemt(const void* grad, const void* saved, const void* residual, bool saved_is_output,
                               const StatsPlan& plan, const AbnChannels& channels, const void* mean_dy,
                               const void* mean_dy_xhat, void* grad_input, void* grad_residual, void* workspace,
                               cudaStream_t stream) {
  return with_element_loop(plan, channels, workspace, stream, {grad, saved, residual, grad_input, grad_residual},
                           [&](auto types, const FlatWalk& w, unsigned blocks, const auto& p, bool vector) {
    using scalar_t = typename decltype(types)::scalar_t;
    using acc_t = typename decltype(types)::acc_t;
    return with_activation(channels.activation, [&](auto act) {
      return with_source<decltype(act)::value>(saved_is_output, [&](auto from_output) {
        constexpr Activation A = decltype(act)::value;
        constexpr bool kFromOutput = decltype(from_output)::value;
        const auto* g = static_cast<const scalar_t*>(grad);
        const auto* s = static_cast<const scalar_t*>(saved);
        const auto* r = static_cast<const scalar_t*>(residual);
        auto* gi = static_cast<scalar_t*>(grad_input);
        auto* gr = static_cast<scalar_t*>(grad_residual);
        const auto* mdy = static_cast<const acc_t*>(mean_dy);
        const auto* mdyx = static_cast<const acc_t*>(mean_dy_xhat);
        return with_width<scalar_t>(vector, [&](auto width) {
          EFFILAYERS_LAUNCH(blocks, kThreads, stream,
                            elemt_kernel<decltype(width)::value, A, kFromOutput, scalar_t, acc_t>)(
              g, s, r, gi, gr, w, p, mdy, mdyx);
          return cudaGetLastError();
        });
      });
    });
  });
}

}  // namespace cuda
}  // namespace effilayers

// Per-channel batch statistics on CUDA (kernels only; the torch binding is
// stats_binding.cpp). Two launches:
//   1. partial: each block reduces one chunk of one or more channels to
//      (mean, M2) with per-thread Welford updates and Chan merges across the
//      block; results go to a small workspace laid out [chunk][channel].
//      channels_first chunks are read in 16-byte vectors where vector_chunks
//      (reduce.cuh) allows it, one element per load otherwise.
//   2. merge: one block per channel combines that channel's chunks, in
//      double, and writes mean and var.
// Welford per element keeps the variance of large-mean data (1e4 +- 1 in
// fp16) that a one-pass sum of squares would lose; the arithmetic is hidden
// under the memory traffic of these loops. Each channel's values are also
// shifted by the channel's first value (its pivot) before they reach
// Welford: the block's float merges of rounded means would otherwise cost
// the variance up to about eps * |mean| / std (1e-4 relative for a few fp32
// values of spread 0.1 around 300, seen on an H200); merge_chunks adds the
// pivot back to the mean, in double.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "elementwise.cuh"
#include "launch.cuh"
#include "reduce.cuh"
#include "stats.cuh"

namespace effilayers {
namespace cuda {
namespace {

// Work per block: enough values per thread to amortise the block reduction,
// few enough chunks per channel that the merge stays short.
constexpr int64_t kChunkElements = 16384;
constexpr int64_t kMaxChunksPerChannel = 1024;

// What the partial kernels subtract from channel c's values: its first
// value, element (0, c, 0) of contiguous NCHW input, element c of
// channels_last (rows of C) input.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t channel_pivot(const scalar_t* x, const StatsPlan& plan, int64_t c) {
  return load<scalar_t, acc_t>(x + (plan.channels_last ? c : c * plan.spatial));
}

// V elements per load: 16 bytes (Vec<scalar_t>::kSize) where vector_chunks
// allows it, else 1 (the scalar fallback). The vector path feeds the same
// values to Welford in another order (each thread takes V consecutive ones
// per step), so the two paths agree to rounding, not to the bit.
template <int V, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kChunkThreads)
    partial_channels_first(const scalar_t* __restrict__ x, StatsPlan plan, acc_t* __restrict__ part_mean,
                           acc_t* __restrict__ part_m2, acc_t* __restrict__ part_count) {
  const int64_t C = plan.channels, S = plan.spatial;
  const PlaneChunk chunk = plane_chunk(plan);
  const int64_t c = chunk.c, j = chunk.j;
  const scalar_t* base = x + (chunk.plane0 * C + c) * S + chunk.s0;
  // len <= kChunkElements fits 32 bits, so the index split is a 32-bit
  // divide; i counts vectors, w is a row's width in vectors.
  const uint32_t w = static_cast<uint32_t>(chunk.width / V), len = static_cast<uint32_t>(chunk.planes * w);
  const acc_t pivot = channel_pivot<scalar_t, acc_t>(x, plan, c);
  Moments<acc_t> m{};
  for (uint32_t i = threadIdx.x; i < len; i += kChunkThreads) {
    const uint32_t p = i / w, s = i - p * w;
    const Vec<scalar_t, V> v = load_vec<V>(base + static_cast<int64_t>(p) * C * S + static_cast<int64_t>(s) * V);
#pragma unroll
    for (int k = 0; k < V; ++k) welford(m, load<scalar_t, acc_t>(&v.v[k]) - pivot);
  }
  m = block_reduce<kChunkThreads>(m, MergeMoments{});
  if (threadIdx.x == 0) {
    part_mean[j * C + c] = m.mean;
    part_m2[j * C + c] = m.m2;
    if (c == 0) part_count[j] = m.count;
  }
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kTileChannels* kTileRows)
    partial_channels_last(const scalar_t* __restrict__ x, StatsPlan plan, acc_t* __restrict__ part_mean,
                          acc_t* __restrict__ part_m2, acc_t* __restrict__ part_count) {
  const int64_t C = plan.channels;
  const RowChunk rows = row_chunk(plan);
  const int64_t c = rows.c, j = rows.j;
  Moments<acc_t> m{};
  if (c < C) {
    const acc_t pivot = channel_pivot<scalar_t, acc_t>(x, plan, c);
    const int64_t first = rows.first + threadIdx.y;
    // A 32-bit trip count and a moving pointer: the 64-bit row index and its
    // product with C cost the registers the pivot needs (no spill at 32).
    const int trips = first < rows.last ? static_cast<int>((rows.last - first + kTileRows - 1) / kTileRows) : 0;
    const scalar_t* p = x + first * C + c;
    const int64_t step = kTileRows * C;
    for (int i = 0; i < trips; ++i, p += step) welford(m, load<scalar_t, acc_t>(p) - pivot);
  }
  m = column_reduce<kTileChannels, kTileRows>(m, MergeMoments{});
  if (threadIdx.y == 0 && c < C) {
    part_mean[j * C + c] = m.mean;
    part_m2[j * C + c] = m.m2;
    if (c == 0) part_count[j] = static_cast<acc_t>(rows.last - rows.first);
  }
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kChunkThreads)
    merge_chunks(const scalar_t* __restrict__ x, StatsPlan plan, int64_t correction,
                 const acc_t* __restrict__ part_mean,
                 const acc_t* __restrict__ part_m2, const acc_t* __restrict__ part_count, acc_t* __restrict__ mean,
                 acc_t* __restrict__ var) {
  const int64_t c = blockIdx.x, C = plan.channels;
  const Moments<double> m = combine_chunks<Moments<double>>(
      plan.chunks,
      [&](int64_t j) {
        return Moments<double>{static_cast<double>(part_count[j]), static_cast<double>(part_mean[j * C + c]),
                               static_cast<double>(part_m2[j * C + c])};
      },
      MergeMoments{});
  if (threadIdx.x == 0) {
    const double dof = m.count - static_cast<double>(correction);
    mean[c] = static_cast<acc_t>(m.mean + static_cast<double>(channel_pivot<scalar_t, acc_t>(x, plan, c)));
    var[c] = dof > 0 ? static_cast<acc_t>(m.m2 / dof) : static_cast<acc_t>(nan(""));
  }
}

template <typename scalar_t, typename acc_t>
cudaError_t launch(const void* input, const StatsPlan& plan, int64_t correction, void* mean_out, void* var_out,
                   void* workspace, cudaStream_t stream) {
  const auto* x = static_cast<const scalar_t*>(input);
  auto* mean = static_cast<acc_t*>(mean_out);
  auto* var = static_cast<acc_t*>(var_out);
  const int64_t C = plan.channels;
  if (C == 0) return cudaSuccess;
  if (plan.batch * plan.spatial == 0) return zero_outputs(mean, var, C * sizeof(acc_t), stream);  // mean 0, var 0
  auto* part_mean = static_cast<acc_t*>(workspace);
  acc_t* part_m2 = part_mean + plan.chunks * C;
  acc_t* part_count = part_m2 + plan.chunks * C;
  if (plan.channels_last) {
    const dim3 block(kTileChannels, kTileRows);
    const dim3 grid(static_cast<unsigned>(ceil_div(C, kTileChannels)), static_cast<unsigned>(plan.chunks));
    EFFILAYERS_LAUNCH(grid, block, stream, partial_channels_last<scalar_t, acc_t>)(x, plan, part_mean, part_m2,
                                                                                  part_count);
  } else {
    const cudaError_t err =
        with_width<scalar_t>(vector_chunks(plan, Vec<scalar_t>::kSize, {x}), [&](auto width) {
          EFFILAYERS_LAUNCH(static_cast<unsigned>(C * plan.chunks), kChunkThreads, stream,
                            partial_channels_first<decltype(width)::value, scalar_t, acc_t>)(x, plan, part_mean,
                                                                                              part_m2, part_count);
          return cudaGetLastError();
        });
    if (err != cudaSuccess) return err;
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  EFFILAYERS_LAUNCH(static_cast<unsigned>(C), kChunkThreads, stream, merge_chunks<scalar_t, acc_t>)(
      x, plan, correction, part_mean, part_m2, part_count, mean, var);
  return cudaGetLastError();
}

}  // namespace

StatsPlan plan_batch_stats(int64_t batch, int64_t channels, int64_t spatial, bool channels_last) {
  StatsPlan plan;
  plan.batch = batch;
  plan.channels = channels;
  plan.spatial = spatial;
  plan.channels_last = channels_last;
  const int64_t per_channel = batch * spatial;
  if (per_channel == 0 || channels == 0) return plan;
  if (channels_last) {
    const int64_t rows_per_block = kChunkElements / kTileChannels;  // values per thread like channels_first
    // Grid y is limited to 65535 chunks.
    plan.rows_per_chunk = std::max(std::max(rows_per_block, ceil_div(per_channel, kMaxChunksPerChannel)),
                                   ceil_div(per_channel, 65535));
    plan.chunks = ceil_div(per_channel, plan.rows_per_chunk);
    return plan;
  }
  const int64_t chunk = std::max(kChunkElements, ceil_div(per_channel, kMaxChunksPerChannel));
  if (spatial >= chunk) {
    // Pieces of about equal length, rounded up to kPieceAlign elements (the
    // count again from the rounded length, so that no piece is empty).
    plan.piece_len = ceil_div(ceil_div(spatial, ceil_div(spatial, chunk)), kPieceAlign) * kPieceAlign;
    plan.pieces_per_plane = ceil_div(spatial, plan.piece_len);
    plan.chunks = batch * plan.pieces_per_plane;
  } else {
    plan.planes_per_chunk = std::max<int64_t>(1, chunk / spatial);
    plan.chunks = ceil_div(batch, plan.planes_per_chunk);
  }
  return plan;
}

int64_t batch_stats_workspace_elements(const StatsPlan& plan) {
  return plan.chunks * plan.channels * 2 + plan.chunks;
}

cudaError_t batch_stats(const void* input, DType dtype, const StatsPlan& plan, int64_t correction, void* mean,
                        void* var, void* workspace, cudaStream_t stream) {
  return with_types(dtype, [&](auto types) {
    using T = decltype(types);
    return launch<typename T::scalar_t, typename T::acc_t>(input, plan, correction, mean, var, workspace, stream);
  });
}

}  // namespace cuda
}  // namespace effilayers

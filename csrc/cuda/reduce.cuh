// The deterministic per-channel reductions of the CUDA kernels, written once:
// warp and block reductions of any small value type under a combine, the
// (count, mean, M2) summary with Welford updates and Chan's combine, and the
// chunks of a StatsPlan (stats.cuh) that batch_stats and the activated
// BatchNorm backward both reduce. CUDA headers only.
//
// Every reduction has a fixed shape and order: the same input gives the same
// bits whatever the scheduling (no atomics).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "elementwise.cuh"
#include "stats.cuh"

namespace effilayers {
namespace cuda {

// Block shapes of the chunk kernels. 1-D blocks (a channels_first chunk, a
// channel's merge) have kChunkThreads threads; channels_last tiles are
// kTileChannels consecutive channels per warp row (coalesced) by kTileRows
// rows. plan_batch_stats sizes channels_last chunks for these tiles.
constexpr int kChunkThreads = 256;
constexpr int kTileChannels = 32;
constexpr int kTileRows = 8;

// ---- combines ------------------------------------------------------------------------

// Plain sums: V has operator+ (field by field for a struct).
struct Add {
  template <typename V>
  __device__ __forceinline__ V operator()(const V& a, const V& b) const {
    return a + b;
  }
};

// Summary of count values: their mean and M2 = sum((x - mean)^2).
// Moments{} (all zero) is the empty summary.
template <typename T>
struct Moments {
  T count, mean, m2;
};

template <typename T>
__device__ __forceinline__ void welford(Moments<T>& m, T x) {
  m.count += T(1);
  const T delta = x - m.mean;
  m.mean += delta / m.count;
  m.m2 += delta * (x - m.mean);
}

// Chan et al.'s combination of two summaries.
struct MergeMoments {
  template <typename T>
  __device__ __forceinline__ Moments<T> operator()(const Moments<T>& a, const Moments<T>& b) const {
    const T count = a.count + b.count;
    if (count == T(0)) return a;
    const T delta = b.mean - a.mean;
    const T weight_b = b.count / count;
    return {count, a.mean + delta * weight_b, a.m2 + b.m2 + delta * delta * a.count * weight_b};
  }
};

// ---- across threads ------------------------------------------------------------------

// v of the lane `offset` above, for any trivially copyable V made of 32-bit
// words (moved word by word, as __shfl_down_sync moves a double).
template <typename V>
__device__ __forceinline__ V shuffle_down(const V& v, int offset) {
  static_assert(sizeof(V) % sizeof(unsigned) == 0, "shuffle_down moves 32-bit words");
  constexpr int kWords = sizeof(V) / sizeof(unsigned);
  unsigned words[kWords];
  memcpy(words, &v, sizeof(V));
#pragma unroll
  for (int k = 0; k < kWords; ++k) words[k] = __shfl_down_sync(0xffffffffu, words[k], offset);
  V out;
  memcpy(&out, words, sizeof(V));
  return out;
}

// Combines the 32 lanes of a warp, lower lane first. Only lane 0 ends with
// the warp's result: __shfl_down_sync hands a lane whose source is out of
// range its own value back.
template <typename V, typename Combine>
__device__ __forceinline__ V warp_reduce(V v, Combine combine) {
  for (int offset = 16; offset > 0; offset >>= 1) v = combine(v, shuffle_down(v, offset));
  return v;
}

// Combines a 1-D block of kThreads threads, every thread taking part; the
// result is valid in thread 0. V{} must be combine's identity. Called once
// per kernel, so the shared array needs no second barrier.
template <int kThreads, typename V, typename Combine>
__device__ V block_reduce(V v, Combine combine) {
  static_assert(kThreads % 32 == 0 && kThreads <= 32 * 32, "whole warps, at most 32");
  __shared__ V per_warp[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_reduce(v, combine);
  if (lane == 0) per_warp[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? per_warp[lane] : V{};
    v = warp_reduce(v, combine);
  }
  return v;
}

// Combines each column of a (kColumns, kRows) block down its rows, in row
// order, through shared memory; the result is valid in the threads of row 0.
template <int kColumns, int kRows, typename V, typename Combine>
__device__ V column_reduce(V v, Combine combine) {
  __shared__ V tile[kRows][kColumns];
  tile[threadIdx.y][threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.y == 0) {
    for (int row = 1; row < kRows; ++row) v = combine(v, tile[row][threadIdx.x]);
  }
  return v;
}

// ---- the chunks of a StatsPlan -----------------------------------------------------

// What the block of a channels_first partial launch (one block per chunk
// and channel) reduces: chunk j of channel c, which covers `planes` planes
// from plane0, and in each the `width` positions from s0.
struct PlaneChunk {
  int64_t c, j, plane0, planes, s0, width;
};

__device__ __forceinline__ PlaneChunk plane_chunk(const StatsPlan& plan) {
  const int64_t task = blockIdx.x;
  const int64_t c = task / plan.chunks, j = task % plan.chunks;
  if (plan.pieces_per_plane > 0) {  // a plane holds several chunks
    const int64_t s0 = (j % plan.pieces_per_plane) * plan.piece_len;
    return {c, j, j / plan.pieces_per_plane, 1, s0, min(plan.piece_len, plan.spatial - s0)};
  }
  const int64_t plane0 = j * plan.planes_per_chunk;  // a chunk holds several planes
  return {c, j, plane0, min(plan.planes_per_chunk, plan.batch - plane0), 0, plan.spatial};
}

// Whether the channels_first chunks of `plan` can be read in vectors of
// `vec` elements (16 bytes): every tensor 16-byte aligned, and each chunk's
// rows start and end on vector boundaries: S a multiple of vec (so every
// plane starts on one) and, where a plane holds several chunks, piece_len
// too (plan_batch_stats rounds it to kPieceAlign elements, a multiple of
// every dtype's vec). Else the kernels read one element per access.
inline bool vector_chunks(const StatsPlan& plan, int64_t vec, std::initializer_list<const void*> tensors) {
  return aligned_16(tensors) && !plan.channels_last && plan.spatial % vec == 0 && plan.piece_len % vec == 0;
}

// What the thread of a channels_last partial launch (grid: channel tiles x
// chunks) reduces: channel c (possibly past the last one) over the rows
// [first, last) of chunk j.
struct RowChunk {
  int64_t c, j, first, last;
};

__device__ __forceinline__ RowChunk row_chunk(const StatsPlan& plan) {
  const int64_t j = blockIdx.y, first = j * plan.rows_per_chunk;
  return {static_cast<int64_t>(blockIdx.x) * kTileChannels + threadIdx.x, j, first,
          min(first + plan.rows_per_chunk, plan.batch * plan.spatial)};
}

// A merge block (kChunkThreads threads) combines load(j) over the chunks j
// of its channel: strided over the threads, then across the block. The
// result is valid in thread 0.
template <typename V, typename Load, typename Combine>
__device__ V combine_chunks(int64_t chunks, Load load, Combine combine) {
  V v{};
  for (int64_t j = threadIdx.x; j < chunks; j += kChunkThreads) v = combine(v, load(j));
  return block_reduce<kChunkThreads>(v, combine);
}

// An empty batch: both per-channel outputs zero (all-zero bits).
inline cudaError_t zero_outputs(void* a, void* b, size_t bytes, cudaStream_t stream) {
  const cudaError_t err = cudaMemsetAsync(a, 0, bytes, stream);
  if (err != cudaSuccess) return err;
  return cudaMemsetAsync(b, 0, bytes, stream);
}

}  // namespace cuda
}  // namespace effilayers

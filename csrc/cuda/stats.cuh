// Launchers for the batch-statistics CUDA kernels. Plain C++ and CUDA
// runtime types only, so stats.cu compiles with nvcc alone (no torch
// headers) and stats_binding.cpp can include this from a host compiler.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace effilayers {
namespace cuda {

enum class DType : int { Half = 0, BFloat16 = 1, Float = 2, Double = 3 };

// How the per-channel values are cut into blocks of work. Computed on the
// host; every chunk has the same shape for every channel.
struct StatsPlan {
  int64_t batch = 0, channels = 0, spatial = 1;
  bool channels_last = false;
  int64_t chunks = 0;  // partial results per channel
  // channels_first: a chunk is planes [j*planes_per_chunk, ...) when a plane
  // is shorter than a chunk, else piece (j % pieces_per_plane) of plane
  // j / pieces_per_plane.
  // piece_len is a multiple of kPieceAlign elements, so the pieces of a
  // plane start on 16-byte boundaries when the plane does (vector_chunks).
  int64_t planes_per_chunk = 0, pieces_per_plane = 0, piece_len = 0;
  // channels_last: a chunk is rows [j*rows_per_chunk, ...).
  int64_t rows_per_chunk = 0;
};

constexpr int64_t kPieceAlign = 8;  // 16 bytes of the narrowest dtype (fp16, bf16)

StatsPlan plan_batch_stats(int64_t batch, int64_t channels, int64_t spatial, bool channels_last);

// Workspace in elements of the accumulation type (float, or double for
// double input): mean and M2 per (chunk, channel) plus a count per chunk.
int64_t batch_stats_workspace_elements(const StatsPlan& plan);

// mean/var/workspace hold float, or double when dtype is Double. var
// divides M2 by (count - correction); NaN when that is <= 0; an empty batch
// gives mean 0, var 0.
cudaError_t batch_stats(const void* input, DType dtype, const StatsPlan& plan, int64_t correction, void* mean,
                        void* var, void* workspace, cudaStream_t stream);

}  // namespace cuda
}  // namespace effilayers

// Launchers for the activated-BatchNorm CUDA kernels (abn.cu). Plain C++ and
// CUDA runtime types only, like stats.cuh, so abn.cu compiles with nvcc alone
// and abn_binding.cpp can include this from a host compiler.
//
// The math is the reference in effilayers/ops/abn/reference.py:
//   forward:  z = act(s * (x - mean) * invstd + beta [+ residual])
//   backward: dy = grad * act'(y), x_hat = (x - mean) * invstd (or rebuilt
//             from z), sum_dy, sum_dy_xhat per channel, and
//             grad_input = s * invstd * (dy - mean_dy - x_hat * mean_dy_xhat).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/activation.h"
#include "stats.cuh"

namespace effilayers {
namespace cuda {

using effilayers::Activation;

// The per-channel side of one call. Vectors hold plan.channels contiguous
// values of the accumulation type (float, or double when dtype is Double) on
// the device of the data.
struct AbnChannels {
  DType dtype = DType::Float;  // of the full-size tensors
  const void* mean = nullptr;
  const void* invstd = nullptr;
  const void* weight = nullptr;  // null: s = 1
  const void* bias = nullptr;    // null: beta = 0
  // > 0: s = sign(weight) * max(|weight|, weight_eps), sign(0) = +1;
  // otherwise s = weight.
  double weight_eps = 0.0;
  Activation activation = Activation::Identity;
  double activation_param = 0.0;  // leaky_relu negative slope, elu alpha
};

// Every launcher takes the geometry of plan_batch_stats (stats.cuh): dense
// (N, C, S), channels_first or channels_last. All full-size tensors of one
// call share that layout, so one flat index addresses all of them.
//
// Workspace, in elements of the accumulation type: folded per-channel
// constants, plus the per-chunk partial sums when `reduce`.
int64_t abn_workspace_elements(const StatsPlan& plan, bool reduce);

// out may alias x (in place); residual may be null.
cudaError_t abn_forward(const void* x, const void* residual, void* out, const StatsPlan& plan,
                        const AbnChannels& channels, void* workspace, cudaStream_t stream);

// saved is the output z when saved_is_output (x_hat is rebuilt by inverting
// the activation and the affine map), else the input x. sum_dy / sum_dy_xhat
// receive plan.channels values of the accumulation type; an empty batch
// gives zeros. Deterministic: no atomics, a fixed summation order.
cudaError_t abn_backward_reduce(const void* grad, const void* saved, const void* residual, bool saved_is_output,
                                const StatsPlan& plan, const AbnChannels& channels, void* sum_dy,
                                void* sum_dy_xhat, void* workspace, cudaStream_t stream);

// mean_dy / mean_dy_xhat: plan.channels values of the accumulation type.
// grad_residual (may be null) receives dy in the input dtype.
cudaError_t abn_backward_elemt(const void* grad, const void* saved, const void* residual, bool saved_is_output,
                               const StatsPlan& plan, const AbnChannels& channels, const void* mean_dy,
                               const void* mean_dy_xhat, void* grad_input, void* grad_residual, void* workspace,
                               cudaStream_t stream);

}  // namespace cuda
}  // namespace effilayers

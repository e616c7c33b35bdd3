// Operator schemas of the compiled kernels, one string per op, shared by the
// CPU library (namespace effilayers_cpu) and the CUDA one (effilayers_cuda)
// so the two cannot drift apart. They match the Python custom ops in
// effilayers/ops/.
#pragma once

namespace effilayers {
namespace schema {

constexpr const char* kBatchStats =
    "batch_stats(Tensor input, int correction) -> (Tensor mean, Tensor var, Tensor count)";

// Batch statistics, BatchNorm's running update and invstd in one call
// (effilayers/ops/_batchnorm.py; common/batch_norm.h).
constexpr const char* kNormalizingStatistics =
    "normalizing_statistics(Tensor input, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
    "Tensor(c!)? num_batches_tracked, float momentum, bool cumulative, float eps) -> (Tensor mean, Tensor invstd)";

// Its finishing step alone, for statistics the caller already has (a dense
// block's shared ones): the running update and invstd = rsqrt(var + eps).
constexpr const char* kFinishStatistics =
    "finish_statistics(Tensor mean, Tensor var, int count, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
    "Tensor(c!)? num_batches_tracked, float momentum, bool cumulative, float eps) -> Tensor";

constexpr const char* kAbnForward =
    "abn_forward(Tensor x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, Tensor? residual, "
    "str activation, float activation_param, float weight_eps) -> Tensor";

constexpr const char* kAbnForwardInplace =
    "abn_forward_(Tensor(a!) x, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, Tensor? residual, "
    "str activation, float activation_param, float weight_eps) -> ()";

constexpr const char* kAbnBackwardReduce =
    "abn_backward_reduce(Tensor grad, Tensor saved, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, "
    "Tensor? residual, str activation, float activation_param, float weight_eps, bool saved_is_output) "
    "-> (Tensor, Tensor)";

constexpr const char* kAbnBackwardElemt =
    "abn_backward_elemt(Tensor grad, Tensor saved, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, "
    "Tensor? residual, str activation, float activation_param, float weight_eps, bool saved_is_output, "
    "Tensor mean_dy, Tensor mean_dy_xhat, bool want_residual_grad) -> (Tensor, Tensor)";

// abn_backward_reduce, the means and abn_backward_elemt in one call, for one
// rank (common/batch_norm.h; effilayers/ops/_batchnorm.py's backward_passes).
constexpr const char* kAbnBackward =
    "abn_backward(Tensor grad, Tensor saved, Tensor mean, Tensor invstd, Tensor? weight, Tensor? bias, "
    "Tensor? residual, str activation, float activation_param, float weight_eps, bool saved_is_output, int count, "
    "bool need_sums, bool need_elemt, bool want_residual_grad) -> (Tensor, Tensor, Tensor, Tensor)";

// Fused Adam/AdamW update of a run of parameters whose states lie end to end
// in flat buffers (effilayers/ops/adam/ describes the arguments).
constexpr const char* kAdamStep =
    "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
    "Tensor(d!)? max_exp_avg_sq, Tensor(e!)? master, Tensor step, Tensor? grad_scale, Tensor? found_inf, "
    "float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled_weight_decay, "
    "bool maximize) -> ()";

// Softmax family (effilayers/ops/softmax/): output dtype `dtype` (None: x's),
// gradient in `input_dtype`; the scaled/masked forward's backward is
// softmax_backward over the last dim with its scale.
constexpr const char* kSoftmaxForward =
    "softmax_forward(Tensor x, int dim, bool log, ScalarType? dtype) -> Tensor";

constexpr const char* kSoftmaxBackward =
    "softmax_backward(Tensor grad, Tensor output, int dim, bool log, float scale, ScalarType input_dtype) -> Tensor";

constexpr const char* kScaledMaskedSoftmaxForward =
    "scaled_masked_softmax_forward(Tensor x, Tensor? mask, float scale, bool causal) -> Tensor";

// Sum / mean / var / std / vector 2-norm over the middle dimension of an
// (outer, reduced, inner) strided view into a contiguous (outer, inner) out
// of the result dtype (effilayers/ops/reductions/).
constexpr const char* kReduce = "reduce_(Tensor x, Tensor(a!) out, str kind, float correction) -> ()";

// The same update with 8-bit block-quantized states: int8 / uint8 codes and
// one float32 absmax per block of 256 (effilayers/ops/adam/).
constexpr const char* kAdamStep8bit =
    "adam_step_8bit_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!) exp_avg, Tensor(c!) exp_avg_absmax, "
    "Tensor(d!) exp_avg_sq, Tensor(e!) exp_avg_sq_absmax, Tensor(f!)? max_exp_avg_sq, "
    "Tensor(g!)? max_exp_avg_sq_absmax, Tensor(h!)? master, Tensor step, Tensor? grad_scale, Tensor? found_inf, "
    "float lr, float beta1, float beta2, float eps, float weight_decay, bool decoupled_weight_decay, "
    "bool maximize) -> ()";

}  // namespace schema
}  // namespace effilayers

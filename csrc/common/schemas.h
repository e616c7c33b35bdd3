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

// The DenseNet bottleneck conv(relu(batch_norm(cat(features))), padding) with
// given statistics, and its gradients (of the concatenation, BatchNorm's bias
// and weight, the convolution weight; empty where not asked for)
// (effilayers/ops/densenet/).
constexpr const char* kDenseBottleneckForward =
    "dense_bottleneck_forward(Tensor[] features, Tensor mean, Tensor invstd, Tensor weight, Tensor bias, "
    "Tensor conv_weight, int padding) -> Tensor";

constexpr const char* kDenseBottleneckBackward =
    "dense_bottleneck_backward(Tensor grad_out, Tensor[] features, Tensor mean, Tensor invstd, Tensor weight, "
    "Tensor bias, Tensor conv_weight, bool batch_stats, bool need_input, bool need_conv, int padding) "
    "-> (Tensor, Tensor, Tensor, Tensor)";

// Softmax family (effilayers/ops/softmax/): output dtype `dtype` (None: x's),
// gradient in `input_dtype`; the scaled/masked forward's backward is
// softmax_backward over the last dim with its scale.
constexpr const char* kSoftmaxForward =
    "softmax_forward(Tensor x, int dim, bool log, ScalarType? dtype) -> Tensor";

constexpr const char* kSoftmaxBackward =
    "softmax_backward(Tensor grad, Tensor output, int dim, bool log, float scale, ScalarType input_dtype) -> Tensor";

constexpr const char* kScaledMaskedSoftmaxForward =
    "scaled_masked_softmax_forward(Tensor x, Tensor? mask, float scale, bool causal) -> Tensor";

// Row-wise cross-entropy over an (N, C, I) view of the logits: per-row losses,
// and the reduction-scaled gradient written into `grad` (which may be the
// logits themselves) when given (effilayers/ops/cross_entropy/).
constexpr const char* kCrossEntropyRows =
    "cross_entropy_rows(Tensor logits, Tensor target, Tensor? weight, Tensor(a!)? grad, Tensor grad_scale, "
    "int ignore_index, float label_smoothing) -> Tensor";

// One vocabulary chunk of wider rows ((rows, classes) logits, classes
// contiguous, starting at class `class_offset`): the online statistics
// updated in place in `stats` (4, rows), then, given the final log-sum-exp
// and scales in `row_terms` (4, rows), the gradient written over the logits
// (effilayers/ops/cross_entropy/, used by linear_cross_entropy).
constexpr const char* kCrossEntropyChunkStats =
    "cross_entropy_chunk_stats_(Tensor logits, Tensor target, Tensor? weight, Tensor(a!) stats, int class_offset, "
    "int ignore_index, bool smoothing) -> ()";

constexpr const char* kCrossEntropyChunkGrad =
    "cross_entropy_chunk_grad_(Tensor(a!) logits, Tensor target, Tensor? class_term, Tensor row_terms, "
    "int class_offset, int ignore_index) -> ()";

// The same two passes for rows with class-probability targets `probs` (the
// chunk's classes, (rows, classes), any floating dtype and strides), each probability
// weighted as q_c = p_c * prob_weight_c + class_term_c: `stats` (4, rows)
// gains sum_c q_c z_c and sum_c q_c; `row_terms` (3, rows) is the final
// log-sum-exp, sum_c q_c over the whole row, and the gradient's scale.
constexpr const char* kCrossEntropySoftChunkStats =
    "cross_entropy_soft_chunk_stats_(Tensor logits, Tensor probs, Tensor? prob_weight, Tensor? class_term, "
    "Tensor(a!) stats) -> ()";

constexpr const char* kCrossEntropySoftChunkGrad =
    "cross_entropy_soft_chunk_grad_(Tensor(a!) logits, Tensor probs, Tensor? prob_weight, Tensor? class_term, "
    "Tensor row_terms) -> ()";

}  // namespace schema
}  // namespace effilayers

// BatchNorm's normalising statistics, and activated BatchNorm's backward, each
// in one call, for the bindings of both libraries (torch headers: never
// included by a .cu file).
//
// One host round trip instead of a chain of small ops: a layer on a small
// tensor spends its time on the host, and this is most of a BatchNorm
// forward's host work. It matches effilayers/ops/_batchnorm.py's
// normalizing_statistics for one tensor on one rank (the Python path serves
// the rest, and torch.compile): the library's batch_stats kernel, then
// BatchNorm's running update with its arithmetic, running = (1 - f) running +
// f batch with the unbiased variance, then invstd = rsqrt(var + eps).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>

namespace effilayers {

// The factor of BatchNorm's running update: `momentum`, or with
// momentum=None a cumulative average, 1 / num_batches_tracked (after this
// batch's increment; a host read, as in torch's BatchNorm).
inline double running_factor(const std::optional<at::Tensor>& num_batches_tracked, double momentum,
                             bool cumulative) {
  return cumulative ? 1.0 / num_batches_tracked->item<double>() : momentum;
}

// The finishing step composed of ATen ops, for a device without its own:
// num_batches_tracked += 1, the running update when count > 0, and
// invstd = rsqrt(var + eps).
inline at::Tensor finish_statistics_aten(const at::Tensor& mean, const at::Tensor& var, int64_t count,
                                         const std::optional<at::Tensor>& running_mean,
                                         const std::optional<at::Tensor>& running_var,
                                         const std::optional<at::Tensor>& num_batches_tracked, double momentum,
                                         bool cumulative, double eps) {
  if (num_batches_tracked) num_batches_tracked->add_(1);
  if (count > 0 && (running_mean || running_var)) {
    const double factor = running_factor(num_batches_tracked, momentum, cumulative);
    if (running_mean) running_mean->mul_(1 - factor).add_(mean.to(running_mean->scalar_type()), factor);
    if (running_var) {
      const at::Tensor unbiased = var.mul(static_cast<double>(count) / static_cast<double>(count - 1));
      running_var->mul_(1 - factor).add_(unbiased.to(running_var->scalar_type()), factor);
    }
  }
  return var.add(eps).rsqrt_();
}

using BatchStats = std::tuple<at::Tensor, at::Tensor, at::Tensor> (*)(const at::Tensor& input, int64_t correction);
using FinishStatistics = at::Tensor (*)(const at::Tensor& mean, const at::Tensor& var, int64_t count,
                                        const std::optional<at::Tensor>& running_mean,
                                        const std::optional<at::Tensor>& running_var,
                                        const std::optional<at::Tensor>& num_batches_tracked, double momentum,
                                        bool cumulative, double eps);

// The op `normalizing_statistics` of the library whose batch_stats kernel is
// `batch_stats` and whose finishing step (the running update and invstd,
// an empty batch leaving the running statistics untouched) is `finish`.
template <BatchStats batch_stats, FinishStatistics finish>
std::tuple<at::Tensor, at::Tensor> normalizing_statistics(const at::Tensor& input,
                                                          const std::optional<at::Tensor>& running_mean,
                                                          const std::optional<at::Tensor>& running_var,
                                                          const std::optional<at::Tensor>& num_batches_tracked,
                                                          double momentum, bool cumulative, double eps) {
  TORCH_CHECK_VALUE(!cumulative || num_batches_tracked.has_value() || (!running_mean && !running_var),
                    "normalizing_statistics: a cumulative average of running statistics needs num_batches_tracked");
  auto [mean, var, count_tensor] = batch_stats(input, 0);
  const int64_t count = input.numel() / std::max<int64_t>(input.size(1), 1);
  TORCH_CHECK_VALUE(count != 1, "expected more than 1 value per channel when training, got input size ",
                    input.sizes());
  at::Tensor invstd = finish(mean, var, count, running_mean, running_var, num_batches_tracked, momentum, cumulative,
                             eps);
  return {mean, invstd};
}

// The op `finish_statistics`: `finish` on statistics the caller computed
// (per-channel float32 or float64 vectors, as batch_stats returns them).
template <FinishStatistics finish>
at::Tensor checked_finish(const at::Tensor& mean, const at::Tensor& var, int64_t count,
                          const std::optional<at::Tensor>& running_mean, const std::optional<at::Tensor>& running_var,
                          const std::optional<at::Tensor>& num_batches_tracked, double momentum, bool cumulative,
                          double eps) {
  TORCH_CHECK_VALUE(mean.dim() == 1 && var.dim() == 1 && mean.numel() == var.numel() && mean.is_contiguous() &&
                        var.is_contiguous(),
                    "finish_statistics: mean and var must be contiguous vectors of one length, got ", mean.sizes(),
                    " and ", var.sizes());
  TORCH_CHECK_VALUE(mean.scalar_type() == var.scalar_type() &&
                        (var.scalar_type() == at::kFloat || var.scalar_type() == at::kDouble),
                    "finish_statistics: mean and var must both be float32 or float64, got ", mean.scalar_type(),
                    " and ", var.scalar_type());
  TORCH_CHECK_VALUE(count >= 0, "finish_statistics: count must be non-negative, got ", count);
  TORCH_CHECK_VALUE(!cumulative || num_batches_tracked.has_value() || (!running_mean && !running_var),
                    "finish_statistics: a cumulative average of running statistics needs num_batches_tracked");
  return finish(mean, var, count, running_mean, running_var, num_batches_tracked, momentum, cumulative, eps);
}

// ---- backward -----------------------------------------------------------------

using AbnBackwardReduce = std::tuple<at::Tensor, at::Tensor> (*)(
    const at::Tensor& grad, const at::Tensor& saved, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, std::string activation, double activation_param, double weight_eps,
    bool saved_is_output);
using AbnBackwardElemt = std::tuple<at::Tensor, at::Tensor> (*)(
    const at::Tensor& grad, const at::Tensor& saved, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, std::string activation, double activation_param, double weight_eps,
    bool saved_is_output, const at::Tensor& mean_dy, const at::Tensor& mean_dy_xhat, bool want_residual_grad);

// The op `abn_backward`: effilayers/ops/_batchnorm.py's backward_passes for
// one rank in one call (the reduce kernel, the means, the element kernel), so
// a small layer's backward is one host round trip. Returns (grad_input,
// grad_residual, sum_dy, sum_dy_xhat), undefined (None) where not asked for;
// count 0 means running statistics, constants with no mean terms.
template <AbnBackwardReduce reduce, AbnBackwardElemt elemt>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> abn_backward(
    const at::Tensor& grad, const at::Tensor& saved, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, std::string activation, double activation_param, double weight_eps,
    bool saved_is_output, int64_t count, bool need_sums, bool need_elemt, bool want_residual_grad) {
  TORCH_CHECK_VALUE(count == 0 || need_sums || !need_elemt,
                    "abn_backward: batch statistics (count > 0) need the sums for the input gradient");
  at::Tensor sum_dy, sum_dy_xhat, grad_input, grad_residual;
  if (need_sums) {
    std::tie(sum_dy, sum_dy_xhat) = reduce(grad, saved, mean, invstd, weight, bias, residual, activation,
                                           activation_param, weight_eps, saved_is_output);
  }
  if (need_elemt) {
    const at::Tensor mean_dy = count > 0 ? sum_dy.div(static_cast<double>(count)) : at::zeros_like(mean);
    const at::Tensor mean_dy_xhat = count > 0 ? sum_dy_xhat.div(static_cast<double>(count)) : mean_dy;
    std::tie(grad_input, grad_residual) = elemt(grad, saved, mean, invstd, weight, bias, residual, activation,
                                                activation_param, weight_eps, saved_is_output, mean_dy,
                                                mean_dy_xhat, want_residual_grad);
  }
  return {grad_input, grad_residual, sum_dy, sum_dy_xhat};
}

// ---- registration ---------------------------------------------------------------

// Each library binds its kernels to the ops (declared once, in Python:
// ops/stats/op.py, ops/_batchnorm.py, ops/abn/op.py) through these, so the
// compositions above are put together the same way on every device and a
// library names only its own kernels.
template <BatchStats batch_stats, FinishStatistics finish>
void register_statistics_kernels(torch::Library& m) {
  m.impl("batch_stats", batch_stats);
  m.impl("normalizing_statistics", &normalizing_statistics<batch_stats, finish>);
  m.impl("finish_statistics", &checked_finish<finish>);
}

template <auto forward, auto forward_inplace, AbnBackwardReduce reduce, AbnBackwardElemt elemt>
void register_abn_kernels(torch::Library& m) {
  m.impl("abn_forward", forward);
  m.impl("abn_forward_", forward_inplace);
  m.impl("abn_backward_reduce", reduce);
  m.impl("abn_backward_elemt", elemt);
  m.impl("abn_backward", &abn_backward<reduce, elemt>);
}

}  // namespace effilayers

// Activated BatchNorm's CPU kernels (abn.cpp), for the other CPU ops that
// are built on them (densenet.cpp): a direct call, without the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

namespace effilayers {

at::Tensor abn_forward_cpu(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual, std::string activation, double param,
                           double weight_eps);

void abn_forward_inplace_cpu(at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                             const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual, std::string activation, double param,
                             double weight_eps);

std::tuple<at::Tensor, at::Tensor> abn_backward_reduce_cpu(
    const at::Tensor& grad, const at::Tensor& saved, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, std::string activation, double param, double weight_eps,
    bool saved_is_output);

std::tuple<at::Tensor, at::Tensor> abn_backward_elemt_cpu(
    const at::Tensor& grad, const at::Tensor& saved, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, std::string activation, double param, double weight_eps,
    bool saved_is_output, const at::Tensor& mean_dy, const at::Tensor& mean_dy_xhat, bool want_residual_grad);

}  // namespace effilayers

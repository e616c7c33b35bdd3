// Torch binding of the activated-BatchNorm CUDA kernels in abn.cu:
// effilayers_cuda::abn_forward, abn_forward_, abn_backward_reduce and
// abn_backward_elemt, with the schemas of their CPU counterparts. Built
// where torch has CUDA, and on CPU tensors into the emulated test library
// (binding.h).
//
// The kernels walk every full-size tensor of a call with one flat index, so
// the binding makes them share one dense layout: x (or saved) is used in
// place when it is contiguous or dense channels-last, else copied to
// contiguous, and any other full-size tensor with different strides is
// copied to match it.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>

#include "common/batch_norm.h"
#include "common/checks.h"
#include "cuda/binding.h"
#include "cuda/abn.cuh"

namespace effilayers {
namespace {

void check_cuda_input(const at::Tensor& x, const char* op, const char* name) {
  check_batch_input(x, op);
  TORCH_CHECK(on_kernel_device(x), op, " (cuda kernel): ", name, " must be a ", kKernelDevice, " tensor, got ",
              x.device());
}

// A (C,) vector in the accumulation dtype, contiguous, as the kernels read it.
at::Tensor channel_vector(const at::Tensor& t, const at::Tensor& x, const char* op, const char* name) {
  const int64_t C = x.size(1);
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == C, op, ": ", name, " must have shape (", C, ",), got ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.device() == x.device(), op, ": ", name, " is on ", t.device(), " but input is on ",
                    x.device());
  return t.to(accumulation_type(x.scalar_type())).contiguous();
}

const void* maybe_ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->const_data_ptr() : nullptr; }

// The per-channel inputs of one call, kept alive until their kernels are
// queued (the caching allocator orders any reuse after them on the stream).
struct Channels {
  at::Tensor mean, invstd;
  std::optional<at::Tensor> weight, bias;
  cuda::AbnChannels view;
};

Channels channels_for(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                      const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                      cuda::Activation activation, double activation_param, double weight_eps, const char* op) {
  Channels ch;
  ch.mean = channel_vector(mean, x, op, "mean");
  ch.invstd = channel_vector(invstd, x, op, "invstd");
  if (weight.has_value()) ch.weight = channel_vector(*weight, x, op, "weight");
  if (bias.has_value()) ch.bias = channel_vector(*bias, x, op, "bias");
  ch.view.dtype = kernel_dtype(x.scalar_type(), op);
  ch.view.mean = ch.mean.const_data_ptr();
  ch.view.invstd = ch.invstd.const_data_ptr();
  ch.view.weight = maybe_ptr(ch.weight);
  ch.view.bias = maybe_ptr(ch.bias);
  ch.view.weight_eps = weight_eps;
  ch.view.activation = activation;
  ch.view.activation_param = activation_param;
  return ch;
}

cuda::StatsPlan plan_for(const at::Tensor& x) {
  const BatchGeometry g = batch_geometry(x);
  return cuda::plan_batch_stats(g.batch, g.channels, g.spatial, g.channels_last);
}

at::Tensor workspace_for(const cuda::StatsPlan& plan, const at::Tensor& x, bool reduce) {
  return at::empty({std::max<int64_t>(1, cuda::abn_workspace_elements(plan, reduce))},
                   x.options().dtype(accumulation_type(x.scalar_type())));
}

// The forward of abn_forward (into a new tensor) and abn_forward_ (into
// x_arg itself); returns the output. x_arg's strides no kernel walks
// (neither contiguous nor dense channels-last) are computed on a copy.
at::Tensor forward(const at::Tensor& x_arg, const at::Tensor& mean, const at::Tensor& invstd,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   const std::optional<at::Tensor>& residual_arg, const std::string& activation,
                   double activation_param, double weight_eps, bool inplace, const char* op) {
  check_cuda_input(x_arg, op, "x");
  const KernelDeviceGuard guard(x_arg.device());
  const at::Tensor x = readable_batch(x_arg);
  const at::Tensor out = inplace ? x : at::empty_like(x);
  const cuda::Activation act = parse_activation(activation, op);
  const auto residual = matching(residual_arg, x, op, "residual");
  const Channels ch = channels_for(x, mean, invstd, weight, bias, act, activation_param, weight_eps, op);
  if (x.numel() > 0) {
    const cuda::StatsPlan plan = plan_for(x);
    at::Tensor workspace = workspace_for(plan, x, /*reduce=*/false);
    EFFILAYERS_KERNEL_CHECK(cuda::abn_forward(x.const_data_ptr(), maybe_ptr(residual), out.mutable_data_ptr(), plan,
                                              ch.view, workspace.mutable_data_ptr(), kernel_stream()));
  }
  if (inplace && !x.is_same(x_arg)) x_arg.copy_(x);
  return out;
}

at::Tensor abn_forward_cuda(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                            const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual, std::string activation,
                            double activation_param, double weight_eps) {
  return forward(x, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps,
                 /*inplace=*/false, "abn_forward");
}

void abn_forward_inplace_cuda(at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& residual, std::string activation,
                              double activation_param, double weight_eps) {
  forward(x, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps, /*inplace=*/true,
          "abn_forward_");
}

// What both backward ops start from, under the device guard of saved: the
// saved tensor in a layout the kernels walk, grad and residual with its
// strides, and the per-channel inputs.
struct BackwardInputs {
  at::Tensor saved, grad;
  std::optional<at::Tensor> residual;
  Channels ch;
};

BackwardInputs backward_inputs(const at::Tensor& grad_arg, const at::Tensor& saved_arg, const at::Tensor& mean,
                               const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual_arg,
                               const std::string& activation, double activation_param, double weight_eps,
                               bool saved_is_output, const char* op) {
  const cuda::Activation act = parse_backward_activation(activation, saved_is_output, op);
  BackwardInputs in;
  in.saved = readable_batch(saved_arg);
  in.grad = matching(grad_arg, in.saved, op, "grad");
  in.residual = matching(residual_arg, in.saved, op, "residual");
  in.ch = channels_for(in.saved, mean, invstd, weight, bias, act, activation_param, weight_eps, op);
  return in;
}

std::tuple<at::Tensor, at::Tensor> abn_backward_reduce_cuda(
    const at::Tensor& grad_arg, const at::Tensor& saved_arg, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual_arg, std::string activation, double activation_param,
    double weight_eps, bool saved_is_output) {
  const char* op = "abn_backward_reduce";
  check_cuda_input(saved_arg, op, "saved");
  const KernelDeviceGuard guard(saved_arg.device());
  const BackwardInputs in = backward_inputs(grad_arg, saved_arg, mean, invstd, weight, bias, residual_arg, activation,
                                            activation_param, weight_eps, saved_is_output, op);
  const cuda::StatsPlan plan = plan_for(in.saved);
  const auto acc_options = in.saved.options().dtype(accumulation_type(in.saved.scalar_type()));
  at::Tensor sum_dy = at::empty({plan.channels}, acc_options);
  at::Tensor sum_dy_xhat = at::empty({plan.channels}, acc_options);
  at::Tensor workspace = workspace_for(plan, in.saved, /*reduce=*/true);
  EFFILAYERS_KERNEL_CHECK(cuda::abn_backward_reduce(in.grad.const_data_ptr(), in.saved.const_data_ptr(),
                                                    maybe_ptr(in.residual), saved_is_output, plan, in.ch.view,
                                                    sum_dy.mutable_data_ptr(), sum_dy_xhat.mutable_data_ptr(),
                                                    workspace.mutable_data_ptr(), kernel_stream()));
  return {sum_dy, sum_dy_xhat};
}

std::tuple<at::Tensor, at::Tensor> abn_backward_elemt_cuda(
    const at::Tensor& grad_arg, const at::Tensor& saved_arg, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual_arg, std::string activation, double activation_param,
    double weight_eps, bool saved_is_output, const at::Tensor& mean_dy_arg, const at::Tensor& mean_dy_xhat_arg,
    bool want_residual_grad) {
  const char* op = "abn_backward_elemt";
  check_cuda_input(saved_arg, op, "saved");
  const KernelDeviceGuard guard(saved_arg.device());
  const BackwardInputs in = backward_inputs(grad_arg, saved_arg, mean, invstd, weight, bias, residual_arg, activation,
                                            activation_param, weight_eps, saved_is_output, op);
  const at::Tensor mean_dy = channel_vector(mean_dy_arg, in.saved, op, "mean_dy");
  const at::Tensor mean_dy_xhat = channel_vector(mean_dy_xhat_arg, in.saved, op, "mean_dy_xhat");
  at::Tensor grad_input = at::empty_like(in.saved);
  at::Tensor grad_residual = want_residual_grad ? at::empty_like(in.saved) : saved_arg.new_empty({0});
  if (in.saved.numel() > 0) {
    const cuda::StatsPlan plan = plan_for(in.saved);
    at::Tensor workspace = workspace_for(plan, in.saved, /*reduce=*/false);
    EFFILAYERS_KERNEL_CHECK(cuda::abn_backward_elemt(
        in.grad.const_data_ptr(), in.saved.const_data_ptr(), maybe_ptr(in.residual), saved_is_output, plan,
        in.ch.view, mean_dy.const_data_ptr(), mean_dy_xhat.const_data_ptr(), grad_input.mutable_data_ptr(),
        want_residual_grad ? grad_residual.mutable_data_ptr() : nullptr, workspace.mutable_data_ptr(),
        kernel_stream()));
  }
  return {grad_input, grad_residual};
}

}  // namespace
}  // namespace effilayers

TORCH_LIBRARY_IMPL(EFFILAYERS_KERNEL_LIBRARY, EFFILAYERS_KERNEL_DISPATCH_KEY, m) {
  effilayers::register_abn_kernels<&effilayers::abn_forward_cuda, &effilayers::abn_forward_inplace_cuda,
                                   &effilayers::abn_backward_reduce_cuda, &effilayers::abn_backward_elemt_cuda>(m);
}

// The autograd of activated BatchNorm in C++: effilayers::activated_batch_norm
// and activated_batch_norm_ (declared in effilayers/ops/abn/op.py), the path
// of an eager call on one rank. The Python Function in op.py does the same
// for what this cannot see: traced calls (torch.compile, export, functorch,
// tensor subclasses) and statistics synchronised over a process group. The
// reason for two: a Python Function costs host time on every call of a small
// layer (ARCHITECTURE.md, "One call, from Module to kernel", has the measurement).
//
// Each library registers these for its own device (cpu/autograd.cpp on
// AutogradCPU and CPU, cuda/abn_autograd.cpp on AutogradCUDA and CUDA; the
// plain key serves inference mode, which skips autograd). The kernels are
// reached through the dispatcher, so a backend forced for a test
// (effilayers._core.registry.use_backend) is what runs underneath.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#include "op_handle.h"

#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

namespace effilayers::abn_autograd {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The same words as op.py's _RefuseDoubleBackward, so both paths fail alike.
inline constexpr const char* kNoDoubleBackward =
    "effilayers: activated BatchNorm has no double backward (its backward kernels are not differentiable); use "
    "torch.nn.BatchNorm2d and the activation for higher-order gradients";

// The kernels' schemas, as op.py declares them and cpu/abn.cpp implements
// them (a `str` argument is a std::string there).
using StatisticsSignature = std::tuple<Tensor, Tensor>(const Tensor&, const OptionalTensor&, const OptionalTensor&,
                                                       const OptionalTensor&, double, bool, double);
using ForwardSignature = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                                const OptionalTensor&, const OptionalTensor&, std::string, double, double);
using InPlaceForwardSignature = void(Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
                                     const OptionalTensor&, const OptionalTensor&, std::string, double, double);
using BackwardSignature = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&, const OptionalTensor&,
    const OptionalTensor&, std::string, double, double, bool, int64_t, bool, bool, bool);

inline OptionalTensor optional(const Tensor& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; }

// Nodes are std::shared_ptr in torch 2.11 and c10::intrusive_ptr later
// (ErrorNode is a parameter so that only the branch taken is compiled).
template <class NodePointer, class ErrorNode>
NodePointer error_node(torch::autograd::edge_list&& next_edges) {
  if constexpr (std::is_same_v<NodePointer, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<ErrorNode>(kNoDoubleBackward, std::move(next_edges));
  } else {
    return c10::make_intrusive<ErrorNode>(kNoDoubleBackward, std::move(next_edges));
  }
}

// backward(create_graph=True): the kernels are not differentiable, so the
// gradients were computed as constants; tie them to what they came from
// through a node that raises if a second backward reaches it.
inline void refuse_double_backward(variable_list& grads, const variable_list& sources) {
  if (!torch::autograd::any_variable_requires_grad(sources)) return;
  using NodePointer = decltype(torch::autograd::Edge::function);
  auto node = error_node<NodePointer, torch::autograd::Error>(
      torch::autograd::collect_next_edges(at::ArrayRef<Tensor>(sources)));
  for (auto& grad : grads) {
    if (grad.defined()) torch::autograd::create_gradient_edge(grad, node);
  }
}

// act(batch_norm(x) [+ residual]); in place, x is overwritten and the
// output is what backward keeps, else x is.
template <bool kInPlace>
struct ActivatedBatchNorm : public torch::autograd::Function<ActivatedBatchNorm<kInPlace>> {
  static Tensor forward(AutogradContext* ctx, Tensor x, const OptionalTensor& weight, const OptionalTensor& bias,
                        const OptionalTensor& residual, const OptionalTensor& running_mean,
                        const OptionalTensor& running_var, const OptionalTensor& num_batches_tracked,
                        bool use_batch_stats, double momentum, bool cumulative, double eps,
                        const std::string& activation, double activation_param, double weight_eps) {
    Tensor mean, invstd;
    int64_t count = 0;
    if (use_batch_stats) {
      static auto statistics = op_handle<StatisticsSignature>("effilayers::normalizing_statistics");
      std::tie(mean, invstd) =
          statistics.call(x, running_mean, running_var, num_batches_tracked, momentum, cumulative, eps);
      count = x.numel() / x.size(1);
    } else {
      // Copies: a later training step updates the buffers in place before this backward runs.
      const auto accumulation = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      mean = running_mean->to(accumulation, /*non_blocking=*/false, /*copy=*/true);
      invstd = running_var->to(accumulation).add(eps).rsqrt_();
    }
    Tensor output;
    if constexpr (kInPlace) {
      static auto forward_ = op_handle<InPlaceForwardSignature>("effilayers::abn_forward_");
      forward_.call(x, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps);
      ctx->mark_dirty(variable_list{x});
      output = x;
    } else {
      static auto forward = op_handle<ForwardSignature>("effilayers::abn_forward");
      output = forward.call(x, mean, invstd, weight, bias, residual, activation, activation_param, weight_eps);
    }
    // The per-channel statistics are saved too, so the memory meter sees
    // everything this layer keeps.
    ctx->save_for_backward(variable_list{x, residual.value_or(Tensor()), weight.value_or(Tensor()),
                                         bias.value_or(Tensor()), mean, invstd});
    ctx->saved_data["count"] = count;
    ctx->saved_data["use_batch_stats"] = use_batch_stats;
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["activation_param"] = activation_param;
    ctx->saved_data["weight_eps"] = weight_eps;
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const variable_list saved_tensors = ctx->get_saved_variables();
    const Tensor &saved = saved_tensors[0], &residual = saved_tensors[1], &weight = saved_tensors[2],
                 &bias = saved_tensors[3], &mean = saved_tensors[4], &invstd = saved_tensors[5];
    Tensor grad = grad_outputs[0];
    if (grad.strides() != saved.strides()) {
      // An expanded or differently laid-out gradient (e.g. from .sum()):
      // the kernels walk grad and saved with one set of strides.
      grad = at::empty_like(saved).copy_(grad);
    }
    // needs_input_grad counts the tensors given (x, then weight, bias and
    // residual where present), not the arguments.
    size_t edge = 0;
    const bool need_input = ctx->needs_input_grad(edge++);
    const bool need_weight = weight.defined() && ctx->needs_input_grad(edge++);
    const bool need_bias = bias.defined() && ctx->needs_input_grad(edge++);
    const bool want_residual_grad = residual.defined() && ctx->needs_input_grad(edge++);
    const bool use_batch_stats = ctx->saved_data["use_batch_stats"].toBool();
    static auto backward = op_handle<BackwardSignature>("effilayers::abn_backward");
    Tensor grad_input, grad_residual, sum_dy, sum_dy_xhat;
    {
      at::AutoGradMode constants(false);
      std::tie(grad_input, grad_residual, sum_dy, sum_dy_xhat) = backward.call(
          grad, saved, mean, invstd, optional(weight), optional(bias), optional(residual),
          ctx->saved_data["activation"].toStringRef(), ctx->saved_data["activation_param"].toDouble(),
          ctx->saved_data["weight_eps"].toDouble(), kInPlace, ctx->saved_data["count"].toInt(),
          use_batch_stats || need_weight || need_bias, need_input || want_residual_grad, want_residual_grad);
    }
    // One gradient per forward argument. Straight through the weight clamp:
    // where |weight| < weight_eps the clamp is flat, and its true derivative
    // (zero) would freeze a weight that starts or decays there for good.
    variable_list grads(15);
    if (need_input) grads[0] = grad_input;
    if (need_weight) grads[1] = sum_dy_xhat.to(weight.scalar_type());
    if (need_bias) grads[2] = sum_dy.to(bias.scalar_type());
    if (want_residual_grad) grads[3] = grad_residual;
    if (at::GradMode::is_enabled()) {
      refuse_double_backward(grads, variable_list{grad_outputs[0], saved, residual, weight, bias, mean, invstd});
    }
    return grads;
  }
};

template <bool kInPlace>
Tensor activated_batch_norm(std::conditional_t<kInPlace, Tensor&, const Tensor&> x, const OptionalTensor& weight,
                            const OptionalTensor& bias, const OptionalTensor& residual,
                            const OptionalTensor& running_mean, const OptionalTensor& running_var,
                            const OptionalTensor& num_batches_tracked, bool use_batch_stats, double momentum,
                            bool cumulative, double eps, std::string activation, double activation_param,
                            double weight_eps) {
  return ActivatedBatchNorm<kInPlace>::apply(x, weight, bias, residual, running_mean, running_var,
                                             num_batches_tracked, use_batch_stats, momentum, cumulative, eps,
                                             activation, activation_param, weight_eps);
}

inline void register_kernels(torch::Library& m) {
  m.impl("activated_batch_norm", &activated_batch_norm<false>);
  m.impl("activated_batch_norm_", &activated_batch_norm<true>);
}

}  // namespace effilayers::abn_autograd

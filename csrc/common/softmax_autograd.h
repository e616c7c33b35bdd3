// The autograd of softmax and log-softmax in C++: effilayers::softmax
// (declared in effilayers/ops/softmax/op.py), the path of an eager call on a
// CPU tensor. The Python Function in op.py does the same where this is not
// registered or cannot see the call (traced calls, tensor subclasses, a
// forced reference backend, CUDA tensors, whose kernels are Triton's). The
// reason for two: a Python Function costs more host time than the kernel of
// a small softmax (ARCHITECTURE.md, "One call, from Module to kernel").
//
// The kernels are reached through the dispatcher below the Autograd key, so
// the backend the registry chose is what runs underneath; the ops' own
// Python autograd is skipped, except for backward(create_graph=True), where
// the backward op's registered derivative makes the gradient differentiable.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "op_handle.h"

#include <optional>

namespace effilayers::softmax_autograd {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The kernels' schemas, as op.py declares them and cpu/softmax.cpp implements them.
using ForwardSignature = Tensor(const Tensor&, int64_t, bool, std::optional<at::ScalarType>);
using BackwardSignature = Tensor(const Tensor&, const Tensor&, int64_t, bool, double, at::ScalarType);

// softmax / log_softmax of x along dim; only the output is kept for backward.
struct Softmax : public torch::autograd::Function<Softmax> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, int64_t dim, bool log,
                        std::optional<at::ScalarType> dtype) {
    static auto forward_op = op_handle<ForwardSignature>("effilayers::softmax_forward");
    Tensor output;
    {
      at::AutoDispatchBelowAutograd below;
      output = forward_op.call(x, dim, log, dtype);
    }
    ctx->save_for_backward(variable_list{output});
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["log"] = log;
    ctx->saved_data["input_dtype"] = static_cast<int64_t>(x.scalar_type());
    return output;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    static auto backward_op = op_handle<BackwardSignature>("effilayers::softmax_backward");
    const Tensor output = ctx->get_saved_variables()[0];
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const bool log = ctx->saved_data["log"].toBool();
    const auto input_dtype = static_cast<at::ScalarType>(ctx->saved_data["input_dtype"].toInt());
    // Below the Autograd key unless the gradient must be differentiable.
    std::optional<at::AutoDispatchBelowAutograd> below;
    if (!at::GradMode::is_enabled()) below.emplace();
    const Tensor grad_input = backward_op.call(grad_outputs[0], output, dim, log, 1.0, input_dtype);
    // One gradient per forward argument after ctx: x, dim, log, dtype.
    return variable_list{grad_input, Tensor(), Tensor(), Tensor()};
  }
};

inline Tensor softmax(const Tensor& x, int64_t dim, bool log, std::optional<at::ScalarType> dtype) {
  return Softmax::apply(x, dim, log, dtype);
}

inline void register_kernels(torch::Library& m) { m.impl("softmax", &softmax); }

}  // namespace effilayers::softmax_autograd

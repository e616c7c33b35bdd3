// The DenseNet bottleneck on CPU: the CPU kernels of effilayers::dense_bottleneck_forward
// and dense_bottleneck_backward, the math of effilayers/ops/densenet/reference.py.
//
// Each is one call from Python: the concatenation, ABN's kernels (abn.cpp)
// for BatchNorm+ReLU and its backward, and ATen's convolution. A dense
// layer's tensors are small, so what a chain of Python-level calls would add
// per layer is comparable to the work itself. ABN's kernels are called as the
// C++ functions they are, not through the dispatcher: the bottleneck's kernel
// is then the same code whatever a use_backend block registers on the abn
// ops' CPU key.
//
// Layouts follow effilayers/ops/densenet/contract.py: every 4-D result takes
// layout_of(the first map), the rule the fake kernels use too.

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "common/batch_norm.h"
#include "cpu/abn.h"

namespace effilayers {
namespace {

// contract.layout_of: dense layouts first, then a channel slice of an NCHW
// block buffer (the maps a dense layer is given), then ATen's suggestion.
c10::MemoryFormat layout_of(const at::Tensor& first) {
  if (first.is_contiguous()) return c10::MemoryFormat::Contiguous;
  if (first.is_contiguous(c10::MemoryFormat::ChannelsLast)) return c10::MemoryFormat::ChannelsLast;
  if (first.dim() == 4) {
    const int64_t height = first.size(2), width = first.size(3);
    if (height * width > 1 && first.stride(3) == 1 && first.stride(2) == width && first.stride(1) == height * width) {
      return c10::MemoryFormat::Contiguous;
    }
  }
  return first.suggest_memory_format();
}

at::Tensor in_layout(const at::Tensor& t, const at::Tensor& like) {
  return t.dim() == 4 ? t.contiguous(layout_of(like)) : t;
}

// reference.concatenated: the norm's input, and whether it is a buffer of our
// own (one map is used as it is, never copied or written).
std::pair<at::Tensor, bool> concatenated(at::TensorList features) {
  if (features.size() == 1) return {features[0], false};
  const at::Tensor& first = features[0];
  int64_t channels = 0;
  for (const auto& f : features) channels += f.size(1);
  std::vector<int64_t> shape = first.sizes().vec();
  shape[1] = channels;
  at::Tensor out = at::empty(shape, first.options().memory_format(layout_of(first)));
  at::cat_out(out, features, 1);
  return {out, true};
}

// The layouts ABN's kernels walk without copying first.
at::Tensor dense(const at::Tensor& x) { return x.contiguous(layout_of(x)); }

at::Tensor nothing(const at::Tensor& like) { return at::empty({0}, like.options()); }

constexpr const char* kRelu = "relu";

at::Tensor dense_bottleneck_forward_cpu(at::TensorList features, const at::Tensor& mean, const at::Tensor& invstd,
                                        const at::Tensor& weight, const at::Tensor& bias,
                                        const at::Tensor& conv_weight, int64_t padding) {
  TORCH_CHECK_VALUE(!features.empty(), "dense_bottleneck_forward: features must not be empty");
  auto [x, private_buffer] = concatenated(features);
  at::Tensor readable = dense(x);
  at::Tensor y;
  if (private_buffer || !readable.is_same(x)) {
    abn_forward_inplace_cpu(readable, mean, invstd, weight, bias, std::nullopt, kRelu, 0.0, 0.0);
    y = readable;
  } else {
    y = abn_forward_cpu(x, mean, invstd, weight, bias, std::nullopt, kRelu, 0.0, 0.0);
  }
  const at::Tensor out = at::convolution(y, conv_weight, std::nullopt, {1, 1}, {padding, padding}, {1, 1}, false,
                                         {0, 0}, 1);
  return in_layout(out, features[0]);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dense_bottleneck_backward_cpu(
    const at::Tensor& grad_out, at::TensorList features, const at::Tensor& mean, const at::Tensor& invstd,
    const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& conv_weight, bool batch_stats,
    bool need_input, bool need_conv, int64_t padding) {
  TORCH_CHECK_VALUE(!features.empty(), "dense_bottleneck_backward: features must not be empty");
  const at::Tensor x = dense(concatenated(features).first);
  at::Tensor y = abn_forward_cpu(x, mean, invstd, weight, bias, std::nullopt, kRelu, 0.0, 0.0);
  auto [grad_y, grad_conv, unused_bias] = at::convolution_backward(
      grad_out, y, conv_weight, std::nullopt, {1, 1}, {padding, padding}, {1, 1}, false, {0, 0}, 1,
      {need_input, need_conv, false});
  y.reset();
  grad_conv = need_conv ? in_layout(grad_conv, conv_weight) : nothing(mean);
  if (!need_input) return {nothing(mean), nothing(mean), nothing(mean), grad_conv};
  // ABN's kernels walk the gradient and the saved input with one set of strides.
  if (grad_y.strides() != x.strides()) grad_y = at::empty_like(x).copy_(grad_y);
  // Running statistics (count 0) are constants: no mean terms.
  const int64_t count = batch_stats ? x.numel() / std::max<int64_t>(x.size(1), 1) : 0;
  auto [grad_x, no_residual, sum_dy, sum_dy_xhat] =
      abn_backward<&abn_backward_reduce_cpu, &abn_backward_elemt_cpu>(
          grad_y, x, mean, invstd, weight, bias, std::nullopt, kRelu, 0.0, 0.0, /*saved_is_output=*/false, count,
          /*need_sums=*/true, /*need_elemt=*/true, /*want_residual_grad=*/false);
  return {in_layout(grad_x, features[0]), sum_dy, sum_dy_xhat, grad_conv};
}

}  // namespace
}  // namespace effilayers

// The ops are declared once, in Python (effilayers/ops/densenet/op.py).
TORCH_LIBRARY_IMPL(effilayers, CPU, m) {
  m.impl("dense_bottleneck_forward", &effilayers::dense_bottleneck_forward_cpu);
  m.impl("dense_bottleneck_backward", &effilayers::dense_bottleneck_backward_cpu);
}

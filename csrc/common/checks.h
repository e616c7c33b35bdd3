// Argument checks and layout classification shared by every op's CPU and
// CUDA bindings. Messages name the op and the argument, like the Python
// wrappers, because a compiled kernel may be called directly through
// torch.ops.effilayers_cpu / torch.ops.effilayers_cuda.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "common/activation.h"

namespace effilayers {

// The accumulation type of a kernel reading scalar_t (effilayers/_core/
// dtypes.py's rule for one dtype): double for double, float otherwise.
template <typename scalar_t>
using accumulation_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

inline at::ScalarType accumulation_type(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// The floating types the kernels dispatch on (AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16)).
inline bool is_floating_type(at::ScalarType dtype) {
  return dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble;
}

// An optional tensor's data, or null when it is absent.
template <typename T>
const T* optional_data(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
}

inline void check_floating_input(const at::Tensor& input, const char* op) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK_TYPE(is_floating_type(dtype), op, ": input dtype must be float16, bfloat16, float32 or float64, got ",
                   dtype);
}

inline void check_batch_input(const at::Tensor& input, const char* op) {
  TORCH_CHECK_VALUE(input.dim() >= 2, op, ": input must have at least 2 dimensions (N, C, ...), got ", input.dim());
  check_floating_input(input, op);
}

// How the (N, C, spatial...) values sit in memory.
//   channels_first: dense, strides (C*S, S, 1): a batch of C planes of S values.
//   channels_last:  dense with the channel stride 1: M = N*S rows of C values.
//                   Covers channels_last(_3d) and contiguous rank-2 input.
struct BatchGeometry {
  int64_t batch = 0;     // N
  int64_t channels = 0;  // C
  int64_t spatial = 1;   // S: product of dims 2..
  bool channels_last = false;
};

// True when the tensor is dense with dim 1 innermost and the other dims in
// order: the memory of permute(0, 2, 3, ..., 1).contiguous().
inline bool is_dense_channels_last(const at::Tensor& t) {
  const int64_t rank = t.dim();
  if (t.size(1) != 1 && t.stride(1) != 1) return false;
  int64_t expected = t.size(1);
  for (int64_t d = rank - 1; d >= 2; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return t.size(0) == 1 || t.stride(0) == expected;
}

// Classifies a tensor already known to be dense in one of the two layouts
// (the binding makes anything else contiguous first).
inline BatchGeometry batch_geometry(const at::Tensor& input) {
  BatchGeometry g;
  g.batch = input.size(0);
  g.channels = input.size(1);
  for (int64_t d = 2; d < input.dim(); ++d) g.spatial *= input.size(d);
  // With one value per (n, c) plane both layouts coincide; the row form
  // reads it with unit stride across channels.
  g.channels_last = g.spatial == 1 || !input.is_contiguous();
  return g;
}

// The tensor itself when a kernel can read it in place, else a contiguous copy.
inline at::Tensor readable_batch(const at::Tensor& input) {
  if (input.is_contiguous() || is_dense_channels_last(input)) return input;
  return input.contiguous();
}

inline Activation parse_activation(const std::string& name, const char* op) {
  std::string names;
  for (int i = 0; i < kActivationCount; ++i) {
    if (name == kActivationNames[i]) return static_cast<Activation>(i);
    names += (i ? ", " : "") + std::string(kActivationNames[i]);
  }
  TORCH_CHECK_VALUE(false, op, ": activation must be one of ", names, ", got '", name, "'");
}

// The activation of a backward kernel: from the saved output only an
// invertible one (the kernels for the others are never built).
inline Activation parse_backward_activation(const std::string& name, bool saved_is_output, const char* op) {
  const Activation activation = parse_activation(name, op);
  TORCH_CHECK_VALUE(!saved_is_output || invertible(activation), op, ": activation '", name,
                    "' is not invertible, so backward needs the saved input (saved_is_output=False)");
  return activation;
}

// A full-size tensor that a kernel walks with `like`'s strides: itself when
// they match, else a copy laid out like `like` (dense, so empty_like keeps
// its strides).
inline at::Tensor matching(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), op, ": ", name, " must have shape ", like.sizes(), ", got ",
                    t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), op, ": ", name, " must have dtype ", like.scalar_type(),
                   ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == like.device(), op, ": ", name, " is on ", t.device(), " but input is on ",
                    like.device());
  if (t.strides() == like.strides()) return t;
  return at::empty_like(like).copy_(t);
}

inline std::optional<at::Tensor> matching(const std::optional<at::Tensor>& t, const at::Tensor& like, const char* op,
                                          const char* name) {
  if (!t.has_value()) return std::nullopt;
  return matching(*t, like, op, name);
}

}  // namespace effilayers

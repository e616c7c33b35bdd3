// Activated BatchNorm on CPU: effilayers_cpu::abn_forward(_), abn_backward_reduce,
// abn_backward_elemt. The math (and its edge cases) is that of the reference in
// effilayers/ops/abn/reference.py.
//
// Every full-size tensor of one call (input or saved output, residual, grad,
// results) is walked with the same strides, so one index addresses all of
// them; the binding below makes a tensor with other strides match first.
// Per-channel constants are folded once per call (scale, shift, ...), the
// element loops are `omp simd` loops over unit-stride runs (a plane of NCHW
// data, or a row of channels_last data), and a piecewise activation is a
// template parameter so each loop body is branch-light and vectorises (the
// transcendental ones share one instantiation: kTranscendental).
//
// Reductions are deterministic: partial sums in the accumulation type per
// plane (NCHW) or per tile of rows (channels_last), a fixed partition that
// does not depend on the thread count, combined per channel in double.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common/activation.h"
#include "common/batch_norm.h"
#include "common/checks.h"
#include "cpu/abn.h"
#include "cpu/vec.h"

namespace effilayers {

// The element math (common/activation.h and the loops below) is written once
// for a lane type T: the accumulation scalar (float/double) or its GCC vector
// (Vec<acc_t>::type). Comparisons and `?:` work on both (element-wise
// selects for vectors), so every loop below runs the same formulas whole
// vectors at a time and finishes the tail one scalar at a time, without
// depending on the auto-vectoriser (which leaves these selects and
// reductions scalar). The transcendental functions (ELU's exp/log1p, the
// smooth activations' exp/tanh/erfc) have no vector form here and run lane by
// lane.
template <typename acc_t>
struct VecLane {
  using V = typename Vec<acc_t>::type;
  using Scalar = acc_t;
  static constexpr int kWidth = Vec<acc_t>::kWidth;
  static V splat(acc_t v) { return V{} + v; }
  template <typename F>
  static V per_lane(V v, F f) {
    V out;
    for (int l = 0; l < kWidth; ++l) out[l] = f(v[l]);
    return out;
  }
  static V exp(V v) { return per_lane(v, [](acc_t x) { return Lane<acc_t>::exp(x); }); }
  static V expm1(V v) { return per_lane(v, [](acc_t x) { return Lane<acc_t>::expm1(x); }); }
  static V log1p(V v) { return per_lane(v, [](acc_t x) { return Lane<acc_t>::log1p(x); }); }
  static V tanh(V v) { return per_lane(v, [](acc_t x) { return Lane<acc_t>::tanh(x); }); }
  static V erfc(V v) { return per_lane(v, [](acc_t x) { return Lane<acc_t>::erfc(x); }); }
  static acc_t epsilon() { return Lane<acc_t>::epsilon(); }
};
template <>
struct Lane<Vec<float>::type> : VecLane<float> {};
template <>
struct Lane<Vec<double>::type> : VecLane<double> {};

namespace {

using Act = Activation;

// The activation reaches a kernel as a template argument, except for the
// transcendental ones, which share one instantiation (this sentinel) and
// pick their formula per lane of values at run time. Their libm calls, lane
// by lane, cost far more than that uniform switch, while an instantiation
// per activation, dtype and op doubled the build time of this file.
constexpr Act kTranscendental = static_cast<Act>(kActivationCount);

// The activation's run-time arguments: its parameter, and which
// transcendental activation a kTranscendental kernel computes.
template <typename acc_t>
struct ActArgs {
  acc_t param;
  Act which;
};

constexpr bool transcendental(Act a) {
  return a == Act::Silu || a == Act::Gelu || a == Act::GeluTanh || a == Act::Mish || a == Act::Sigmoid ||
         a == Act::Tanh;
}

// f(the activation as a type): A itself, or the run-time `which` when A is
// kTranscendental.
template <Act A, typename F>
inline decltype(auto) on_activation(Act which, F&& f) {
  if constexpr (A == kTranscendental) return with_activation(which, f);
  else return f(std::integral_constant<Act, A>{});
}

template <Act A, typename T>
inline T act_value(T y, T param, Act which) {
  return on_activation<A>(which, [&](auto a) { return activate<decltype(a)::value>(y, param); });
}

template <Act A, typename T>
inline T act_derivative(T y, T param, Act which) {
  return on_activation<A>(which, [&](auto a) { return derivative<decltype(a)::value>(y, param); });
}

// with_activation for these kernels: f sees a piecewise activation as
// itself and every transcendental one as kTranscendental (one instantiation).
template <typename F>
void with_kernel_activation(Act act, F&& f) {
  with_activation(act, [&](auto a) {
    if constexpr (transcendental(decltype(a)::value)) {
      f(std::integral_constant<Act, kTranscendental>{});
    } else {
      f(a);
    }
  });
}

template <typename T>
inline T splat(typename Lane<T>::Scalar value) {
  return Lane<T>::splat(value);
}

// Loads and stores between the tensor dtype and a lane of the accumulation type.
template <typename T, typename scalar_t>
inline T load_lane(const scalar_t* p) {
  using S = typename Lane<T>::Scalar;
  if constexpr (Lane<T>::kWidth == 1) {
    return static_cast<S>(*p);
  } else if constexpr (std::is_same_v<S, scalar_t>) {
    return Vec<S>::load(p);
  } else {
    T v;
    for (int l = 0; l < Lane<T>::kWidth; ++l) v[l] = static_cast<S>(p[l]);
    return v;
  }
}

template <typename T, typename scalar_t>
inline void store_lane(scalar_t* p, T v) {
  if constexpr (Lane<T>::kWidth == 1) {
    *p = static_cast<scalar_t>(v);
  } else if constexpr (std::is_same_v<typename Lane<T>::Scalar, scalar_t>) {
    std::memcpy(p, &v, sizeof(v));
  } else {
    for (int l = 0; l < Lane<T>::kWidth; ++l) p[l] = static_cast<scalar_t>(v[l]);
  }
}

// Runs body.template operator()<T>(offset) over [0, n): whole vectors of
// acc_t first, then the scalar tail.
template <typename acc_t, typename Body>
inline void for_lanes(int64_t n, Body&& body) {
  using V = typename Vec<acc_t>::type;
  constexpr int W = Vec<acc_t>::kWidth;
  int64_t i = 0;
  for (; i + W <= n; i += W) body.template operator()<V>(i);
  for (; i < n; ++i) body.template operator()<acc_t>(i);
}

// ---- layouts ------------------------------------------------------------------

// The shared walk over a (N, C, S) tensor. channels_first: body(c, offset,
// length) on each plane; channels_last: body_rows(offset_of_row, rows) on
// tiles of whole rows. Work items are fixed by the shape.
struct Walk {
  BatchGeometry g;
  int64_t rows_per_tile = 0;  // channels_last only

  explicit Walk(const BatchGeometry& geometry) : g(geometry) {
    // ~16K values a tile keeps a channels_last tile's partial sums few and
    // its work well above the fork/join cost.
    rows_per_tile = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, g.channels));
  }
  int64_t planes() const { return g.batch * g.channels; }
  int64_t rows() const { return g.batch * g.spatial; }
  int64_t tiles() const { return (rows() + rows_per_tile - 1) / rows_per_tile; }
  // Items per parallel_for grain: about 32K values before splitting.
  int64_t plane_grain() const { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, g.spatial)); }
  int64_t tile_grain() const { return std::max<int64_t>(1, 32768 / (rows_per_tile * std::max<int64_t>(1, g.channels))); }
};

template <typename acc_t>
struct Channel {
  // Everything an element of channel c needs, folded once per call.
  std::vector<acc_t> scale;      // s
  std::vector<acc_t> inv_scale;  // 1 / s
  std::vector<acc_t> shift;      // beta
  std::vector<acc_t> mean;
  std::vector<acc_t> invstd;
};

template <typename acc_t>
Channel<acc_t> fold_channels(int64_t C, const at::Tensor& mean, const at::Tensor& invstd,
                             const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             double weight_eps) {
  const auto acc_type = c10::CppTypeToScalarType<acc_t>::value;
  const at::Tensor mean_acc = mean.to(acc_type).contiguous();
  const at::Tensor invstd_acc = invstd.to(acc_type).contiguous();
  Channel<acc_t> ch;
  ch.scale.assign(C, acc_t(1));
  ch.shift.assign(C, acc_t(0));
  ch.mean.assign(mean_acc.const_data_ptr<acc_t>(), mean_acc.const_data_ptr<acc_t>() + C);
  ch.invstd.assign(invstd_acc.const_data_ptr<acc_t>(), invstd_acc.const_data_ptr<acc_t>() + C);
  if (weight.has_value()) {
    const at::Tensor w = weight->to(acc_type).contiguous();
    const acc_t* wp = w.const_data_ptr<acc_t>();
    for (int64_t c = 0; c < C; ++c) {
      acc_t s = wp[c];
      if (weight_eps > 0) {  // sign-preserving clamp away from zero, sign(0) = +1
        const acc_t magnitude = std::max(std::abs(s), static_cast<acc_t>(weight_eps));
        s = s < acc_t(0) ? -magnitude : magnitude;
      }
      ch.scale[c] = s;
    }
  }
  if (bias.has_value()) {
    const at::Tensor b = bias->to(acc_type).contiguous();
    std::copy(b.const_data_ptr<acc_t>(), b.const_data_ptr<acc_t>() + C, ch.shift.begin());
  }
  ch.inv_scale.resize(C);
  for (int64_t c = 0; c < C; ++c) ch.inv_scale[c] = acc_t(1) / ch.scale[c];
  return ch;
}

// ---- forward --------------------------------------------------------------------

template <Act A, typename scalar_t, typename acc_t>
void forward_kernel(const scalar_t* x, const scalar_t* residual, scalar_t* out, const Walk& walk,
                    const Channel<acc_t>& ch, ActArgs<acc_t> act) {
  const int64_t C = walk.g.channels, S = walk.g.spatial;
  // y = (x - mean) * a + beta with a = s * invstd. Folding the mean into
  // the shift (x * a + (beta - mean * a)) saves a subtraction but cancels
  // when |mean| >> std, which costs real accuracy in float32.
  std::vector<acc_t> a(C);
  const acc_t* mean = ch.mean.data();
  const acc_t* b = ch.shift.data();
  for (int64_t c = 0; c < C; ++c) a[c] = ch.scale[c] * ch.invstd[c];
  if (!walk.g.channels_last) {
    at::parallel_for(0, walk.planes(), walk.plane_grain(), [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t c = p % C, base = p * S;
        for_lanes<acc_t>(S, [&]<typename T>(int64_t i) {
          T y = (load_lane<T>(x + base + i) - splat<T>(mean[c])) * splat<T>(a[c]) + splat<T>(b[c]);
          if (residual != nullptr) y += load_lane<T>(residual + base + i);
          store_lane(out + base + i, act_value<A>(y, splat<T>(act.param), act.which));
        });
      }
    });
    return;
  }
  at::parallel_for(0, walk.tiles(), walk.tile_grain(), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * walk.rows_per_tile, r1 = std::min(r0 + walk.rows_per_tile, walk.rows());
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t base = r * C;
        for_lanes<acc_t>(C, [&]<typename T>(int64_t c) {
          T y = (load_lane<T>(x + base + c) - load_lane<T>(mean + c)) * load_lane<T>(a.data() + c) +
                load_lane<T>(b + c);
          if (residual != nullptr) y += load_lane<T>(residual + base + c);
          store_lane(out + base + c, act_value<A>(y, splat<T>(act.param), act.which));
        });
      }
    }
  });
}

// ---- backward -------------------------------------------------------------------

// dy and x_hat of one lane of elements starting at `index`; the per-channel
// constants come in as lanes too (one channel's value splatted, or the
// consecutive channels of a channels_last row).
template <Act A, bool kFromOutput, typename T, typename scalar_t, typename acc_t>
inline void dy_and_xhat(const scalar_t* grad, const scalar_t* saved, const scalar_t* residual, int64_t index,
                        T mean, T invstd, T scale, T inv_scale, T shift, ActArgs<acc_t> act, T& dy, T& x_hat) {
  const T g = load_lane<T>(grad + index);
  const T value = load_lane<T>(saved + index);
  const T p = splat<T>(act.param);
  if constexpr (kFromOutput) {
    T y = invert<A>(value, p);
    if (residual != nullptr) y -= load_lane<T>(residual + index);
    dy = g * derivative_from_output<A>(value, p);
    x_hat = (y - shift) * inv_scale;
  } else {
    x_hat = (value - mean) * invstd;
    T y = x_hat * scale + shift;
    if (residual != nullptr) y += load_lane<T>(residual + index);
    dy = g * act_derivative<A>(y, p, act.which);
  }
}

template <typename T, typename acc_t>
inline T channel_lane(const std::vector<acc_t>& values, int64_t c, bool channels_last) {
  return channels_last ? load_lane<T>(values.data() + c) : splat<T>(values[c]);
}

template <Act A, bool kFromOutput, typename scalar_t, typename acc_t>
void reduce_kernel(const scalar_t* grad, const scalar_t* saved, const scalar_t* residual, const Walk& walk,
                   const Channel<acc_t>& ch, ActArgs<acc_t> act, double* sum_dy, double* sum_dy_xhat) {
  using V = typename Vec<acc_t>::type;
  const int64_t C = walk.g.channels, S = walk.g.spatial;
  if (!walk.g.channels_last) {
    // One partial pair per plane (vector lanes, then the tail), then per
    // channel over the batch in order.
    std::vector<acc_t> part_dy(walk.planes()), part_dyx(walk.planes());
    at::parallel_for(0, walk.planes(), walk.plane_grain(), [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t c = p % C, base = p * S;
        V acc_dy = {}, acc_dyx = {};
        acc_t tail_dy = 0, tail_dyx = 0;
        for_lanes<acc_t>(S, [&]<typename T>(int64_t i) {
          T dy, x_hat;
          dy_and_xhat<A, kFromOutput, T>(grad, saved, residual, base + i, splat<T>(ch.mean[c]),
                                                    splat<T>(ch.invstd[c]), splat<T>(ch.scale[c]),
                                                    splat<T>(ch.inv_scale[c]), splat<T>(ch.shift[c]), act, dy,
                                                    x_hat);
          if constexpr (std::is_same_v<T, V>) {
            acc_dy += dy;
            acc_dyx += dy * x_hat;
          } else {
            tail_dy += dy;
            tail_dyx += dy * x_hat;
          }
        });
        part_dy[p] = Vec<acc_t>::sum(acc_dy) + tail_dy;
        part_dyx[p] = Vec<acc_t>::sum(acc_dyx) + tail_dyx;
      }
    });
    for (int64_t c = 0; c < C; ++c) {
      double a = 0, b = 0;
      for (int64_t n = 0; n < walk.g.batch; ++n) {
        a += part_dy[n * C + c];
        b += part_dyx[n * C + c];
      }
      sum_dy[c] = a;
      sum_dy_xhat[c] = b;
    }
    return;
  }
  // channels_last: per tile, per channel partials accumulated row by row.
  const int64_t tiles = walk.tiles();
  std::vector<acc_t> part_dy(tiles * C, acc_t(0)), part_dyx(tiles * C, acc_t(0));
  at::parallel_for(0, tiles, walk.tile_grain(), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      acc_t* s_dy = part_dy.data() + t * C;
      acc_t* s_dyx = part_dyx.data() + t * C;
      const int64_t r0 = t * walk.rows_per_tile, r1 = std::min(r0 + walk.rows_per_tile, walk.rows());
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t base = r * C;
        for_lanes<acc_t>(C, [&]<typename T>(int64_t c) {
          T dy, x_hat;
          dy_and_xhat<A, kFromOutput, T>(
              grad, saved, residual, base + c, load_lane<T>(ch.mean.data() + c), load_lane<T>(ch.invstd.data() + c),
              load_lane<T>(ch.scale.data() + c), load_lane<T>(ch.inv_scale.data() + c),
              load_lane<T>(ch.shift.data() + c), act, dy, x_hat);
          store_lane(s_dy + c, load_lane<T>(s_dy + c) + dy);
          store_lane(s_dyx + c, load_lane<T>(s_dyx + c) + dy * x_hat);
        });
      }
    }
  });
  std::fill(sum_dy, sum_dy + C, 0.0);
  std::fill(sum_dy_xhat, sum_dy_xhat + C, 0.0);
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t c = 0; c < C; ++c) {
      sum_dy[c] += part_dy[t * C + c];
      sum_dy_xhat[c] += part_dyx[t * C + c];
    }
  }
}

template <Act A, bool kFromOutput, typename scalar_t, typename acc_t>
void elemt_kernel(const scalar_t* grad, const scalar_t* saved, const scalar_t* residual, scalar_t* grad_input,
                  scalar_t* grad_residual, const Walk& walk, const Channel<acc_t>& ch, ActArgs<acc_t> act,
                  const acc_t* mean_dy, const acc_t* mean_dy_xhat) {
  const int64_t C = walk.g.channels, S = walk.g.spatial;
  // grad_input = k * (dy - mean_dy - x_hat * mean_dy_xhat), k = s * invstd
  std::vector<acc_t> k(C), mdy(mean_dy, mean_dy + C), mdyx(mean_dy_xhat, mean_dy_xhat + C);
  for (int64_t c = 0; c < C; ++c) k[c] = ch.scale[c] * ch.invstd[c];
  const bool rows = walk.g.channels_last;
  // `c` is the channel (channels_first) or the first channel of the lane (rows).
  auto element = [&]<typename T>(int64_t index, int64_t c) {
    T dy, x_hat;
    dy_and_xhat<A, kFromOutput, T>(
        grad, saved, residual, index, channel_lane<T>(ch.mean, c, rows), channel_lane<T>(ch.invstd, c, rows),
        channel_lane<T>(ch.scale, c, rows), channel_lane<T>(ch.inv_scale, c, rows),
        channel_lane<T>(ch.shift, c, rows), act, dy, x_hat);
    const T result = channel_lane<T>(k, c, rows) *
                     (dy - channel_lane<T>(mdy, c, rows) - x_hat * channel_lane<T>(mdyx, c, rows));
    store_lane(grad_input + index, result);
    if (grad_residual != nullptr) store_lane(grad_residual + index, dy);
  };
  if (!rows) {
    at::parallel_for(0, walk.planes(), walk.plane_grain(), [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t c = p % C, base = p * S;
        for_lanes<acc_t>(S, [&]<typename T>(int64_t i) { element.template operator()<T>(base + i, c); });
      }
    });
    return;
  }
  at::parallel_for(0, walk.tiles(), walk.tile_grain(), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * walk.rows_per_tile, r1 = std::min(r0 + walk.rows_per_tile, walk.rows());
      for (int64_t r = r0; r < r1; ++r) {
        for_lanes<acc_t>(C, [&]<typename T>(int64_t c) { element.template operator()<T>(r * C + c, c); });
      }
    }
  });
}

// ---- dispatch helpers ----------------------------------------------------------

// The activation and the source of x_hat are template parameters (they
// change the arithmetic); whether a residual is read or its gradient written
// is a runtime test per vector, uniform and predicted, which keeps the number
// of instantiations (and the first-use build time) down. Only the
// invertible activations are instantiated from the output (the binding
// refuses the others: check_saved_source).
template <typename F>
void with_backward_variant(Act act, bool from_output, F&& f) {
  with_kernel_activation(act, [&](auto a) {
    if constexpr (!invertible(decltype(a)::value)) {
      f(a, std::false_type{});
    } else if (from_output) {
      f(a, std::true_type{});
    } else {
      f(a, std::false_type{});
    }
  });
}

void check_channel_vector(const std::optional<at::Tensor>& t, int64_t C, const char* op, const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == C, op, ": ", name, " must have shape (", C, "), got ",
                    t->sizes());
  TORCH_CHECK(t->device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t->device());
}

void check_common(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                  const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const char* op) {
  check_batch_input(x, op);
  TORCH_CHECK(x.device().is_cpu(), op, " (cpu kernel): input must be a CPU tensor, got ", x.device());
  const int64_t C = x.size(1);
  check_channel_vector(mean, C, op, "mean");
  check_channel_vector(invstd, C, op, "invstd");
  check_channel_vector(weight, C, op, "weight");
  check_channel_vector(bias, C, op, "bias");
}

// ---- ops ----------------------------------------------------------------------------

// The forward of abn_forward (into a new tensor) and abn_forward_ (into
// x_arg itself); returns the output. x_arg's strides no kernel walks
// (neither contiguous nor dense channels-last) are computed on a copy.
at::Tensor forward(const at::Tensor& x_arg, const at::Tensor& mean, const at::Tensor& invstd,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   const std::optional<at::Tensor>& residual_arg, const std::string& activation, double param,
                   double weight_eps, bool inplace, const char* op) {
  check_common(x_arg, mean, invstd, weight, bias, op);
  const Act act = parse_activation(activation, op);
  const at::Tensor x = readable_batch(x_arg);
  const at::Tensor out = inplace ? x : at::empty_like(x);
  const auto residual = matching(residual_arg, x, op, "residual");
  const Walk walk(batch_geometry(x));
  if (x.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "abn_forward_cpu", [&] {
      using acc_t = accumulation_t<scalar_t>;
      const auto ch = fold_channels<acc_t>(walk.g.channels, mean, invstd, weight, bias, weight_eps);
      with_kernel_activation(act, [&](auto a) {
        forward_kernel<decltype(a)::value, scalar_t, acc_t>(x.const_data_ptr<scalar_t>(),
                                                           optional_data<scalar_t>(residual),
                                                           out.mutable_data_ptr<scalar_t>(), walk, ch,
                                                           ActArgs<acc_t>{static_cast<acc_t>(param), act});
      });
    });
  }
  if (inplace && !x.is_same(x_arg)) x_arg.copy_(x);
  return out;
}

}  // namespace

at::Tensor abn_forward_cpu(const at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                           const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& residual, std::string activation, double param,
                           double weight_eps) {
  return forward(x, mean, invstd, weight, bias, residual, activation, param, weight_eps, /*inplace=*/false,
                 "abn_forward");
}

void abn_forward_inplace_cpu(at::Tensor& x, const at::Tensor& mean, const at::Tensor& invstd,
                             const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                             const std::optional<at::Tensor>& residual, std::string activation, double param,
                             double weight_eps) {
  forward(x, mean, invstd, weight, bias, residual, activation, param, weight_eps, /*inplace=*/true, "abn_forward_");
}

namespace {

// What both backward kernels start from: checked arguments, the saved
// tensor in a layout the kernels walk, and grad/residual with its strides.
struct BackwardInputs {
  Act act;
  at::Tensor saved, grad;
  std::optional<at::Tensor> residual;
  Walk walk;

  BackwardInputs(const at::Tensor& grad_arg, const at::Tensor& saved_arg, const at::Tensor& mean,
                 const at::Tensor& invstd, const std::optional<at::Tensor>& weight,
                 const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual_arg,
                 const std::string& activation, bool saved_is_output, const char* op)
      : act((check_common(saved_arg, mean, invstd, weight, bias, op),
             parse_backward_activation(activation, saved_is_output, op))),
        saved(readable_batch(saved_arg)),
        grad(matching(grad_arg, saved, op, "grad")),
        residual(matching(residual_arg, saved, op, "residual")),
        walk(batch_geometry(saved)) {}
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> abn_backward_reduce_cpu(
    const at::Tensor& grad_arg, const at::Tensor& saved_arg, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual_arg, std::string activation, double param, double weight_eps,
    bool saved_is_output) {
  const BackwardInputs in(grad_arg, saved_arg, mean, invstd, weight, bias, residual_arg, activation,
                          saved_is_output, "abn_backward_reduce");
  const at::Tensor &saved = in.saved, &grad = in.grad;
  const auto& residual = in.residual;
  const Walk& walk = in.walk;
  const Act act = in.act;
  const int64_t C = walk.g.channels;
  const auto acc_type = accumulation_type(saved.scalar_type());
  std::vector<double> sum_dy(C, 0.0), sum_dy_xhat(C, 0.0);
  if (saved.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, saved.scalar_type(), "abn_backward_reduce_cpu", [&] {
      using acc_t = accumulation_t<scalar_t>;
      const auto ch = fold_channels<acc_t>(C, mean, invstd, weight, bias, weight_eps);
      with_backward_variant(act, saved_is_output, [&](auto a, auto from_output) {
        reduce_kernel<decltype(a)::value, decltype(from_output)::value, scalar_t, acc_t>(
            grad.const_data_ptr<scalar_t>(), saved.const_data_ptr<scalar_t>(), optional_data<scalar_t>(residual), walk,
            ch, ActArgs<acc_t>{static_cast<acc_t>(param), act}, sum_dy.data(), sum_dy_xhat.data());
      });
    });
  }
  at::Tensor out_dy = at::empty({C}, saved.options().dtype(at::kDouble));
  at::Tensor out_dyx = at::empty({C}, saved.options().dtype(at::kDouble));
  std::copy(sum_dy.begin(), sum_dy.end(), out_dy.mutable_data_ptr<double>());
  std::copy(sum_dy_xhat.begin(), sum_dy_xhat.end(), out_dyx.mutable_data_ptr<double>());
  return {out_dy.to(acc_type), out_dyx.to(acc_type)};
}

std::tuple<at::Tensor, at::Tensor> abn_backward_elemt_cpu(
    const at::Tensor& grad_arg, const at::Tensor& saved_arg, const at::Tensor& mean, const at::Tensor& invstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual_arg, std::string activation, double param, double weight_eps,
    bool saved_is_output, const at::Tensor& mean_dy, const at::Tensor& mean_dy_xhat, bool want_residual_grad) {
  const char* op = "abn_backward_elemt";
  const BackwardInputs in(grad_arg, saved_arg, mean, invstd, weight, bias, residual_arg, activation,
                          saved_is_output, op);
  const at::Tensor &saved = in.saved, &grad = in.grad;
  const auto& residual = in.residual;
  const Walk& walk = in.walk;
  const Act act = in.act;
  const int64_t C = walk.g.channels;
  check_channel_vector(mean_dy, C, op, "mean_dy");
  check_channel_vector(mean_dy_xhat, C, op, "mean_dy_xhat");
  at::Tensor grad_input = at::empty_like(saved);
  at::Tensor grad_residual = want_residual_grad ? at::empty_like(saved) : at::empty({0}, saved.options());
  if (saved.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, saved.scalar_type(), "abn_backward_elemt_cpu", [&] {
      using acc_t = accumulation_t<scalar_t>;
      const auto acc_type = accumulation_type(saved.scalar_type());
      const auto ch = fold_channels<acc_t>(C, mean, invstd, weight, bias, weight_eps);
      const at::Tensor mdy = mean_dy.to(acc_type).contiguous();
      const at::Tensor mdyx = mean_dy_xhat.to(acc_type).contiguous();
      with_backward_variant(act, saved_is_output, [&](auto a, auto from_output) {
        elemt_kernel<decltype(a)::value, decltype(from_output)::value, scalar_t, acc_t>(
            grad.const_data_ptr<scalar_t>(), saved.const_data_ptr<scalar_t>(), optional_data<scalar_t>(residual),
            grad_input.mutable_data_ptr<scalar_t>(),
            want_residual_grad ? grad_residual.mutable_data_ptr<scalar_t>() : nullptr, walk, ch,
            ActArgs<acc_t>{static_cast<acc_t>(param), act}, mdy.const_data_ptr<acc_t>(), mdyx.const_data_ptr<acc_t>());
      });
    });
  }
  return {grad_input, grad_residual};
}

}  // namespace effilayers

TORCH_LIBRARY_IMPL(effilayers, CPU, m) {
  effilayers::register_abn_kernels<&effilayers::abn_forward_cpu, &effilayers::abn_forward_inplace_cpu,
                                   &effilayers::abn_backward_reduce_cpu, &effilayers::abn_backward_elemt_cpu>(m);
}

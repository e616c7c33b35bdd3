// The activations of activated BatchNorm, written once for the CPU kernels,
// the CUDA kernels and the bindings. Plain C++ for the host compiler, and
// __host__ __device__ under nvcc; it needs no torch header.
//
// The math, edge cases included, is the reference in effilayers/ops/abn/reference.py.
// Each function is a template on the lane type T: a float or double, or a
// type the including file describes with its own Lane<T> specialization
// (the CPU kernels' SIMD vectors, on which `>` and `?:` work lane by lane).
#pragma once

#include <cfloat>
#include <cmath>
#include <type_traits>

#if defined(__CUDACC__)
#define EFFILAYERS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define EFFILAYERS_HOST_DEVICE inline
#endif

namespace effilayers {

// Numbered from 0 in this order, the order of kActivationNames (the Python
// side passes the names).
enum class Activation : int { Identity, LeakyRelu, Elu, Relu, Silu, Gelu, GeluTanh, Hardswish, Mish, Relu6, Sigmoid, Tanh };
constexpr int kActivationCount = static_cast<int>(Activation::Tanh) + 1;
constexpr const char* kActivationNames[kActivationCount] = {
    "identity", "leaky_relu", "elu", "relu", "silu", "gelu", "gelu_tanh", "hardswish", "mish", "relu6", "sigmoid",
    "tanh"};

// Whether backward can rebuild the pre-activation from the output (the
// in-place form); the others are only ever run from the saved input.
constexpr bool invertible(Activation a) {
  return a == Activation::Identity || a == Activation::LeakyRelu || a == Activation::Elu;
}

// What the activations need of a lane type: a constant in every lane, and
// the transcendental functions lane by lane. This primary template is the
// scalar float / double one; it calls the float functions (expf, ...) for
// float, so a float lane is never computed in double or the other way round.
template <typename T>
struct Lane {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "a float or double lane");
  static constexpr bool kFloat = std::is_same_v<T, float>;
  using Scalar = T;
  static constexpr int kWidth = 1;
  static EFFILAYERS_HOST_DEVICE T splat(T v) { return v; }
#define EFFILAYERS_LANE_FUNCTION(name)     \
  static EFFILAYERS_HOST_DEVICE T name(T v) { \
    if constexpr (kFloat) return ::name##f(v); \
    else return ::name(v);                     \
  }
  EFFILAYERS_LANE_FUNCTION(exp)
  EFFILAYERS_LANE_FUNCTION(expm1)
  EFFILAYERS_LANE_FUNCTION(log1p)
  EFFILAYERS_LANE_FUNCTION(tanh)
  EFFILAYERS_LANE_FUNCTION(erfc)
#undef EFFILAYERS_LANE_FUNCTION
  // torch.finfo(T).eps (std::numeric_limits is host-only in CUDA).
  static EFFILAYERS_HOST_DEVICE T epsilon() { return kFloat ? FLT_EPSILON : DBL_EPSILON; }
};

// Pieces the smooth activations share. Each is written so a value near 0
// is computed relative to itself, not as 1 minus a value near 1 (the
// derivatives at saturated inputs are tiny, and a whole channel's sum of
// them would otherwise be rounding noise): 1 - sigmoid(y) as sigmoid(-y),
// Phi through erfc, 1 - tanh^2 as sech^2.
template <typename T>
EFFILAYERS_HOST_DEVICE T sigmoid(T y) {
  using L = Lane<T>;
  return L::splat(1) / (L::splat(1) + L::exp(-y));
}

// Phi(y), the standard normal CDF: gelu(y) = y * Phi(y).
template <typename T>
EFFILAYERS_HOST_DEVICE T normal_cdf(T y) {
  using L = Lane<T>;
  return L::splat(0.5) * L::erfc(y * L::splat(-0.70710678118654752440));
}

// 2 * sqrt(2 / pi) * (y + 0.044715 y^3): gelu(approximate='tanh')'s
// 0.5 * (1 + tanh(u)) is sigmoid(2u).
template <typename T>
EFFILAYERS_HOST_DEVICE T gelu_tanh_twice_inner(T y) {
  using L = Lane<T>;
  return L::splat(2 * 0.79788456080286535588) * (y + L::splat(0.044715) * (y * y * y));
}

// 1 - tanh(y)^2 = 4 / (e^y + e^-y)^2 (0 once the square overflows).
template <typename T>
EFFILAYERS_HOST_DEVICE T sech_squared(T y) {
  using L = Lane<T>;
  const T sum = L::exp(y) + L::exp(-y);
  return L::splat(4) / (sum * sum);
}

// min(max(y, 0), 6), NaN passing through as with hardtanh.
template <typename T>
EFFILAYERS_HOST_DEVICE T relu6(T y) {
  using L = Lane<T>;
  const T zero = L::splat(0), six = L::splat(6);
  return y < zero ? zero : (y > six ? six : y);
}

// act(y) (_activate).
template <Activation A, typename T>
EFFILAYERS_HOST_DEVICE T activate(T y, T param) {
  using L = Lane<T>;
  const T zero = L::splat(0);
  if constexpr (A == Activation::LeakyRelu) {
    return y > zero ? y : y * param;
  } else if constexpr (A == Activation::Elu) {
    return y > zero ? y : param * L::expm1(y);
  } else if constexpr (A == Activation::Relu) {
    return y < zero ? zero : y;  // NaN and -0.0 pass through, as with clamp_min
  } else if constexpr (A == Activation::Silu) {
    return y * sigmoid(y);
  } else if constexpr (A == Activation::Gelu) {
    return y * normal_cdf(y);
  } else if constexpr (A == Activation::GeluTanh) {
    return y * sigmoid(gelu_tanh_twice_inner(y));
  } else if constexpr (A == Activation::Hardswish) {
    return y * relu6(y + L::splat(3)) / L::splat(6);
  } else if constexpr (A == Activation::Mish) {
    return y * L::tanh(L::log1p(L::exp(y)));
  } else if constexpr (A == Activation::Relu6) {
    return relu6(y);
  } else if constexpr (A == Activation::Sigmoid) {
    return sigmoid(y);
  } else if constexpr (A == Activation::Tanh) {
    return L::tanh(y);
  } else {
    return y;
  }
}

// d act / d y at the pre-activation y (_derivative).
template <Activation A, typename T>
EFFILAYERS_HOST_DEVICE T derivative(T y, T param) {
  using L = Lane<T>;
  const T zero = L::splat(0), one = L::splat(1);
  if constexpr (A == Activation::LeakyRelu) {
    return y > zero ? one : param;
  } else if constexpr (A == Activation::Elu) {
    // The reference's clamp_max(0) is a no-op on this branch (y <= 0), and
    // leaving it out keeps a NaN y NaN as it does there.
    return y > zero ? one : param * L::exp(y);
  } else if constexpr (A == Activation::Relu) {
    return y > zero ? one : zero;
  } else if constexpr (A == Activation::Silu) {
    return sigmoid(y) * (one + y * sigmoid(-y));
  } else if constexpr (A == Activation::Gelu) {
    // Phi(y) + y * phi(y), phi the standard normal density
    return normal_cdf(y) + y * (L::splat(0.39894228040143267794) * L::exp(L::splat(-0.5) * y * y));
  } else if constexpr (A == Activation::GeluTanh) {
    // y * s(v), s = sigmoid, v = 2u: s(v) + y * s(v) s(-v) * dv/dy
    const T v = gelu_tanh_twice_inner(y);
    const T dv = L::splat(2 * 0.79788456080286535588) * (one + L::splat(3 * 0.044715) * (y * y));
    const T s = sigmoid(v);
    return s + y * (s * sigmoid(-v)) * dv;
  } else if constexpr (A == Activation::Hardswish) {
    // torch's choices at the kinks: 0 at y = -3, 1 at y = 3
    const T three = L::splat(3);
    return y <= -three ? zero : (y >= three ? one : y / three + L::splat(0.5));
  } else if constexpr (A == Activation::Mish) {
    const T t = L::tanh(L::log1p(L::exp(y)));
    return t + y * sigmoid(y) * (one - t * t);
  } else if constexpr (A == Activation::Relu6) {
    // hardtanh's: zero at both kinks
    return y > zero ? (y < L::splat(6) ? one : zero) : zero;
  } else if constexpr (A == Activation::Sigmoid) {
    return sigmoid(y) * sigmoid(-y);
  } else if constexpr (A == Activation::Tanh) {
    return sech_squared(y);
  } else {
    return one;
  }
}

// d act / d y in terms of the output z = act(y) (_derivative_from_output).
template <Activation A, typename T>
EFFILAYERS_HOST_DEVICE T derivative_from_output(T z, T param) {
  static_assert(invertible(A) || A == Activation::Relu, "only sign-based or invertible activations run from z");
  if constexpr (A == Activation::Elu) {
    return z > Lane<T>::splat(0) ? Lane<T>::splat(1) : z + param;
  } else {
    return derivative<A>(z, param);  // depends only on the sign, shared by y and z
  }
}

// y from z = act(y) (_invert).
template <Activation A, typename T>
EFFILAYERS_HOST_DEVICE T invert(T z, T param) {
  static_assert(invertible(A) || A == Activation::Relu, "only sign-based or invertible activations run from z");
  using L = Lane<T>;
  if constexpr (A == Activation::LeakyRelu) {
    return z > L::splat(0) ? z : z / param;
  } else if constexpr (A == Activation::Elu) {
    // Saturated outputs (z == -alpha) carry no information about y; the
    // clamp keeps x_hat finite there (their dy is zero anyway). Written so a
    // NaN ratio stays NaN, as clamp_min leaves it.
    const T lowest = L::splat(typename L::Scalar(-1) + L::epsilon());
    const T ratio = z / param;
    return z > L::splat(0) ? z : L::log1p(ratio < lowest ? lowest : ratio);
  } else {
    return z;  // identity; relu is not invertible and the reference passes z through
  }
}

// f(std::integral_constant<Activation, a>{}): the activation as a template
// argument of the kernel f launches. Host code.
template <typename F>
decltype(auto) with_activation(Activation activation, F&& f) {
  switch (activation) {
    case Activation::LeakyRelu:
      return f(std::integral_constant<Activation, Activation::LeakyRelu>{});
    case Activation::Elu:
      return f(std::integral_constant<Activation, Activation::Elu>{});
    case Activation::Relu:
      return f(std::integral_constant<Activation, Activation::Relu>{});
    case Activation::Silu:
      return f(std::integral_constant<Activation, Activation::Silu>{});
    case Activation::Gelu:
      return f(std::integral_constant<Activation, Activation::Gelu>{});
    case Activation::GeluTanh:
      return f(std::integral_constant<Activation, Activation::GeluTanh>{});
    case Activation::Hardswish:
      return f(std::integral_constant<Activation, Activation::Hardswish>{});
    case Activation::Mish:
      return f(std::integral_constant<Activation, Activation::Mish>{});
    case Activation::Relu6:
      return f(std::integral_constant<Activation, Activation::Relu6>{});
    case Activation::Sigmoid:
      return f(std::integral_constant<Activation, Activation::Sigmoid>{});
    case Activation::Tanh:
      return f(std::integral_constant<Activation, Activation::Tanh>{});
    case Activation::Identity:
    default:
      return f(std::integral_constant<Activation, Activation::Identity>{});
  }
}

}  // namespace effilayers

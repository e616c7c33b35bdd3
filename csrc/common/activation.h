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

enum class Activation : int { Identity = 0, LeakyRelu = 1, Elu = 2, Relu = 3 };

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
  static EFFILAYERS_HOST_DEVICE T exp(T v) {
    if constexpr (kFloat) return ::expf(v);
    else return ::exp(v);
  }
  static EFFILAYERS_HOST_DEVICE T expm1(T v) {
    if constexpr (kFloat) return ::expm1f(v);
    else return ::expm1(v);
  }
  static EFFILAYERS_HOST_DEVICE T log1p(T v) {
    if constexpr (kFloat) return ::log1pf(v);
    else return ::log1p(v);
  }
  // torch.finfo(T).eps (std::numeric_limits is host-only in CUDA).
  static EFFILAYERS_HOST_DEVICE T epsilon() { return kFloat ? FLT_EPSILON : DBL_EPSILON; }
};

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
  } else {
    return one;
  }
}

// d act / d y in terms of the output z = act(y) (_derivative_from_output).
template <Activation A, typename T>
EFFILAYERS_HOST_DEVICE T derivative_from_output(T z, T param) {
  if constexpr (A == Activation::Elu) {
    return z > Lane<T>::splat(0) ? Lane<T>::splat(1) : z + param;
  } else {
    return derivative<A>(z, param);  // depends only on the sign, shared by y and z
  }
}

// y from z = act(y) (_invert).
template <Activation A, typename T>
EFFILAYERS_HOST_DEVICE T invert(T z, T param) {
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
    case Activation::Identity:
    default:
      return f(std::integral_constant<Activation, Activation::Identity>{});
  }
}

}  // namespace effilayers

// Vectorised elementwise math on the GCC vector types of vec.h.
//
// std::exp in a loop stays scalar without -ffast-math (and libmvec), which
// would make exp the bottleneck of a softmax row. exp_vec evaluates
// exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2],
// with the Cephes single-precision polynomial for exp(r) (relative error
// about 2 ulp on the range softmax uses) and builds the power of two from
// exponent bits - as 2^(n + 64), then multiplies by 2^-64. The first product
// is exact (both factors and the result are normal floats for n down to
// -150), and the second rounds once, so results in float's subnormal range
// (x from -87.3 down to -103.97, 1.2e-38 down to 1.4e-45) come out correctly
// rounded instead of flushed to 0. This costs nothing over building 2^n
// directly: the final multiply replaces the select that zeroed the lanes
// below the normal range. Below ln(2^-150) ~ -103.97 the result rounds to 0
// (-inf included); NaN stays NaN.
//
// Domain: the kernels call it with x <= 0 (values minus their maximum or
// log-sum-exp). Because of the 2^64 headroom, x > 44.0 gives inf (the true
// overflow is at 88.7).
#pragma once

#include <cstdint>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "cpu/vec.h"

namespace effilayers {

using VecF = Vec<float>::type;
typedef int32_t VecI __attribute__((vector_size(32)));
typedef uint32_t VecU __attribute__((vector_size(32)));

// min(max(x, lo), hi) per lane with a NaN lane left NaN: one vmaxps and one
// vminps where AVX is enabled (the ternaries compile to compare + blend).
inline VecF clamp_keeping_nan(VecF x, float lo, float hi) {
#if defined(__AVX__)
  // _mm256_max_ps(a, b) is a > b ? a : b, so b (x) wins when either is NaN.
  return (VecF)_mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), (__m256)x));
#else
  const VecF low = x < lo ? VecF{} + lo : x;
  return low > hi ? VecF{} + hi : low;
#endif
}

inline VecF exp_vec(VecF x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // ln 2 split so n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;   // 1.5 * 2^23: adding it rounds to an integer
  // Just below ln(2^-150): a lane clamped there (-inf included) evaluates to
  // 0.99999 * 2^-150, which the last multiply rounds to 0.
  constexpr float kLowest = -103.972084f;
  constexpr float kHighest = 88.37626f;   // keeps n <= 128 and r in range
  constexpr float kTwoToMinus64 = 5.42101086e-20f;
  const VecF clamped = clamp_keeping_nan(x, kLowest, kHighest);
  const VecF n = (clamped * kLog2e + kRound) - kRound;  // an integer in [-150, 128]
  const VecF r = (clamped - n * kLn2Hi) - n * kLn2Lo;
  VecF p = VecF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const VecF e = p * (r * r) + r + 1.0f;
  // Biased exponent of 2^(n + 64): n + 64 + 127, at most 255 (inf, for n > 63).
  const VecI biased = __builtin_convertvector(n, VecI) + (64 + 127);
  const VecI capped = biased > 255 ? VecI{} + 255 : biased;
  const VecU bits = __builtin_convertvector(capped, VecU) << 23;  // unsigned: a NaN lane's integer is arbitrary
  VecF two_n_plus_64;
  static_assert(sizeof(bits) == sizeof(two_n_plus_64), "lane sizes");
  __builtin_memcpy(&two_n_plus_64, &bits, sizeof(two_n_plus_64));
  return (e * two_n_plus_64) * kTwoToMinus64;
}

}  // namespace effilayers

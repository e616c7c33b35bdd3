// Vectorised elementwise math on the GCC vector types of vec.h.
//
// std::exp in a loop stays scalar without -ffast-math (and libmvec), which
// would make exp the bottleneck of a softmax row. exp_vec evaluates
// exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2],
// with the Cephes single-precision polynomial for exp(r) (relative error
// about 2 ulp on the range softmax uses, x <= 0) and builds 2^n from the
// exponent bits. Inputs below -87.3 (where the float result would be
// subnormal) give 0, -inf included; NaN stays NaN.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace effilayers {

using VecF = Vec<float>::type;
typedef int32_t VecI __attribute__((vector_size(32)));

inline VecF exp_vec(VecF x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // ln 2 split so n * kLn2Hi is exact
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;   // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kLowest = -87.33654f;   // exp below this is subnormal: return 0
  constexpr float kHighest = 88.37626f;
  const VecF clamped = x > kHighest ? VecF{} + kHighest : x;
  const VecF n = (clamped * kLog2e + kRound) - kRound;
  const VecF r = (clamped - n * kLn2Hi) - n * kLn2Lo;
  VecF p = VecF{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const VecF e = p * (r * r) + r + 1.0f;
  // 2^n for n in [-126, 127]; lanes below kLowest are replaced below.
  const VecI ni = __builtin_convertvector(n, VecI);
  const VecI lo = ni < -126 ? VecI{} - 126 : ni;
  VecI bits = (lo + 127) << 23;
  VecF two_n;
  static_assert(sizeof(bits) == sizeof(two_n), "lane sizes");
  __builtin_memcpy(&two_n, &bits, sizeof(two_n));
  const VecF result = e * two_n;
  const VecF zero = {};
  return x < kLowest ? zero : result;
}

}  // namespace effilayers

// Stand-in for the CUDA toolkit's cuda_fp16.h in the emulated build: the
// IEEE half type as 16 bits, and the conversions the kernels use, rounding
// to nearest even as the GPU and Tensor.to(torch.float16) do.
#pragma once

#include <cstdint>
#include <cstring>

#include "emulation/simt.h"

struct __half {
  uint16_t bits;
};

inline float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exponent = (h.bits >> 10) & 0x1fu, mantissa = h.bits & 0x3ffu;
  uint32_t word;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    word = sign | simt::float_bits(static_cast<float>(mantissa) * 5.9604644775390625e-8f);
  } else if (exponent == 0x1f) {  // inf, NaN (payload kept)
    word = sign | 0x7f800000u | (mantissa << 13);
  } else {
    word = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  return simt::bits_float(word);
}

inline __half __float2half_rn(float value) {
  const uint32_t word = simt::float_bits(value);
  const uint16_t sign = static_cast<uint16_t>((word >> 16) & 0x8000u);
  uint32_t magnitude = word & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return {static_cast<uint16_t>(sign | 0x7e00u)};  // NaN
  if (magnitude >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // rounds past 65504
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half: adding 0.5 puts the value's multiple
    // of 2^-24 (the subnormal step) in the low mantissa bits, rounded to
    // nearest even by the FPU.
    const uint32_t bits = simt::float_bits(simt::bits_float(magnitude) + 0.5f);
    return {static_cast<uint16_t>(sign | (bits - 0x3f000000u))};
  }
  // Rebias the exponent (127 -> 15) and round the 13 dropped bits to even.
  const uint32_t odd = (magnitude >> 13) & 1u;
  magnitude += 0xc8000fffu + odd;
  return {static_cast<uint16_t>(sign | (magnitude >> 13))};
}

inline __half __float2half(float value) { return __float2half_rn(value); }

// Stand-in for the CUDA toolkit's cuda_bf16.h in the emulated build: bfloat16
// as the top 16 bits of a float, rounded to nearest even.
#pragma once

#include <cstdint>
#include <cstring>

#include "emulation/simt.h"

struct __nv_bfloat16 {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 h) {
  return simt::bits_float(static_cast<uint32_t>(h.bits) << 16);
}

inline __nv_bfloat16 __float2bfloat16_rn(float value) {
  uint32_t word = simt::float_bits(value);
  if ((word & 0x7fffffffu) > 0x7f800000u) return {static_cast<uint16_t>(((word >> 16) & 0x8000u) | 0x7fc0u)};
  word += 0x7fffu + ((word >> 16) & 1u);
  return {static_cast<uint16_t>(word >> 16)};
}

inline __nv_bfloat16 __float2bfloat16(float value) { return __float2bfloat16_rn(value); }

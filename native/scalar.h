// Scalar conversions used by the portable variant and by the vector variants'
// tails. Header-only and static so each variant gets its own copy compiled
// with its own flags (no cross-variant symbol can be picked by the linker).
#pragma once

#include <cstdint>
#include <cstring>

namespace offload {
namespace scalar {

static inline float bits_to_f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

static inline uint32_t f32_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_f32(uint32_t(h) << 16); }

// IEEE binary16 -> binary32, exact for every input (subnormals, Inf, NaN).
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_to_f32(sign);
    // Subnormal: renormalise.
    exp = 113;  // 127 - 15 + 1
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    man &= 0x3ffu;
    return bits_to_f32(sign | (exp << 23) | (man << 13));
  }
  return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

static inline float load(const void* data, int dtype, size_t i) {
  switch (dtype) {
    case 1: return bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case 2: return f16_to_f32(static_cast<const uint16_t*>(data)[i]);
    default: return static_cast<const float*>(data)[i];
  }
}

static inline bool nonfinite(float f) { return (f32_to_bits(f) & 0x7f800000u) == 0x7f800000u; }

}  // namespace scalar
}  // namespace offload

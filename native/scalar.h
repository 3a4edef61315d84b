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

// binary32 -> bfloat16, round to nearest even; every NaN becomes the quiet 0x7fc0 (as torch does).
static inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// binary32 -> binary16, round to nearest even, overflow to Inf, NaN -> quiet NaN.
static inline uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_to_bits(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;
  const int e = int(ax >> 23) - 127 + 15;
  if (e >= 31) return sign | 0x7c00u;
  if (e <= 0) {
    const int shift = 14 - e;
    if (shift > 24) return sign;
    const uint32_t full = (ax & 0x7fffffu) | 0x800000u;
    uint32_t r = full >> shift;
    const uint32_t rem = full & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t h = (uint32_t(e) << 10) | ((ax & 0x7fffffu) >> 13);
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is still right
  return uint16_t(sign | h);
}

static inline void store16(void* out, int dtype, size_t i, float f) {
  static_cast<uint16_t*>(out)[i] = dtype == 1 ? f32_to_bf16(f) : f32_to_f16(f);
}

// [Note: state formats] in kernels.cpp. The 16+16 master: the high half rounded to nearest (ties away from zero,
// so that the low half, the float's own low 16 bits, always restores it), NaN to the quiet 0x7fc0 with a zero low half.
static inline void split(float f, uint16_t* hi, uint16_t* lo) {
  const uint32_t x = f32_to_bits(f);
  const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
  *hi = nan ? uint16_t(0x7fc0) : uint16_t((x + 0x8000u) >> 16);
  *lo = nan ? uint16_t(0) : uint16_t(x);
}

static inline float join_split(uint16_t hi, uint16_t lo) {
  return bits_to_f32((uint32_t(hi) << 16) + uint32_t(int32_t(int16_t(lo))));
}

// A 32-bit integer hash (lowbias32): the stochastic rounding's random bits of one element.
static inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// binary32 -> bfloat16 rounded up in magnitude with probability (dropped bits) / 2^16: unbiased; NaN -> 0x7fc0.
static inline uint16_t bf16_stochastic(float f, uint32_t random) {
  const uint32_t x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((x + (random & 0xffffu)) >> 16);
}

// [Note: instruction rules] A vector variant that stores through a conversion instruction inherits the
// instruction's own rules, which are not the portable rounding's, and fixes the lanes where they differ. Each rule is
// modelled here in scalar code, compiled into every build: the tests hold model + fix-up to the portable rounding on
// every CPU (so a machine that cannot run a variant still checks what the variant must store), and each instruction
// to its model on the CPUs that run it (tests/test_conversion_rules.py). The instructions the variants lean on:
// - VCVTNEPS2BF16 (avx512bf16's bfloat16): round to nearest even, but a zero or subnormal input gives a signed zero
//   (denormals are zero whatever MXCSR says), and a NaN keeps its sign and payload, quieted. The variant redoes the
//   lanes with a zero exponent and the NaN lanes the portable way.
// - VCVTPS2PH with the round-to-nearest immediate (avx2's and avx512's float16), and AArch64's FCVTN under Linux's
//   FPCR (neon's): IEEE round to nearest even, subnormal results kept; a NaN keeps its sign and the top of its
//   payload, quieted. The variants give every NaN the quiet 0x7e00 with its sign, as torch does.
// No variant uses AMX, and none contracts a multiply and an add into an FMA the portable build does not make
// (-ffp-contract=off; an FMA is written as one on both sides, __builtin_fmaf here); square root and divide are
// correctly rounded in every instruction set.
namespace instruction {

static inline uint16_t vcvtneps2bf16(float f) {
  const uint32_t x = f32_to_bits(f);
  const uint32_t exp = x & 0x7f800000u;
  if (exp == 0) return uint16_t((x >> 16) & 0x8000u);                  // zero or subnormal: a signed zero
  if (exp == 0x7f800000u && (x & 0x7fffffu)) return uint16_t((x >> 16) | 0x40u);  // NaN: quieted, payload kept
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);             // round to nearest even (Inf stays Inf)
}

static inline uint16_t vcvtps2ph(float f) {
  const uint32_t x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return uint16_t(((x >> 16) & 0x8000u) | 0x7e00u | ((x >> 13) & 0x3ffu));  // NaN: quieted, payload's top kept
  return f32_to_f16(f);
}

}  // namespace instruction

// What a variant's kernels store from each instruction: its result, with the lanes whose rules differ from the
// portable rounding redone (the scalar statement of the vector fix-ups in kernels.cpp).
static inline uint16_t bf16_from_vcvtneps2bf16(float f) {
  const uint32_t x = f32_to_bits(f);
  const bool zero_exponent = (x & 0x7f800000u) == 0, nan = (x & 0x7fffffffu) > 0x7f800000u;
  return zero_exponent || nan ? f32_to_bf16(f) : instruction::vcvtneps2bf16(f);
}

static inline uint16_t f16_from_vcvtps2ph(float f) {
  const uint32_t x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t(((x >> 16) & 0x8000u) | 0x7e00u);
  return instruction::vcvtps2ph(f);
}

static inline bool nonfinite(float f) { return (f32_to_bits(f) & 0x7f800000u) == 0x7f800000u; }

}  // namespace scalar
}  // namespace offload

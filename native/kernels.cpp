// The kernels, written once and compiled once per instruction set.
//
// [Note: one source, many targets] CMake compiles this file several times with
// different -m flags and OFFLOAD_ISA_NAME set; the preprocessor picks the
// intrinsics the flags allow. The portable variant is built with OFFLOAD_SCALAR_ONLY: one
// element at a time on every machine, AArch64 too, whose baseline has Advanced SIMD (it
// is the reference every vector variant is held to, so it must not be one of them).
// Everything here has internal linkage (anonymous
// namespace, static helpers) and no std:: templates are instantiated: an
// inline function with external linkage compiled with -mavx512f could be
// merged by the linker into the portable variant and fault on an AVX2 CPU.
#include "kernels.h"
#include "scalar.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__SSE4_2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#endif

#define OFFLOAD_CAT2(a, b) a##b
#define OFFLOAD_CAT(a, b) OFFLOAD_CAT2(a, b)
#define OFFLOAD_STR2(a) #a
#define OFFLOAD_STR(a) OFFLOAD_STR2(a)

namespace offload {
namespace {

SqNorm sq_norm_tail(const void* data, DType dtype, size_t begin, size_t end, float scale) {
  SqNorm r;
  for (size_t i = begin; i < end; ++i) {
    float x = scalar::load(data, int(dtype), i);
    if (scale != 1.0f) x = x * scale;
    r.nonfinite += scalar::nonfinite(x);
    r.sum_sq += double(x) * double(x);
  }
  return r;
}

#if defined(__AVX512F__)

inline __m512 load16(const void* data, DType dtype, size_t i) {
  switch (dtype) {
    case DType::BF16: {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case DType::F16: {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + i));
      return _mm512_cvtph_ps(h);
    }
    default: return _mm512_loadu_ps(static_cast<const float*>(data) + i);
  }
}

SqNorm sq_norm(const void* data, DType dtype, size_t n, float scale) {
  const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
  const __m512 s = _mm512_set1_ps(scale);
  const bool scaled = scale != 1.0f;
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  uint64_t bad = 0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 x = load16(data, dtype, i);
    if (scaled) x = _mm512_mul_ps(x, s);
    const __m512i e = _mm512_and_si512(_mm512_castps_si512(x), exp_mask);
    bad += uint64_t(__builtin_popcount(_mm512_cmpeq_epi32_mask(e, exp_mask)));
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  SqNorm r = sq_norm_tail(data, dtype, i, n, scale);
  r.sum_sq += _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
  r.nonfinite += bad;
  return r;
}

// [Note: a float16 NaN] The hardware's conversion keeps a NaN's payload; torch's .to(torch.float16) and the
// portable kernel give the quiet NaN 0x7e00 with the sign kept, so every variant's copy is the same bits.
inline __m256i f16_nan(__m512i b) {
  return _mm512_cvtepi32_epi16(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x8000)),
                                               _mm512_set1_epi32(0x7e00)));
}

inline __m256i bf16_16_emulated(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

#if defined(__AVX512BF16__)
// VCVTNEPS2BF16 rounds to nearest even like the portable kernel, but flushes subnormal inputs to zero and keeps a
// NaN's sign and payload (see [Note: instruction rules] in scalar.h, whose bf16_from_vcvtneps2bf16 states this
// fix-up): lanes with a zero exponent and NaN lanes are redone the portable way, so every variant stores the same
// bits, a NaN as the one quiet 0x7fc0 (a checkpoint written on one CPU reads the same on another).
//
// [Note: a variant of its own for avx512_bf16] The instruction is compiled into the avx512bf16 variant, whose
// flags allow it everywhere, not into the avx512 one behind a target attribute: a function built for another
// target cannot be inlined, and the call it became spilled the loop's vectors three times an iteration (the
// moments and the copy). Inlined, the bf16-moment step took 0.86x its time with its state in the cache and 0.89x
// from DRAM (the Xeon, 2026-11-28). dispatch.cpp picks the variant only where the CPU has the instructions.
inline __m256i bf16_16_native(__m512 x) {
  __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
  const __mmask16 tiny = __mmask16(~_mm512_test_epi32_mask(_mm512_castps_si512(x), _mm512_set1_epi32(0x7f800000)));
  const __mmask16 redo = tiny | _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  if (redo) r = _mm256_mask_mov_epi16(r, redo, bf16_16_emulated(x));
  return r;
}
#endif

struct Vec {
  using F = __m512;
  static constexpr size_t W = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static constexpr bool STREAMS = true;  // stream: a store around the cache, at W elements' alignment
  static constexpr size_t PREFETCH = 256;  // elements ahead (see [Note: software prefetch])
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }
  static void fence() { _mm_sfence(); }
  static F load_any(const void* data, DType dtype, size_t i) { return load16(data, dtype, i); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  // -1, 0 or +1 as torch.sign: a NaN stays NaN (see [Note: one state]).
  static F sign(F a) {
    const F one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
    const F s = _mm512_sub_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), one),
                              _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), one));
    return _mm512_mask_mov_ps(s, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
  }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256i to16(DType dtype, F x) {
    if (dtype == DType::F16) {
      const __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      if (!nan) return h;
      return _mm256_mask_mov_epi16(h, nan, f16_nan(_mm512_castps_si512(x)));
    }
#if defined(__AVX512BF16__)
    return bf16_16_native(x);
#else
    return bf16_16_emulated(x);
#endif
  }
  static void store16(void* out, DType dtype, size_t i, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), to16(dtype, x));
  }
  static void stream16(void* out, DType dtype, size_t i, F x) {  // 32-byte aligned
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), to16(dtype, x));
  }
  // The state formats (see [Note: state formats]).
  static F load_split(const uint16_t* hi, const uint16_t* lo, size_t i) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + i)));
    const __m512i l = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i)));
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 16), l));
  }
  // c = the float's bits + 0x8000: its high half is the master rounded (ties away from zero) and its low half the
  // float's own low half with the top bit flipped; a NaN lane is 0x7fc0'8000 (the quiet NaN, a zero low half once
  // flipped back). One word permute sends the high halves to the lower 256 bits and the low halves to the upper:
  // two narrowing moves (two shuffle uops each) cost more on a core with one shuffle port.
  static void store_split(uint16_t* hi, uint16_t* lo, size_t i, F x) {
    alignas(64) static const uint16_t order[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                                   0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i c = _mm512_mask_mov_epi32(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_set1_epi32(0x8000)), nan,
                                            _mm512_set1_epi32(0x7fc08000));
    const __m512i flip = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(int16_t(0x8000)), 1);
    const __m512i r = _mm512_xor_si512(_mm512_permutexvar_epi16(_mm512_load_si512(order), c), flip);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm512_castsi512_si256(r));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), _mm512_extracti64x4_epi64(r, 1));
  }
  static void store_stochastic(uint16_t* out, size_t i, F x, uint32_t at, uint32_t seed) {
    __m512i k = _mm512_xor_si512(_mm512_add_epi32(_mm512_set1_epi32(int(at)),
                                                  _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                                 _mm512_set1_epi32(int(seed)));
    k = _mm512_xor_si512(k, _mm512_srli_epi32(k, 16));  // lowbias32, as scalar::mix32
    k = _mm512_mullo_epi32(k, _mm512_set1_epi32(0x7feb352d));
    k = _mm512_xor_si512(k, _mm512_srli_epi32(k, 15));
    k = _mm512_mullo_epi32(k, _mm512_set1_epi32(int(0x846ca68bu)));
    k = _mm512_xor_si512(k, _mm512_srli_epi32(k, 16));
    const __m512i b = _mm512_add_epi32(_mm512_castps_si512(x), _mm512_and_si512(k, _mm512_set1_epi32(0xffff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i h = _mm512_mask_mov_epi32(_mm512_srli_epi32(b, 16), nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(h));
  }
  static void copy16(void* out, const uint16_t* from, size_t i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + i)));
  }
};

#elif defined(__AVX2__)

inline __m256 load8(const void* data, DType dtype, size_t i) {
  switch (dtype) {
    case DType::BF16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(data) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case DType::F16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(data) + i));
      return _mm256_cvtph_ps(h);
    }
    default: return _mm256_loadu_ps(static_cast<const float*>(data) + i);
  }
}

inline uint64_t count_nonfinite(__m256 x, __m256i exp_mask) {
  const __m256i e = _mm256_and_si256(_mm256_castps_si256(x), exp_mask);
  const int m = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(e, exp_mask)));
  return uint64_t(__builtin_popcount(unsigned(m)));
}

inline double hsum(__m256d v) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

SqNorm sq_norm(const void* data, DType dtype, size_t n, float scale) {
  const __m256i exp_mask = _mm256_set1_epi32(0x7f800000);
  const __m256 s = _mm256_set1_ps(scale);
  const bool scaled = scale != 1.0f;
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  __m256d acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
  uint64_t bad = 0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 x = load8(data, dtype, i);
    __m256 y = load8(data, dtype, i + 8);
    if (scaled) {
      x = _mm256_mul_ps(x, s);
      y = _mm256_mul_ps(y, s);
    }
    bad += count_nonfinite(x, exp_mask) + count_nonfinite(y, exp_mask);
    const __m256d x0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d x1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    const __m256d y0 = _mm256_cvtps_pd(_mm256_castps256_ps128(y));
    const __m256d y1 = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
    acc0 = _mm256_fmadd_pd(x0, x0, acc0);
    acc1 = _mm256_fmadd_pd(x1, x1, acc1);
    acc2 = _mm256_fmadd_pd(y0, y0, acc2);
    acc3 = _mm256_fmadd_pd(y1, y1, acc3);
  }
  SqNorm r = sq_norm_tail(data, dtype, i, n, scale);
  r.sum_sq += hsum(_mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3)));
  r.nonfinite += bad;
  return r;
}

// The 16-bit roundings, each leaving its result in the high half of every 32-bit lane: the eight-wide Vec narrows
// them, the word-order loop (see [Note: sixteen in the order of the 16-bit words]) blends two vectors of them.
inline __m256i nan_lanes(__m256 x) { return _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }

// bfloat16 rounded to nearest even (a NaN: the quiet 0x7fc0).
inline __m256i bf16_high(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan_lanes(x));
}

// A bfloat16 master rounded stochastically (see [Note: state formats]), for the elements at stream indices idx.
inline __m256i stochastic_high(__m256 x, __m256i idx, uint32_t seed) {
  __m256i k = _mm256_xor_si256(idx, _mm256_set1_epi32(int(seed)));
  k = _mm256_xor_si256(k, _mm256_srli_epi32(k, 16));  // lowbias32, as scalar::mix32
  k = _mm256_mullo_epi32(k, _mm256_set1_epi32(0x7feb352d));
  k = _mm256_xor_si256(k, _mm256_srli_epi32(k, 15));
  k = _mm256_mullo_epi32(k, _mm256_set1_epi32(int(0x846ca68bu)));
  k = _mm256_xor_si256(k, _mm256_srli_epi32(k, 16));
  const __m256i b = _mm256_add_epi32(_mm256_castps_si256(x), _mm256_and_si256(k, _mm256_set1_epi32(0xffff)));
  return _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7fc00000), nan_lanes(x));
}

// The 16+16 master's halves: the high one (rounded to nearest, ties away) in the high half of ``hi``, the float's
// own low 16 bits in the low half of ``lo``; a NaN is the quiet NaN with a zero low half.
inline void split_halves(__m256 x, __m256i& hi, __m256i& lo) {
  const __m256i b = _mm256_castps_si256(x), nan = nan_lanes(x);
  hi = _mm256_blendv_epi8(_mm256_add_epi32(b, _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7fc00000), nan);
  lo = _mm256_andnot_si256(nan, b);
}

inline __m128i bf16_8(__m256 x) {
  const __m256i r = _mm256_srli_epi32(bf16_high(x), 16);
  // packus works per 128-bit lane; gather qwords 0 and 2 to restore element order.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

struct Vec {
  using F = __m256;
  static constexpr size_t W = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static constexpr bool STREAMS = true;
  static constexpr size_t PREFETCH = 256;
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }
  static void fence() { _mm_sfence(); }
  static F load_any(const void* data, DType dtype, size_t i) { return load8(data, dtype, i); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F sign(F a) {  // -1, 0 or +1 as torch.sign, a NaN kept
    const F one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const F s = _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), one),
                              _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), one));
    return _mm256_blendv_ps(s, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static __m128i to16(DType dtype, F x) {
    if (dtype != DType::F16) return bf16_8(x);
    const __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (_mm256_movemask_ps(nan) == 0) return h;
    // the quiet NaN with its sign, as torch (see [Note: a float16 NaN])
    const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16),
                                                       _mm256_set1_epi32(0x8000)), _mm256_set1_epi32(0x7e00));
    const __m256i n = _mm256_castps_si256(nan);
    return _mm_blendv_epi8(h, _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)),
                           _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1)));
  }
  static void store16(void* out, DType dtype, size_t i, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), to16(dtype, x));
  }
  static void stream16(void* out, DType dtype, size_t i, F x) {  // 16-byte aligned
    _mm_stream_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), to16(dtype, x));
  }
  // The state formats (see [Note: state formats]).
  static __m128i low16(__m256i x) {  // each lane's low 16 bits, in order
    const __m256i m = _mm256_and_si256(x, _mm256_set1_epi32(0xffff));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(m, m), 0x08));
  }
  static F load_split(const uint16_t* hi, const uint16_t* lo, size_t i) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + i)));
    const __m256i l = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + i)));
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(h, 16), l));
  }
  static void store_split(uint16_t* hi, uint16_t* lo, size_t i, F x) {
    __m256i h, l;
    split_halves(x, h, l);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), low16(_mm256_srli_epi32(h, 16)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), low16(l));
  }
  static void store_stochastic(uint16_t* out, size_t i, F x, uint32_t at, uint32_t seed) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(int(at)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i h = stochastic_high(x, idx, seed);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), low16(_mm256_srli_epi32(h, 16)));
  }
  static void copy16(void* out, const uint16_t* from, size_t i) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i)));
  }
};

// [Note: sixteen in the order of the 16-bit words] A 256-bit load of sixteen 16-bit values holds two float32 vectors
// already, without a widening shuffle: shifting each 32-bit lane left by 16 gives the even elements (0, 2, .. 14) as
// floats, masking off its low half the odd ones (1, 3, .. 15); and two such vectors of results, their values in the
// high halves, go back to sixteen words in order with one shift and one word blend. Adam is element-wise, so a loop
// whose streams are all 16-bit (a 16-bit master with bf16 moments and gradient) steps sixteen elements in this order
// with no shuffle at all, where widening eight at a time and narrowing them back costs one to three cross-lane
// shuffles a stream, and AVX2 cores have fewer shuffle ports than ALUs. Where a float32 stream joins them (a float32
// master beside bf16 moments, a float32 gradient), the order is permuted once more (Pairs<true>): 64-bit blocks
// 0, 2, 1, 3 of the words, so the even elements are 0, 2, 8, 10, 4, 6, 12, 14, which is what one in-lane
// shuffle_ps of two float32 vectors gives; one shuffle a 16-bit stream and one a float32 vector, fewer than the
// widening and narrowing cost. The values are the same as the eight-wide loop's, bit for bit: only the order in
// which the lanes hold the elements differs.
#define OFFLOAD_AVX2_PAIRS 1

template <bool MIXED>
struct Pairs {
  static __m256i words(const uint16_t* p) {  // sixteen words, in the lane order of this mode
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return MIXED ? _mm256_permute4x64_epi64(w, 0xD8) : w;
  }
  static void put(uint16_t* p, __m256i w, bool stream = false) {
    if (MIXED) w = _mm256_permute4x64_epi64(w, 0xD8);
    if (stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), w);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), w);
  }
  static void widen(const void* p, size_t i, __m256 x[2]) {  // sixteen bfloat16s as two float vectors
    const __m256i w = words(static_cast<const uint16_t*>(p) + i);
    x[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    x[1] = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xffff0000u))));
  }
  // Two vectors whose 32-bit lanes hold their 16-bit results in the high (or low) halves, as sixteen words.
  static void put_high(void* p, size_t i, __m256i even, __m256i odd, bool stream = false) {
    put(static_cast<uint16_t*>(p) + i, _mm256_blend_epi16(_mm256_srli_epi32(even, 16), odd, 0xAA), stream);
  }
  static void put_low(void* p, size_t i, __m256i even, __m256i odd) {
    put(static_cast<uint16_t*>(p) + i, _mm256_blend_epi16(even, _mm256_slli_epi32(odd, 16), 0xAA));
  }
  static void load32(const float* p, __m256 x[2]) {  // MIXED only: sixteen floats in its order
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    x[0] = _mm256_shuffle_ps(a, b, 0x88);
    x[1] = _mm256_shuffle_ps(a, b, 0xDD);
  }
  static void store32(float* p, const __m256 x[2]) {
    _mm256_storeu_ps(p, _mm256_unpacklo_ps(x[0], x[1]));
    _mm256_storeu_ps(p + 8, _mm256_unpackhi_ps(x[0], x[1]));
  }
  static __m256i even_index() {  // the element each lane of the even vector holds
    return MIXED ? _mm256_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14) : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  }
};

#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(OFFLOAD_SCALAR_ONLY)

inline float32x4_t load4(const void* data, DType dtype, size_t i) {
  switch (dtype) {
    case DType::BF16:
      return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(static_cast<const uint16_t*>(data) + i), 16));
    case DType::F16:
      return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(static_cast<const uint16_t*>(data) + i)));
    default: return vld1q_f32(static_cast<const float*>(data) + i);
  }
}

SqNorm sq_norm(const void* data, DType dtype, size_t n, float scale) {
  const uint32x4_t exp_mask = vdupq_n_u32(0x7f800000u);
  const float32x4_t s = vdupq_n_f32(scale);
  const bool scaled = scale != 1.0f;
  float64x2_t acc0 = vdupq_n_f64(0.0), acc1 = vdupq_n_f64(0.0);
  uint32x4_t bad = vdupq_n_u32(0);
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    float32x4_t x = load4(data, dtype, i);
    if (scaled) x = vmulq_f32(x, s);
    const uint32x4_t e = vandq_u32(vreinterpretq_u32_f32(x), exp_mask);
    bad = vsubq_u32(bad, vceqq_u32(e, exp_mask));  // a true lane is all ones: -1
    const float64x2_t lo = vcvt_f64_f32(vget_low_f32(x)), hi = vcvt_high_f64_f32(x);
    acc0 = vfmaq_f64(acc0, lo, lo);
    acc1 = vfmaq_f64(acc1, hi, hi);
  }
  SqNorm r = sq_norm_tail(data, dtype, i, n, scale);
  r.sum_sq += vaddvq_f64(vaddq_f64(acc0, acc1));
  r.nonfinite += vaddvq_u32(bad);
  return r;
}

inline uint16x4_t bf16_4(float32x4_t x) {  // round to nearest even, NaN to the quiet 0x7fc0, as torch
  const uint32x4_t b = vreinterpretq_u32_f32(x);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(1));
  uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(b, vdupq_n_u32(0x7fff)), lsb), 16);
  r = vbslq_u32(vceqq_f32(x, x), r, vdupq_n_u32(0x7fc0));
  return vmovn_u32(r);
}

struct Vec {
  using F = float32x4_t;
  static constexpr size_t W = 4;
  static F set1(float x) { return vdupq_n_f32(x); }
  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F x) { vst1q_f32(p, x); }
  static constexpr bool STREAMS = false;  // no streaming store here: stream is store
  static constexpr size_t PREFETCH = 0;    // not measured on an Arm core: the hardware's own prefetchers alone
  static void stream(float* p, F x) { vst1q_f32(p, x); }
  static void fence() {}
  static F load_any(const void* data, DType dtype, size_t i) { return load4(data, dtype, i); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F sqrt(F a) { return vsqrtq_f32(a); }
  static F sign(F a) {  // -1, 0 or +1 as torch.sign, a NaN kept
    const F one = vdupq_n_f32(1.0f), zero = vdupq_n_f32(0.0f);
    const F s = vsubq_f32(vbslq_f32(vcgtq_f32(a, zero), one, zero), vbslq_f32(vcltq_f32(a, zero), one, zero));
    return vbslq_f32(vceqq_f32(a, a), s, a);
  }
  static F fmadd(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static void store16(void* out, DType dtype, size_t i, F x) {
    uint16x4_t h;
    if (dtype == DType::F16) {  // a NaN: the quiet one with its sign, as torch (see [Note: a float16 NaN])
      const uint16x4_t q = vmovn_u32(vorrq_u32(vandq_u32(vshrq_n_u32(vreinterpretq_u32_f32(x), 16),
                                                         vdupq_n_u32(0x8000)), vdupq_n_u32(0x7e00)));
      h = vbsl_u16(vmovn_u32(vceqq_f32(x, x)), vreinterpret_u16_f16(vcvt_f16_f32(x)), q);
    } else {
      h = bf16_4(x);
    }
    vst1_u16(static_cast<uint16_t*>(out) + i, h);
  }
  static void stream16(void* out, DType dtype, size_t i, F x) {
    store16(out, dtype, i, x);
  }
  // The state formats (see [Note: state formats]).
  static F load_split(const uint16_t* hi, const uint16_t* lo, size_t i) {
    const uint32x4_t h = vshll_n_u16(vld1_u16(hi + i), 16);
    const uint32x4_t l = vreinterpretq_u32_s32(vmovl_s16(vreinterpret_s16_u16(vld1_u16(lo + i))));
    return vreinterpretq_f32_u32(vaddq_u32(h, l));
  }
  static void store_split(uint16_t* hi, uint16_t* lo, size_t i, F x) {
    const uint32x4_t b = vreinterpretq_u32_f32(x);
    const uint32x4_t ok = vceqq_f32(x, x);  // all ones where not NaN
    const uint32x4_t h = vbslq_u32(ok, vshrq_n_u32(vaddq_u32(b, vdupq_n_u32(0x8000)), 16), vdupq_n_u32(0x7fc0));
    vst1_u16(hi + i, vmovn_u32(h));
    vst1_u16(lo + i, vmovn_u32(vandq_u32(b, ok)));
  }
  static void store_stochastic(uint16_t* out, size_t i, F x, uint32_t at, uint32_t seed) {
    const uint32_t lanes[4] = {0, 1, 2, 3};
    uint32x4_t k = veorq_u32(vaddq_u32(vdupq_n_u32(at), vld1q_u32(lanes)), vdupq_n_u32(seed));
    k = veorq_u32(k, vshrq_n_u32(k, 16));  // lowbias32, as scalar::mix32
    k = vmulq_u32(k, vdupq_n_u32(0x7feb352du));
    k = veorq_u32(k, vshrq_n_u32(k, 15));
    k = vmulq_u32(k, vdupq_n_u32(0x846ca68bu));
    k = veorq_u32(k, vshrq_n_u32(k, 16));
    const uint32x4_t b = vaddq_u32(vreinterpretq_u32_f32(x), vandq_u32(k, vdupq_n_u32(0xffff)));
    const uint32x4_t h = vbslq_u32(vceqq_f32(x, x), vshrq_n_u32(b, 16), vdupq_n_u32(0x7fc0));
    vst1_u16(out + i, vmovn_u32(h));
  }
  static void copy16(void* out, const uint16_t* from, size_t i) { vst1_u16(static_cast<uint16_t*>(out) + i, vld1_u16(from + i)); }
};

#else

SqNorm sq_norm(const void* data, DType dtype, size_t n, float scale) {
  return sq_norm_tail(data, dtype, 0, n, scale);
}

#define OFFLOAD_NO_VECTOR 1

#endif

// One element at a time: the portable variant, and every variant's tail.
struct Scalar {
  using F = float;
  static constexpr size_t W = 1;
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static constexpr bool STREAMS = false;
  static constexpr size_t PREFETCH = 0;
  static void stream(float* p, F x) { *p = x; }
  static void fence() {}
  static F load_any(const void* data, DType dtype, size_t i) { return scalar::load(data, int(dtype), i); }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return __builtin_sqrtf(a); }
  static F sign(F a) { return a > 0.0f ? 1.0f : a < 0.0f ? -1.0f : a; }  // 0 and NaN as they are
  static F fmadd(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  static void store16(void* out, DType dtype, size_t i, F x) { scalar::store16(out, int(dtype), i, x); }
  static void stream16(void* out, DType dtype, size_t i, F x) { scalar::store16(out, int(dtype), i, x); }
  // The state formats (see [Note: state formats]).
  static F load_split(const uint16_t* hi, const uint16_t* lo, size_t i) { return scalar::join_split(hi[i], lo[i]); }
  static void store_split(uint16_t* hi, uint16_t* lo, size_t i, F x) { scalar::split(x, hi + i, lo + i); }
  static void store_stochastic(uint16_t* out, size_t i, F x, uint32_t at, uint32_t seed) {
    out[i] = scalar::bf16_stochastic(x, scalar::mix32(at ^ seed));
  }
  static void copy16(void* out, const uint16_t* from, size_t i) { static_cast<uint16_t*>(out)[i] = from[i]; }
};

#if defined(OFFLOAD_NO_VECTOR)
using Vec = Scalar;  // the portable build: the "vector" pass is the scalar one, the tail pass is empty
#endif

template <class V>
bool aligned(const void* p, size_t bytes = sizeof(float)) {  // for V's streaming store of W `bytes`-wide elements
  return V::STREAMS && reinterpret_cast<uintptr_t>(p) % (V::W * bytes) == 0;
}

// [Note: Adam's order of operations] Each line rounds where torch.optim.Adam's
// single-tensor path rounds, and uses an FMA where torch's vectorized lerp_, addcmul_
// and add(alpha=) do, so the moments come out bit-identical to torch's; the params
// differ only where torch's CPU sqrt is not correctly rounded (ours is). Scalars arrive
// pre-rounded to float as torch rounds its Python-float arguments.
//
// [Note: one divide] torch divides sqrt(v) by sqrt(1 - beta2**t); we multiply by its
// float reciprocal instead. Divides and square roots share one unit whose throughput
// bounds the kernel when the state sits in cache (here: 10M parameters in a 480 MiB L3),
// so this buys about a third. It can move that term by an ulp, so params match torch's
// within 1e-6 relative rather than to the bit; the moments are still bit-identical.
//
// [Note: hoisting] Everything the loop reads from AdamArgs is copied to locals and the
// pointers marked __restrict: stores through float* could otherwise alias the struct's
// float fields, and the compiler then reloads pointers and re-tests the flags on every
// iteration. Gradient and copy dtypes are template parameters so their switches fold away; so is whether the
// new state goes elsewhere (ELSEWHERE), so an in-place step never has two restrict pointers to one buffer.
//
// [Note: streaming stores] A step written elsewhere (the speculative step's second slot) stores to lines it never
// read, and an ordinary store first reads each such line into the cache: 12 more bytes an element over the 28 that
// an in-place step moves (the H100 measured its speculative Adam 1.43x the in-place one, 57 against 40 ms). Where
// the three outputs are aligned for it, the vector pass stores around the cache instead and fences before it
// returns, so the thread that waits for the pool sees every element. Values are unchanged: only how they reach
// memory. The 16-bit copy is written the same way wherever it is aligned for it, in place or not: it is a pinned
// buffer a copy engine reads next, or compute weights the next forward reads after the pass has evicted them
// (2 bytes an element less: 1.05x on the Xeon at 32M elements).
// [Note: state formats] The master weights and the moments may be held in fewer bytes than float32 (each 4 bytes an
// element, 12 of state). The arithmetic is always float32, as above; only what is loaded and stored differs:
// - moments in bfloat16 (DType::BF16): widened on load, rounded to nearest even on store (bf16 keeps float32's
//   exponent range, so the second moment neither flushes to zero nor overflows where float32's would not);
// - Master::SPLIT, 16+16: the float32 master as two 16-bit halves, the high one the bf16 weights the forward reads.
//   The high half is the master rounded to nearest, ties away from zero (plain mixed precision rounds ties to even:
//   they differ on exact ties only, one element in 65536, by one bf16 unit), and the low half is the float's own
//   low 16 bits: high << 16 plus the low half sign-extended is the float32 bit for bit, because rounding moves the
//   high half by at most the low half's weight. A NaN master is stored as the quiet NaN 0x7fc0 with a zero low half
//   (a payload must not carry into the sign). So the split master steps exactly as the float32 one;
// - Master::BF16, rounded to nearest even (DeepSpeed's bf16 master), or Master::BF16_STOCHASTIC: rounded up in
//   magnitude with the probability of the dropped bits, from random bits that hash the step's seed with the
//   element's index in the stream, so the result depends on neither the tiles nor the threads, and a run resumed
//   with the same seeds rounds the same way.
// The 16-bit copy (out16) of a 16-bit master is the master itself, copied.
// [Note: software prefetch] Each stream the step reads is prefetched V::PREFETCH elements ahead. The hardware's
// prefetchers alone left the Xeon's cores (Emerald Rapids, 2 vCPUs) short of the lines in flight they need: with
// the prefetch the AVX-512 step took 0.82-0.89x its time with the fp32 state and 0.90-0.92x with bf16 moments, the
// AVX2 step 0.95x with the fp32 state (100M elements, 2 threads, 15 interleaved rounds, 2026-11-28). Not measured
// on AMD or Arm cores (the NEON build does not prefetch). On an AMD Zen 5 EPYC it cost about 10%, so the distance
// is a run-time choice (AdamArgs::prefetch, 0: none), which offload/machine/prefetch.py makes per CPU from a
// measurement; V::PREFETCH is the variant's default and 0 where it never prefetches. A prefetch is only a hint: it
// never faults, even past a buffer's end, and changes no value.
template <class V>
inline void prefetch(const void* base, size_t i, size_t bytes, size_t ahead) {
  if constexpr (V::PREFETCH != 0)
    if (ahead != 0)
      __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(base) + (i + ahead) * bytes));
}

template <class V, int MASTER>
typename V::F load_master(const void* param, const uint16_t* lo, size_t i) {
  if constexpr (MASTER == int(Master::F32)) return V::load(static_cast<const float*>(param) + i);
  else if constexpr (MASTER == int(Master::SPLIT)) return V::load_split(static_cast<const uint16_t*>(param), lo, i);
  else return V::load_any(param, DType::BF16, i);
}

template <class V, int MASTER>
void store_master(void* param, uint16_t* lo, size_t i, typename V::F x, uint32_t at, uint32_t seed) {
  if constexpr (MASTER == int(Master::F32)) V::store(static_cast<float*>(param) + i, x);
  else if constexpr (MASTER == int(Master::SPLIT)) V::store_split(static_cast<uint16_t*>(param), lo, i, x);
  else if constexpr (MASTER == int(Master::BF16)) V::store16(param, DType::BF16, i, x);
  else V::store_stochastic(static_cast<uint16_t*>(param), i, x, at, seed);
}

template <class V, bool BF16>
typename V::F load_moment(const void* m, size_t i) {
  if constexpr (BF16) return V::load_any(m, DType::BF16, i);
  else return V::load(static_cast<const float*>(m) + i);
}

template <class V, bool BF16>
void store_moment(void* m, size_t i, typename V::F x) {
  if constexpr (BF16) V::store16(m, DType::BF16, i, x);
  else V::store(static_cast<float*>(m) + i, x);
}

// Adam's arithmetic on one vector of elements, shared by every loop that loads and stores them (see [Note: Adam's
// order of operations]); the scalars rounded to float once, as torch rounds its Python floats.
template <class V>
struct AdamTerms {
  using F = typename V::F;
  F pre, scale, decay, l2, b1c, b2, b2c, inv_bc2, eps, step;
  bool use_pre, use_scale, use_decay, use_l2, use_bc2;

  explicit AdamTerms(const AdamArgs& a)
      : pre(V::set1(a.pre_scale)), scale(V::set1(a.grad_scale)), decay(V::set1(a.decay)), l2(V::set1(a.l2)),
        b1c(V::set1(a.one_minus_beta1)), b2(V::set1(a.beta2)), b2c(V::set1(a.one_minus_beta2)),
        inv_bc2(V::set1(1.0f / a.bc2_sqrt)),  // one divide less per element (see [Note: one divide])
        eps(V::set1(a.eps)), step(V::set1(a.step_size)), use_pre(a.pre_scale != 1.0f),
        use_scale(a.grad_scale != 1.0f), use_decay(a.decay != 1.0f), use_l2(a.l2 != 0.0f),
        use_bc2(a.bc2_sqrt != 1.0f) {}

  // The new master from the gradient as loaded and the old master; the moments updated in place.
  F update(F g, F p0, F& m, F& v) const {
    if (use_pre) g = V::mul(g, pre);               // a landed gradient: what its accumulation would have rounded
    if (use_scale) g = V::mul(g, scale);
    F p = use_decay ? V::mul(p0, decay) : p0;     // AdamW: param.mul_(1 - lr * wd)
    if (use_l2) g = V::fmadd(l2, p0, g);          // Adam: grad.add(param, alpha=wd); skipped, not * 0 (0 * inf)
    m = V::fmadd(b1c, V::sub(g, m), m);           // exp_avg.lerp_(grad, 1 - beta1)
    v = V::fmadd(V::mul(b2c, g), g, V::mul(v, b2));  // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
    const F root = V::sqrt(v);
    const F denom = V::add(use_bc2 ? V::mul(root, inv_bc2) : root, eps);
    return V::sub(p, V::div(V::mul(step, m), denom));  // param.addcdiv_(m, denom, -step_size)
  }
};

template <class V, DType G, int OUT, bool ELSEWHERE, int MASTER, bool BF16M>
size_t adam_loop(const AdamArgs& a, size_t i, size_t end) {
  using F = typename V::F;
  constexpr bool WIDE = MASTER == int(Master::F32) && !BF16M;  // the float32 state, which may stream
  // Written; read too when in place.
  void* __restrict param = ELSEWHERE ? a.param_out : a.param;
  uint16_t* __restrict param_lo = ELSEWHERE ? a.param_lo_out : a.param_lo;
  void* __restrict exp_avg = ELSEWHERE ? a.exp_avg_out : a.exp_avg;
  void* __restrict exp_avg_sq = ELSEWHERE ? a.exp_avg_sq_out : a.exp_avg_sq;
  // Read, when the new state goes elsewhere (never dereferenced in place).
  const void* __restrict param_src = ELSEWHERE ? a.param : nullptr;
  const uint16_t* __restrict param_lo_src = ELSEWHERE ? a.param_lo : nullptr;
  const void* __restrict exp_avg_src = ELSEWHERE ? a.exp_avg : nullptr;
  const void* __restrict exp_avg_sq_src = ELSEWHERE ? a.exp_avg_sq : nullptr;
  const void* __restrict grad = a.grad;
  void* __restrict out16 = a.out16;
  const uint32_t seed = scalar::mix32(a.seed), at0 = uint32_t(a.index0);
  const AdamTerms<V> terms(a);
  const bool stream = WIDE && ELSEWHERE && aligned<V>(static_cast<float*>(param) + i) &&
                      aligned<V>(static_cast<float*>(exp_avg) + i) &&
                      aligned<V>(static_cast<float*>(exp_avg_sq) + i);  // see [Note: streaming stores]
  const bool stream16 = OUT != 0 && aligned<V>(static_cast<uint16_t*>(out16) + i, sizeof(uint16_t));
  const size_t ahead = a.prefetch == PREFETCH_BUILD ? V::PREFETCH : a.prefetch;
  for (; i + V::W <= end; i += V::W) {
    prefetch<V>(grad, i, G == DType::F32 ? 4 : 2, ahead);
    prefetch<V>(ELSEWHERE ? param_src : param, i, MASTER == int(Master::F32) ? 4 : 2, ahead);
    if constexpr (MASTER == int(Master::SPLIT)) prefetch<V>(ELSEWHERE ? param_lo_src : param_lo, i, 2, ahead);
    prefetch<V>(ELSEWHERE ? exp_avg_src : exp_avg, i, BF16M ? 2 : 4, ahead);
    prefetch<V>(ELSEWHERE ? exp_avg_sq_src : exp_avg_sq, i, BF16M ? 2 : 4, ahead);
    const F p0 = load_master<V, MASTER>(ELSEWHERE ? param_src : param, ELSEWHERE ? param_lo_src : param_lo, i);
    F m = load_moment<V, BF16M>(ELSEWHERE ? exp_avg_src : exp_avg, i);
    F v = load_moment<V, BF16M>(ELSEWHERE ? exp_avg_sq_src : exp_avg_sq, i);
    const F p = terms.update(V::load_any(grad, G, i), p0, m, v);
    if (stream) {
      V::stream(static_cast<float*>(param) + i, p);
      V::stream(static_cast<float*>(exp_avg) + i, m);
      V::stream(static_cast<float*>(exp_avg_sq) + i, v);
    } else {
      store_master<V, MASTER>(param, param_lo, i, p, at0 + uint32_t(i), seed);
      store_moment<V, BF16M>(exp_avg, i, m);
      store_moment<V, BF16M>(exp_avg_sq, i, v);
    }
    if constexpr (OUT != 0 && MASTER != int(Master::F32)) {
      V::copy16(out16, static_cast<const uint16_t*>(param), i);  // the weights are the master's 16 bits
    } else if constexpr (OUT != 0) {
      if (stream16) V::stream16(out16, OUT == 1 ? DType::BF16 : DType::F16, i, p);
      else V::store16(out16, OUT == 1 ? DType::BF16 : DType::F16, i, p);
    }
  }
  if (stream || stream16) V::fence();
  return i;
}

#if defined(OFFLOAD_AVX2_PAIRS)
// Adam over sixteen elements at a time in the order of the 16-bit words (see [Note: sixteen in the order of the 16-bit
// words]), for a state with a 16-bit stream: the same arithmetic (AdamTerms) on each half, the same roundings as
// Vec's, so the same bits as adam_loop. A float16 gradient or copy goes through adam_loop (no word-order widening).
template <DType G, int OUT, bool ELSEWHERE, int MASTER, bool BF16M>
size_t adam_pairs(const AdamArgs& a, size_t i, size_t end) {
  constexpr bool MIXED = MASTER == int(Master::F32) || !BF16M || G == DType::F32;
  using P = Pairs<MIXED>;
  void* __restrict param = ELSEWHERE ? a.param_out : a.param;
  uint16_t* __restrict param_lo = ELSEWHERE ? a.param_lo_out : a.param_lo;
  void* __restrict exp_avg = ELSEWHERE ? a.exp_avg_out : a.exp_avg;
  void* __restrict exp_avg_sq = ELSEWHERE ? a.exp_avg_sq_out : a.exp_avg_sq;
  // Read, when the new state goes elsewhere; in place the loads read the buffers above (one pointer to each).
  const void* __restrict param_old = ELSEWHERE ? a.param : nullptr;
  const uint16_t* __restrict param_lo_old = ELSEWHERE ? a.param_lo : nullptr;
  const void* __restrict exp_avg_old = ELSEWHERE ? a.exp_avg : nullptr;
  const void* __restrict exp_avg_sq_old = ELSEWHERE ? a.exp_avg_sq : nullptr;
  const void* param_src = ELSEWHERE ? param_old : param;
  const uint16_t* param_lo_src = ELSEWHERE ? param_lo_old : param_lo;
  const void* exp_avg_src = ELSEWHERE ? exp_avg_old : exp_avg;
  const void* exp_avg_sq_src = ELSEWHERE ? exp_avg_sq_old : exp_avg_sq;
  const void* __restrict grad = a.grad;
  void* __restrict out16 = a.out16;
  const uint32_t seed = scalar::mix32(a.seed);
  const __m256i even_index = P::even_index(), one = _mm256_set1_epi32(1);
  const AdamTerms<Vec> terms(a);
  // the copy of a float32 master streams around the cache where it is aligned (see [Note: streaming stores])
  const bool stream16 = OUT == 1 && MASTER == int(Master::F32) &&
                        reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(out16) + i) % 32 == 0;
  const size_t ahead = a.prefetch == PREFETCH_BUILD ? Vec::PREFETCH : a.prefetch;
  for (; i + 16 <= end; i += 16) {
    prefetch<Vec>(grad, i, G == DType::F32 ? 4 : 2, ahead);
    prefetch<Vec>(param_src, i, MASTER == int(Master::F32) ? 4 : 2, ahead);
    if constexpr (MASTER == int(Master::SPLIT)) prefetch<Vec>(param_lo_src, i, 2, ahead);
    prefetch<Vec>(exp_avg_src, i, BF16M ? 2 : 4, ahead);
    prefetch<Vec>(exp_avg_sq_src, i, BF16M ? 2 : 4, ahead);
    __m256 g[2], p[2], m[2], v[2];
    if constexpr (G == DType::F32) P::load32(static_cast<const float*>(grad) + i, g);
    else P::widen(grad, i, g);
    if constexpr (MASTER == int(Master::F32)) {
      P::load32(static_cast<const float*>(param_src) + i, p);
    } else if constexpr (MASTER == int(Master::SPLIT)) {  // high << 16 plus the low half sign-extended
      const __m256i hi = P::words(static_cast<const uint16_t*>(param_src) + i), lo = P::words(param_lo_src + i);
      p[0] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(hi, 16),
                                                  _mm256_srai_epi32(_mm256_slli_epi32(lo, 16), 16)));
      p[1] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(int(0xffff0000u))),
                                                  _mm256_srai_epi32(lo, 16)));
    } else {
      P::widen(param_src, i, p);
    }
    if constexpr (BF16M) {
      P::widen(exp_avg_src, i, m);
      P::widen(exp_avg_sq_src, i, v);
    } else {
      P::load32(static_cast<const float*>(exp_avg_src) + i, m);
      P::load32(static_cast<const float*>(exp_avg_sq_src) + i, v);
    }
    for (int h = 0; h < 2; ++h) p[h] = terms.update(g[h], p[h], m[h], v[h]);
    __m256i hi[2];  // a 16-bit master's words as stored, in their high halves: the copy is them
    if constexpr (MASTER == int(Master::F32)) {
      P::store32(static_cast<float*>(param) + i, p);
    } else if constexpr (MASTER == int(Master::SPLIT)) {
      __m256i lo[2];
      for (int h = 0; h < 2; ++h) split_halves(p[h], hi[h], lo[h]);
      P::put_high(param, i, hi[0], hi[1]);
      P::put_low(param_lo, i, lo[0], lo[1]);
    } else if constexpr (MASTER == int(Master::BF16)) {
      hi[0] = bf16_high(p[0]);
      hi[1] = bf16_high(p[1]);
      P::put_high(param, i, hi[0], hi[1]);
    } else {
      const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(int(uint32_t(a.index0) + uint32_t(i))), even_index);
      hi[0] = stochastic_high(p[0], at, seed);
      hi[1] = stochastic_high(p[1], _mm256_add_epi32(at, one), seed);
      P::put_high(param, i, hi[0], hi[1]);
    }
    if constexpr (BF16M) {
      P::put_high(exp_avg, i, bf16_high(m[0]), bf16_high(m[1]));
      P::put_high(exp_avg_sq, i, bf16_high(v[0]), bf16_high(v[1]));
    } else {
      P::store32(static_cast<float*>(exp_avg) + i, m);
      P::store32(static_cast<float*>(exp_avg_sq) + i, v);
    }
    if constexpr (OUT == 1 && MASTER != int(Master::F32)) P::put_high(out16, i, hi[0], hi[1]);
    else if constexpr (OUT == 1) P::put_high(out16, i, bf16_high(p[0]), bf16_high(p[1]), stream16);
  }
  if (stream16) Vec::fence();
  return i;
}
#endif

template <class V, DType G, bool ELSEWHERE, int MASTER, bool BF16M>
size_t adam_span_out(const AdamArgs& a, size_t i, size_t end) {
#if defined(OFFLOAD_AVX2_PAIRS)
  // A 16-bit stream's state in word order (see [Note: sixteen in the order of the 16-bit words]); the float32 state
  // and anything float16 stay eight-wide. The rest of the span (under sixteen) goes on below.
  if constexpr (V::W == Vec::W && G != DType::F16 && (MASTER != int(Master::F32) || BF16M)) {
    if (a.out16 == nullptr) i = adam_pairs<G, 0, ELSEWHERE, MASTER, BF16M>(a, i, end);
    else if (a.out_dtype == DType::BF16) i = adam_pairs<G, 1, ELSEWHERE, MASTER, BF16M>(a, i, end);
  }
#endif
  if (a.out16 == nullptr) return adam_loop<V, G, 0, ELSEWHERE, MASTER, BF16M>(a, i, end);
  if (a.out_dtype == DType::BF16) return adam_loop<V, G, 1, ELSEWHERE, MASTER, BF16M>(a, i, end);
  if constexpr (MASTER == int(Master::F32)) return adam_loop<V, G, 2, ELSEWHERE, MASTER, BF16M>(a, i, end);
  return i;  // a 16-bit master has no float16 copy (refused by the binding)
}

template <class V, DType G, bool ELSEWHERE, bool BF16M>
size_t adam_span_master(const AdamArgs& a, size_t i, size_t end) {
  switch (a.master) {
    case Master::SPLIT: return adam_span_out<V, G, ELSEWHERE, int(Master::SPLIT), BF16M>(a, i, end);
    case Master::BF16: return adam_span_out<V, G, ELSEWHERE, int(Master::BF16), BF16M>(a, i, end);
    case Master::BF16_STOCHASTIC: return adam_span_out<V, G, ELSEWHERE, int(Master::BF16_STOCHASTIC), BF16M>(a, i, end);
    default: return adam_span_out<V, G, ELSEWHERE, int(Master::F32), BF16M>(a, i, end);
  }
}

template <class V, DType G>
size_t adam_span_g(const AdamArgs& a, size_t i, size_t end) {
  const bool bf16m = a.moment_dtype == DType::BF16;
  if (a.param_out != nullptr)
    return bf16m ? adam_span_master<V, G, true, true>(a, i, end) : adam_span_master<V, G, true, false>(a, i, end);
  return bf16m ? adam_span_master<V, G, false, true>(a, i, end) : adam_span_master<V, G, false, false>(a, i, end);
}

template <class V>
size_t adam_span(const AdamArgs& a, size_t i, size_t end) {
  switch (a.grad_dtype) {
    case DType::BF16: return adam_span_g<V, DType::BF16>(a, i, end);
    case DType::F16: return adam_span_g<V, DType::F16>(a, i, end);
    default: return adam_span_g<V, DType::F32>(a, i, end);
  }
}

// The first elements of a step written elsewhere one at a time, up to where its outputs are aligned for the
// vector pass's streaming stores (see [Note: streaming stores]); returns where the vector pass starts.
template <class V>
size_t align_elsewhere(const AdamArgs& a, size_t i, size_t end) {
  if (!V::STREAMS || a.param_out == nullptr || a.master != Master::F32 || a.moment_dtype != DType::F32) return i;
  const size_t width = V::W * sizeof(float);  // the vector pass's store, bytes
  const uintptr_t off = reinterpret_cast<uintptr_t>(static_cast<float*>(a.param_out) + i) % width;
  const size_t lead = off == 0 ? 0 : (width - off) / sizeof(float);
  const size_t stop = i + lead < end ? i + lead : end;
  if (!aligned<V>(static_cast<float*>(a.exp_avg_out) + stop) || !aligned<V>(static_cast<float*>(a.exp_avg_sq_out) + stop))
    return i;  // offsets differ
  return adam_span<Scalar>(a, i, stop);
}

void adam(const AdamArgs& a, size_t begin, size_t end) {
  adam_span<Scalar>(a, adam_span<Vec>(a, align_elsewhere<Vec>(a, begin, end), end), end);
}

// [Note: one state] Lion and Adagrad keep one state buffer beside the master (Lion its momentum, Adagrad its sum of
// squared gradients): with the float32 state 12 bytes an element moved where Adam moves 16 (plus the gradient and
// the 16-bit copy). Each line rounds where the reference rounds: Lion as its paper writes it (the decay first, the
// sign of beta1 * m + (1 - beta1) * g, then the momentum's own update with beta2), with torch's add(alpha=)'s FMA;
// Adagrad as torch.optim.Adagrad's single-tensor path (the L2 term into the gradient, the sum's addcmul_ as an FMA,
// the divide by sqrt(sum) + eps; its learning rate decayed by the caller). The sign of 0 is 0 and of a NaN a NaN, as
// torch.sign's (DeepSpeed's CPU Lion steps an exact zero by -lr, its GPU Lion by +lr). The master and the state take
// Adam's formats (see [Note: state formats]): loaded and stored as held, the arithmetic float32, so a 16+16 master
// steps bit for bit as a float32 one.
template <class V, DType G, int OUT, int RULE, int MASTER, bool BF16S>
size_t one_state_loop(const OneStateArgs& a, size_t i, size_t end) {
  using F = typename V::F;
  void* __restrict param = a.param;
  uint16_t* __restrict param_lo = a.param_lo;
  void* __restrict state = a.state;
  const void* __restrict grad = a.grad;
  void* __restrict out16 = a.out16;
  const uint32_t seed = scalar::mix32(a.seed), at0 = uint32_t(a.index0);
  const F scale = V::set1(a.grad_scale), decay = V::set1(a.decay), l2 = V::set1(a.l2), lr = V::set1(a.lr);
  const F neg_lr = V::set1(-a.lr), b1 = V::set1(a.beta1), b1c = V::set1(a.one_minus_beta1);
  const F b2 = V::set1(a.beta2), b2c = V::set1(a.one_minus_beta2), eps = V::set1(a.eps);
  const bool use_scale = a.grad_scale != 1.0f, use_decay = a.decay != 1.0f, use_l2 = a.l2 != 0.0f;
  for (; i + V::W <= end; i += V::W) {
    F g = V::load_any(grad, G, i);
    if (use_scale) g = V::mul(g, scale);
    F p = load_master<V, MASTER>(param, param_lo, i);
    F s = load_moment<V, BF16S>(state, i);
    if constexpr (RULE == int(OneStateRule::LION)) {
      if (use_decay) p = V::mul(p, decay);                  // param.mul_(1 - lr * weight_decay)
      const F c = V::fmadd(b1c, g, V::mul(s, b1));          // exp_avg * beta1 + (1 - beta1) * grad
      p = V::fmadd(neg_lr, V::sign(c), p);                  // param.add_(sign(c), alpha=-lr)
      s = V::fmadd(b2c, g, V::mul(s, b2));                  // exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
    } else {
      if (use_l2) g = V::fmadd(l2, p, g);                   // grad.add(param, alpha=weight_decay)
      s = V::fmadd(g, g, s);                                // state_sum.addcmul_(grad, grad)
      p = V::sub(p, V::div(V::mul(lr, g), V::add(V::sqrt(s), eps)));  // param.addcdiv_(grad, std, value=-clr)
    }
    store_master<V, MASTER>(param, param_lo, i, p, at0 + uint32_t(i), seed);
    store_moment<V, BF16S>(state, i, s);
    if constexpr (OUT != 0 && MASTER != int(Master::F32)) {
      V::copy16(out16, static_cast<const uint16_t*>(param), i);  // the weights are the master's 16 bits
    } else if constexpr (OUT != 0) {
      V::store16(out16, OUT == 1 ? DType::BF16 : DType::F16, i, p);
    }
  }
  return i;
}

template <class V, DType G, int OUT, int MASTER, bool BF16S>
size_t one_state_rule(const OneStateArgs& a, size_t i, size_t end) {
  if (a.rule == OneStateRule::LION)
    return one_state_loop<V, G, OUT, int(OneStateRule::LION), MASTER, BF16S>(a, i, end);
  return one_state_loop<V, G, OUT, int(OneStateRule::ADAGRAD), MASTER, BF16S>(a, i, end);
}

template <class V, DType G, int MASTER, bool BF16S>
size_t one_state_out(const OneStateArgs& a, size_t i, size_t end) {
  if (a.out16 == nullptr) return one_state_rule<V, G, 0, MASTER, BF16S>(a, i, end);
  if (a.out_dtype == DType::BF16) return one_state_rule<V, G, 1, MASTER, BF16S>(a, i, end);
  if constexpr (MASTER == int(Master::F32)) return one_state_rule<V, G, 2, MASTER, BF16S>(a, i, end);
  return i;  // a 16-bit master has no float16 copy (refused by the binding)
}

template <class V, DType G, bool BF16S>
size_t one_state_master(const OneStateArgs& a, size_t i, size_t end) {
  switch (a.master) {
    case Master::SPLIT: return one_state_out<V, G, int(Master::SPLIT), BF16S>(a, i, end);
    case Master::BF16: return one_state_out<V, G, int(Master::BF16), BF16S>(a, i, end);
    case Master::BF16_STOCHASTIC: return one_state_out<V, G, int(Master::BF16_STOCHASTIC), BF16S>(a, i, end);
    default: return one_state_out<V, G, int(Master::F32), BF16S>(a, i, end);
  }
}

template <class V, DType G>
size_t one_state_g(const OneStateArgs& a, size_t i, size_t end) {
  if (a.state_dtype == DType::BF16) return one_state_master<V, G, true>(a, i, end);
  return one_state_master<V, G, false>(a, i, end);
}

template <class V>
size_t one_state_span(const OneStateArgs& a, size_t i, size_t end) {
  switch (a.grad_dtype) {
    case DType::BF16: return one_state_g<V, DType::BF16>(a, i, end);
    case DType::F16: return one_state_g<V, DType::F16>(a, i, end);
    default: return one_state_g<V, DType::F32>(a, i, end);
  }
}

void one_state(const OneStateArgs& a, size_t begin, size_t end) {
  one_state_span<Scalar>(a, one_state_span<Vec>(a, begin, end), end);
}

template <class V>
size_t accumulate_span(float* a, const void* b, DType dtype, float s, bool overwrite, size_t i, size_t end) {
  const typename V::F k = V::set1(s);
  if (overwrite) {
    for (; i + V::W <= end; i += V::W) V::store(a + i, V::mul(k, V::load_any(b, dtype, i)));
  } else {
    for (; i + V::W <= end; i += V::W) V::store(a + i, V::fmadd(k, V::load_any(b, dtype, i), V::load(a + i)));
  }
  return i;
}

void accumulate(float* a, const void* b, DType dtype, float s, bool overwrite, size_t begin, size_t end) {
  accumulate_span<Scalar>(a, b, dtype, s, overwrite, accumulate_span<Vec>(a, b, dtype, s, overwrite, begin, end),
                          end);
}

template <class V>
size_t touch3_span(float* p, float* m, float* v, const float* g, size_t i, size_t end) {
  for (; i + V::W <= end; i += V::W) {
    const typename V::F x = V::load(g + i);
    V::store(p + i, V::add(V::load(p + i), x));
    V::store(m + i, V::add(V::load(m + i), x));
    V::store(v + i, V::add(V::load(v + i), x));
  }
  return i;
}

void touch3(float* p, float* m, float* v, const float* g, size_t begin, size_t end) {
  touch3_span<Scalar>(p, m, v, g, touch3_span<Vec>(p, m, v, g, begin, end), end);
}

#if defined(__SSE4_2__) || (defined(__aarch64__) && defined(__ARM_FEATURE_CRC32))
#if defined(__SSE4_2__)
inline uint64_t crc_u64(uint64_t c, uint64_t word) { return _mm_crc32_u64(c, word); }
inline uint32_t crc_u8(uint32_t c, unsigned char byte) { return _mm_crc32_u8(c, byte); }
#else
inline uint64_t crc_u64(uint64_t c, uint64_t word) { return __crc32cd(uint32_t(c), word); }
inline uint32_t crc_u8(uint32_t c, unsigned char byte) { return __crc32cb(c, byte); }
#endif
// [Note: three CRC lanes] The CRC32 instruction (CRC32CX on Arm) takes 8 bytes but has a latency of 3
// cycles, so one dependency chain runs at a third of its throughput (~8 GB/s a core).
// A long buffer is cut into three equal lanes checksummed in one loop (three chains in
// flight) and the lanes' raw CRCs are joined by linearity: the raw CRC of A||B from
// state s is raw(A, s) * x^(8|B|) + raw(B, 0) mod P. The x^(8n) factors cost a few dozen
// carry-less products in software per call, nothing next to the megabyte blocks here.
constexpr uint32_t kCrc32cPoly = 0x82F63B78u;  // reflected: bit 31 - e holds x^e

uint32_t gf_mul(uint32_t a, uint32_t b) {  // a * b mod P, reflected
  uint32_t r = 0;
  for (int e = 0; e < 32; ++e) {
    if (a & (0x80000000u >> e)) r ^= b;
    b = (b >> 1) ^ ((b & 1u) ? kCrc32cPoly : 0u);  // b * x
  }
  return r;
}

uint32_t x_pow_8n(size_t n) {  // x^(8n) mod P by square-and-multiply
  uint32_t result = 0x80000000u, base = 0x00800000u;  // 1 and x^8
  for (; n > 0; n >>= 1) {
    if (n & 1) result = gf_mul(result, base);
    base = gf_mul(base, base);
  }
  return result;
}

uint64_t crc_chain(uint64_t c, const unsigned char* p, size_t n) {  // raw state; n a multiple of 8
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    __builtin_memcpy(&word, p, 8);
    c = crc_u64(c, word);
  }
  return c;
}

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t c = uint32_t(~crc);
  if (n >= 3 * 4096) {
    const size_t lane = n / 24 * 8;
    uint64_t a = c, b = 0, d = 0;
    const unsigned char *pa = p, *pb = p + lane, *pd = p + 2 * lane;
    for (size_t i = 0; i < lane; i += 8) {
      uint64_t wa, wb, wd;
      __builtin_memcpy(&wa, pa + i, 8);
      __builtin_memcpy(&wb, pb + i, 8);
      __builtin_memcpy(&wd, pd + i, 8);
      a = crc_u64(a, wa);
      b = crc_u64(b, wb);
      d = crc_u64(d, wd);
    }
    c = gf_mul(uint32_t(a), x_pow_8n(2 * lane)) ^ gf_mul(uint32_t(b), x_pow_8n(lane)) ^ uint32_t(d);
    p += 3 * lane;
    n -= 3 * lane;
  }
  c = crc_chain(c, p, n & ~size_t(7));
  p += n & ~size_t(7);
  uint32_t c32 = uint32_t(c);
  for (n &= 7; n > 0; --n, ++p) c32 = crc_u8(c32, *p);
  return ~c32;
}
#else
uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  // Bitwise reflected CRC-32C, 0x82F63B78: slow, and only the portable fallback.
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}
#endif

// The 16-bit values this variant's kernels store (see [Note: instruction rules] in scalar.h): Vec's store16, fix-ups
// included, and the scalar tail's.
void to16(const float* x, uint16_t* out, DType dtype, size_t n) {
  size_t i = 0;
#if !defined(OFFLOAD_NO_VECTOR)
  for (; i + Vec::W <= n; i += Vec::W) Vec::store16(out, dtype, i, Vec::load(x + i));
#endif
  for (; i < n; ++i) Scalar::store16(out, dtype, i, x[i]);
}

// The conversion instruction this variant leans on for dtype, bare (no fix-up), named as its scalar model is.
const char* instruction_name(DType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == DType::BF16) return "vcvtneps2bf16";
#endif
#if !defined(OFFLOAD_NO_VECTOR)
  if (dtype == DType::F16) return "vcvtps2ph";  // every Vec's float16 store: F16C's, or AArch64's FCVTN
#endif
  (void)dtype;
  return nullptr;
}

// That instruction's results over n floats, W at a time (the last W through a padded copy); false where the variant
// has no instruction for dtype.
bool instruction16(const float* x, uint16_t* out, DType dtype, size_t n) {
  if (instruction_name(dtype) == nullptr) return false;
#if !defined(OFFLOAD_NO_VECTOR)
  constexpr size_t W = Vec::W;
  for (size_t i = 0; i < n; i += W) {
    float in[W] = {};
    uint16_t got[W];
    for (size_t k = 0; k < W && i + k < n; ++k) in[k] = x[i + k];
#if defined(__AVX512F__)
    if (dtype == DType::F16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(got),
                          _mm512_cvtps_ph(_mm512_loadu_ps(in), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#if defined(__AVX512BF16__)
    if (dtype == DType::BF16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(got), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in)));
#endif
#elif defined(__AVX2__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(got),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__aarch64__)
    vst1_u16(got, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(in))));
#endif
    for (size_t k = 0; k < W && i + k < n; ++k) out[i + k] = got[k];
  }
  return true;
#else
  (void)x, (void)out, (void)n;
  return false;
#endif
}

}  // namespace

extern const KernelTable OFFLOAD_CAT(kernels_, OFFLOAD_ISA_NAME) = {
    OFFLOAD_STR(OFFLOAD_ISA_NAME),
    &sq_norm,
    &adam,
    &touch3,
    &crc32c,
    &accumulate,
    &one_state,
    &to16,
    &instruction_name,
    &instruction16,
};

}  // namespace offload

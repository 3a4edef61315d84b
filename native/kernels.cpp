// The kernels, written once and compiled once per instruction set.
//
// [Note: one source, many targets] CMake compiles this file several times with
// different -m flags and OFFLOAD_ISA_NAME set; the preprocessor picks the
// intrinsics the flags allow. Everything here has internal linkage (anonymous
// namespace, static helpers) and no std:: templates are instantiated: an
// inline function with external linkage compiled with -mavx512f could be
// merged by the linker into the portable variant and fault on an AVX2 CPU.
#include "kernels.h"
#include "scalar.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define OFFLOAD_CAT2(a, b) a##b
#define OFFLOAD_CAT(a, b) OFFLOAD_CAT2(a, b)
#define OFFLOAD_STR2(a) #a
#define OFFLOAD_STR(a) OFFLOAD_STR2(a)

namespace offload {
namespace {

SqNorm sq_norm_tail(const void* data, DType dtype, size_t begin, size_t end) {
  SqNorm r;
  for (size_t i = begin; i < end; ++i) {
    const float x = scalar::load(data, int(dtype), i);
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

SqNorm sq_norm(const void* data, DType dtype, size_t n) {
  const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  uint64_t bad = 0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = load16(data, dtype, i);
    const __m512i e = _mm512_and_si512(_mm512_castps_si512(x), exp_mask);
    bad += uint64_t(__builtin_popcount(_mm512_cmpeq_epi32_mask(e, exp_mask)));
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  SqNorm r = sq_norm_tail(data, dtype, i, n);
  r.sum_sq += _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
  r.nonfinite += bad;
  return r;
}

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

SqNorm sq_norm(const void* data, DType dtype, size_t n) {
  const __m256i exp_mask = _mm256_set1_epi32(0x7f800000);
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  __m256d acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
  uint64_t bad = 0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 x = load8(data, dtype, i);
    const __m256 y = load8(data, dtype, i + 8);
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
  SqNorm r = sq_norm_tail(data, dtype, i, n);
  r.sum_sq += hsum(_mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3)));
  r.nonfinite += bad;
  return r;
}

#else

SqNorm sq_norm(const void* data, DType dtype, size_t n) { return sq_norm_tail(data, dtype, 0, n); }

#endif

}  // namespace

extern const KernelTable OFFLOAD_CAT(kernels_, OFFLOAD_ISA_NAME) = {
    OFFLOAD_STR(OFFLOAD_ISA_NAME),
    &sq_norm,
};

}  // namespace offload

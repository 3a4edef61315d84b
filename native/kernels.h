// Kernel interface shared by every instruction-set variant.
//
// kernels.cpp is compiled once per variant (CMakeLists.txt: portable, avx2,
// avx512) with that variant's target flags; each compilation defines one
// KernelTable. dispatch.cpp picks a table at run time from the CPU's features,
// so no translation unit is ever built with -march=native.
#pragma once

#include <cstddef>
#include <cstdint>

namespace offload {

// Element types the kernels read. Values match offload/native.py.
enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

// Sum of squares, accumulated in double so that a billion-element gradient
// neither loses small terms nor overflows, plus a count of NaN/Inf elements so
// the overflow check of fp16 training costs no second read.
struct SqNorm {
  double sum_sq = 0.0;
  uint64_t nonfinite = 0;
};

struct KernelTable {
  const char* name;
  // One thread's share: elements [0, n) of data, read as dtype.
  SqNorm (*sq_norm)(const void* data, DType dtype, size_t n);
};

extern const KernelTable kernels_portable;
#if defined(OFFLOAD_HAVE_AVX2)
extern const KernelTable kernels_avx2;
#endif
#if defined(OFFLOAD_HAVE_AVX512)
extern const KernelTable kernels_avx512;
#endif

}  // namespace offload

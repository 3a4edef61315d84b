// Kernel interface shared by every instruction-set variant.
//
// kernels.cpp is compiled once per variant (CMakeLists.txt: portable, avx2,
// avx512, avx512bf16 on x86-64; portable, neon on aarch64) with that variant's target flags; each compilation defines one
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

// How the master weights are held (see [Note: state formats] in kernels.cpp).
enum class Master : int {
  F32 = 0,              // float32
  SPLIT = 1,            // 16+16: the high halves are the bf16 weights (rounded), the low halves beside them
  BF16 = 2,             // bfloat16, rounded to nearest even
  BF16_STOCHASTIC = 3,  // bfloat16, rounded stochastically from the step's stream (seed, element index)
};

// One Adam/AdamW step over flat buffers. Scalars are computed by the caller in
// double and rounded to float once, as torch.optim.Adam does with Python floats.
inline constexpr size_t PREFETCH_BUILD = ~size_t(0);

struct AdamArgs {
  void* param = nullptr;          // float (Master::F32), else bf16: SPLIT's high halves
  uint16_t* param_lo = nullptr;   // SPLIT: the low halves
  const void* grad = nullptr;
  void* exp_avg = nullptr;        // moment_dtype, both moments
  void* exp_avg_sq = nullptr;
  void* out16 = nullptr;  // optional 16-bit copy of the updated params
  // Where the new param and moments go: all of them, or none for in place. A step written elsewhere leaves the old
  // state intact (the speculative step's second slot).
  void* param_out = nullptr;
  uint16_t* param_lo_out = nullptr;
  void* exp_avg_out = nullptr;
  void* exp_avg_sq_out = nullptr;
  DType grad_dtype = DType::F32;
  DType out_dtype = DType::BF16;
  DType moment_dtype = DType::F32;  // F32, or BF16 (stored rounded to nearest even; arithmetic in float32)
  Master master = Master::F32;
  uint32_t seed = 0;      // BF16_STOCHASTIC: the step's stream ...
  uint64_t index0 = 0;    // ... and the stream index of element 0 (the rounding depends on neither tiles nor threads)
  float pre_scale = 1.0f;       // a landed 16-bit gradient's own factor, first: what its accumulation multiplied by
  float grad_scale = 1.0f;      // unscale and clip in one factor (1: off)
  float decay = 1.0f;           // AdamW: param *= 1 - lr * weight_decay
  float l2 = 0.0f;              // Adam: grad += l2 * param
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float bc2_sqrt = 1.0f;        // sqrt(1 - beta2**step), or 1 without bias correction
  float eps = 1e-8f;
  float step_size = 1e-3f;      // lr / (1 - beta1**step), or lr
  // Elements ahead each read stream is prefetched (see [Note: software prefetch]); PREFETCH_BUILD: the variant's.
  size_t prefetch = PREFETCH_BUILD;
};

// Lion or Adagrad (see [Note: one state] in kernels.cpp): a master and one state buffer, each in the formats Adam's
// state takes (see [Note: state formats] in kernels.cpp).
enum class OneStateRule : int { LION = 0, ADAGRAD = 1 };

struct OneStateArgs {
  void* param = nullptr;          // float (Master::F32), else bf16: SPLIT's high halves
  uint16_t* param_lo = nullptr;   // SPLIT: the low halves
  const void* grad = nullptr;
  void* state = nullptr;    // state_dtype; Lion: the momentum; Adagrad: the sum of squared gradients
  void* out16 = nullptr;    // optional 16-bit copy of the updated params
  DType grad_dtype = DType::F32;
  DType out_dtype = DType::BF16;
  DType state_dtype = DType::F32;  // F32, or BF16 (stored rounded to nearest even; arithmetic in float32)
  Master master = Master::F32;
  uint32_t seed = 0;        // BF16_STOCHASTIC: the step's stream, and the stream index of element 0 (as AdamArgs)
  uint64_t index0 = 0;
  OneStateRule rule = OneStateRule::LION;
  float grad_scale = 1.0f;  // unscale and clip in one factor (1: off)
  float decay = 1.0f;       // Lion: param *= 1 - lr * weight_decay
  float l2 = 0.0f;          // Adagrad: grad += weight_decay * param
  float lr = 1e-3f;         // Lion: lr; Adagrad: lr / (1 + (step - 1) * lr_decay)
  float beta1 = 0.9f, one_minus_beta1 = 0.1f, beta2 = 0.99f, one_minus_beta2 = 0.01f;  // Lion
  float eps = 1e-10f;       // Adagrad
};

struct KernelTable {
  const char* name;
  // One thread's share: elements [0, n) of data, read as dtype, each times scale in float first (1: as read), so
  // a 16-bit gradient's norm is bitwise that of its fp32 accumulation by scale.
  SqNorm (*sq_norm)(const void* data, DType dtype, size_t n, float scale);
  // Elements [begin, end) of one Adam step.
  void (*adam)(const AdamArgs& a, size_t begin, size_t end);
  // p += g, m += g, v += g over [begin, end): Adam's memory traffic (read 4 streams, write 3)
  // with no arithmetic to speak of, the ceiling an Adam step can approach.
  void (*touch3)(float* p, float* m, float* v, const float* g, size_t begin, size_t end);
  // CRC-32C (Castagnoli) of n bytes, continuing from crc (0 to start); the swap checksums.
  uint32_t (*crc32c)(const void* data, size_t n, uint32_t crc);
  // a[i] = s * b[i] (overwrite) or a[i] += s * b[i] over [begin, end), b read as dtype: a gradient
  // shard (fp32 or 16-bit) added into its fp32 accumulator. With fp32 b it is also the in-place
  // read-2-write-1 probe (axpy) the benchmarks measure as the practical DRAM ceiling.
  void (*accumulate)(float* a, const void* b, DType dtype, float s, bool overwrite, size_t begin, size_t end);
  // Elements [begin, end) of one Lion or Adagrad step.
  void (*one_state)(const OneStateArgs& a, size_t begin, size_t end);
  // The 16-bit values (dtype BF16 or F16) the kernels store for n floats, fix-ups included: the portable rounding.
  void (*to16)(const float* x, uint16_t* out, DType dtype, size_t n);
  // The conversion instruction the variant leans on for dtype, named as its scalar model in scalar.h, or nullptr;
  // and its bare results, before the variant's fix-ups (false where it has none). See [Note: instruction rules].
  const char* (*instruction_name)(DType dtype);
  bool (*instruction16)(const float* x, uint16_t* out, DType dtype, size_t n);
};

extern const KernelTable kernels_portable;
#if defined(OFFLOAD_HAVE_AVX2)
extern const KernelTable kernels_avx2;
#endif
#if defined(OFFLOAD_HAVE_AVX512)
extern const KernelTable kernels_avx512;
#endif
#if defined(OFFLOAD_HAVE_AVX512BF16)
extern const KernelTable kernels_avx512bf16;  // avx512 and the CPU's own bf16 conversion
#endif
#if defined(OFFLOAD_HAVE_NEON)
extern const KernelTable kernels_neon;
#endif

}  // namespace offload

// Run-time choice of a kernel variant, and the thread split every kernel shares.
#pragma once

#include <string>
#include <vector>

#include "kernels.h"

namespace offload {

// Variants this build contains, best last.
std::vector<std::string> compiled_variants();
// Compiled variants whose instructions this CPU (and OS) can execute.
std::vector<std::string> supported_variants();
// Why a compiled variant cannot run here ("" when it can).
std::string missing_features(const std::string& name);

const KernelTable& active_kernels();
// Throws std::invalid_argument naming the variant and the fix.
void select_variant(const std::string& name);

// Sum of squares over n elements, split across `threads` threads.
SqNorm sq_norm(const void* data, DType dtype, size_t n, int threads, float scale = 1.0f);

// One Adam step over n elements, each of `threads` threads sweeping one contiguous range.
// Element-wise, so the result does not depend on the thread count.
void adam(AdamArgs args, size_t n, int threads);
// One Lion or Adagrad step over n elements.
void one_state(OneStateArgs args, size_t n, int threads);

// acc = s * grad (overwrite) or acc += s * grad, grad fp32 or 16-bit: gradient accumulation.
void accumulate(float* acc, const void* grad, DType dtype, float s, bool overwrite, size_t n, int threads);

// Adam's memory traffic without its arithmetic (the ceiling probe for the Adam benchmark).
void touch3(float* p, float* m, float* v, const float* g, size_t n, int threads);

// CRC-32C of each `block`-byte piece of data (the last may be shorter) into out.
void crc32c_blocks(const void* data, size_t n, size_t block, uint32_t* out, int threads);

}  // namespace offload

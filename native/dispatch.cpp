#include "dispatch.h"
#include "pool.h"

#include <atomic>
#include <cstdlib>
#if defined(__aarch64__)
#include <sys/auxv.h>
#endif
#include <string>
#include <stdexcept>

namespace offload {
namespace {

struct Variant {
  const char* name;
  const KernelTable* table;
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"portable", &kernels_portable},
#if defined(OFFLOAD_HAVE_AVX2)
      {"avx2", &kernels_avx2},
#endif
#if defined(OFFLOAD_HAVE_AVX512)
      {"avx512", &kernels_avx512},
#endif
#if defined(OFFLOAD_HAVE_AVX512BF16)
      {"avx512bf16", &kernels_avx512bf16},
#endif
#if defined(OFFLOAD_HAVE_NEON)
      {"neon", &kernels_neon},
#endif
  };
  return v;
}

const Variant* find(const std::string& name) {
  for (const Variant& v : variants())
    if (name == v.name) return &v;
  return nullptr;
}

// The features each variant's compile flags assume (CMakeLists.txt).
std::vector<std::string> required_features(const std::string& name) {
#if defined(__x86_64__) || defined(__i386__)
  if (name == "avx2") return {"avx2", "fma", "f16c", "sse4.2"};
  if (name == "avx512") return {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "sse4.2"};
  if (name == "avx512bf16") {  // avx512's flags and -mavx512bf16
    std::vector<std::string> f = required_features("avx512");
    f.emplace_back("avx512bf16");
    return f;
  }
#endif
#if defined(__aarch64__)
  if (name == "neon") return {"asimd", "crc32"};
#endif
  return {};
}

bool has_feature(const std::string& f) {
#if defined(__x86_64__) || defined(__i386__)
  // __builtin_cpu_supports also checks that the OS saves the wide registers.
  __builtin_cpu_init();
  if (f == "avx2") return __builtin_cpu_supports("avx2");
  if (f == "fma") return __builtin_cpu_supports("fma");
  if (f == "f16c") return __builtin_cpu_supports("f16c");
  if (f == "sse4.2") return __builtin_cpu_supports("sse4.2");
  if (f == "avx512f") return __builtin_cpu_supports("avx512f");
  if (f == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (f == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (f == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (f == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
#endif
#if defined(__aarch64__)
  // The kernel's hardware capability bits (asm/hwcap.h): HWCAP_ASIMD = 1 << 1, HWCAP_CRC32 = 1 << 7.
  const unsigned long hwcap = getauxval(AT_HWCAP);
  if (f == "asimd") return (hwcap & (1ul << 1)) != 0;
  if (f == "crc32") return (hwcap & (1ul << 7)) != 0;
#endif
  (void)f;
  return false;
}

std::atomic<const KernelTable*> g_active{nullptr};

const KernelTable* best_supported() {
  const KernelTable* best = &kernels_portable;
  for (const Variant& v : variants())
    if (missing_features(v.name).empty()) best = v.table;
  return best;
}

}  // namespace

std::vector<std::string> compiled_variants() {
  std::vector<std::string> out;
  for (const Variant& v : variants()) out.emplace_back(v.name);
  return out;
}

std::vector<std::string> supported_variants() {
  std::vector<std::string> out;
  for (const Variant& v : variants())
    if (missing_features(v.name).empty()) out.emplace_back(v.name);
  return out;
}

std::string missing_features(const std::string& name) {
  std::string missing;
  for (const std::string& f : required_features(name))
    if (!has_feature(f)) missing += (missing.empty() ? "" : ", ") + f;
  return missing;
}

const KernelTable& active_kernels() {
  const KernelTable* t = g_active.load(std::memory_order_acquire);
  if (t == nullptr) {
    t = best_supported();
    g_active.store(t, std::memory_order_release);
  }
  return *t;
}

void select_variant(const std::string& name) {
  std::string compiled;
  for (const Variant& v : variants()) compiled += (compiled.empty() ? "" : ", ") + std::string(v.name);
  const Variant* v = find(name);
  if (v == nullptr)
    throw std::invalid_argument("kernel variant '" + name + "' is not in this build; compiled variants: " + compiled);
  const std::string missing = missing_features(name);
  if (!missing.empty()) {
    std::string ok;
    for (const std::string& s : supported_variants()) ok += (ok.empty() ? "" : ", ") + s;
    throw std::invalid_argument("kernel variant '" + name + "' needs CPU features this machine lacks (" + missing +
                                "); variants that run here: " + ok);
  }
  g_active.store(v->table, std::memory_order_release);
}

namespace {

// Below this many elements per thread, starting a thread costs more than it saves.
constexpr size_t kMinPerThread = size_t(1) << 16;

size_t useful_threads(size_t n, int threads) {
  size_t t = threads < 1 ? 1 : size_t(threads);
  const size_t cap = n / kMinPerThread > 0 ? n / kMinPerThread : 1;
  return t < cap ? t : cap;
}

// Each thread sweeps one contiguous range, tile by tile: the hardware prefetchers then
// see a handful of long sequential streams (measured faster here than threads taking
// interleaved tiles from a shared counter, which restarts every stream at each tile).
template <class Fn>
void for_each_tile(size_t n, int threads, size_t tile, const Fn& fn) {
  const size_t t = useful_threads(n, threads);
  const size_t chunk = ((n + t - 1) / t + tile - 1) / tile * tile;
  run_on_workers(t, [&](size_t w) {
    const size_t begin = w * chunk;
    const size_t end = begin + chunk < n ? begin + chunk : n;
    for (size_t i = begin; i < end; i += tile) fn(i, i + tile < end ? i + tile : end);
  });
}

}  // namespace

void adam(AdamArgs args, size_t n, int threads) {
  const KernelTable& k = active_kernels();
  // 16K elements: 64 KiB of each fp32 stream, a multiple of every vector width.
  for_each_tile(n, threads, size_t(1) << 14, [&](size_t begin, size_t end) { k.adam(args, begin, end); });
}

void one_state(OneStateArgs args, size_t n, int threads) {
  const KernelTable& k = active_kernels();
  for_each_tile(n, threads, size_t(1) << 14, [&](size_t begin, size_t end) { k.one_state(args, begin, end); });
}

void accumulate(float* acc, const void* grad, DType dtype, float s, bool overwrite, size_t n, int threads) {
  const KernelTable& k = active_kernels();
  for_each_tile(n, threads, size_t(1) << 14,
                [&](size_t begin, size_t end) { k.accumulate(acc, grad, dtype, s, overwrite, begin, end); });
}

void touch3(float* p, float* m, float* v, const float* g, size_t n, int threads) {
  const KernelTable& k = active_kernels();
  for_each_tile(n, threads, size_t(1) << 14, [&](size_t begin, size_t end) { k.touch3(p, m, v, g, begin, end); });
}

void crc32c_blocks(const void* data, size_t n, size_t block, uint32_t* out, int threads) {
  const KernelTable& k = active_kernels();
  const size_t blocks = (n + block - 1) / block;
  // Threads split whole blocks; one block's CRC is one chain.
  size_t t = threads < 1 ? 1 : size_t(threads);
  if (t > blocks) t = blocks > 0 ? blocks : 1;
  if (n < (size_t(1) << 20)) t = 1;
  const size_t per = (blocks + t - 1) / t;
  run_on_workers(t, [&](size_t w) {
    for (size_t b = w * per; b < blocks && b < (w + 1) * per; ++b) {
      const size_t begin = b * block;
      const size_t len = begin + block < n ? block : n - begin;
      out[b] = k.crc32c(static_cast<const char*>(data) + begin, len, 0);
    }
  });
}

SqNorm sq_norm(const void* data, DType dtype, size_t n, int threads, float scale) {
  const KernelTable& k = active_kernels();
  const size_t t = useful_threads(n, threads);
  if (t == 1) return k.sq_norm(data, dtype, n, scale);

  const size_t elem = dtype == DType::F32 ? 4 : 2;
  // Chunks on 64-element boundaries keep every thread's range cache-line aligned.
  const size_t chunk = ((n + t - 1) / t + 63) / 64 * 64;
  std::vector<SqNorm> parts(t);
  run_on_workers(t, [&](size_t w) {
    const size_t begin = w * chunk;
    const size_t end = begin + chunk < n ? begin + chunk : n;
    if (begin < end) parts[w] = k.sq_norm(static_cast<const char*>(data) + begin * elem, dtype, end - begin, scale);
  });
  SqNorm total;
  for (const SqNorm& p : parts) {
    total.sum_sq += p.sum_sq;
    total.nonfinite += p.nonfinite;
  }
  return total;
}

}  // namespace offload

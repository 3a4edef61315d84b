// Every compiled kernel variant against the portable one, in C++ with no Python: for a
// variant that cannot run on the test machine itself (NEON, built by a cross compiler and
// run under qemu-user by tests/test_native_cross.py).
//
// The Adam step, accumulation and the probes must agree bit for bit (every variant
// rounds where the portable one does, FMA where it uses an FMA, correctly rounded sqrt
// and divide); the squared norm only to double rounding (lanes sum in another order),
// with the same count of non-finite values; CRC-32C exactly.
#include "kernels.h"
#include "scalar.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

using namespace offload;

namespace {

int failures = 0;

void fail(const char* variant, const char* what, size_t n, const char* detail) {
  std::printf("FAIL %s %s n=%zu: %s\n", variant, what, n, detail);
  ++failures;
}

bool same_bits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

std::vector<float> random_floats(std::mt19937& rng, size_t n, float scale, bool positive) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = positive ? std::fabs(d(rng)) : d(rng);
  if (n > 3) {
    x[0] = 0.0f;
    x[1] = positive ? 1e-40f : -1e-40f;  // subnormal
    x[2] = positive ? 3e4f : -3e4f;
  }
  return x;
}

// A gradient buffer of the given dtype holding the values of x (rounded as torch rounds).
std::vector<uint8_t> as_dtype(const std::vector<float>& x, DType dtype) {
  const size_t item = dtype == DType::F32 ? 4 : 2;
  std::vector<uint8_t> out(x.size() * item + 64);
  for (size_t i = 0; i < x.size(); ++i) {
    if (dtype == DType::F32) std::memcpy(out.data() + 4 * i, &x[i], 4);
    else scalar::store16(out.data(), int(dtype), i, x[i]);
  }
  return out;
}

struct Hyper {
  const char* name;
  float grad_scale, decay, l2, bc2_sqrt, step_size;
};

void check_adam(const KernelTable& k, std::mt19937& rng, size_t n) {
  const Hyper hypers[] = {
      {"adamw", 1.0f, 1.0f - 1e-3f * 0.1f, 0.0f, std::sqrt(1.0f - std::pow(0.999f, 3.0f)), 1e-3f / (1 - 0.729f)},
      {"adam-l2-scaled", 0.5f, 1.0f, 0.01f, std::sqrt(1.0f - std::pow(0.999f, 7.0f)), 3e-2f},
      {"no-bias-correction", 1.0f, 1.0f, 0.0f, 1.0f, 1e-4f},
  };
  const DType dtypes[] = {DType::F32, DType::BF16, DType::F16};
  for (const Hyper& h : hypers) {
    for (DType g : dtypes) {
      for (int out = 0; out < 3; ++out) {
        const std::vector<float> p = random_floats(rng, n, 1.0f, false);
        const std::vector<float> m = random_floats(rng, n, 1e-2f, false);
        const std::vector<float> v = random_floats(rng, n, 1e-4f, true);
        const std::vector<uint8_t> grad = as_dtype(random_floats(rng, n, 1e-1f, false), g);
        std::vector<float> p1 = p, m1 = m, v1 = v, p2 = p, m2 = m, v2 = v;
        std::vector<uint16_t> o1(n + 8), o2(n + 8);
        AdamArgs a;
        a.grad = grad.data();
        a.grad_dtype = g;
        a.out_dtype = out == 2 ? DType::F16 : DType::BF16;
        a.grad_scale = h.grad_scale;
        a.decay = h.decay;
        a.l2 = h.l2;
        a.one_minus_beta1 = 0.1f;
        a.beta2 = 0.999f;
        a.one_minus_beta2 = 1.0f - 0.999f;
        a.bc2_sqrt = h.bc2_sqrt;
        a.eps = 1e-8f;
        a.step_size = h.step_size;
        AdamArgs b = a;
        a.param = p1.data(), a.exp_avg = m1.data(), a.exp_avg_sq = v1.data(), a.out16 = out ? o1.data() : nullptr;
        b.param = p2.data(), b.exp_avg = m2.data(), b.exp_avg_sq = v2.data(), b.out16 = out ? o2.data() : nullptr;
        kernels_portable.adam(a, 0, n);
        k.adam(b, 0, n);
        char what[96];
        std::snprintf(what, sizeof what, "%s grad=%d out=%d", h.name, int(g), out);
        if (!same_bits(p1.data(), p2.data(), 4 * n)) fail(k.name, "adam params", n, what);
        if (!same_bits(m1.data(), m2.data(), 4 * n)) fail(k.name, "adam exp_avg", n, what);
        if (!same_bits(v1.data(), v2.data(), 4 * n)) fail(k.name, "adam exp_avg_sq", n, what);
        if (out && !same_bits(o1.data(), o2.data(), 2 * n)) fail(k.name, "adam 16-bit copy", n, what);
      }
    }
  }
}

// The state formats ([Note: state formats] in kernels.cpp): every master and moment format, with and without the
// 16-bit copy, bitwise as the portable kernel (stochastic rounding too: the same random bits for the same index).
void check_formats(const KernelTable& k, std::mt19937& rng, size_t n) {
  const Master masters[] = {Master::F32, Master::SPLIT, Master::BF16, Master::BF16_STOCHASTIC};
  for (Master master : masters) {
    for (DType moments : {DType::F32, DType::BF16}) {
      for (int out = 0; out < 2; ++out) {
        const std::vector<float> p = random_floats(rng, n, 1.0f, false);
        const std::vector<uint8_t> grad = as_dtype(random_floats(rng, n, 1e-1f, false), DType::BF16);
        const size_t pbytes = master == Master::F32 ? 4 : 2, mbytes = moments == DType::F32 ? 4 : 2;
        std::vector<uint8_t> p1 = as_dtype(p, master == Master::F32 ? DType::F32 : DType::BF16), p2 = p1;
        std::vector<uint16_t> lo1(n + 8), lo2;
        for (size_t i = 0; i < n; ++i) lo1[i] = uint16_t(rng());
        lo2 = lo1;
        std::vector<uint8_t> m1 = as_dtype(random_floats(rng, n, 1e-2f, false), moments), m2 = m1;
        std::vector<uint8_t> v1 = as_dtype(random_floats(rng, n, 1e-4f, true), moments), v2 = v1;
        std::vector<uint16_t> o1(n + 8), o2(n + 8);
        AdamArgs a;
        a.grad = grad.data();
        a.grad_dtype = DType::BF16;
        a.moment_dtype = moments;
        a.master = master;
        a.seed = 77;
        a.index0 = 1000003;
        a.decay = 1.0f - 1e-3f * 0.1f;
        a.bc2_sqrt = std::sqrt(1.0f - std::pow(0.95f, 4.0f));
        a.beta2 = 0.95f;
        a.one_minus_beta2 = 1.0f - 0.95f;
        a.step_size = 1e-3f / (1 - 0.6561f);
        AdamArgs b = a;
        a.param = p1.data(), a.exp_avg = m1.data(), a.exp_avg_sq = v1.data(), a.out16 = out ? o1.data() : nullptr;
        b.param = p2.data(), b.exp_avg = m2.data(), b.exp_avg_sq = v2.data(), b.out16 = out ? o2.data() : nullptr;
        if (master == Master::SPLIT) a.param_lo = lo1.data(), b.param_lo = lo2.data();
        kernels_portable.adam(a, 0, n);
        k.adam(b, 0, n);
        char what[96];
        std::snprintf(what, sizeof what, "master=%d moments=%d out=%d", int(master), int(moments), out);
        if (!same_bits(p1.data(), p2.data(), pbytes * n)) fail(k.name, "format params", n, what);
        if (master == Master::SPLIT && !same_bits(lo1.data(), lo2.data(), 2 * n)) fail(k.name, "format low halves", n, what);
        if (!same_bits(m1.data(), m2.data(), mbytes * n)) fail(k.name, "format exp_avg", n, what);
        if (!same_bits(v1.data(), v2.data(), mbytes * n)) fail(k.name, "format exp_avg_sq", n, what);
        if (out && !same_bits(o1.data(), o2.data(), 2 * n)) fail(k.name, "format 16-bit copy", n, what);
      }
    }
  }
}

void check_norm_and_accumulate(const KernelTable& k, std::mt19937& rng, size_t n) {
  const DType dtypes[] = {DType::F32, DType::BF16, DType::F16};
  for (DType g : dtypes) {
    std::vector<float> x = random_floats(rng, n, 3.0f, false);
    if (n > 5) x[n / 2] = INFINITY, x[n - 1] = NAN;
    const std::vector<uint8_t> data = as_dtype(x, g);
    const SqNorm a = kernels_portable.sq_norm(data.data(), g, n, 1.0f), b = k.sq_norm(data.data(), g, n, 1.0f);
    if (a.nonfinite != b.nonfinite) fail(k.name, "sq_norm non-finite count", n, "");
    const bool both_nan = std::isnan(a.sum_sq) && std::isnan(b.sum_sq);
    if (!both_nan && std::fabs(a.sum_sq - b.sum_sq) > 1e-12 * std::fabs(a.sum_sq)) fail(k.name, "sq_norm", n, "");

    std::vector<float> finite = random_floats(rng, n, 1.0f, false);
    const std::vector<uint8_t> shard = as_dtype(finite, g);
    for (int overwrite = 0; overwrite < 2; ++overwrite) {
      std::vector<float> acc1 = random_floats(rng, n, 1.0f, false), acc2 = acc1;
      kernels_portable.accumulate(acc1.data(), shard.data(), g, 0.25f, overwrite, 0, n);
      k.accumulate(acc2.data(), shard.data(), g, 0.25f, overwrite, 0, n);
      if (!same_bits(acc1.data(), acc2.data(), 4 * n)) fail(k.name, overwrite ? "accumulate (overwrite)" : "accumulate", n, "");
    }
  }
  std::vector<float> p = random_floats(rng, n, 1.0f, false), m = p, v = p, g = random_floats(rng, n, 1.0f, false);
  std::vector<float> p2 = p, m2 = m, v2 = v;
  kernels_portable.touch3(p.data(), m.data(), v.data(), g.data(), 0, n);
  k.touch3(p2.data(), m2.data(), v2.data(), g.data(), 0, n);
  if (!same_bits(p.data(), p2.data(), 4 * n) || !same_bits(v.data(), v2.data(), 4 * n)) fail(k.name, "touch3", n, "");
}

// A gradient that landed in the compute dtype, read with its factor, norms and steps bitwise as its fp32
// accumulation (acc = factor x gradient) does: the landing path skips that pass without changing a bit.
void check_landed(const KernelTable& k, std::mt19937& rng, size_t n) {
  for (DType g : {DType::F32, DType::BF16, DType::F16}) {
    std::vector<float> values = random_floats(rng, n, 1e-1f, false);
    if (n > 5) values[n / 3] = INFINITY;
    const std::vector<uint8_t> grad = as_dtype(values, g);
    std::vector<float> acc(n);
    k.accumulate(acc.data(), grad.data(), g, 0.3f, true, 0, n);
    const SqNorm landed = k.sq_norm(grad.data(), g, n, 0.3f), summed = k.sq_norm(acc.data(), DType::F32, n, 1.0f);
    const bool same_sum = landed.sum_sq == summed.sum_sq || (std::isnan(landed.sum_sq) && std::isnan(summed.sum_sq));
    if (!same_sum || landed.nonfinite != summed.nonfinite) fail(k.name, "landed sq_norm", n, "");
    if (n > 5) values[n / 3] = 0.5f;
    const std::vector<uint8_t> finite = as_dtype(values, g);
    k.accumulate(acc.data(), finite.data(), g, 0.3f, true, 0, n);
    std::vector<float> p1 = random_floats(rng, n, 1.0f, false), m1 = random_floats(rng, n, 1e-2f, false);
    std::vector<float> v1 = random_floats(rng, n, 1e-4f, true), p2 = p1, m2 = m1, v2 = v1;
    std::vector<uint16_t> o1(n + 8), o2(n + 8);
    AdamArgs a;
    a.grad_scale = 0.7f;
    a.decay = 1.0f - 1e-3f * 0.1f;
    a.step_size = 1e-3f;
    AdamArgs b = a;
    a.grad = acc.data(), a.grad_dtype = DType::F32;
    b.grad = finite.data(), b.grad_dtype = g, b.pre_scale = 0.3f;
    a.param = p1.data(), a.exp_avg = m1.data(), a.exp_avg_sq = v1.data(), a.out16 = o1.data();
    b.param = p2.data(), b.exp_avg = m2.data(), b.exp_avg_sq = v2.data(), b.out16 = o2.data();
    k.adam(a, 0, n);
    k.adam(b, 0, n);
    if (!same_bits(p1.data(), p2.data(), 4 * n) || !same_bits(m1.data(), m2.data(), 4 * n) ||
        !same_bits(v1.data(), v2.data(), 4 * n) || !same_bits(o1.data(), o2.data(), 2 * n))
      fail(k.name, "adam on a landed gradient", n, "");
  }
}

// [Note: instruction rules] in scalar.h: every high half with the low halves that decide a rounding; the variant's
// stores are the portable rounding, and the instruction it leans on is its scalar model.
void check_conversions(const KernelTable& k) {
  const uint32_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x7fff, 0x8000, 0x8001, 0xffff};
  std::vector<float> x;
  for (uint32_t high = 0; high < 0x10000u; ++high)
    for (uint32_t low : lows) x.push_back(scalar::bits_to_f32((high << 16) | low));
  const size_t n = x.size() - 3;  // a tail the vector width does not divide
  std::vector<uint16_t> got(n), want(n);
  for (DType d : {DType::BF16, DType::F16}) {
    const char* what = d == DType::BF16 ? "bfloat16" : "float16";
    k.to16(x.data(), got.data(), d, n);
    for (size_t i = 0; i < n; ++i) want[i] = d == DType::BF16 ? scalar::f32_to_bf16(x[i]) : scalar::f32_to_f16(x[i]);
    if (!same_bits(got.data(), want.data(), 2 * n)) fail(k.name, "16-bit store", n, what);
    const char* name = k.instruction_name(d);
    if (name == nullptr) continue;
    if (!k.instruction16(x.data(), got.data(), d, n)) fail(k.name, "instruction16", n, name);
    const bool bf16 = std::strcmp(name, "vcvtneps2bf16") == 0;
    for (size_t i = 0; i < n; ++i)
      want[i] = bf16 ? scalar::instruction::vcvtneps2bf16(x[i]) : scalar::instruction::vcvtps2ph(x[i]);
    if (!same_bits(got.data(), want.data(), 2 * n)) fail(k.name, "instruction against its model", n, name);
  }
}

void check_crc(const KernelTable& k, std::mt19937& rng, size_t n) {
  std::vector<uint8_t> bytes(n + 1);
  for (auto& b : bytes) b = uint8_t(rng());
  // Also from an odd address: the lanes' 8-byte loads are unaligned there.
  for (size_t start = 0; start < 2; ++start) {
    if (kernels_portable.crc32c(bytes.data() + start, n - start * (n > 0), 0) !=
        k.crc32c(bytes.data() + start, n - start * (n > 0), 0))
      fail(k.name, "crc32c", n, start ? "odd start" : "");
  }
}

}  // namespace

int main() {
  const unsigned char check[] = "123456789";
  if (kernels_portable.crc32c(check, 9, 0) != 0xE3069283u) fail("portable", "crc32c check value", 9, "");
  const KernelTable* tables[] = {
#if defined(OFFLOAD_HAVE_NEON)
      &kernels_neon,
#endif
#if defined(OFFLOAD_HAVE_AVX2)
      &kernels_avx2,
#endif
#if defined(OFFLOAD_HAVE_AVX512)
      &kernels_avx512,
#endif
#if defined(OFFLOAD_HAVE_AVX512BF16)
      &kernels_avx512bf16,
#endif
  };
  std::mt19937 rng(1234);
  for (size_t n : {1, 7, 100003}) check_landed(kernels_portable, rng, n);
  int variants = 0;
  for (const KernelTable* k : tables) {
    ++variants;
    for (size_t n : {1, 3, 4, 7, 8, 17, 1023, 4101, 100003}) {
      check_adam(*k, rng, n);
      check_formats(*k, rng, n);
      check_norm_and_accumulate(*k, rng, n);
      check_landed(*k, rng, n);
    }
    for (size_t n : {0, 1, 7, 8, 9, 24, 4095, 12287, 12288, 12289, 100003}) check_crc(*k, rng, n);
    check_conversions(*k);
  }
  if (failures) {
    std::printf("%d failure(s)\n", failures);
    return 1;
  }
  std::printf("ok: %d variant(s) equal the portable kernels\n", variants);
  return 0;
}

// Python bindings. Buffers arrive through DLPack (torch tensors, numpy arrays),
// so the extension never links against libtorch and builds in seconds.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <exception>
#include <optional>
#include <stdexcept>
#include <string>

#include "dispatch.h"
#include "pool.h"
#include "scalar.h"

namespace nb = nanobind;
using namespace offload;

namespace {

using AnyArray = nb::ndarray<nb::ro>;

template <class Array>
DType dtype_of(const Array& a, const char* what) {
  const nb::dlpack::dtype d = a.dtype();
  if (d.lanes == 1) {
    if (d.code == uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 32) return DType::F32;
    if (d.code == uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 16) return DType::F16;
    if (d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && d.bits == 16) return DType::BF16;
  }
  throw std::invalid_argument(std::string(what) + " must be float32, bfloat16 or float16");
}

// The kernels walk raw memory: anything but a dense CPU buffer would be read wrong.
template <class Array>
void require_dense_cpu(const Array& a, const char* what) {
  if (a.device_type() != nb::device::cpu::value)
    throw std::invalid_argument(std::string(what) + " must be in CPU memory; copy it to the host first");
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected)
      throw std::invalid_argument(std::string(what) + " must be contiguous; call .contiguous() first");
    expected *= int64_t(a.shape(i));
  }
}

nb::tuple py_sq_norm(const AnyArray& a, int threads, float scale) {
  require_dense_cpu(a, "grad");
  const DType dt = dtype_of(a, "grad");
  SqNorm r;
  {
    nb::gil_scoped_release unlocked;
    r = sq_norm(a.data(), dt, a.size(), threads, scale);
  }
  return nb::make_tuple(r.sum_sq, r.nonfinite);
}

using RwArray = nb::ndarray<>;

template <class Array>
void require_size(const Array& a, const char* what, size_t n) {
  if (a.size() != n)
    throw std::invalid_argument(std::string(what) + " has " + std::to_string(a.size()) + " elements, expected " +
                                std::to_string(n));
}

float* fp32_buffer(const RwArray& a, const char* what, size_t n) {
  require_dense_cpu(a, what);
  const nb::dlpack::dtype d = a.dtype();
  if (!(d.code == uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 32 && d.lanes == 1))
    throw std::invalid_argument(std::string(what) + " must be float32");
  require_size(a, what, n);
  return static_cast<float*>(a.data());
}

// A buffer of the kernel's element type `want` (float32 or bfloat16), dense, on the CPU, of n elements.
void* typed_buffer(const RwArray& a, const char* what, size_t n, DType want) {
  require_dense_cpu(a, what);
  require_size(a, what, n);
  if (dtype_of(a, what) != want)
    throw std::invalid_argument(std::string(what) + " must be " + (want == DType::F32 ? "float32" : "bfloat16") +
                                " like the state it goes with");
  return a.data();
}

uint16_t* half_buffer(const RwArray& a, const char* what, size_t n) {  // the split master's low halves: 16-bit
  require_dense_cpu(a, what);
  require_size(a, what, n);
  const nb::dlpack::dtype d = a.dtype();
  if (d.bits != 16 || d.lanes != 1) throw std::invalid_argument(std::string(what) + " must be a 16-bit buffer");
  return static_cast<uint16_t*>(a.data());
}

// The optional 16-bit copy of a step's new params: dense, on the CPU, bfloat16 or float16 (its dtype into `dtype`).
void* out16_buffer(const RwArray& a, size_t n, DType& dtype) {
  require_dense_cpu(a, "out16");
  dtype = dtype_of(a, "out16");
  if (dtype == DType::F32) throw std::invalid_argument("out16 must be bfloat16 or float16");
  require_size(a, "out16", n);
  return a.data();
}

// The master weights as their buffers hold them (see [Note: state formats] in kernels.cpp): float32; bfloat16 with
// its low halves (16+16); or bfloat16 alone, rounded to nearest or stochastically.
struct MasterBuffers {
  Master master;
  DType dtype;
  void* param;
  uint16_t* lo;
};

MasterBuffers master_buffers(const RwArray& param, const std::optional<RwArray>& param_lo, bool stochastic, size_t n) {
  require_dense_cpu(param, "param");
  const DType dtype = dtype_of(param, "param");
  if (dtype == DType::F16) throw std::invalid_argument("param must be float32 or bfloat16 (a master weight)");
  MasterBuffers out{Master::F32, dtype, nullptr, nullptr};
  if (dtype == DType::F32) {
    if (param_lo || stochastic)
      throw std::invalid_argument("param_lo and stochastic rounding go with a bfloat16 master, and param is float32");
  } else if (param_lo) {
    if (stochastic) throw std::invalid_argument("a 16+16 master (param_lo given) is exact: no stochastic rounding");
    out.master = Master::SPLIT;
    out.lo = half_buffer(*param_lo, "param_lo", n);
  } else {
    out.master = stochastic ? Master::BF16_STOCHASTIC : Master::BF16;
  }
  out.param = typed_buffer(param, "param", n, dtype);
  return out;
}

// A state buffer's dtype: float32, or bfloat16 (see [Note: state formats] in kernels.cpp).
DType state_dtype(const RwArray& a, const char* what) {
  require_dense_cpu(a, what);
  const DType dtype = dtype_of(a, what);
  if (dtype == DType::F16) throw std::invalid_argument(std::string(what) + " must be float32 or bfloat16");
  return dtype;
}

void py_adam(const RwArray& param, const AnyArray& grad, const RwArray& exp_avg, const RwArray& exp_avg_sq,
             std::optional<RwArray> out16, std::optional<RwArray> param_out, std::optional<RwArray> exp_avg_out,
             std::optional<RwArray> exp_avg_sq_out, float pre_scale, float grad_scale, float decay, float l2,
             float one_minus_beta1, float beta2, float one_minus_beta2, float bc2_sqrt, float eps, float step_size,
             int threads, std::optional<RwArray> param_lo, std::optional<RwArray> param_lo_out, bool stochastic,
             uint32_t seed, uint64_t index0, int64_t prefetch) {
  AdamArgs a;
  const size_t n = param.size();
  const MasterBuffers held = master_buffers(param, param_lo, stochastic, n);
  const DType master_dtype = held.dtype;
  a.master = held.master;
  a.param = held.param;
  a.param_lo = held.lo;
  a.moment_dtype = state_dtype(exp_avg, "exp_avg");
  a.exp_avg = typed_buffer(exp_avg, "exp_avg", n, a.moment_dtype);
  a.exp_avg_sq = typed_buffer(exp_avg_sq, "exp_avg_sq", n, a.moment_dtype);
  require_dense_cpu(grad, "grad");
  a.grad_dtype = dtype_of(grad, "grad");
  a.grad = grad.data();
  require_size(grad, "grad", n);
  if (out16) {
    a.out16 = out16_buffer(*out16, n, a.out_dtype);
    if (a.master != Master::F32 && a.out_dtype != DType::BF16)
      throw std::invalid_argument("out16 of a bfloat16 master is bfloat16: the copy is the master's own bits");
  }
  if (param_out || exp_avg_out || exp_avg_sq_out || param_lo_out) {  // the new state elsewhere: all or none
    if (!(param_out && exp_avg_out && exp_avg_sq_out) || bool(param_lo_out) != bool(param_lo))
      throw std::invalid_argument("param_out, exp_avg_out and exp_avg_sq_out (and param_lo_out with param_lo) go "
                                  "together: give all of them or none");
    a.param_out = typed_buffer(*param_out, "param_out", n, master_dtype);
    if (param_lo_out) a.param_lo_out = half_buffer(*param_lo_out, "param_lo_out", n);
    a.exp_avg_out = typed_buffer(*exp_avg_out, "exp_avg_out", n, a.moment_dtype);
    a.exp_avg_sq_out = typed_buffer(*exp_avg_sq_out, "exp_avg_sq_out", n, a.moment_dtype);
  }
  a.seed = seed;
  a.index0 = index0;
  a.pre_scale = pre_scale;
  a.grad_scale = grad_scale;
  a.decay = decay;
  a.l2 = l2;
  a.one_minus_beta1 = one_minus_beta1;
  a.beta2 = beta2;
  a.one_minus_beta2 = one_minus_beta2;
  a.bc2_sqrt = bc2_sqrt;
  a.eps = eps;
  a.step_size = step_size;
  if (prefetch < -1) throw std::invalid_argument("prefetch is elements ahead (0: none), or -1 for the build's");
  a.prefetch = prefetch == -1 ? PREFETCH_BUILD : size_t(prefetch);
  nb::gil_scoped_release unlocked;
  adam(a, n, threads);
}

void py_one_state(const RwArray& param, const AnyArray& grad, const RwArray& state, std::optional<RwArray> out16,
                  int rule, float grad_scale, float decay, float l2, float lr, float beta1, float one_minus_beta1,
                  float beta2, float one_minus_beta2, float eps, int threads, std::optional<RwArray> param_lo,
                  bool stochastic, uint32_t seed, uint64_t index0) {
  OneStateArgs a;
  const size_t n = param.size();
  const MasterBuffers held = master_buffers(param, param_lo, stochastic, n);
  a.master = held.master;
  a.param = held.param;
  a.param_lo = held.lo;
  a.state_dtype = state_dtype(state, "state");
  a.state = typed_buffer(state, "state", n, a.state_dtype);
  require_dense_cpu(grad, "grad");
  require_size(grad, "grad", n);
  a.grad_dtype = dtype_of(grad, "grad");
  a.grad = grad.data();
  if (out16) {
    a.out16 = out16_buffer(*out16, n, a.out_dtype);
    if (a.master != Master::F32 && a.out_dtype != DType::BF16)
      throw std::invalid_argument("out16 of a bfloat16 master is bfloat16: the copy is the master's own bits");
  }
  if (rule != int(OneStateRule::LION) && rule != int(OneStateRule::ADAGRAD))
    throw std::invalid_argument("rule must be 0 (Lion) or 1 (Adagrad)");
  a.rule = OneStateRule(rule);
  a.seed = seed;
  a.index0 = index0;
  a.grad_scale = grad_scale;
  a.decay = decay;
  a.l2 = l2;
  a.lr = lr;
  a.beta1 = beta1;
  a.one_minus_beta1 = one_minus_beta1;  // rounded once from double by the caller, as torch rounds alpha=
  a.beta2 = beta2;
  a.one_minus_beta2 = one_minus_beta2;
  a.eps = eps;
  nb::gil_scoped_release unlocked;
  one_state(a, n, threads);
}

void py_accumulate(const RwArray& acc, const AnyArray& grad, float s, bool overwrite, int threads) {
  float* pa = fp32_buffer(acc, "acc", acc.size());
  require_dense_cpu(grad, "grad");
  require_size(grad, "grad", acc.size());
  const DType dt = dtype_of(grad, "grad");
  nb::gil_scoped_release unlocked;
  accumulate(pa, grad.data(), dt, s, overwrite, acc.size(), threads);
}

void py_touch3(const RwArray& p, const RwArray& m, const RwArray& v, const RwArray& g, int threads) {
  const size_t n = p.size();
  float* pp = fp32_buffer(p, "p", n);
  float* pm = fp32_buffer(m, "m", n);
  float* pv = fp32_buffer(v, "v", n);
  const float* pg = fp32_buffer(g, "g", n);
  nb::gil_scoped_release unlocked;
  touch3(pp, pm, pv, pg, n, threads);
}

void py_crc32c_blocks(const AnyArray& data, size_t block, const nb::ndarray<uint32_t, nb::c_contig>& out, int threads) {
  require_dense_cpu(data, "data");
  if (block == 0) throw std::invalid_argument("block must be positive");
  const size_t nbytes = data.nbytes();
  const size_t blocks = (nbytes + block - 1) / block;
  if (out.size() < blocks)
    throw std::invalid_argument("out has " + std::to_string(out.size()) + " slots for " + std::to_string(blocks) +
                                " blocks");
  nb::gil_scoped_release unlocked;
  crc32c_blocks(data.data(), nbytes, block, out.data(), threads);
}

// [Note: instruction rules] in scalar.h: the conversions the tests hold against one another.
DType dtype16(const std::string& dtype) {
  if (dtype == "bfloat16") return DType::BF16;
  if (dtype == "float16") return DType::F16;
  throw std::invalid_argument("dtype must be 'bfloat16' or 'float16', not '" + dtype + "'");
}

void py_to16(const RwArray& x, const RwArray& out, const std::string& dtype, bool instruction) {
  const size_t n = x.size();
  const float* in = fp32_buffer(x, "x", n);
  uint16_t* o = half_buffer(out, "out", n);
  const KernelTable& k = active_kernels();
  const DType d = dtype16(dtype);
  nb::gil_scoped_release unlocked;
  if (!instruction) return k.to16(in, o, d, n);
  if (!k.instruction16(in, o, d, n))
    throw std::invalid_argument(std::string("kernel variant '") + k.name + "' stores " + dtype +
                                " through no conversion instruction of its own");
}

std::optional<std::string> py_instruction_name(const std::string& dtype) {
  const char* name = active_kernels().instruction_name(dtype16(dtype));
  if (name == nullptr) return std::nullopt;
  return std::string(name);
}

void py_model16(const RwArray& x, const RwArray& out, const std::string& rule) {
  const size_t n = x.size();
  const float* in = fp32_buffer(x, "x", n);
  uint16_t* o = half_buffer(out, "out", n);
  uint16_t (*f)(float) = nullptr;
  if (rule == "bfloat16") f = scalar::f32_to_bf16;
  else if (rule == "float16") f = scalar::f32_to_f16;
  else if (rule == "vcvtneps2bf16") f = scalar::instruction::vcvtneps2bf16;
  else if (rule == "vcvtneps2bf16+fix") f = scalar::bf16_from_vcvtneps2bf16;
  else if (rule == "vcvtps2ph") f = scalar::instruction::vcvtps2ph;
  else if (rule == "vcvtps2ph+fix") f = scalar::f16_from_vcvtps2ph;
  else
    throw std::invalid_argument("no scalar model '" + rule + "'; models: bfloat16, float16, vcvtneps2bf16, "
                                "vcvtneps2bf16+fix, vcvtps2ph, vcvtps2ph+fix");
  nb::gil_scoped_release unlocked;
  for (size_t i = 0; i < n; ++i) o[i] = f(in[i]);
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "offload's native CPU kernels, one build per instruction set, chosen at run time.";
  m.def("compiled_variants", &compiled_variants, "Kernel variants in this build, best last.");
  m.def("supported_variants", &supported_variants, "Compiled variants this CPU can run, best last.");
  m.def("missing_features", &missing_features, nb::arg("variant"),
        "CPU features a variant needs that this machine lacks ('' if none).");
  m.def("active_variant", [] { return std::string(active_kernels().name); });
  m.def("select_variant", &select_variant, nb::arg("variant"));
  m.def("sq_norm", &py_sq_norm, nb::arg("grad").noconvert(), nb::arg("threads") = 1, nb::arg("scale") = 1.0f,
        "(sum of squares as float64, count of non-finite elements) of a dense CPU buffer, each element times "
        "scale in float first.");
  m.def("adam", &py_adam, nb::arg("param").noconvert(), nb::arg("grad").noconvert(),
        nb::arg("exp_avg").noconvert(), nb::arg("exp_avg_sq").noconvert(), nb::arg("out16").none(),
        nb::arg("param_out").none(), nb::arg("exp_avg_out").none(), nb::arg("exp_avg_sq_out").none(),
        nb::arg("pre_scale"), nb::arg("grad_scale"), nb::arg("decay"), nb::arg("l2"), nb::arg("one_minus_beta1"), nb::arg("beta2"),
        nb::arg("one_minus_beta2"), nb::arg("bc2_sqrt"), nb::arg("eps"), nb::arg("step_size"), nb::arg("threads"),
        nb::arg("param_lo").none() = nb::none(), nb::arg("param_lo_out").none() = nb::none(),
        nb::arg("stochastic") = false, nb::arg("seed") = 0, nb::arg("index0") = 0, nb::arg("prefetch") = -1,
        "One fused Adam/AdamW step over flat CPU buffers (scalars precomputed by offload.native.adam_step), in place "
        "or into param_out/exp_avg_out/exp_avg_sq_out; the master float32, 16+16 (bfloat16 param and its param_lo) "
        "or bfloat16 (rounded to nearest, or stochastic from seed and index0), the moments float32 or bfloat16.");
  m.def("one_state", &py_one_state, nb::arg("param").noconvert(), nb::arg("grad").noconvert(),
        nb::arg("state").noconvert(), nb::arg("out16").none(), nb::arg("rule"), nb::arg("grad_scale"),
        nb::arg("decay"), nb::arg("l2"), nb::arg("lr"), nb::arg("beta1"), nb::arg("one_minus_beta1"),
        nb::arg("beta2"), nb::arg("one_minus_beta2"), nb::arg("eps"), nb::arg("threads"),
        nb::arg("param_lo").none(), nb::arg("stochastic"), nb::arg("seed"), nb::arg("index0"),
        "One Lion (rule 0) or Adagrad (rule 1) step over a master and its one state buffer, each as held (see "
        "adam), in place, with an optional 16-bit copy of the new params.");
  m.def("accumulate", &py_accumulate, nb::arg("acc").noconvert(), nb::arg("grad").noconvert(), nb::arg("s"),
        nb::arg("overwrite"), nb::arg("threads"), "acc = s * grad (overwrite) or acc += s * grad.");
  m.def("use_openmp", [](const std::string& path) { return use_openmp(path.c_str()); }, nb::arg("path"),
        "Run multi-threaded kernels called from this thread on the OpenMP team of the runtime at path.");
  m.def("threads_backend", [] { return std::string(threads_backend()); });
  m.def("pool_jobs_at_once", [] { return pool_jobs_at_once(); },
        "The most kernel calls offload's pools ran at once since the last call.");
  m.def("crc32c_blocks", &py_crc32c_blocks, nb::arg("data").noconvert(), nb::arg("block"), nb::arg("out").noconvert(),
        nb::arg("threads"), "CRC-32C of each block of a dense CPU buffer into out (uint32).");
  m.def("touch3", &py_touch3, nb::arg("p").noconvert(), nb::arg("m").noconvert(), nb::arg("v").noconvert(),
        nb::arg("g").noconvert(), nb::arg("threads"), "p += g, m += g, v += g: Adam's memory traffic alone.");
  m.def("to16", &py_to16, nb::arg("x").noconvert(), nb::arg("out").noconvert(), nb::arg("dtype"),
        nb::arg("instruction"),
        "The active variant's 16-bit values of float32 x into out: as its kernels store them, or (instruction) the "
        "bare conversion instruction it leans on.");
  m.def("instruction_name", &py_instruction_name, nb::arg("dtype"),
        "The conversion instruction the active variant leans on for dtype, named as its scalar model, or None.");
  m.def("model16", &py_model16, nb::arg("x").noconvert(), nb::arg("out").noconvert(), nb::arg("rule"),
        "A scalar model's 16-bit values of float32 x into out (native/scalar.h, [Note: instruction rules]).");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
}

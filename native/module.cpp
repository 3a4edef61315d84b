// Python bindings. Buffers arrive through DLPack (torch tensors, numpy arrays),
// so the extension never links against libtorch and builds in seconds.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

#include "dispatch.h"

namespace nb = nanobind;
using namespace offload;

namespace {

using AnyArray = nb::ndarray<nb::ro>;

DType dtype_of(const AnyArray& a, const char* what) {
  const nb::dlpack::dtype d = a.dtype();
  if (d.lanes == 1) {
    if (d.code == uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 32) return DType::F32;
    if (d.code == uint8_t(nb::dlpack::dtype_code::Float) && d.bits == 16) return DType::F16;
    if (d.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && d.bits == 16) return DType::BF16;
  }
  throw std::invalid_argument(std::string(what) + " must be float32, bfloat16 or float16");
}

// The kernels walk raw memory: anything but a dense CPU buffer would be read wrong.
void require_dense_cpu(const AnyArray& a, const char* what) {
  if (a.device_type() != nb::device::cpu::value)
    throw std::invalid_argument(std::string(what) + " must be in CPU memory; copy it to the host first");
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected)
      throw std::invalid_argument(std::string(what) + " must be contiguous; call .contiguous() first");
    expected *= int64_t(a.shape(i));
  }
}

nb::tuple py_sq_norm(const AnyArray& a, int threads) {
  require_dense_cpu(a, "grad");
  const DType dt = dtype_of(a, "grad");
  SqNorm r;
  {
    nb::gil_scoped_release unlocked;
    r = sq_norm(a.data(), dt, a.size(), threads);
  }
  return nb::make_tuple(r.sum_sq, r.nonfinite);
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
  m.def("sq_norm", &py_sq_norm, nb::arg("grad").noconvert(), nb::arg("threads") = 1,
        "(sum of squares as float64, count of non-finite elements) of a dense CPU buffer.");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
}

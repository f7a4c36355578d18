#include "client/python/memoryview_export.h"

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace flatshard::python {
namespace py = pybind11;

namespace {

// The buffer-protocol exporter: what a memoryview holds on to.
struct HostBuffer {
  Region region;
  Keepalive keep;
  bool writable = false;
};

// The struct-module format of `dtype` (PEP 3118), as numpy spells it.
std::string Format(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "f";
    case DType::kFloat16:
      return "e";
    case DType::kBFloat16:
      return "H";  // no format for bfloat16: its bits, as numpy arrays show them
    case DType::kFloat64:
      return "d";
    case DType::kInt8:
      return "b";
    case DType::kInt32:
      return "i";
    case DType::kInt64:
      return "q";
    case DType::kUInt8:
      return "B";
    case DType::kBool:
      return "?";
  }
  return "B";
}

py::buffer_info Describe(const HostBuffer& b) {
  const py::ssize_t item = static_cast<py::ssize_t>(ItemSize(b.region.dtype));
  std::vector<py::ssize_t> shape(b.region.shape.begin(), b.region.shape.end());
  std::vector<py::ssize_t> strides(shape.size());
  py::ssize_t stride = item;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  const auto ndim = static_cast<py::ssize_t>(shape.size());
  return py::buffer_info(b.region.data, item, Format(b.region.dtype), ndim, std::move(shape),
                         std::move(strides), /*readonly=*/!b.writable);
}

}  // namespace

void DefineHostBuffer(py::module_& m) {
  py::class_<HostBuffer>(m, "_HostBuffer", py::buffer_protocol()).def_buffer([](HostBuffer& b) {
    return Describe(b);
  });
}

py::memoryview ToMemoryview(const Region& region, const Keepalive& keep, bool writable,
                            bool device_as_host) {
  if (region.device >= 0 && !device_as_host) {
    throw std::invalid_argument(absl::StrCat("memoryviews need host memory; this view is on GPU ",
                                             region.device, " (use the torch tensors)"));
  }
  py::object exporter = py::cast(HostBuffer{region, keep, writable});
  return py::memoryview(exporter);
}

}  // namespace flatshard::python

#include "client/python/dlpack_export.h"

#include <stdexcept>
#include <utility>

#include "absl/strings/str_cat.h"

namespace flatshard::python {
namespace py = pybind11;

namespace {

// What a DLManagedTensor owns: the shape (DLTensor points into it) and the mappings.
struct Owner {
  DLManagedTensor managed{};
  std::vector<int64_t> shape;
  Keepalive keep;
};

void DeleteOwner(DLManagedTensor* self) {
  // May run without the GIL (torch frees tensors from any thread): touches no Python object.
  delete static_cast<Owner*>(self->manager_ctx);
}

DLDataType ToDlDataType(DType dtype) {
  const uint8_t bits = static_cast<uint8_t>(ItemSize(dtype) * 8);
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kFloat64:
      return {kDLFloat, bits, 1};
    case DType::kBFloat16:
      return {kDLBfloat, bits, 1};
    case DType::kInt8:
    case DType::kInt32:
    case DType::kInt64:
      return {kDLInt, bits, 1};
    case DType::kUInt8:
      return {kDLUInt, bits, 1};
    case DType::kBool:
      break;
  }
  throw std::invalid_argument(
      absl::StrCat("dtype ", DTypeName(dtype), " has no DLPack type torch 1.13 can read"));
}

// The capsule destructor: a capsule nobody consumed still owns its tensor.
void CapsuleDestructor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
  }
  // Renamed "used_dltensor" by the consumer: the tensor owns it now.
}

}  // namespace

py::capsule ToDlpack(const Region& region, const Keepalive& keep, bool device_as_host) {
  const DLDataType dl_dtype = ToDlDataType(region.dtype);
  auto owner = std::make_unique<Owner>();
  owner->shape = region.shape;
  owner->keep = keep;
  DLTensor& t = owner->managed.dl_tensor;
  t.data = region.data;
  if (region.device >= 0 && !device_as_host) {
    t.device = {kDLCUDA, region.device};
  } else {
    t.device = {kDLCPU, 0};
  }
  t.ndim = static_cast<int32_t>(owner->shape.size());
  t.dtype = dl_dtype;
  t.shape = owner->shape.empty() ? nullptr : owner->shape.data();
  t.strides = nullptr;  // compact row-major
  t.byte_offset = 0;
  owner->managed.manager_ctx = owner.get();
  owner->managed.deleter = &DeleteOwner;
  DLManagedTensor* managed = &owner->managed;
  PyObject* capsule = PyCapsule_New(managed, "dltensor", &CapsuleDestructor);
  if (capsule == nullptr) throw py::error_already_set();
  owner.release();  // the capsule (then the tensor) owns it
  return py::reinterpret_steal<py::capsule>(capsule);
}

std::string NumpyDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "uint16";
    case DType::kFloat64:
      return "float64";
    case DType::kInt8:
      return "int8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
    case DType::kBool:
      return "bool";
  }
  return "uint8";
}

py::array ToNumpy(const Region& region, const Keepalive& keep, bool writable, bool device_as_host) {
  if (region.device >= 0 && !device_as_host) {
    throw std::invalid_argument(absl::StrCat("numpy arrays need host memory; this view is on GPU ",
                                             region.device, " (use the torch tensors)"));
  }
  const py::dtype dtype(NumpyDTypeName(region.dtype));
  std::vector<py::ssize_t> shape(region.shape.begin(), region.shape.end());
  std::vector<py::ssize_t> strides(shape.size());
  py::ssize_t stride = dtype.itemsize();
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  // The base object: a capsule owning a share of the mappings.
  auto* held = new Keepalive(keep);
  py::capsule base(held, [](void* p) { delete static_cast<Keepalive*>(p); });
  py::array array(dtype, std::move(shape), std::move(strides), region.data, base);
  if (!writable) {
    py::detail::array_proxy(array.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  }
  return array;
}

py::dict DescribeDlpack(const py::capsule& capsule) {
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor")) {
    throw std::invalid_argument("not an unconsumed \"dltensor\" capsule");
  }
  const auto* managed =
      static_cast<const DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  const DLTensor& t = managed->dl_tensor;
  py::list shape;
  for (int32_t i = 0; i < t.ndim; ++i) shape.append(t.shape[i]);
  py::dict d;
  d["device_type"] = t.device.device_type == kDLCUDA ? "cuda" : "cpu";
  d["device_id"] = t.device.device_id;
  d["code"] = static_cast<int>(t.dtype.code);
  d["bits"] = static_cast<int>(t.dtype.bits);
  d["lanes"] = static_cast<int>(t.dtype.lanes);
  d["shape"] = shape;
  d["data"] = reinterpret_cast<uintptr_t>(t.data);
  return d;
}

}  // namespace flatshard::python

#pragma once
// Zero-copy export of mapped flatshard memory to Python: DLPack capsules (torch tensors, host
// and CUDA) and numpy arrays, each owning a share of the mappings it points into, so an
// array or tensor that outlives its summon (or its Client) keeps the bytes mapped.
//
// The DLPack structs are the stable C ABI of dlpack.h (v0.6, the version torch 1.13 reads):
// https://github.com/dmlc/dlpack. They are declared here because Debian ships no dlpack
// header; their layout must not change.
//
// Thread safety: the functions need the GIL (they create Python objects).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace flatshard::python {

extern "C" {
typedef enum { kDLCPU = 1, kDLCUDA = 2 } DLDeviceType;
typedef struct {
  DLDeviceType device_type;
  int32_t device_id;
} DLDevice;
typedef enum { kDLInt = 0U, kDLUInt = 1U, kDLFloat = 2U, kDLBfloat = 4U } DLDataTypeCode;
typedef struct {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
} DLDataType;
typedef struct {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(struct DLManagedTensor* self);
} DLManagedTensor;
}  // extern "C"

// Shared ownership of the mappings some views point into.
using Keepalive = std::shared_ptr<const std::vector<std::shared_ptr<const void>>>;

// Where a view's bytes are, and how to read them.
struct Region {
  void* data = nullptr;
  std::vector<int64_t> shape;  // empty: a scalar
  DType dtype = DType::kFloat32;
  int device = -1;  // CUDA ordinal; -1 host memory
};

// A "dltensor" capsule over `region` (torch.utils.dlpack.from_dlpack consumes it). The
// tensor's deleter drops its share of `keep`. `device_as_host`: describe device memory as
// host memory (only for the simulated GPUs of tests, whose "device pointers" are host ones).
// Throws std::invalid_argument for dtypes DLPack consumers cannot take (bool).
pybind11::capsule ToDlpack(const Region& region, const Keepalive& keep, bool device_as_host);

// A numpy array over host memory `region` whose base object owns a share of `keep`;
// read-only unless `writable`. bfloat16 (no numpy dtype) comes out as uint16.
// Throws std::invalid_argument for device memory, unless `device_as_host` (simulated GPUs).
pybind11::array ToNumpy(const Region& region, const Keepalive& keep, bool writable,
                        bool device_as_host = false);

// The numpy dtype name ToNumpy uses for `dtype` ("uint16" for bfloat16).
std::string NumpyDTypeName(DType dtype);

// Describes a "dltensor" capsule without consuming it (tests of the device path):
// {"device_type", "device_id", "code", "bits", "lanes", "shape", "data"}.
pybind11::dict DescribeDlpack(const pybind11::capsule& capsule);

}  // namespace flatshard::python

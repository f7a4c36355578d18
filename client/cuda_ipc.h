#pragma once
// Client internals: opening the daemon's device memory (CUDA IPC). SegmentCache opens each
// device slab once through a DeviceMemoryOpener and caches the DeviceMapping; the interface
// lets the cache be tested without a GPU (tests use a fake) and keeps <cuda_runtime.h> out of
// every header.
//
// Thread safety: DeviceMemoryOpener implementations are thread-safe. A DeviceMapping is
// immutable; it may be destroyed on any thread.

#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace flatshard::client::internal {

// A device allocation of another process, mapped into this one. Unmaps it on destruction.
class DeviceMapping {
 public:
  virtual ~DeviceMapping() = default;
  // Device pointer to the allocation's first byte.
  virtual void* data() const = 0;
  // This process's CUDA ordinal of the GPU holding it.
  virtual int device() const = 0;
};

class DeviceMemoryOpener {
 public:
  virtual ~DeviceMemoryOpener() = default;
  // Maps the allocation that `ipc_handle` (cudaIpcMemHandle_t bytes) names on the GPU
  // `device_uuid` ("GPU-..."). Each call is a new mapping: callers cache.
  // Errors: INTERNAL for a handle of the wrong size; NOT_FOUND when this process cannot see
  // the GPU; FAILED_PRECONDITION when this process has no usable GPU (or was built without
  // CUDA); the CUDA runtime's (gpu::CudaStatus) when opening fails.
  virtual absl::StatusOr<std::unique_ptr<DeviceMapping>> Open(absl::string_view ipc_handle,
                                                              absl::string_view device_uuid) = 0;
};

// The real opener: gpu::DeviceForUuid, then cudaIpcOpenMemHandle with that device current
// (cudaIpcMemLazyEnablePeerAccess); its mappings close with cudaIpcCloseMemHandle on the same
// device. Creating it touches no CUDA API; only Open does.
std::unique_ptr<DeviceMemoryOpener> NewCudaIpcOpener();

}  // namespace flatshard::client::internal

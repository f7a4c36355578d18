#pragma once
// The CUDA runtime as the rest of flatshard sees it: errors as absl::Status, the machine's GPUs
// by uuid, the current device scoped, IPC handles as bytes. Daemon and client both use it.
//
// Builds without CUDA (FS_HAVE_CUDA == 0) compile this too: ListGpus() then fails with
// FAILED_PRECONDITION "built without CUDA", so callers need no #if of their own to report it.
// Code that calls the CUDA runtime itself includes <cuda_runtime.h> under #if FS_HAVE_CUDA;
// libcudart is loaded at run time (gpu/cuda_runtime_library.h), and where it is missing
// ListGpus() and CudaStatus() fail with FAILED_PRECONDITION naming it and where it was looked for.
//
// A machine without a GPU or driver is normal (CI, the default host-memory daemon): ListGpus()
// says why there is none and nothing here aborts.
//
// Thread safety: all functions are thread-safe. ScopedCudaDevice changes the calling thread's
// current device only.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace flatshard::gpu {

// Bytes of a cudaIpcMemHandle_t / cudaIpcEventHandle_t (CUDA_IPC_HANDLE_SIZE).
inline constexpr size_t kIpcHandleBytes = 64;

// `err` (a cudaError_t) as a status: OK for cudaSuccess; RESOURCE_EXHAUSTED for out of memory;
// FAILED_PRECONDITION for a missing driver or device; INVALID_ARGUMENT for invalid values or
// handles; UNAVAILABLE for a device that fell off the bus or a context that is gone; INTERNAL
// otherwise. The message is "<what>: <cudaGetErrorName> (<cudaGetErrorString>)". Any error
// while libcudart cannot be loaded is FAILED_PRECONDITION "<what>: <why it is not loaded>".
absl::Status CudaStatus(int err, absl::string_view what);

// Evaluates a CUDA runtime call and returns CudaStatus(its result, what) from the enclosing
// function when it failed.
#define FS_CUDA_RETURN_IF_ERROR(call, what)                                         \
  do {                                                                              \
    const int fs_cuda_err_ = static_cast<int>(call);                                \
    if (fs_cuda_err_ != 0) return ::flatshard::gpu::CudaStatus(fs_cuda_err_, what); \
  } while (0)

struct GpuDevice {
  int ordinal = -1;         // as this process sees it (after CUDA_VISIBLE_DEVICES)
  std::string uuid;         // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi's form)
  std::string name;         // "NVIDIA H100 80GB HBM3"
  int64_t total_bytes = 0;  // device memory
  std::string pci_bus_id;   // "0000:1b:00.0"
};

// The GPUs this process can use, by ordinal.
// Errors: FAILED_PRECONDITION saying why there are none: built without CUDA, no driver
// (cudaErrorInsufficientDriver, cudaErrorNoDevice), or the runtime's error.
absl::StatusOr<std::vector<GpuDevice>> ListGpus();

// The ordinal of the GPU with `uuid` in this process. NOT_FOUND when this process cannot see
// it (another CUDA_VISIBLE_DEVICES, another machine); ListGpus' errors.
absl::StatusOr<int> DeviceForUuid(absl::string_view uuid);

// Makes `device` the calling thread's current device and restores the previous one when it
// goes out of scope. status() says whether cudaSetDevice succeeded.
class ScopedCudaDevice {
 public:
  explicit ScopedCudaDevice(int device);
  ~ScopedCudaDevice();
  ScopedCudaDevice(const ScopedCudaDevice&) = delete;
  ScopedCudaDevice& operator=(const ScopedCudaDevice&) = delete;
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

// Calls `probe` (a cudaStreamQuery / cudaEventQuery as true = done, false = not yet, or its
// error) until it says done or fails, or until `timeout` passed (DEADLINE_EXCEEDED "<what>: not
// done within <timeout>"). The host wait of every device operation goes through here, so its
// latency is one policy: spin for the first 200 us (a small device copy took 50-100 us to
// complete on an H100, and a sleep costs a scheduler wakeup of 20-70 us), then nap for 1/16 of
// the time waited so far, at least 10 us and at most 1 ms, with the thread's timer slack at
// 1 us. A completion is noticed at most about 6% (plus one wakeup) late, and a long wait costs
// about one query per millisecond. (An exponential backoff to 1 ms noticed a 0.72 ms copy
// after 1.3 ms.)
absl::Status PollUntilDone(absl::FunctionRef<absl::StatusOr<bool>()> probe, absl::Duration timeout,
                           absl::string_view what);

}  // namespace flatshard::gpu

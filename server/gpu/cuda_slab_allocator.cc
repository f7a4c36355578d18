// MakeCudaSlabAllocator: slabs from cudaMalloc, exported with cudaIpcGetMemHandle.

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/config.h"
#include "common/gpu/cuda_util.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/gpu/device_context.h"
#include "server/gpu/device_pool.h"

#if FS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace flatshard::gpu {

#if FS_HAVE_CUDA

namespace {

// A memset of a whole slab takes milliseconds; a minute means the device is wedged.
constexpr absl::Duration kZeroTimeout = absl::Minutes(1);

class CudaSlabAllocator final : public SlabAllocator {
 public:
  CudaSlabAllocator(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudaSlabAllocator() override {
    ScopedCudaDevice scoped(device_);
    if (cudaStreamDestroy(stream_) != cudaSuccess) cudaGetLastError();
  }

  absl::StatusOr<Slab> Allocate(size_t bytes) override {
    ScopedCudaDevice scoped(device_);
    FS_RETURN_IF_ERROR(scoped.status());
    Slab slab;
    FS_CUDA_RETURN_IF_ERROR(cudaMalloc(&slab.base, bytes),
                            absl::StrCat("device ", device_, ": cudaMalloc(", bytes, ")"));
    cudaIpcMemHandle_t handle;
    const cudaError_t err = cudaIpcGetMemHandle(&handle, slab.base);
    if (err != cudaSuccess) {
      cudaGetLastError();
      cudaFree(slab.base);
      return CudaStatus(err, absl::StrCat("device ", device_, ": cudaIpcGetMemHandle"));
    }
    slab.bytes = bytes;
    slab.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    return slab;
  }

  void Free(const Slab& slab) override {
    ScopedCudaDevice scoped(device_);
    const cudaError_t err = cudaFree(slab.base);
    if (err != cudaSuccess) {
      cudaGetLastError();
      FS_LOG(ERROR) << CudaStatus(err, absl::StrCat("device ", device_, ": cudaFree(slab ", slab.id,
                                                    ", ", slab.bytes, " bytes)"));
    }
  }

  absl::Status Zero(void* device_ptr, size_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    ScopedCudaDevice scoped(device_);
    FS_RETURN_IF_ERROR(scoped.status());
    // cudaMemset may return before the device has written: use a stream and wait for it.
    FS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(device_ptr, 0, bytes, stream_),
                            absl::StrCat("device ", device_, ": cudaMemsetAsync(", bytes, ")"));
    return internal::WaitForStream(stream_, kZeroTimeout,
                                   absl::StrCat("device ", device_, ": zero-fill"));
  }

 private:
  const int device_;
  const cudaStream_t stream_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SlabAllocator>> MakeCudaSlabAllocator(int device) {
  FS_ASSIGN_OR_RETURN(std::vector<GpuDevice> gpus, ListGpus());
  if (device < 0 || device >= static_cast<int>(gpus.size())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "MakeCudaSlabAllocator: device ", device, " is not visible (", gpus.size(), " GPU(s))"));
  }
  ScopedCudaDevice scoped(device);
  FS_RETURN_IF_ERROR(scoped.status());
  cudaStream_t stream = nullptr;
  FS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                          absl::StrCat("device ", device, ": cudaStreamCreateWithFlags"));
  return std::unique_ptr<SlabAllocator>(new CudaSlabAllocator(device, stream));
}

#else  // !FS_HAVE_CUDA

absl::StatusOr<std::unique_ptr<SlabAllocator>> MakeCudaSlabAllocator(int device) {
  return absl::FailedPreconditionError(
      absl::StrCat("MakeCudaSlabAllocator(device ", device, "): built without CUDA"));
}

#endif  // FS_HAVE_CUDA

}  // namespace flatshard::gpu

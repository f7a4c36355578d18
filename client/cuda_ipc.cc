#include "client/cuda_ipc.h"

#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/gpu/cuda_util.h"
#include "common/logging.h"

#if FS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace flatshard::client::internal {
namespace {

#if FS_HAVE_CUDA
static_assert(sizeof(cudaIpcMemHandle_t) == gpu::kIpcHandleBytes);

class CudaIpcMapping final : public DeviceMapping {
 public:
  CudaIpcMapping(void* data, int device) : data_(data), device_(device) {}
  ~CudaIpcMapping() override {
    // The handle was opened in `device_`'s context, so it must be closed there.
    gpu::ScopedCudaDevice scoped(device_);
    absl::Status s = scoped.status();
    if (s.ok()) s = gpu::CudaStatus(cudaIpcCloseMemHandle(data_), "cudaIpcCloseMemHandle");
    if (!s.ok()) {
      cudaGetLastError();  // clear it, so it does not surface in an unrelated later call
      FS_LOG(WARNING) << "closing the CUDA IPC mapping at " << data_ << " on device " << device_
                      << ": " << s;
    }
  }
  void* data() const override { return data_; }
  int device() const override { return device_; }

 private:
  void* const data_;
  const int device_;
};
#endif  // FS_HAVE_CUDA

class CudaIpcOpener final : public DeviceMemoryOpener {
 public:
  absl::StatusOr<std::unique_ptr<DeviceMapping>> Open(absl::string_view ipc_handle,
                                                      absl::string_view device_uuid) override {
    if (ipc_handle.size() != gpu::kIpcHandleBytes) {
      return absl::InternalError(absl::StrCat("CUDA IPC handle of ", ipc_handle.size(),
                                              " bytes, want ", gpu::kIpcHandleBytes));
    }
    absl::StatusOr<int> device = gpu::DeviceForUuid(device_uuid);
    if (!device.ok()) {
      if (device.status().code() != absl::StatusCode::kFailedPrecondition) return device.status();
      return absl::FailedPreconditionError(
          absl::StrCat("the daemon placed this rank's memory on GPU ", device_uuid,
                       " but this process has no usable GPU: ", device.status().message()));
    }
#if FS_HAVE_CUDA
    gpu::ScopedCudaDevice scoped(*device);
    if (!scoped.status().ok()) return scoped.status();
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
    void* data = nullptr;
    FS_CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&data, handle, cudaIpcMemLazyEnablePeerAccess),
                            absl::StrCat("cudaIpcOpenMemHandle on device ", *device));
    return std::unique_ptr<DeviceMapping>(new CudaIpcMapping(data, *device));
#else
    // ListGpus fails in builds without CUDA, so DeviceForUuid cannot have succeeded.
    return absl::InternalError("built without CUDA, yet a GPU was found");
#endif
  }
};

}  // namespace

std::unique_ptr<DeviceMemoryOpener> NewCudaIpcOpener() { return std::make_unique<CudaIpcOpener>(); }

}  // namespace flatshard::client::internal

#include "client/cuda_events.h"

#include <atomic>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/gpu/cuda_util.h"
#include "common/logging.h"

#if FS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace flatshard::client::internal {
namespace {

// CudaEvent.id is unique per creating process, so it is process-wide, not per Client.
std::atomic<uint64_t> next_event_id{1};

#if FS_HAVE_CUDA
static_assert(sizeof(cudaIpcEventHandle_t) == gpu::kIpcHandleBytes);

class CudaRuntimeEventApi final : public CudaEventApi {
 public:
  absl::StatusOr<int> DeviceForUuid(absl::string_view uuid) override {
    return gpu::DeviceForUuid(uuid);
  }

  absl::StatusOr<std::string> DeviceUuid(int device) override {
    absl::StatusOr<std::vector<gpu::GpuDevice>> gpus = gpu::ListGpus();
    if (!gpus.ok()) return gpus.status();
    for (const gpu::GpuDevice& g : *gpus) {
      if (g.ordinal == device) return g.uuid;
    }
    return absl::NotFoundError(absl::StrCat("no CUDA device ", device, " in this process"));
  }

  absl::StatusOr<std::pair<void*, std::string>> CreateInterprocessEvent(int device) override {
    gpu::ScopedCudaDevice scoped(device);
    if (!scoped.status().ok()) return scoped.status();
    cudaEvent_t event = nullptr;
    FS_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventInterprocess),
        "cudaEventCreateWithFlags(cudaEventDisableTiming | cudaEventInterprocess)");
    cudaIpcEventHandle_t handle;
    if (const cudaError_t err = cudaIpcGetEventHandle(&handle, event); err != cudaSuccess) {
      cudaEventDestroy(event);
      return gpu::CudaStatus(err, "cudaIpcGetEventHandle");
    }
    return std::make_pair(static_cast<void*>(event),
                          std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  }

  absl::StatusOr<void*> OpenEvent(absl::string_view ipc_handle, int device) override {
    if (ipc_handle.size() != sizeof(cudaIpcEventHandle_t)) {
      return absl::InternalError(absl::StrCat("CUDA IPC event handle of ", ipc_handle.size(),
                                              " bytes, want ", sizeof(cudaIpcEventHandle_t)));
    }
    gpu::ScopedCudaDevice scoped(device);
    if (!scoped.status().ok()) return scoped.status();
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, ipc_handle.data(), sizeof(handle));
    cudaEvent_t event = nullptr;
    FS_CUDA_RETURN_IF_ERROR(cudaIpcOpenEventHandle(&event, handle), "cudaIpcOpenEventHandle");
    return static_cast<void*>(event);
  }

  absl::Status Record(void* event, void* stream, int device) override {
    // The legacy default stream (nullptr) is the current device's.
    gpu::ScopedCudaDevice scoped(device);
    if (!scoped.status().ok()) return scoped.status();
    FS_CUDA_RETURN_IF_ERROR(
        cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)),
        "cudaEventRecord");
    return absl::OkStatus();
  }

  absl::Status StreamWait(void* stream, void* event, int device) override {
    gpu::ScopedCudaDevice scoped(device);
    if (!scoped.status().ok()) return scoped.status();
    // An event whose work has completed orders nothing: skip the wait. A stream wait on an
    // interprocess event costs the stream about 150-200 us on an H100 even when the event has
    // long completed (measured with tests/bench/gpu_benchmark.cc), and the daemon records its
    // `ready` only after the host saw the collective complete, so this is the common case.
    if (cudaEventQuery(static_cast<cudaEvent_t>(event)) == cudaSuccess) return absl::OkStatus();
    cudaGetLastError();  // cudaErrorNotReady is not sticky, but leave nothing behind
    FS_CUDA_RETURN_IF_ERROR(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent");
    return absl::OkStatus();
  }

  void Destroy(void* event, int device) override {
    gpu::ScopedCudaDevice scoped(device);
    if (const cudaError_t err = cudaEventDestroy(static_cast<cudaEvent_t>(event));
        err != cudaSuccess) {
      FS_LOG(WARNING) << gpu::CudaStatus(err, absl::StrCat("cudaEventDestroy on device ", device));
    }
  }
};
#else   // !FS_HAVE_CUDA

// Nothing creates or opens an event without CUDA, so only the lookups can be reached.
class CudaRuntimeEventApi final : public CudaEventApi {
 public:
  absl::StatusOr<int> DeviceForUuid(absl::string_view uuid) override {
    return gpu::DeviceForUuid(uuid);
  }
  absl::StatusOr<std::string> DeviceUuid(int) override { return NoCuda(); }
  absl::StatusOr<std::pair<void*, std::string>> CreateInterprocessEvent(int) override {
    return NoCuda();
  }
  absl::StatusOr<void*> OpenEvent(absl::string_view, int) override { return NoCuda(); }
  absl::Status Record(void*, void*, int) override { return NoCuda(); }
  absl::Status StreamWait(void*, void*, int) override { return NoCuda(); }
  void Destroy(void*, int) override {}

 private:
  static absl::Status NoCuda() {
    return absl::FailedPreconditionError(
        "this flatshard client was built without CUDA (FLATSHARD_WITH_CUDA)");
  }
};
#endif  // FS_HAVE_CUDA

}  // namespace

std::unique_ptr<CudaEventApi> NewCudaEventApi() { return std::make_unique<CudaRuntimeEventApi>(); }

StreamEvents::StreamEvents(std::unique_ptr<CudaEventApi> api)
    : api_(api != nullptr ? std::move(api) : NewCudaEventApi()) {}

StreamEvents::~StreamEvents() {
  for (auto& [device, own] : own_) api_->Destroy(own.event, device);
  opened_.clear();  // while api_ lives: the deleters call it
}

absl::StatusOr<IpcEvent> StreamEvents::RecordWritten(int device, void* stream) {
  const auto where = [device] { return absl::StrCat("the trainer's event on device ", device); };
  void* event = nullptr;
  IpcEvent ipc;
  {
    absl::MutexLock lock(&mu_);
    if (const auto it = own_.find(device); it != own_.end()) {
      event = it->second.event;
      ipc = it->second.ipc;
    }
  }
  if (event == nullptr) {
    // First use on this device. Created outside the lock (CUDA call); a racing thread's
    // event wins and ours is destroyed.
    absl::StatusOr<std::string> uuid = api_->DeviceUuid(device);
    if (!uuid.ok()) {
      return absl::Status(uuid.status().code(),
                          absl::StrCat(where(), ": ", uuid.status().message()));
    }
    absl::StatusOr<std::pair<void*, std::string>> created = api_->CreateInterprocessEvent(device);
    if (!created.ok()) {
      return absl::Status(created.status().code(),
                          absl::StrCat(where(), ": ", created.status().message()));
    }
    void* extra = nullptr;
    {
      absl::MutexLock lock(&mu_);
      const auto [it, inserted] = own_.try_emplace(device);
      if (inserted) {
        it->second.event = created->first;
        it->second.ipc.id = next_event_id.fetch_add(1);
        it->second.ipc.ipc_handle = std::move(created->second);
        it->second.ipc.device_uuid = *std::move(uuid);
        ++created_;
      } else {
        extra = created->first;
      }
      event = it->second.event;
      ipc = it->second.ipc;
    }
    if (extra != nullptr) api_->Destroy(extra, device);
  }
  if (absl::Status s = api_->Record(event, stream, device); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(where(), " (id ", ipc.id, "): ", s.message()));
  }
  return ipc;
}

absl::Status StreamEvents::WaitReady(const IpcEvent& ready, void* stream) {
  if (ready.id == 0) return absl::OkStatus();
  const auto where = [&ready] {
    return absl::StrCat("the daemon's ready event ", ready.id, " on GPU ", ready.device_uuid, ": ");
  };
  if (ready.ipc_handle.size() != gpu::kIpcHandleBytes) {
    return absl::InternalError(
        absl::StrCat(where(), "CUDA IPC event handle has the wrong size: ", ready.ipc_handle.size(),
                     " bytes, want ", gpu::kIpcHandleBytes));
  }
  std::shared_ptr<void> event;
  int device = -1;
  {
    absl::MutexLock lock(&mu_);
    if (const auto it = opened_.find(ready.id);
        it != opened_.end() && it->second.ipc_handle == ready.ipc_handle) {
      event = it->second.event;
      device = it->second.device;
    }
  }
  if (event == nullptr) {
    absl::StatusOr<int> found = api_->DeviceForUuid(ready.device_uuid);
    if (!found.ok()) {
      return absl::Status(found.status().code(), absl::StrCat(where(), found.status().message()));
    }
    device = *found;
    absl::StatusOr<void*> opened = api_->OpenEvent(ready.ipc_handle, device);
    if (!opened.ok()) {
      return absl::Status(opened.status().code(), absl::StrCat(where(), opened.status().message()));
    }
    CudaEventApi* const api = api_.get();
    event = std::shared_ptr<void>(*opened, [api, device](void* e) { api->Destroy(e, device); });
    std::shared_ptr<void> replaced;  // destroyed after unlocking (a CUDA call)
    absl::MutexLock lock(&mu_);
    // Another thread may have opened the same handle meanwhile: either copy works, and ours
    // replaces it (the other stays alive while its user holds it).
    OpenedEvent& slot = opened_[ready.id];
    replaced = std::move(slot.event);
    slot.ipc_handle = ready.ipc_handle;
    slot.device = device;
    slot.event = event;
    ++opened_count_;
  }
  if (absl::Status s = api_->StreamWait(stream, event.get(), device); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(where(), s.message()));
  }
  return absl::OkStatus();
}

void StreamEvents::ForgetOpened() {
  absl::flat_hash_map<uint64_t, OpenedEvent> dropped;  // destroyed after unlocking
  absl::MutexLock lock(&mu_);
  dropped.swap(opened_);
}

int64_t StreamEvents::created_events() const {
  absl::MutexLock lock(&mu_);
  return created_;
}

int64_t StreamEvents::opened_events() const {
  absl::MutexLock lock(&mu_);
  return opened_count_;
}

}  // namespace flatshard::client::internal

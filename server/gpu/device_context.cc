#include "server/gpu/device_context.h"

#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/logging.h"
#include "common/status_macros.h"

#if FS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace flatshard::gpu {

#if FS_HAVE_CUDA

namespace {
std::atomic<uint64_t> next_event_id{1};

cudaStream_t AsStream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t AsEvent(void* e) { return static_cast<cudaEvent_t>(e); }
}  // namespace

namespace internal {
absl::Status WaitForStream(void* stream, absl::Duration timeout, absl::string_view what) {
  absl::Status s = PollUntilDone(
      [&]() -> absl::StatusOr<bool> {
        const cudaError_t err = cudaStreamQuery(AsStream(stream));
        if (err == cudaSuccess) return true;
        if (err == cudaErrorNotReady) return false;
        cudaGetLastError();  // clear it, as FS_CUDA_RETURN_IF_ERROR would
        return CudaStatus(err, what);
      },
      timeout, what);
  if (absl::IsDeadlineExceeded(s)) {
    return absl::DeadlineExceededError(
        absl::StrCat(s.message(), " (the stream may wait for an event that is never recorded)"));
  }
  return s;
}
}  // namespace internal

struct DeviceContext::OpenedEvent {
  OpenedEvent(std::string h, cudaEvent_t e, int d) : handle(std::move(h)), event(e), device(d) {}
  ~OpenedEvent() {
    ScopedCudaDevice scoped(device);
    if (cudaEventDestroy(event) != cudaSuccess) cudaGetLastError();
  }
  const std::string handle;
  const cudaEvent_t event;
  const int device;
};

absl::StatusOr<std::unique_ptr<DeviceContext>> DeviceContext::Create(
    const GpuDevice& gpu, DevicePoolOptions pool_options) {
  FS_ASSIGN_OR_RETURN(std::vector<GpuDevice> gpus, ListGpus());
  if (gpu.ordinal < 0 || gpu.ordinal >= static_cast<int>(gpus.size())) {
    return absl::NotFoundError(absl::StrCat("GPU ordinal ", gpu.ordinal, " (", gpu.uuid,
                                            ") is not visible: this process sees ", gpus.size(),
                                            " GPU(s)"));
  }
  const GpuDevice& seen = gpus[gpu.ordinal];
  if (!gpu.uuid.empty() && gpu.uuid != seen.uuid) {
    return absl::NotFoundError(absl::StrCat("GPU ordinal ", gpu.ordinal, " is ", seen.uuid,
                                            ", not the requested ", gpu.uuid));
  }
  FS_ASSIGN_OR_RETURN(std::unique_ptr<SlabAllocator> allocator,
                      MakeCudaSlabAllocator(seen.ordinal));
  pool_options.device = seen.ordinal;
  pool_options.device_uuid = seen.uuid;
  std::unique_ptr<DeviceContext> ctx(
      new DeviceContext(seen, DevicePool::Create(std::move(pool_options), std::move(allocator))));

  ScopedCudaDevice scoped(seen.ordinal);
  FS_RETURN_IF_ERROR(scoped.status());
  const std::string where = absl::StrCat("device ", seen.ordinal, " (", seen.uuid, ")");
  cudaStream_t stream = nullptr;
  FS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                          absl::StrCat(where, ": cudaStreamCreateWithFlags"));
  ctx->stream_ = stream;
  cudaEvent_t ready = nullptr;
  // Interprocess events must not record timing.
  FS_CUDA_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&ready, cudaEventDisableTiming | cudaEventInterprocess),
      absl::StrCat(where, ": cudaEventCreateWithFlags(interprocess)"));
  ctx->ready_event_ = ready;
  cudaIpcEventHandle_t handle;
  FS_CUDA_RETURN_IF_ERROR(cudaIpcGetEventHandle(&handle, ready),
                          absl::StrCat(where, ": cudaIpcGetEventHandle"));
  ctx->ready_ref_.id = next_event_id.fetch_add(1);
  ctx->ready_ref_.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  ctx->ready_ref_.device_uuid = seen.uuid;
  FS_LOG(INFO) << "GPU context ready: " << where << " " << seen.name << " pool "
               << ctx->pool_->Usage().DebugString();
  return ctx;
}

DeviceContext::DeviceContext(GpuDevice gpu, std::shared_ptr<DevicePool> pool)
    : gpu_(std::move(gpu)), pool_(std::move(pool)) {}

DeviceContext::~DeviceContext() {
  if (stream_ != nullptr) {
    absl::Status drained = Synchronize();
    if (!drained.ok()) FS_LOG(WARNING) << "destroying GPU context: " << drained;
  }
  absl::flat_hash_map<std::string, std::shared_ptr<OpenedEvent>> opened;
  {
    absl::MutexLock lock(&mu_);
    opened.swap(opened_);
  }
  opened.clear();                                             // cudaEventDestroy, outside the lock
  if (ready_event_ == nullptr && stream_ == nullptr) return;  // simulated, or never created
  ScopedCudaDevice scoped(gpu_.ordinal);
  if (ready_event_ != nullptr && cudaEventDestroy(AsEvent(ready_event_)) != cudaSuccess) {
    cudaGetLastError();
  }
  if (stream_ != nullptr && cudaStreamDestroy(AsStream(stream_)) != cudaSuccess) {
    cudaGetLastError();
  }
}

void DeviceContext::set_sync_timeout(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  sync_timeout_ = timeout;
}

absl::Status DeviceContext::Copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  {
    ScopedCudaDevice scoped(gpu_.ordinal);
    FS_RETURN_IF_ERROR(scoped.status());
    // cudaMemcpyDefault: unified addressing tells the direction from the pointers.
    FS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, AsStream(stream_)),
                            absl::StrCat("device ", gpu_.ordinal, " (", gpu_.uuid,
                                         "): cudaMemcpyAsync of ", bytes, " bytes"));
  }
  return Synchronize();
}

absl::Status DeviceContext::CopyAsync(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (stream_ == nullptr) return Copy(dst, src, bytes);  // a subclass without a CUDA stream
  ScopedCudaDevice scoped(gpu_.ordinal);
  FS_RETURN_IF_ERROR(scoped.status());
  FS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, AsStream(stream_)),
                          absl::StrCat("device ", gpu_.ordinal, " (", gpu_.uuid,
                                       "): cudaMemcpyAsync of ", bytes, " bytes"));
  return absl::OkStatus();
}

absl::Status DeviceContext::StreamError() {
  if (stream_ == nullptr) return absl::OkStatus();  // a subclass without a CUDA stream
  ScopedCudaDevice scoped(gpu_.ordinal);
  FS_RETURN_IF_ERROR(scoped.status());
  const cudaError_t err = cudaStreamQuery(AsStream(stream_));
  if (err == cudaSuccess || err == cudaErrorNotReady) return absl::OkStatus();
  cudaGetLastError();
  return CudaStatus(err, absl::StrCat("device ", gpu_.ordinal, " (", gpu_.uuid, "): stream"));
}

absl::Status DeviceContext::Synchronize() {
  absl::Duration timeout;
  {
    absl::MutexLock lock(&mu_);
    timeout = sync_timeout_;
  }
  ScopedCudaDevice scoped(gpu_.ordinal);
  FS_RETURN_IF_ERROR(scoped.status());
  return internal::WaitForStream(
      stream_, timeout, absl::StrCat("device ", gpu_.ordinal, " (", gpu_.uuid, "): stream"));
}

absl::StatusOr<IpcEventRef> DeviceContext::RecordReady() {
  ScopedCudaDevice scoped(gpu_.ordinal);
  FS_RETURN_IF_ERROR(scoped.status());
  FS_CUDA_RETURN_IF_ERROR(
      cudaEventRecord(AsEvent(ready_event_), AsStream(stream_)),
      absl::StrCat("device ", gpu_.ordinal, " (", gpu_.uuid, "): cudaEventRecord(ready)"));
  return ready_ref_;
}

absl::StatusOr<std::shared_ptr<DeviceContext::OpenedEvent>> DeviceContext::Open(
    const IpcEventRef& event, const std::string& where) {
  if (event.id == 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": event id 0 (none)"));
  }
  if (event.ipc_handle.size() != sizeof(cudaIpcEventHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(where, " event ", event.id, ": ipc_handle has ",
                                                   event.ipc_handle.size(), " bytes, want ",
                                                   sizeof(cudaIpcEventHandle_t)));
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = opened_.find(event.ipc_handle);
    if (it != opened_.end()) return it->second;
  }
  // Opened without the lock (a CUDA call); a racing Open of the same event may open it too, and
  // the later insert simply wins.
  cudaIpcEventHandle_t handle;
  std::memcpy(&handle, event.ipc_handle.data(), sizeof(handle));
  cudaEvent_t e = nullptr;
  FS_CUDA_RETURN_IF_ERROR(cudaIpcOpenEventHandle(&e, handle),
                          absl::StrCat(where, ": cudaIpcOpenEventHandle(event ", event.id, " of ",
                                       event.device_uuid, ")"));
  auto opened = std::make_shared<OpenedEvent>(event.ipc_handle, e, gpu_.ordinal);
  std::shared_ptr<OpenedEvent> replaced;
  absl::flat_hash_map<std::string, std::shared_ptr<OpenedEvent>> dropped;
  {
    absl::MutexLock lock(&mu_);
    // Restarted trainers bring new events; live ones are simply opened again when needed.
    if (opened_.size() >= 256) dropped.swap(opened_);
    replaced = std::exchange(opened_[event.ipc_handle], opened);
  }
  // `replaced` and `dropped` are destroyed here, outside the lock (cudaEventDestroy).
  return opened;
}

absl::Status DeviceContext::WaitFor(const IpcEventRef& event) {
  const std::string where = absl::StrCat("device ", gpu_.ordinal, " (", gpu_.uuid, "): WaitFor");
  ScopedCudaDevice scoped(gpu_.ordinal);
  FS_RETURN_IF_ERROR(scoped.status());
  FS_ASSIGN_OR_RETURN(std::shared_ptr<OpenedEvent> opened, Open(event, where));
  // A completed event orders nothing, and a stream wait on an interprocess event is costly.
  if (cudaEventQuery(opened->event) == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  FS_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(AsStream(stream_), opened->event, 0),
                          absl::StrCat(where, ": cudaStreamWaitEvent(event ", event.id, ")"));
  return absl::OkStatus();
}

absl::Status DeviceContext::WaitOnHost(const IpcEventRef& event, absl::Duration timeout) {
  const std::string where = absl::StrCat("device ", gpu_.ordinal, " (", gpu_.uuid, "): WaitOnHost");
  if (timeout == absl::InfiniteDuration()) {
    absl::MutexLock lock(&mu_);
    timeout = sync_timeout_;
  }
  ScopedCudaDevice scoped(gpu_.ordinal);
  FS_RETURN_IF_ERROR(scoped.status());
  FS_ASSIGN_OR_RETURN(std::shared_ptr<OpenedEvent> opened, Open(event, where));
  absl::Status s = PollUntilDone(
      [&]() -> absl::StatusOr<bool> {
        const cudaError_t err = cudaEventQuery(opened->event);
        if (err == cudaSuccess) return true;
        if (err == cudaErrorNotReady) return false;
        cudaGetLastError();
        return CudaStatus(err, absl::StrCat(where, ": cudaEventQuery(event ", event.id, ")"));
      },
      timeout, absl::StrCat(where, ": the trainer's event ", event.id));
  if (absl::IsDeadlineExceeded(s)) {
    return absl::DeadlineExceededError(
        absl::StrCat(s.message(), " (its stream may wait for work that never finishes)"));
  }
  return s;
}

absl::Status PinHostMemory(void* ptr, size_t bytes) {
  if (ptr == nullptr || bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("PinHostMemory: need memory, got ",
                                                   ptr == nullptr ? "a null pointer" : "0 bytes"));
  }
  FS_CUDA_RETURN_IF_ERROR(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable),
                          absl::StrCat("cudaHostRegister(", bytes, " bytes)"));
  return absl::OkStatus();
}

void UnpinHostMemory(void* ptr) {
  const cudaError_t err = cudaHostUnregister(ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    FS_LOG(WARNING) << CudaStatus(
        err, absl::StrCat("cudaHostUnregister(", absl::Hex(reinterpret_cast<uintptr_t>(ptr)), ")"));
  }
}

#else  // !FS_HAVE_CUDA

namespace {
absl::Status NoCuda(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat(what, ": built without CUDA"));
}
}  // namespace

namespace internal {
absl::Status WaitForStream(void*, absl::Duration, absl::string_view what) { return NoCuda(what); }
}  // namespace internal

struct DeviceContext::OpenedEvent {};

absl::StatusOr<std::unique_ptr<DeviceContext>> DeviceContext::Create(const GpuDevice&,
                                                                     DevicePoolOptions) {
  FS_RETURN_IF_ERROR(ListGpus().status());
  return NoCuda("DeviceContext");
}
DeviceContext::DeviceContext(GpuDevice gpu, std::shared_ptr<DevicePool> pool)
    : gpu_(std::move(gpu)), pool_(std::move(pool)) {}
DeviceContext::~DeviceContext() = default;
void DeviceContext::set_sync_timeout(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  sync_timeout_ = timeout;
}
absl::Status DeviceContext::Copy(void*, const void*, size_t) { return NoCuda("Copy"); }
absl::Status DeviceContext::Synchronize() { return NoCuda("Synchronize"); }
absl::Status DeviceContext::CopyAsync(void* dst, const void* src, size_t bytes) {
  return Copy(dst, src, bytes);  // Copy's error, or a subclass's synchronous copy
}
absl::Status DeviceContext::StreamError() { return absl::OkStatus(); }  // nothing ran
absl::StatusOr<IpcEventRef> DeviceContext::RecordReady() { return NoCuda("RecordReady"); }
absl::Status DeviceContext::WaitFor(const IpcEventRef&) { return NoCuda("WaitFor"); }
absl::Status DeviceContext::WaitOnHost(const IpcEventRef&, absl::Duration) {
  return NoCuda("WaitOnHost");
}
absl::Status PinHostMemory(void*, size_t) { return NoCuda("PinHostMemory"); }
void UnpinHostMemory(void*) {}

#endif  // FS_HAVE_CUDA

int DeviceContext::device() const { return gpu_.ordinal; }
absl::Duration DeviceContext::sync_timeout() const {
  absl::MutexLock lock(&mu_);
  return sync_timeout_;
}
const std::string& DeviceContext::uuid() const { return gpu_.uuid; }
const std::shared_ptr<DevicePool>& DeviceContext::pool() const { return pool_; }
void* DeviceContext::stream() const { return stream_; }

}  // namespace flatshard::gpu

// DeviceContext::CreateSimulated: a "GPU" whose memory is host shared memory, for running the
// daemon's GPU code paths where no GPU exists (flatshardd --simulate_gpus; tests). Nothing here
// calls CUDA, so it works in builds without CUDA too. Its stream and events are asynchronous
// (common/gpu/simulated_stream.h), so ordering bugs show.

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/gpu/simulated_stream.h"
#include "common/shm_segment.h"
#include "common/status_macros.h"
#include "server/gpu/device_context.h"

namespace flatshard::gpu {
namespace {

constexpr char kSimulatedHandlePrefix[] = "SIMGPU";

// Slabs are shm segments; the "IPC handle" is "SIMGPU" + the segment's name, zero-padded to
// kIpcHandleBytes, so a test's opener can map it in another process.
class SimulatedSlabAllocator final : public SlabAllocator {
 public:
  explicit SimulatedSlabAllocator(std::string prefix) : prefix_(std::move(prefix)) {}

  absl::StatusOr<Slab> Allocate(size_t bytes) override {
    FS_ASSIGN_OR_RETURN(ShmSegment segment, ShmSegment::Create(MakeSegmentName(prefix_), bytes));
    std::string handle = absl::StrCat(kSimulatedHandlePrefix, segment.name());
    if (handle.size() > kIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("simulated GPU: segment name ", segment.name(),
                                                     " is too long for a handle"));
    }
    handle.resize(kIpcHandleBytes, '\0');
    Slab slab;
    slab.base = segment.data();
    slab.bytes = bytes;
    slab.ipc_handle = std::move(handle);
    absl::MutexLock lock(&mu_);
    segments_.emplace(slab.base, std::move(segment));
    return slab;
  }

  void Free(const Slab& slab) override {
    ShmSegment gone;  // unmapped and unlinked outside the lock
    absl::MutexLock lock(&mu_);
    auto it = segments_.find(slab.base);
    if (it == segments_.end()) return;
    gone = std::move(it->second);
    segments_.erase(it);
  }

  absl::Status Zero(void* p, size_t bytes) override {
    std::memset(p, 0, bytes);
    return absl::OkStatus();
  }

 private:
  const std::string prefix_;
  absl::Mutex mu_;
  std::map<void*, ShmSegment> segments_ ABSL_GUARDED_BY(mu_);
};

std::atomic<uint64_t> next_simulated_event{1};

// Its "stream" is a SimulatedStream (asynchronous, like CUDA's), its events SimulatedEvents
// (interprocess, through shm), so that an ordering bug shows as wrong values. Trainers' events
// that are not simulated events (an old trainer's tokens) count as completed.
class SimulatedDeviceContext final : public DeviceContext {
 public:
  SimulatedDeviceContext(GpuDevice gpu, std::shared_ptr<DevicePool> pool,
                         std::shared_ptr<SimulatedEvent> ready, absl::Duration delay)
      : DeviceContext(gpu, std::move(pool)),
        stream_(absl::StrCat("simulated GPU ", gpu.ordinal, ": stream")),
        ready_event_(std::move(ready)) {
    ready_.id = next_simulated_event.fetch_add(1);
    ready_.ipc_handle = ready_event_->handle();
    ready_.device_uuid = gpu.uuid;
    stream_.set_delay(delay);
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    CopyAsync(dst, src, bytes).IgnoreError();  // never fails
    return Synchronize();
  }
  absl::Status CopyAsync(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) stream_.EnqueueCopy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return stream_.Synchronize(sync_timeout()); }
  absl::Status StreamError() override { return stream_.error(); }
  absl::StatusOr<IpcEventRef> RecordReady() override {
    stream_.EnqueueRecord(ready_event_);
    return ready_;
  }
  absl::Status WaitFor(const IpcEventRef& event) override {
    FS_ASSIGN_OR_RETURN(std::shared_ptr<SimulatedEvent> opened, Open(event, "WaitFor"));
    if (opened == nullptr) return absl::OkStatus();
    stream_.set_wait_timeout(sync_timeout());
    stream_.EnqueueWait(std::move(opened));
    return absl::OkStatus();
  }
  absl::Status WaitOnHost(const IpcEventRef& event, absl::Duration timeout) override {
    FS_ASSIGN_OR_RETURN(std::shared_ptr<SimulatedEvent> opened, Open(event, "WaitOnHost"));
    if (opened == nullptr) return absl::OkStatus();
    if (timeout == absl::InfiniteDuration()) timeout = sync_timeout();
    return opened->WaitOnHost(
        opened->recorded(), timeout,
        absl::StrCat("simulated GPU ", device(), ": WaitOnHost: the trainer's event ", event.id));
  }

 private:
  // The trainer's event, opened once per handle; null for a token that is not an event.
  absl::StatusOr<std::shared_ptr<SimulatedEvent>> Open(const IpcEventRef& event,
                                                       absl::string_view what) {
    if (event.id == 0 || event.ipc_handle.size() != kIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "simulated GPU ", device(), ": ", what, ": event ", event.id, " with a ",
          event.ipc_handle.size(), "-byte handle (want id > 0 and ", kIpcHandleBytes, " bytes)"));
    }
    if (!SimulatedEvent::IsHandle(event.ipc_handle)) return nullptr;
    absl::MutexLock lock(&mu_);
    auto it = opened_.find(event.ipc_handle);
    if (it != opened_.end()) return it->second;
    absl::StatusOr<std::shared_ptr<SimulatedEvent>> opened = SimulatedEvent::Open(event.ipc_handle);
    if (!opened.ok()) {
      return absl::Status(opened.status().code(),
                          absl::StrCat("simulated GPU ", device(), ": ", what, ": event ", event.id,
                                       ": ", opened.status().message()));
    }
    if (opened_.size() >= 256) opened_.clear();  // trainers long gone (live ones reopen)
    opened_.emplace(event.ipc_handle, *opened);
    return *opened;
  }

  SimulatedStream stream_;
  const std::shared_ptr<SimulatedEvent> ready_event_;
  IpcEventRef ready_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<SimulatedEvent>> opened_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceContext>> DeviceContext::CreateSimulated(
    int ordinal, DevicePoolOptions pool_options, const std::string& segment_prefix,
    absl::Duration stream_delay) {
  FS_RETURN_IF_ERROR(ValidateSegmentPrefix(segment_prefix));
  GpuDevice gpu;
  gpu.ordinal = ordinal;
  gpu.uuid = absl::StrCat("SIM-GPU-", ordinal);
  gpu.name = "simulated GPU (host shared memory)";
  pool_options.device = ordinal;
  pool_options.device_uuid = gpu.uuid;
  std::shared_ptr<DevicePool> pool = DevicePool::Create(
      std::move(pool_options), std::make_unique<SimulatedSlabAllocator>(segment_prefix));
  FS_ASSIGN_OR_RETURN(std::shared_ptr<SimulatedEvent> ready,
                      SimulatedEvent::Create(segment_prefix));
  return std::unique_ptr<DeviceContext>(
      new SimulatedDeviceContext(gpu, std::move(pool), std::move(ready), stream_delay));
}

}  // namespace flatshard::gpu

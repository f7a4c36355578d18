// DeviceContext::CreateSimulated: a "GPU" whose memory is host shared memory, for running the
// daemon's GPU code paths where no GPU exists (flatshardd --simulate_gpus; tests). Nothing here
// calls CUDA, so it works in builds without CUDA too.

#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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

class SimulatedDeviceContext final : public DeviceContext {
 public:
  SimulatedDeviceContext(GpuDevice gpu, std::shared_ptr<DevicePool> pool)
      : DeviceContext(gpu, std::move(pool)) {
    ready_.id = next_simulated_event.fetch_add(1);
    ready_.ipc_handle = std::string(kIpcHandleBytes, '\0');
    ready_.ipc_handle.replace(0, 8, "SIMEVENT");
    ready_.device_uuid = gpu.uuid;
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    if (bytes > 0) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }
  absl::StatusOr<IpcEventRef> RecordReady() override { return ready_; }
  absl::Status WaitFor(const IpcEventRef& event) override {
    if (event.id == 0 || event.ipc_handle.size() != kIpcHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "simulated GPU ", device(), ": WaitFor: event ", event.id, " with a ",
          event.ipc_handle.size(), "-byte handle (want id > 0 and ", kIpcHandleBytes, " bytes)"));
    }
    return absl::OkStatus();  // the trainer's "stream" is the host: its writes are done
  }
  absl::Status WaitOnHost(const IpcEventRef& event, absl::Duration) override {
    return WaitFor(event);
  }

 private:
  IpcEventRef ready_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceContext>> DeviceContext::CreateSimulated(
    int ordinal, DevicePoolOptions pool_options, const std::string& segment_prefix) {
  FS_RETURN_IF_ERROR(ValidateSegmentPrefix(segment_prefix));
  GpuDevice gpu;
  gpu.ordinal = ordinal;
  gpu.uuid = absl::StrCat("SIM-GPU-", ordinal);
  gpu.name = "simulated GPU (host shared memory)";
  pool_options.device = ordinal;
  pool_options.device_uuid = gpu.uuid;
  std::shared_ptr<DevicePool> pool = DevicePool::Create(
      std::move(pool_options), std::make_unique<SimulatedSlabAllocator>(segment_prefix));
  return std::unique_ptr<DeviceContext>(new SimulatedDeviceContext(gpu, std::move(pool)));
}

}  // namespace flatshard::gpu

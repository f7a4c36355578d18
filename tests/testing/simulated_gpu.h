#pragma once
// The trainer side of flatshardd --simulate_gpus: a DeviceMemoryOpener that maps a simulated
// slab by the shm name its "IPC handle" carries ("SIMGPU" + name, zero-padded), and events
// that are simulated interprocess events (SimulatedEvents below). With these a Client
// runs its device-memory code paths (IPC open-once cache, `written`/`ready` plumbing, device
// views) against a real daemon on a machine without a GPU. Simulated GPU ordinal i is
// "SIM-GPU-i"; its "device pointers" are host pointers.
// Thread-safe.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "client/client_internal.h"
#include "common/gpu/cuda_util.h"
#include "common/gpu/simulated_stream.h"

namespace flatshard::testing {

inline absl::StatusOr<int> SimulatedOrdinal(absl::string_view uuid) {
  int ordinal = -1;
  constexpr absl::string_view kPrefix = "SIM-GPU-";
  if (!absl::StartsWith(uuid, kPrefix) ||
      !absl::SimpleAtoi(uuid.substr(kPrefix.size()), &ordinal)) {
    return absl::NotFoundError(absl::StrCat("not a simulated GPU: ", uuid));
  }
  return ordinal;
}

class SimulatedMapping final : public client::internal::DeviceMapping {
 public:
  SimulatedMapping(void* data, size_t bytes, int device)
      : data_(data), bytes_(bytes), device_(device) {}
  ~SimulatedMapping() override { ::munmap(data_, bytes_); }
  void* data() const override { return data_; }
  int device() const override { return device_; }

 private:
  void* const data_;
  const size_t bytes_;
  const int device_;
};

class SimulatedOpener final : public client::internal::DeviceMemoryOpener {
 public:
  absl::StatusOr<std::unique_ptr<client::internal::DeviceMapping>> Open(
      absl::string_view ipc_handle, absl::string_view device_uuid) override {
    absl::StatusOr<int> device = SimulatedOrdinal(device_uuid);
    if (!device.ok()) return device.status();
    std::string name(ipc_handle);
    name.resize(std::strlen(name.c_str()));
    constexpr absl::string_view kPrefix = "SIMGPU";
    if (ipc_handle.size() != gpu::kIpcHandleBytes || !absl::StartsWith(name, kPrefix)) {
      return absl::InternalError("not a simulated slab handle");
    }
    const absl::string_view shm = absl::string_view(name).substr(kPrefix.size());
    const int fd = ::shm_open(std::string(shm).c_str(), O_RDWR, 0);
    if (fd < 0) return absl::NotFoundError(absl::StrCat("shm_open ", shm, ": ", errno));
    struct stat st {};
    ::fstat(fd, &st);
    void* p =
        ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap ", shm));
    return std::unique_ptr<client::internal::DeviceMapping>(
        new SimulatedMapping(p, static_cast<size_t>(st.st_size), *device));
  }
};

// The trainer's events are simulated interprocess events (common/gpu/simulated_stream.h) that
// the simulated daemon opens by handle. ClientOptions::cuda_stream selects the trainer's
// "stream":
// - nullptr (the default): the host. A record completes at once (the host's writes are done);
//   a wait on the daemon's `ready` event waits on the host, so views read right after Summon
//   or Finish returns see the daemon's bytes (as cudaMemcpy on the legacy default stream).
// - a gpu::SimulatedStream*: records and waits are enqueued on it; the test writes and reads
//   device views through it (EnqueueCopy, Synchronize), and its set_delay() makes a daemon
//   that does not wait for the trainer's event read old bytes.
class SimulatedEvents final : public client::internal::CudaEventApi {
 public:
  absl::StatusOr<int> DeviceForUuid(absl::string_view uuid) override {
    return SimulatedOrdinal(uuid);
  }
  absl::StatusOr<std::string> DeviceUuid(int device) override {
    return absl::StrCat("SIM-GPU-", device);
  }
  absl::StatusOr<std::pair<void*, std::string>> CreateInterprocessEvent(int) override {
    absl::StatusOr<std::shared_ptr<gpu::SimulatedEvent>> e = gpu::SimulatedEvent::Create("fssimev");
    if (!e.ok()) return e.status();
    auto* held = new std::shared_ptr<gpu::SimulatedEvent>(*std::move(e));
    return std::make_pair(static_cast<void*>(held), (*held)->handle());
  }
  absl::StatusOr<void*> OpenEvent(absl::string_view handle, int) override {
    absl::StatusOr<std::shared_ptr<gpu::SimulatedEvent>> e = gpu::SimulatedEvent::Open(handle);
    if (!e.ok()) return e.status();
    return static_cast<void*>(new std::shared_ptr<gpu::SimulatedEvent>(*std::move(e)));
  }
  absl::Status Record(void* event, void* stream, int) override {
    std::shared_ptr<gpu::SimulatedEvent>& e = Held(event);
    if (stream == nullptr) {
      e->RecordCompleted();
    } else {
      static_cast<gpu::SimulatedStream*>(stream)->EnqueueRecord(e);
    }
    return absl::OkStatus();
  }
  absl::Status StreamWait(void* stream, void* event, int) override {
    std::shared_ptr<gpu::SimulatedEvent>& e = Held(event);
    if (stream != nullptr) {
      static_cast<gpu::SimulatedStream*>(stream)->EnqueueWait(e);
      return absl::OkStatus();
    }
    return e->WaitOnHost(e->recorded(), absl::Minutes(2), "the daemon's simulated ready event");
  }
  void Destroy(void* event, int) override { delete &Held(event); }

 private:
  static std::shared_ptr<gpu::SimulatedEvent>& Held(void* event) {
    return *static_cast<std::shared_ptr<gpu::SimulatedEvent>*>(event);
  }
};

inline client::internal::GpuApis SimulatedGpuApis() {
  client::internal::GpuApis apis;
  apis.opener = std::make_unique<SimulatedOpener>();
  apis.events = std::make_unique<SimulatedEvents>();
  return apis;
}

}  // namespace flatshard::testing

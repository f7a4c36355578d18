#pragma once
// The trainer side of flatshardd --simulate_gpus: a DeviceMemoryOpener that maps a simulated
// slab by the shm name its "IPC handle" carries ("SIMGPU" + name, zero-padded), and event calls
// that do nothing (the simulated daemon's copies are synchronous memcpy). With these a Client
// runs its device-memory code paths (IPC open-once cache, `written`/`ready` plumbing, device
// views) against a real daemon on a machine without a GPU. Simulated GPU ordinal i is
// "SIM-GPU-i"; its "device pointers" are host pointers.
// Thread-safe (the opener and event API hold no state but a counter).

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

class SimulatedEvents final : public client::internal::CudaEventApi {
 public:
  absl::StatusOr<int> DeviceForUuid(absl::string_view uuid) override {
    return SimulatedOrdinal(uuid);
  }
  absl::StatusOr<std::string> DeviceUuid(int device) override {
    return absl::StrCat("SIM-GPU-", device);
  }
  absl::StatusOr<std::pair<void*, std::string>> CreateInterprocessEvent(int) override {
    std::string handle(gpu::kIpcHandleBytes, '\0');
    handle.replace(0, 9, "SIMCLIENT");
    const std::string n = absl::StrCat(::getpid(), ".", ++created_);
    handle.replace(9, n.size(), n);
    return std::make_pair(static_cast<void*>(&token_), handle);
  }
  absl::StatusOr<void*> OpenEvent(absl::string_view, int) override { return &token_; }
  absl::Status Record(void*, void*, int) override { return absl::OkStatus(); }
  absl::Status StreamWait(void*, void*, int) override { return absl::OkStatus(); }
  void Destroy(void*, int) override {}

 private:
  std::atomic<int> created_{0};
  char token_ = 0;
};

inline client::internal::GpuApis SimulatedGpuApis() {
  client::internal::GpuApis apis;
  apis.opener = std::make_unique<SimulatedOpener>();
  apis.events = std::make_unique<SimulatedEvents>();
  return apis;
}

}  // namespace flatshard::testing

#pragma once
// Test doubles for the client's GPU-facing interfaces, so cache, events and client wiring
// are tested without a GPU.
//
//   FakeDeviceMemoryOpener: "device memory" is a shared-memory segment whose name and size
//     are encoded in the 64-byte IPC handle (FakeIpcHandle); Open maps it, so views point at
//     real bytes. GPUs are the uuids in FakeGpuLog::gpus.
//   FakeCudaEventApi: events are numbered tokens; every call is logged in order.
// Both share a FakeGpuLog (shared_ptr) that the test keeps after handing the fakes over.
//
// Thread safety: all fakes are thread-safe.

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/cuda_events.h"
#include "client/cuda_ipc.h"
#include "common/gpu/cuda_util.h"
#include "common/shm_segment.h"

namespace flatshard::client::testing {

// A 64-byte "IPC handle" naming shm segment `name` of `bytes` bytes (name up to 47 chars).
inline std::string FakeIpcHandle(const std::string& name, uint64_t bytes) {
  std::string h(gpu::kIpcHandleBytes, '\0');
  std::memcpy(h.data(), name.data(), std::min<size_t>(name.size(), 47));
  std::memcpy(h.data() + 48, &bytes, sizeof(bytes));
  return h;
}

struct FakeGpuLog {
  absl::Mutex mu;
  std::map<std::string, int> gpus ABSL_GUARDED_BY(mu) = {{"GPU-fake-0", 0}, {"GPU-fake-1", 1}};
  absl::Status no_gpu ABSL_GUARDED_BY(mu);             // not OK: every lookup fails with it
  int opens ABSL_GUARDED_BY(mu) = 0;                   // successful DeviceMemoryOpener::Open calls
  int closes ABSL_GUARDED_BY(mu) = 0;                  // mappings destroyed
  std::vector<std::string> calls ABSL_GUARDED_BY(mu);  // every call, "Op(args)", in order

  int total_calls() {
    absl::MutexLock lock(&mu);
    return static_cast<int>(calls.size());
  }
  std::vector<std::string> Calls() {
    absl::MutexLock lock(&mu);
    return calls;
  }
  absl::StatusOr<int> Lookup(absl::string_view uuid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!no_gpu.ok()) return no_gpu;
    const auto it = gpus.find(std::string(uuid));
    if (it == gpus.end()) return absl::NotFoundError(absl::StrCat("fake: no GPU ", uuid));
    return it->second;
  }
};

class FakeDeviceMapping final : public internal::DeviceMapping {
 public:
  FakeDeviceMapping(std::shared_ptr<FakeGpuLog> log, ShmSegment segment, int device)
      : log_(std::move(log)), segment_(std::move(segment)), device_(device) {}
  ~FakeDeviceMapping() override {
    absl::MutexLock lock(&log_->mu);
    ++log_->closes;
    log_->calls.push_back(absl::StrCat("Close(", segment_.name(), ")"));
  }
  void* data() const override { return segment_.data(); }
  int device() const override { return device_; }

 private:
  std::shared_ptr<FakeGpuLog> log_;
  ShmSegment segment_;
  int device_;
};

class FakeDeviceMemoryOpener final : public internal::DeviceMemoryOpener {
 public:
  explicit FakeDeviceMemoryOpener(std::shared_ptr<FakeGpuLog> log) : log_(std::move(log)) {}

  absl::StatusOr<std::unique_ptr<internal::DeviceMapping>> Open(
      absl::string_view ipc_handle, absl::string_view device_uuid) override {
    int device;
    {
      absl::MutexLock lock(&log_->mu);
      log_->calls.push_back(absl::StrCat("Open(", device_uuid, ")"));
      if (ipc_handle.size() != gpu::kIpcHandleBytes) {
        return absl::InternalError("fake: handle of the wrong size");
      }
      absl::StatusOr<int> d = log_->Lookup(device_uuid);
      if (!d.ok()) return d.status();
      device = *d;
    }
    const std::string name(ipc_handle.data(), strnlen(ipc_handle.data(), 48));
    uint64_t bytes = 0;
    std::memcpy(&bytes, ipc_handle.data() + 48, sizeof(bytes));
    absl::StatusOr<ShmSegment> segment = ShmSegment::Open(name, bytes, /*writable=*/true);
    if (!segment.ok()) return segment.status();
    absl::MutexLock lock(&log_->mu);
    ++log_->opens;
    return std::unique_ptr<internal::DeviceMapping>(
        new FakeDeviceMapping(log_, *std::move(segment), device));
  }

 private:
  std::shared_ptr<FakeGpuLog> log_;
};

// Events are tokens 1, 2, ... cast to void*; handles are "ev<token>" padded to 64 bytes.
class FakeCudaEventApi final : public internal::CudaEventApi {
 public:
  explicit FakeCudaEventApi(std::shared_ptr<FakeGpuLog> log) : log_(std::move(log)) {}

  static std::string Handle(const std::string& text) {
    std::string h(gpu::kIpcHandleBytes, '\0');
    std::memcpy(h.data(), text.data(), std::min<size_t>(text.size(), 63));
    return h;
  }

  absl::StatusOr<int> DeviceForUuid(absl::string_view uuid) override {
    absl::MutexLock lock(&log_->mu);
    log_->calls.push_back(absl::StrCat("DeviceForUuid(", uuid, ")"));
    return log_->Lookup(uuid);
  }
  absl::StatusOr<std::string> DeviceUuid(int device) override {
    absl::MutexLock lock(&log_->mu);
    log_->calls.push_back(absl::StrCat("DeviceUuid(", device, ")"));
    if (!log_->no_gpu.ok()) return log_->no_gpu;
    for (const auto& [uuid, d] : log_->gpus) {
      if (d == device) return uuid;
    }
    return absl::NotFoundError("fake: no such device");
  }
  absl::StatusOr<std::pair<void*, std::string>> CreateInterprocessEvent(int device) override {
    absl::MutexLock lock(&log_->mu);
    const uintptr_t token = next_token_++;
    log_->calls.push_back(absl::StrCat("Create(", device, ")=", token));
    return std::make_pair(reinterpret_cast<void*>(token), Handle(absl::StrCat("ev", token)));
  }
  absl::StatusOr<void*> OpenEvent(absl::string_view ipc_handle, int device) override {
    absl::MutexLock lock(&log_->mu);
    const uintptr_t token = next_token_++;
    log_->calls.push_back(absl::StrCat("OpenEvent(", ipc_handle.data(), ", ", device, ")=", token));
    return reinterpret_cast<void*>(token);
  }
  absl::Status Record(void* event, void* stream, int device) override {
    absl::MutexLock lock(&log_->mu);
    log_->calls.push_back(absl::StrCat("Record(", reinterpret_cast<uintptr_t>(event), ", stream ",
                                       reinterpret_cast<uintptr_t>(stream), ", ", device, ")"));
    return absl::OkStatus();
  }
  absl::Status StreamWait(void* stream, void* event, int device) override {
    absl::MutexLock lock(&log_->mu);
    log_->calls.push_back(absl::StrCat("Wait(stream ", reinterpret_cast<uintptr_t>(stream), ", ",
                                       reinterpret_cast<uintptr_t>(event), ", ", device, ")"));
    return absl::OkStatus();
  }
  void Destroy(void* event, int device) override {
    absl::MutexLock lock(&log_->mu);
    log_->calls.push_back(
        absl::StrCat("Destroy(", reinterpret_cast<uintptr_t>(event), ", ", device, ")"));
  }

 private:
  std::shared_ptr<FakeGpuLog> log_;
  uintptr_t next_token_ = 1;  // guarded by log_->mu
};

}  // namespace flatshard::client::testing

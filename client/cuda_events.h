#pragma once
// Client internals: interprocess CUDA events that order the trainer's stream and the daemon's
// streams without host round trips (DESIGN "Data paths"; proto CudaEvent).
//
//   - `written`: the client creates ONE interprocess event per GPU, the first time it needs
//     it, and records it again on the trainer's stream for every request that carries it.
//   - `ready`: the daemon's events are opened once per CudaEvent.id and cached; an id that
//     comes back with another handle replaces the cached event.
// The CUDA calls go through CudaEventApi so that tests run without a GPU.
//
// Thread safety: StreamEvents is thread-safe. Its CUDA calls run outside its lock. A Client
// uses one stream, so two threads recording the same event record it in stream order.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/rpc_types.h"

namespace flatshard::client::internal {

// The domain form of proto CudaEvent (common/rpc_types.h; wire mapping in proto_convert).
using IpcEvent = ::flatshard::IpcEvent;

// The CUDA runtime calls StreamEvents makes. Events and streams are opaque here (cudaEvent_t,
// cudaStream_t). Each call makes `device` current for its duration. Thread-safe.
class CudaEventApi {
 public:
  virtual ~CudaEventApi() = default;
  // This process's ordinal of GPU `uuid`. Errors: gpu::DeviceForUuid's.
  virtual absl::StatusOr<int> DeviceForUuid(absl::string_view uuid) = 0;
  // The uuid ("GPU-...") of ordinal `device`.
  virtual absl::StatusOr<std::string> DeviceUuid(int device) = 0;
  // A new event on `device` (cudaEventDisableTiming | cudaEventInterprocess) and its
  // cudaIpcEventHandle_t bytes.
  virtual absl::StatusOr<std::pair<void*, std::string>> CreateInterprocessEvent(int device) = 0;
  // Opens another process's event (cudaIpcOpenEventHandle).
  virtual absl::StatusOr<void*> OpenEvent(absl::string_view ipc_handle, int device) = 0;
  // cudaEventRecord(event, stream).
  virtual absl::Status Record(void* event, void* stream, int device) = 0;
  // cudaStreamWaitEvent(stream, event): later work on `stream` waits for the event.
  virtual absl::Status StreamWait(void* stream, void* event, int device) = 0;
  // cudaEventDestroy (created or opened events alike); failures are logged.
  virtual void Destroy(void* event, int device) = 0;
};

// The CUDA runtime behind CudaEventApi. Builds without CUDA get one whose calls fail with
// FAILED_PRECONDITION. Creating it touches no CUDA API.
std::unique_ptr<CudaEventApi> NewCudaEventApi();

class StreamEvents {
 public:
  // `api` nullptr: NewCudaEventApi().
  explicit StreamEvents(std::unique_ptr<CudaEventApi> api = nullptr);
  StreamEvents(const StreamEvents&) = delete;
  StreamEvents& operator=(const StreamEvents&) = delete;
  // Destroys this process's events and the opened ones no caller still uses.
  ~StreamEvents();

  // Records this process's event for GPU `device` on `stream` (creating the event the first
  // time) and returns it, for a request's `written`.
  // Errors: the CUDA calls', prefixed with the device.
  absl::StatusOr<IpcEvent> RecordWritten(int device, void* stream);

  // Makes `stream` wait for the daemon's `ready` event (opened once per id, on the GPU it
  // names). OK without doing anything for id 0.
  // Errors: INTERNAL for a handle of the wrong size; DeviceForUuid's (NOT_FOUND,
  // FAILED_PRECONDITION); the CUDA calls', naming the event id and GPU.
  absl::Status WaitReady(const IpcEvent& ready, void* stream);

  // Forgets the daemon's events (a new session, perhaps a new daemon). Keeps this process's.
  void ForgetOpened();

  // Events created by this process, and daemon events opened, since construction.
  int64_t created_events() const;
  int64_t opened_events() const;

 private:
  struct OwnEvent {
    void* event = nullptr;
    IpcEvent ipc;
  };
  struct OpenedEvent {
    std::string ipc_handle;
    int device = -1;
    std::shared_ptr<void> event;  // destroys the event when the last user drops it
  };

  const std::unique_ptr<CudaEventApi> api_;  // first: outlives every event below
  mutable absl::Mutex mu_;
  absl::flat_hash_map<int, OwnEvent> own_ ABSL_GUARDED_BY(mu_);             // by device
  absl::flat_hash_map<uint64_t, OpenedEvent> opened_ ABSL_GUARDED_BY(mu_);  // by id
  int64_t created_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t opened_count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flatshard::client::internal

#pragma once
// One GPU as the daemon uses it (DESIGN.md "Data paths": CUDA IPC handles for daemon-owned
// device buffers, ordering through interprocess CUDA events, not host round-trips):
// - a DevicePool whose slabs trainers open through CUDA IPC;
// - one non-blocking stream on which the daemon's own copies run;
// - an interprocess "ready" event the daemon records after its work so that a trainer's stream
//   can wait for it (RecordReady), and the trainers' events the daemon's stream waits for
//   (WaitFor), opened once per event handle and cached (ids are unique only within each
//   trainer process, and several trainers share a daemon).
//
// Every host-side wait (Copy, Synchronize, the destructor) polls with a deadline
// (`sync_timeout`, 2 minutes by default): a stream stuck behind a trainer's event that never
// completes fails with DEADLINE_EXCEEDED instead of hanging the daemon.
//
// Builds without CUDA compile this file: Create() and PinHostMemory() then fail with
// FAILED_PRECONDITION "built without CUDA".
//
// CreateSimulated() makes a context whose "device memory" is host shared memory and whose
// copies are memcpy on a simulated asynchronous stream (flatshardd --simulate_gpus): the daemon's
// GPU code paths (placement, staging, offload, events plumbing) run and are tested on machines
// without a GPU. Trainers then open its slabs by shm name (tests/testing/simulated_gpu.h), not
// through CUDA IPC.
//
// Thread safety: DeviceContext is thread-safe. Copy() and Synchronize() wait for everything
// enqueued on the context's stream, also by other threads.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/gpu/cuda_util.h"
#include "common/rpc_types.h"
#include "server/gpu/device_pool.h"

namespace flatshard::gpu {

// An interprocess CUDA event as the proto CudaEvent carries it.
// (common/rpc_types.h IpcEvent; wire mapping in proto_convert.)
using IpcEventRef = ::flatshard::IpcEvent;

// One GPU as the daemon uses it: its pool, one non-blocking stream for the daemon's copies, an
// interprocess "ready" event, and the trainers' events it has opened (cached by id).
class DeviceContext {
 public:
  // A context on `gpu` (ordinal and uuid as ListGpus() reports them). `pool_options.device`
  // and `device_uuid` are overwritten with the GPU's.
  // Errors: ListGpus()' FAILED_PRECONDITION without CUDA/GPU; NOT_FOUND when `gpu.ordinal` is
  // not visible or its uuid differs from `gpu.uuid`; CUDA errors (stream, event, IPC handle).
  static absl::StatusOr<std::unique_ptr<DeviceContext>> Create(const GpuDevice& gpu,
                                                               DevicePoolOptions pool_options);
  // A simulated GPU `ordinal` with uuid "SIM-GPU-<ordinal>": its slabs are shm segments named
  // with `segment_prefix` (their "IPC handle" is "SIMGPU" + the shm name); copies are memcpy;
  // events are simulated interprocess events, its stream a worker thread
  // (common/gpu/simulated_stream.h) whose operations each start `stream_delay` late (a test
  // knob: work not ordered after them sees old bytes). Errors: INVALID_ARGUMENT for a bad
  // prefix; ShmSegment's for the ready event's segment.
  static absl::StatusOr<std::unique_ptr<DeviceContext>> CreateSimulated(
      int ordinal, DevicePoolOptions pool_options, const std::string& segment_prefix,
      absl::Duration stream_delay = absl::ZeroDuration());
  // Waits (up to sync_timeout) for the stream, then releases the events and the stream. The
  // pool lives on while blocks of it do.
  virtual ~DeviceContext();
  DeviceContext(const DeviceContext&) = delete;
  DeviceContext& operator=(const DeviceContext&) = delete;

  int device() const;
  const std::string& uuid() const;
  const std::shared_ptr<DevicePool>& pool() const;
  void* stream() const;  // cudaStream_t

  // How long host-side waits on the stream may take before DEADLINE_EXCEEDED.
  void set_sync_timeout(absl::Duration timeout);

  // Copies `bytes` (any direction: device<->device, host<->device; host memory pageable or
  // pinned) on this context's stream and waits until done. The copy is ordered after every
  // WaitFor() issued before it. Errors: CUDA errors naming the device; DEADLINE_EXCEEDED.
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes);
  // Enqueues the copy on the stream and returns: no host wait. Ordered after every WaitFor()
  // and copy issued before it; RecordReady() after it completes after it. An error that shows
  // only later (a failed copy, a wait that timed out) is StreamError()'s.
  // Errors: CUDA errors at enqueue naming the device. (A subclass without a CUDA stream that
  // does not override it gets its Copy(): synchronous, which orders as much.)
  virtual absl::Status CopyAsync(void* dst, const void* src, size_t bytes);
  // The stream's error, if its asynchronous work failed (sticky); OK while it runs or is idle.
  // Never waits.
  virtual absl::Status StreamError();
  // Waits until everything enqueued on the stream so far has completed.
  // Errors: DEADLINE_EXCEEDED after sync_timeout; the stream's CUDA error.
  virtual absl::Status Synchronize();
  // Records the ready event on the stream (after everything enqueued so far) and returns it.
  // The same event (same id and handle) is re-recorded each time: a trainer opens it once.
  virtual absl::StatusOr<IpcEventRef> RecordReady();
  // Makes the stream wait for the trainer's event `event` (opened once per handle and cached;
  // past 256 cached events, those of trainers long gone are dropped). No host wait.
  // Errors: INVALID_ARGUMENT for id 0 or a handle that is not kIpcHandleBytes long (or that
  // CUDA rejects); CUDA errors.
  // A completed event is skipped (it orders nothing).
  virtual absl::Status WaitFor(const IpcEventRef& event);
  // Waits on the host until the trainer's event `event` has completed (polling its status,
  // up to sync_timeout): device work issued afterwards, on any stream, is ordered after the
  // trainer's. Use this rather than WaitFor + Synchronize where the host waits anyway: a stream
  // wait on an interprocess event followed by a stream synchronize took about 200 us on an
  // H100 even for an event that had completed, a status poll a few microseconds.
  // `timeout`: at most this long (zero: one query); infinite: the context's sync_timeout.
  // Errors: as WaitFor's; DEADLINE_EXCEEDED when the event did not complete in time.
  virtual absl::Status WaitOnHost(const IpcEventRef& event,
                                  absl::Duration timeout = absl::InfiniteDuration());

 protected:
  DeviceContext(GpuDevice gpu, std::shared_ptr<DevicePool> pool);
  absl::Duration sync_timeout() const;

 private:
  struct OpenedEvent;
  // The trainer's event `event`, opened once per handle (see WaitFor).
  absl::StatusOr<std::shared_ptr<OpenedEvent>> Open(const IpcEventRef& event,
                                                    const std::string& where);

  const GpuDevice gpu_;
  const std::shared_ptr<DevicePool> pool_;
  void* stream_ = nullptr;       // cudaStream_t
  void* ready_event_ = nullptr;  // cudaEvent_t, interprocess
  IpcEventRef ready_ref_;

  mutable absl::Mutex mu_;
  absl::Duration sync_timeout_ ABSL_GUARDED_BY(mu_) = absl::Minutes(2);
  // Trainers' events by id. shared_ptr: a WaitFor in flight keeps a replaced event open.
  // By the event's handle bytes: unique per event across processes (ids are not).
  absl::flat_hash_map<std::string, std::shared_ptr<OpenedEvent>> opened_ ABSL_GUARDED_BY(mu_);
};

// Page-locks host memory (cudaHostRegister, portable) so copies to/from it are DMA; and undoes it.
// Errors: INVALID_ARGUMENT for a null pointer or 0 bytes; FAILED_PRECONDITION without CUDA;
// CUDA errors (RESOURCE_EXHAUSTED when the pages cannot be locked).
absl::Status PinHostMemory(void* ptr, size_t bytes);
// Errors are logged (e.g. `ptr` was not pinned).
void UnpinHostMemory(void* ptr);

namespace internal {
// Waits until `stream` (a cudaStream_t) has drained, polling: spins briefly, then sleeps with
// backoff. DEADLINE_EXCEEDED "<what>: not done within <timeout>"; the stream's CUDA error.
absl::Status WaitForStream(void* stream, absl::Duration timeout, absl::string_view what);
}  // namespace internal

}  // namespace flatshard::gpu

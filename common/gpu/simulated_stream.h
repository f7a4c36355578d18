#pragma once
// Simulated CUDA streams and interprocess events (flatshardd --simulate_gpus and the trainer
// side in tests/testing/simulated_gpu.h), asynchronous like CUDA's so that an ordering bug (a
// missing stream wait, an answer before the copy ran) shows as wrong values:
// - SimulatedStream: a worker thread runs the enqueued operations (copies, waits on events,
//   event records) in order. set_delay() (a test knob) makes each operation start that much
//   later, so work not ordered after it reads the old bytes.
// - SimulatedEvent: an event in a small shared memory segment that another process opens by
//   its handle ("SIMEVENT" + the segment's name, zero-padded to kIpcHandleBytes). As a CUDA
//   event, it is recorded on one stream and re-recorded for each use; a wait (on a stream or
//   on the host) waits for the latest record made before the wait was issued.
// A stream operation that fails (a wait past its timeout, a failed event) makes the stream's
// error sticky: later operations are skipped, and the events it records are marked failed so
// that their waiters (any process) fail instead of hanging.
//
// Thread-safe.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/shm_segment.h"

namespace flatshard::gpu {

class SimulatedEvent {
 public:
  // A new event in segment MakeSegmentName(`segment_prefix`), unlinked when the last holder in
  // this process drops it. Errors: ShmSegment::Create's.
  static absl::StatusOr<std::shared_ptr<SimulatedEvent>> Create(absl::string_view segment_prefix);
  // Another process's event by its handle. Errors: INVALID_ARGUMENT for a handle that is not a
  // simulated event's; NOT_FOUND when its segment is gone.
  static absl::StatusOr<std::shared_ptr<SimulatedEvent>> Open(absl::string_view ipc_handle);
  static bool IsHandle(absl::string_view ipc_handle);

  // kIpcHandleBytes bytes.
  const std::string& handle() const { return handle_; }
  // The latest record's number (0: never recorded, which counts as completed).
  uint64_t recorded() const;
  // Whether record `target` completed. Errors: INTERNAL when the recording stream failed.
  absl::StatusOr<bool> Query(uint64_t target) const;
  // Polls Query(target) on this thread until it completes (DEADLINE_EXCEEDED after `timeout`,
  // naming `what`).
  absl::Status WaitOnHost(uint64_t target, absl::Duration timeout, absl::string_view what) const;

  // Host-side record of work that is already done (a "stream" that is the host).
  void RecordCompleted();

 private:
  friend class SimulatedStream;
  struct Shared;  // in the segment
  SimulatedEvent(ShmSegment segment, std::string handle);
  Shared* shared() const;

  ShmSegment segment_;
  const std::string handle_;
};

class SimulatedStream {
 public:
  // `what` names the stream in errors ("simulated GPU 0: stream").
  explicit SimulatedStream(std::string what);
  // Finishes what was enqueued (a wait still waiting fails at once: the stream is dead) and
  // joins the worker.
  ~SimulatedStream();
  SimulatedStream(const SimulatedStream&) = delete;
  SimulatedStream& operator=(const SimulatedStream&) = delete;

  // Test knob: each operation starts `delay` after the worker reached it (at once once the
  // stream is being destroyed).
  void set_delay(absl::Duration delay);
  // How long a stream wait on an event may take before the stream fails (2 minutes).
  void set_wait_timeout(absl::Duration timeout);

  // memmove(dst, src, bytes) once everything enqueued before has run.
  void EnqueueCopy(void* dst, const void* src, size_t bytes);
  // Later operations wait until `event`'s latest record (as of now) completed.
  void EnqueueWait(std::shared_ptr<const SimulatedEvent> event);
  // Records `event` here: it completes once everything enqueued before it has run.
  void EnqueueRecord(std::shared_ptr<SimulatedEvent> event);

  // Waits until everything enqueued so far has run, then returns the sticky error.
  // DEADLINE_EXCEEDED after `timeout`.
  absl::Status Synchronize(absl::Duration timeout);
  // The sticky error (OK while no operation failed); never waits.
  absl::Status error() const;

 private:
  // `op(failed)`: `failed` when an earlier operation failed (the stream is dead).
  void Enqueue(absl::AnyInvocable<absl::Status(bool)> op);
  void Loop();

  const std::string what_;
  mutable absl::Mutex mu_;
  std::deque<absl::AnyInvocable<absl::Status(bool)>> ops_ ABSL_GUARDED_BY(mu_);
  uint64_t enqueued_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  absl::Duration delay_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  absl::Duration wait_timeout_ ABSL_GUARDED_BY(mu_) = absl::Minutes(2);
  std::atomic<bool> stopping_{false};
  std::thread worker_;
};

}  // namespace flatshard::gpu

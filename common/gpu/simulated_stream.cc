#include "common/gpu/simulated_stream.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/gpu/cuda_util.h"
#include "common/status_macros.h"

namespace flatshard::gpu {
namespace {
constexpr absl::string_view kHandlePrefix = "SIMEVENT";
constexpr uint64_t kMagic = 0x5349'4d45'5645'4e54;  // "SIMEVENT"
}  // namespace

// Lock-free 64-bit atomics work across processes that map the same page.
struct SimulatedEvent::Shared {
  std::atomic<uint64_t> magic;
  std::atomic<uint64_t> recorded;   // the latest record's number
  std::atomic<uint64_t> completed;  // the latest completed record's number
  std::atomic<uint64_t> failed;     // a record's stream failed
};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

SimulatedEvent::SimulatedEvent(ShmSegment segment, std::string handle)
    : segment_(std::move(segment)), handle_(std::move(handle)) {}

SimulatedEvent::Shared* SimulatedEvent::shared() const {
  return static_cast<Shared*>(segment_.data());
}

bool SimulatedEvent::IsHandle(absl::string_view ipc_handle) {
  return ipc_handle.size() == kIpcHandleBytes && absl::StartsWith(ipc_handle, kHandlePrefix);
}

absl::StatusOr<std::shared_ptr<SimulatedEvent>> SimulatedEvent::Create(
    absl::string_view segment_prefix) {
  FS_ASSIGN_OR_RETURN(ShmSegment segment,
                      ShmSegment::Create(MakeSegmentName(segment_prefix), sizeof(Shared)));
  std::string handle = absl::StrCat(kHandlePrefix, segment.name());
  if (handle.size() >= kIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("simulated event: segment name ", segment.name(), " is too long"));
  }
  handle.resize(kIpcHandleBytes, '\0');
  // Readable by every uid (a daemon and its trainers may differ): an event carries no data,
  // and its waiters only read it.
  ::chmod(absl::StrCat("/dev/shm", segment.name()).c_str(), 0644);
  Shared* s = new (segment.data()) Shared{};
  s->magic.store(kMagic);
  return std::shared_ptr<SimulatedEvent>(new SimulatedEvent(std::move(segment), std::move(handle)));
}

absl::StatusOr<std::shared_ptr<SimulatedEvent>> SimulatedEvent::Open(absl::string_view ipc_handle) {
  if (!IsHandle(ipc_handle)) {
    return absl::InvalidArgumentError(absl::StrCat("not a simulated event handle (",
                                                   ipc_handle.size(), " bytes, want ",
                                                   kIpcHandleBytes, " starting with SIMEVENT)"));
  }
  std::string name(ipc_handle.substr(kHandlePrefix.size()));
  name.resize(std::strlen(name.c_str()));
  FS_ASSIGN_OR_RETURN(ShmSegment segment,
                      ShmSegment::Open(name, sizeof(Shared), /*writable=*/false));
  auto event = std::shared_ptr<SimulatedEvent>(
      new SimulatedEvent(std::move(segment), std::string(ipc_handle)));
  if (event->shared()->magic.load() != kMagic) {
    return absl::InvalidArgumentError(absl::StrCat("simulated event ", name, ": not an event"));
  }
  return event;
}

uint64_t SimulatedEvent::recorded() const { return shared()->recorded.load(); }

absl::StatusOr<bool> SimulatedEvent::Query(uint64_t target) const {
  if (shared()->completed.load() >= target) return true;
  if (shared()->failed.load() != 0) {
    return absl::InternalError(
        absl::StrCat("simulated event ", segment_.name(), ": its stream failed"));
  }
  return false;
}

absl::Status SimulatedEvent::WaitOnHost(uint64_t target, absl::Duration timeout,
                                        absl::string_view what) const {
  return PollUntilDone([&] { return Query(target); }, timeout, what);
}

void SimulatedEvent::RecordCompleted() {
  const uint64_t n = shared()->recorded.fetch_add(1) + 1;
  shared()->completed.store(n);
}

SimulatedStream::SimulatedStream(std::string what)
    : what_(std::move(what)), worker_([this] { Loop(); }) {}

SimulatedStream::~SimulatedStream() {
  stopping_.store(true);
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  worker_.join();
}

void SimulatedStream::set_delay(absl::Duration delay) {
  absl::MutexLock lock(&mu_);
  delay_ = delay;
}

void SimulatedStream::set_wait_timeout(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  wait_timeout_ = timeout;
}

void SimulatedStream::Enqueue(absl::AnyInvocable<absl::Status(bool)> op) {
  absl::MutexLock lock(&mu_);
  ops_.push_back(std::move(op));
  ++enqueued_;
}

void SimulatedStream::EnqueueCopy(void* dst, const void* src, size_t bytes) {
  Enqueue([dst, src, bytes](bool failed) {
    if (!failed && bytes > 0) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  });
}

void SimulatedStream::EnqueueWait(std::shared_ptr<const SimulatedEvent> event) {
  const uint64_t target = event->recorded();  // CUDA: the record as of the wait's issue
  Enqueue([this, event = std::move(event), target](bool failed) {
    if (failed) return absl::OkStatus();
    absl::Duration timeout;
    {
      absl::MutexLock lock(&mu_);
      timeout = wait_timeout_;
    }
    // Polled here rather than with PollUntilDone so that destroying the stream ends the wait.
    const absl::Time deadline = absl::Now() + timeout;
    absl::Duration nap = absl::Microseconds(20);
    for (;;) {
      FS_ASSIGN_OR_RETURN(bool done, event->Query(target));
      if (done) return absl::OkStatus();
      if (stopping_.load()) {
        return absl::CancelledError(absl::StrCat(what_, ": destroyed while waiting for an event"));
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(what_, ": the event waited for did not complete within ",
                         absl::FormatDuration(timeout)));
      }
      absl::SleepFor(nap);
      nap = std::min(nap * 2, absl::Milliseconds(1));
    }
  });
}

void SimulatedStream::EnqueueRecord(std::shared_ptr<SimulatedEvent> event) {
  const uint64_t n = event->shared()->recorded.fetch_add(1) + 1;
  Enqueue([event = std::move(event), n](bool failed) {
    // A failed stream never completes the record: its waiters fail instead of hanging.
    if (failed) {
      event->shared()->failed.store(1);
    } else {
      event->shared()->completed.store(n);
    }
    return absl::OkStatus();
  });
}

absl::Status SimulatedStream::Synchronize(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const uint64_t target = enqueued_;
  auto done = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ >= target; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat(what_, ": not done within ",
                                                    absl::FormatDuration(timeout),
                                                    " (it may wait for an event never recorded)"));
  }
  return error_;
}

absl::Status SimulatedStream::error() const {
  absl::MutexLock lock(&mu_);
  return error_;
}

void SimulatedStream::Loop() {
  for (;;) {
    absl::AnyInvocable<absl::Status(bool)> op;
    absl::Duration delay;
    bool failed = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !ops_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (ops_.empty()) return;  // stopped and drained
      op = std::move(ops_.front());
      ops_.pop_front();
      delay = delay_;
      failed = !error_.ok();
    }
    // The test knob, not ordering (cut short when the stream is destroyed). A failed stream
    // runs nothing more but its records.
    if (!failed && delay > absl::ZeroDuration()) {
      absl::MutexLock lock(&mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), delay);
    }
    absl::Status s = op(failed);
    absl::MutexLock lock(&mu_);
    if (!s.ok() && error_.ok()) error_ = s;
    ++done_;
  }
}

}  // namespace flatshard::gpu

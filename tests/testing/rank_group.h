#pragma once
// Test helpers for collectives: RunRanks runs one function per rank on its own thread (ranks
// of one daemon, as the inproc backend sees them); DoneRecorder captures a DoneCallback's
// status, counts how often it ran and lets the test wait for it.
// Thread safety: both are safe to use from the rank threads and the test thread.

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace flatshard::testing {

// Calls fn(rank) for rank in [0, world_size), each on its own thread; returns when all return.
inline void RunRanks(int world_size, const std::function<void(int rank)>& fn) {
  std::vector<std::thread> threads;
  threads.reserve(world_size);
  for (int r = 0; r < world_size; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (std::thread& t : threads) t.join();
}

// Records the outcome of one async op. Must outlive the callbacks it hands out.
class DoneRecorder {
 public:
  DoneRecorder() = default;
  DoneRecorder(const DoneRecorder&) = delete;
  DoneRecorder& operator=(const DoneRecorder&) = delete;

  // A callback that records its status (and the number of calls) here.
  absl::AnyInvocable<void(absl::Status)> Callback() {
    return [this](absl::Status s) {
      absl::MutexLock lock(&mu_);
      if (calls_ == 0) status_ = std::move(s);
      ++calls_;
    };
  }

  // Waits for the first call; DEADLINE_EXCEEDED "test: callback never ran" after `timeout`.
  absl::Status Wait(absl::Duration timeout = absl::Seconds(20)) {
    absl::MutexLock lock(&mu_);
    auto called = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return calls_ > 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&called), timeout)) {
      return absl::DeadlineExceededError("test: callback never ran");
    }
    return status_;
  }

  bool done() const {
    absl::MutexLock lock(&mu_);
    return calls_ > 0;
  }
  int calls() const {
    absl::MutexLock lock(&mu_);
    return calls_;
  }
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  mutable absl::Mutex mu_;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::testing

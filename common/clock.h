#pragma once
// Time as the daemon's state machines read it. Production code uses Clock::Real(); unit tests
// pass a FakeClock and move it by hand, so lease, idle and deferred-failure timeouts can be
// tested in milliseconds. Waits that block a thread (condition timeouts, CUDA, sockets) still
// run in real time; only the decisions "has this deadline passed" read the clock.

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace flatshard {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
  // absl::Now(); never destroyed.
  static Clock* Real();
};

// A clock that moves only when told to. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'000'000'000)) : now_(start) {}
  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

inline Clock* Clock::Real() {
  class RealClock final : public Clock {
   public:
    absl::Time Now() const override { return absl::Now(); }
  };
  static RealClock* const real = new RealClock;
  return real;
}

}  // namespace flatshard

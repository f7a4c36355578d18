#pragma once
// A single thread that runs callbacks at absolute times: the deadline watchdog behind
// Communicators and the CollectiveEngine.
//
// Thread safety: all methods are thread-safe. Callbacks run on the timer's thread, one at a
// time, never under the timer's lock, so they may Schedule or Cancel. A slow callback delays
// the ones after it; keep them short (they fail ops and post work).
//
// Lifetime: the destructor drops callbacks that have not run and joins the thread. It may run
// on the timer thread itself (when a callback drops the last owner); the thread then exits on
// its own after the callback returns.

#include <cstdint>
#include <memory>

#include "absl/functional/any_invocable.h"
#include "absl/time/time.h"

namespace flatshard::collective {

class DeadlineTimer {
 public:
  using TimerId = uint64_t;
  // Never a valid id; Cancel(kNoTimer) is a no-op.
  static constexpr TimerId kNoTimer = 0;

  DeadlineTimer();
  ~DeadlineTimer();
  DeadlineTimer(const DeadlineTimer&) = delete;
  DeadlineTimer& operator=(const DeadlineTimer&) = delete;

  // Runs `fn` once on the timer thread at or soon after `when` (at once if it has passed).
  // Returns kNoTimer, and drops `fn`, when `when` is InfiniteFuture.
  TimerId Schedule(absl::Time when, absl::AnyInvocable<void()> fn);

  // Drops a callback that has not started; returns whether it did. A callback that is running
  // or has run is not waited for.
  bool Cancel(TimerId id);

  // Callbacks scheduled and not yet run or cancelled (for tests).
  size_t pending() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace flatshard::collective

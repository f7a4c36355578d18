#pragma once
// AsyncCall<T>: the outcome of one asynchronous call whose callback takes a T (GroupManager's
// callbacks, a DoneCallback). Callback() hands out the callback; Wait() returns the value,
// failing the test (and returning DEADLINE_EXCEEDED) when none came within a real-time bound.
// The callback shares the state, so a late callback (after a failed expectation, or after the
// AsyncCall went away) never touches freed memory; calls() counts how often it ran: exactly
// once is the contract under test. Thread-safe.

#include <memory>
#include <optional>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace flatshard::testing {

template <typename T>
class AsyncCall {
 public:
  AsyncCall() : state_(std::make_shared<State>()) {}

  absl::AnyInvocable<void(T)> Callback() {
    return [state = state_](T v) {
      {
        absl::MutexLock lock(&state->mu);
        if (++state->calls == 1) state->value.emplace(std::move(v));
      }
      state->done.Notify();
    };
  }
  // The value, waiting at most `wait` of real time for it.
  T& Wait(absl::Duration wait = absl::Seconds(20)) {
    if (!state_->done.WaitForNotificationWithTimeout(wait)) {
      ADD_FAILURE() << "no answer within " << wait;
      absl::MutexLock lock(&state_->mu);
      if (!state_->value) state_->value.emplace(absl::DeadlineExceededError("test: no answer"));
    }
    absl::MutexLock lock(&state_->mu);
    return *state_->value;
  }
  bool Done() const { return state_->done.HasBeenNotified(); }
  int calls() const {
    absl::MutexLock lock(&state_->mu);
    return state_->calls;
  }

 private:
  struct State {
    mutable absl::Mutex mu;
    int calls = 0;
    std::optional<T> value;
    absl::Notification done;
  };
  std::shared_ptr<State> state_;
};

}  // namespace flatshard::testing

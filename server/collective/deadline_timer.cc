#include "server/collective/deadline_timer.h"

#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::collective {

// Shared between the owner and the thread, so a destructor running on the thread itself
// (from a callback) can hand the state over instead of joining itself.
struct DeadlineTimer::State {
  mutable absl::Mutex mu;
  absl::CondVar cv;
  bool stop ABSL_GUARDED_BY(mu) = false;
  TimerId next_id ABSL_GUARDED_BY(mu) = 1;
  std::map<std::pair<absl::Time, TimerId>, absl::AnyInvocable<void()>> queue ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<TimerId, absl::Time> when_by_id ABSL_GUARDED_BY(mu);
  std::thread thread;

  void Loop() {
    absl::MutexLock lock(&mu);
    while (!stop) {
      if (queue.empty()) {
        cv.Wait(&mu);
        continue;
      }
      auto it = queue.begin();
      if (it->first.first > absl::Now()) {
        cv.WaitWithDeadline(&mu, it->first.first);
        continue;
      }
      absl::AnyInvocable<void()> fn = std::move(it->second);
      when_by_id.erase(it->first.second);
      queue.erase(it);
      mu.Unlock();
      fn();
      fn = nullptr;  // destroy captures outside the lock too
      mu.Lock();
    }
  }
};

DeadlineTimer::DeadlineTimer() : state_(std::make_shared<State>()) {
  // The thread keeps the state alive for as long as it runs.
  state_->thread = std::thread([s = state_] { s->Loop(); });
}

DeadlineTimer::~DeadlineTimer() {
  decltype(state_->queue) dropped;
  {
    absl::MutexLock lock(&state_->mu);
    state_->stop = true;
    dropped.swap(state_->queue);
    state_->when_by_id.clear();
    state_->cv.Signal();
  }
  dropped.clear();
  if (state_->thread.get_id() == std::this_thread::get_id()) {
    state_->thread.detach();
  } else {
    state_->thread.join();
  }
}

DeadlineTimer::TimerId DeadlineTimer::Schedule(absl::Time when, absl::AnyInvocable<void()> fn) {
  if (when == absl::InfiniteFuture()) return kNoTimer;
  absl::MutexLock lock(&state_->mu);
  TimerId id = state_->next_id++;
  const bool earliest = state_->queue.empty() || when < state_->queue.begin()->first.first;
  state_->queue.emplace(std::make_pair(when, id), std::move(fn));
  state_->when_by_id.emplace(id, when);
  if (earliest) state_->cv.Signal();
  return id;
}

bool DeadlineTimer::Cancel(TimerId id) {
  if (id == kNoTimer) return false;
  absl::AnyInvocable<void()> fn;  // destroyed after the lock is released
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->when_by_id.find(id);
    if (it == state_->when_by_id.end()) return false;
    auto q = state_->queue.find(std::make_pair(it->second, id));
    fn = std::move(q->second);
    state_->queue.erase(q);
    state_->when_by_id.erase(it);
  }
  return true;
}

size_t DeadlineTimer::pending() const {
  absl::MutexLock lock(&state_->mu);
  return state_->queue.size();
}

}  // namespace flatshard::collective

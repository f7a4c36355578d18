#pragma once
// AfterUnlock: the one way out of a lock. Code that holds a mutex collects here what must not
// happen under it: callbacks (they may re-enter the owner or answer an RPC), objects whose
// destruction is slow or re-entrant (a Buffer's last reference unmaps and unlinks its segment,
// unpins or frees device memory; a communicator's teardown may wait for its backend), record
// writes. The holder releases the lock, then calls Run() (or lets the AfterUnlock go out of
// scope after the lock's scope ends).
//
//   AfterUnlock after;
//   {
//     absl::MutexLock lock(&mu_);
//     after.Call([done = std::move(done)]() mutable { done(absl::OkStatus()); });
//     after.Destroy(std::move(buffers_to_free));
//   }
//   after.Run();  // or implicitly at the end of the scope
//
// Calls run in the order they were queued, then the objects are destroyed. A call may queue
// more (they run in the same Run). Not thread-safe: one owner at a time, like the lock scope
// that fills it.

#include <memory>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"

namespace flatshard {

class AfterUnlock {
 public:
  AfterUnlock() = default;
  AfterUnlock(const AfterUnlock&) = delete;
  AfterUnlock& operator=(const AfterUnlock&) = delete;
  AfterUnlock(AfterUnlock&&) = default;
  AfterUnlock& operator=(AfterUnlock&&) = default;
  // Runs what is still queued: declare it before the lock's scope so the lock is gone by then.
  ~AfterUnlock() { Run(); }

  // Queues `f`.
  void Call(absl::AnyInvocable<void()> f) { calls_.push_back(std::move(f)); }
  // Keeps `object` (a shared_ptr, a unique_ptr, a container of them, a map node) alive until
  // Run, which destroys it after the calls.
  template <typename T>
  void Destroy(T object) {
    doomed_.push_back([held = std::move(object)]() mutable { T gone = std::move(held); });
  }
  // Drops `ref` now when another reference remains (no destructor runs: cheap under a lock),
  // else keeps the last one until Run. A reference dropped concurrently elsewhere at the same
  // moment may still make this one the last: then it goes now, which is only slower.
  template <typename T>
  void Release(std::shared_ptr<T>& ref) {
    if (ref == nullptr) return;
    if (ref.use_count() > 1) {
      ref.reset();
    } else {
      Destroy(std::move(ref));
    }
  }
  // Moves everything `other` collected to the end of this one.
  void Append(AfterUnlock&& other) {
    for (auto& f : other.calls_) calls_.push_back(std::move(f));
    for (auto& f : other.doomed_) doomed_.push_back(std::move(f));
    other.calls_.clear();
    other.doomed_.clear();
  }

  bool empty() const { return calls_.empty() && doomed_.empty(); }

  // Runs every queued call in order, then destroys the kept objects; repeats while calls
  // queued more. REQUIRES: no lock the calls may take is held.
  void Run() {
    while (!empty()) {
      std::vector<absl::AnyInvocable<void()>> calls = std::exchange(calls_, {});
      for (auto& f : calls) f();
      calls.clear();  // what the calls captured goes here too, still outside any lock
      std::vector<absl::AnyInvocable<void()>> doomed = std::exchange(doomed_, {});
      for (auto& f : doomed) f();
    }
  }

 private:
  std::vector<absl::AnyInvocable<void()>> calls_;
  std::vector<absl::AnyInvocable<void()>> doomed_;
};

}  // namespace flatshard

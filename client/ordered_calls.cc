#include "client/ordered_calls.h"

#include <utility>

namespace flatshard::client::internal {

OrderedCalls::~OrderedCalls() { Stop(); }

void OrderedCalls::Submit(std::function<void()> job) {
  State& s = *state_;
  {
    absl::MutexLock lock(&s.mu);
    if (!s.stopping) {
      ++s.submitted;
      s.queue.push_back(std::move(job));
      if (!s.thread.joinable()) {
        s.thread = std::thread(&OrderedCalls::Run, state_);
        s.thread_id = s.thread.get_id();
      }
      return;
    }
  }
  job();
}

void OrderedCalls::Drain() const {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  if (std::this_thread::get_id() == s.thread_id) return;
  const uint64_t target = s.submitted;
  auto done = [&s, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) { return s.finished >= target; };
  s.mu.Await(absl::Condition(&done));
}

void OrderedCalls::Stop() {
  State& s = *state_;
  std::thread thread;
  {
    absl::MutexLock lock(&s.mu);
    s.stopping = true;
    thread = std::move(s.thread);
  }
  if (!thread.joinable()) return;
  if (thread.get_id() == std::this_thread::get_id()) {
    thread.detach();  // Run() holds the state, finishes the queue and returns
  } else {
    thread.join();
  }
}

int64_t OrderedCalls::pending() const {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  return static_cast<int64_t>(s.submitted - s.finished);
}

void OrderedCalls::Run(std::shared_ptr<State> state) {
  State& s = *state;
  for (;;) {
    std::function<void()> job;
    {
      absl::MutexLock lock(&s.mu);
      auto ready = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
        return !s.queue.empty() || s.stopping;
      };
      s.mu.Await(absl::Condition(&ready));
      if (s.queue.empty()) return;
      job = std::move(s.queue.front());
      s.queue.pop_front();
    }
    job();
    job = nullptr;  // what the job holds goes before it counts as finished
    absl::MutexLock lock(&s.mu);
    ++s.finished;
  }
}

}  // namespace flatshard::client::internal

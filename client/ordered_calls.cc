#include "client/ordered_calls.h"

#include <utility>

namespace flatshard::client::internal {

OrderedCalls::~OrderedCalls() { Stop(); }

void OrderedCalls::Submit(std::function<void()> job, std::string key) {
  State& s = *state_;
  {
    absl::MutexLock lock(&s.mu);
    if (!s.stopping) {
      ++s.submitted;
      if (!key.empty()) s.last_of_key[key] = s.submitted;
      s.queue.emplace_back(std::move(job), std::move(key));
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
  AwaitFinished(s, s.submitted);
}

void OrderedCalls::DrainKey(const std::string& key) const {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  const auto it = s.last_of_key.find(key);
  if (it != s.last_of_key.end()) AwaitFinished(s, it->second);
}

void OrderedCalls::AwaitFinished(State& s, uint64_t target) {
  if (std::this_thread::get_id() == s.thread_id) return;
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
    std::string key;
    {
      absl::MutexLock lock(&s.mu);
      auto ready = [&s]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
        return !s.queue.empty() || s.stopping;
      };
      s.mu.Await(absl::Condition(&ready));
      if (s.queue.empty()) return;
      job = std::move(s.queue.front().first);
      key = std::move(s.queue.front().second);
      s.queue.pop_front();
    }
    job();
    job = nullptr;  // what the job holds goes before it counts as finished
    absl::MutexLock lock(&s.mu);
    ++s.finished;
    if (!key.empty()) {
      const auto it = s.last_of_key.find(key);
      if (it != s.last_of_key.end() && it->second <= s.finished) s.last_of_key.erase(it);
    }
  }
}

}  // namespace flatshard::client::internal

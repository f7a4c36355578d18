#pragma once
// Test helpers for collectives: RunRanks runs one function per rank on its own thread (ranks
// of one daemon, as the inproc backend sees them); DoneRecorder captures a DoneCallback's
// status, counts how often it ran and lets the test wait for it; SpawnSelf starts this test
// binary again as a separate process running one test (a rank that must die: gRPC must not be
// used across fork).
// Thread safety: RunRanks and DoneRecorder are safe to use from the rank threads and the test
// thread; SpawnSelf from any thread.

#include <unistd.h>

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

// Starts "/proc/self/exe --gtest_filter=<test>" with `env` ("NAME=value") added to this
// process's environment; returns the child's pid (-1 if fork failed). Everything is built
// before fork(): the child only calls async-signal-safe functions. The caller reaps it.
inline pid_t SpawnSelf(const std::string& test, const std::vector<std::string>& env) {
  std::vector<std::string> args = {"/proc/self/exe", "--gtest_filter=" + test};
  std::vector<std::string> vars = env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) vars.emplace_back(*e);
  std::vector<char*> argv, envp;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (std::string& v : vars) envp.push_back(v.data());
  envp.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  return pid;
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

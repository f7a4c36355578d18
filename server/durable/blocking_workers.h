#pragma once
// BlockingWorkers: a few threads for the daemon core's blocking work that must not run on a
// gRPC reactor or a collective's completion thread: fsync'd record writes and the copies into
// the committed copies they bracket (Records::RunDurable).
//
// Jobs run in the order posted per thread, any job on any idle thread; a job may post more.
// Thread-safe. The destructor runs every job still queued, then joins the threads.

#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::server {

class BlockingWorkers {
 public:
  explicit BlockingWorkers(int threads);
  ~BlockingWorkers();
  BlockingWorkers(const BlockingWorkers&) = delete;
  BlockingWorkers& operator=(const BlockingWorkers&) = delete;

  // Queues `job`; after the destructor began, runs it on the caller's thread instead.
  void Post(absl::AnyInvocable<void()> job) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<absl::AnyInvocable<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace flatshard::server

#pragma once
// BlockingWorkers: a few threads for the daemon core's blocking work that must not run on a
// gRPC reactor or a collective's completion thread: fsync'd record writes and the copies into
// the committed copies they bracket (Records::RunDurable).
//
// Jobs carry a strand: jobs of one strand run one at a time, in the order posted (the jobs of
// one group: its local ranks' commit copies and records, as when they ran on the one thread
// that completed their collective); jobs of different strands run in parallel on any idle
// thread. A job may post more. Thread-safe. The destructor runs every job still queued, then
// joins the threads.

#include <deque>
#include <set>
#include <string>
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

  // Queues `job` on `strand`; after the destructor began, runs it on the caller's thread
  // instead.
  void Post(const std::string& strand, absl::AnyInvocable<void()> job) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Job {
    std::string strand;
    absl::AnyInvocable<void()> run;
  };
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  // A queued job whose strand is not running (the first such), or stopping with none queued.
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::deque<Job>::iterator NextRunnable() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Job> jobs_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> running_ ABSL_GUARDED_BY(mu_);  // strands with a job on a thread
  std::vector<std::thread> threads_;
};

}  // namespace flatshard::server

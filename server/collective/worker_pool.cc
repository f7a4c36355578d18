#include "server/collective/worker_pool.h"

#include <algorithm>
#include <atomic>
#include <utility>

namespace flatshard::collective {

struct WorkerPool::Job {
  explicit Job(size_t n, absl::FunctionRef<void(size_t)> fn) : n(n), fn(fn) {}
  const size_t n;
  // Valid while the caller waits in ParallelFor, which is as long as any piece is unfinished;
  // a helper touches it only after claiming a piece.
  absl::FunctionRef<void(size_t)> fn;
  std::atomic<size_t> next{0};
  absl::Mutex mu;
  size_t finished ABSL_GUARDED_BY(mu) = 0;

  // Runs pieces until none is left to claim.
  void Work() {
    size_t done = 0;
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      fn(i);
      ++done;
    }
    if (done > 0) {
      absl::MutexLock lock(&mu);
      finished += done;
    }
  }
};

WorkerPool::WorkerPool(int num_helpers) {
  for (int i = 0; i < num_helpers; ++i) threads_.emplace_back([this] { HelperLoop(); });
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void WorkerPool::HelperLoop() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkerPool* p)
               ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) { return p->stop_ || !p->queue_.empty(); },
          this));
      if (stop_) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job->Work();
  }
}

void WorkerPool::ParallelFor(size_t n, absl::FunctionRef<void(size_t)> fn) {
  if (n == 0) return;
  if (n == 1 || threads_.empty()) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>(n, fn);
  {
    absl::MutexLock lock(&mu_);
    const size_t helpers = std::min(threads_.size(), n - 1);
    for (size_t i = 0; i < helpers; ++i) queue_.push_back(job);
  }
  job->Work();
  absl::MutexLock lock(&job->mu);
  job->mu.Await(absl::Condition(
      +[](Job* j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(j->mu) { return j->finished == j->n; }, job.get()));
}

}  // namespace flatshard::collective

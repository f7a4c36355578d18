#include "server/durable/blocking_workers.h"

#include <utility>

namespace flatshard::server {

BlockingWorkers::BlockingWorkers(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

BlockingWorkers::~BlockingWorkers() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void BlockingWorkers::Post(absl::AnyInvocable<void()> job) {
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      jobs_.push_back(std::move(job));
      return;
    }
  }
  job();
}

bool BlockingWorkers::Ready() const { return stop_ || !jobs_.empty(); }

void BlockingWorkers::Loop() {
  for (;;) {
    absl::AnyInvocable<void()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &BlockingWorkers::Ready));
      if (jobs_.empty()) return;  // stopping, and nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace flatshard::server

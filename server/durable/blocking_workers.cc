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

void BlockingWorkers::Post(const std::string& strand, absl::AnyInvocable<void()> job) {
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      jobs_.push_back(Job{strand, std::move(job)});
      return;
    }
  }
  job();
}

std::deque<BlockingWorkers::Job>::iterator BlockingWorkers::NextRunnable() {
  for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
    if (!running_.contains(it->strand)) return it;
  }
  return jobs_.end();
}

bool BlockingWorkers::Ready() const {
  if (stop_ && jobs_.empty()) return true;
  for (const Job& j : jobs_) {
    if (!running_.contains(j.strand)) return true;
  }
  return false;
}

void BlockingWorkers::Loop() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &BlockingWorkers::Ready));
      auto it = NextRunnable();
      if (it == jobs_.end()) return;  // stopping, and nothing left
      job = std::move(*it);
      jobs_.erase(it);
      running_.insert(job.strand);
    }
    job.run();
    absl::MutexLock lock(&mu_);
    running_.erase(job.strand);
  }
}

}  // namespace flatshard::server

#include "client/started_calls.h"

#include <utility>

namespace flatshard::client {

// --- PendingSummon --------------------------------------------------------------------------

PendingSummon::PendingSummon(std::shared_ptr<internal::SummonJob> job) : job_(std::move(job)) {}

PendingSummon::~PendingSummon() {
  if (waited_) return;
  // A summon never taken is ended by its SummonedParams' destructor, as the job drops it.
  absl::MutexLock lock(&job_->mu);
  job_->mu.Await(absl::Condition(&job_->done));
}

absl::StatusOr<std::unique_ptr<SummonedParams>> PendingSummon::Wait() {
  if (waited_) return absl::FailedPreconditionError("PendingSummon::Wait: called twice");
  waited_ = true;
  absl::MutexLock lock(&job_->mu);
  job_->mu.Await(absl::Condition(&job_->done));
  return std::move(job_->result);
}

bool PendingSummon::ready() const {
  absl::MutexLock lock(&job_->mu);
  return job_->done;
}

// --- FinishingReduceScatter -----------------------------------------------------------------

FinishingReduceScatter::FinishingReduceScatter(std::shared_ptr<internal::FinishJob> job,
                                               int32_t unit)
    : job_(std::move(job)), unit_(unit) {}

FinishingReduceScatter::~FinishingReduceScatter() { Wait().IgnoreError(); }

absl::Status FinishingReduceScatter::Wait() {
  absl::MutexLock lock(&job_->mu);
  job_->mu.Await(absl::Condition(&job_->done));
  return job_->status;
}

bool FinishingReduceScatter::ready() const {
  absl::MutexLock lock(&job_->mu);
  return job_->done;
}

}  // namespace flatshard::client

#include "server/module/pending_committed.h"

#include <algorithm>
#include <utility>

namespace flatshard::server {

PendingCopy::PendingCopy(std::vector<ParallelCopier::Copy> copies,
                         std::vector<std::shared_ptr<Buffer>> hold)
    : copies_(std::move(copies)), hold_(std::move(hold)) {}

void PendingCopy::Finish() {
  {
    absl::MutexLock lock(&mu_);
    if (started_) {
      mu_.Await(absl::Condition(&done_));
      return;
    }
    started_ = true;
  }
  ParallelCopier::Shared().Run(copies_);
  std::vector<std::shared_ptr<Buffer>> release;
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    release = std::move(hold_);
  }
  // A last reference (the kept set dropped a summon buffer meanwhile) unmaps here, unlocked.
}

bool PendingCopy::done() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

std::vector<std::shared_ptr<PendingCopy>> PendingCommitted::Of(int32_t rank) const {
  std::vector<std::shared_ptr<PendingCopy>> out;
  for (const auto& [r, copies] : by_rank_) {
    if (rank < 0 || r == rank) out.insert(out.end(), copies.begin(), copies.end());
  }
  return out;
}

bool PendingCommitted::Prune() {
  for (auto it = by_rank_.begin(); it != by_rank_.end();) {
    std::erase_if(it->second, [](const std::shared_ptr<PendingCopy>& c) { return c->done(); });
    it = it->second.empty() ? by_rank_.erase(it) : std::next(it);
  }
  return !by_rank_.empty();
}

}  // namespace flatshard::server

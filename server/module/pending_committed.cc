#include "server/module/pending_committed.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <utility>

#include "common/bulk_copy.h"
#include "server/module/foreground_copies.h"

namespace flatshard::server {

PendingCopy::PendingCopy(const std::vector<ParallelCopier::Copy>& copies,
                         std::vector<std::shared_ptr<Buffer>> hold, size_t chunk_bytes)
    : hold_(std::move(hold)) {
  for (const ParallelCopier::Copy& c : copies) {
    for (size_t at = 0; at < c.bytes; at += chunk_bytes) {
      chunks_.push_back({static_cast<char*>(c.dst) + at, static_cast<const char*>(c.src) + at,
                         std::min(chunk_bytes, c.bytes - at)});
    }
  }
  size_t total = 0;
  for (const ParallelCopier::Copy& c : chunks_) total += c.bytes;
  stream_ = BulkShouldStream(total);
  if (chunks_.empty()) hold_.clear();
}

std::vector<state::DeferredRecord> PendingCopy::Recorded() const {
  absl::MutexLock lock(&mu_);
  return copied_ || chunks_.empty() ? std::vector<state::DeferredRecord>() : records_;
}

void PendingCopy::CopyInBackground() {
  // Each chunk once no End's writeback is copying (ForegroundCopies), claimed only then.
  for (ForegroundCopies::Shared().WaitIdle(); next_.load() < chunks_.size();
       ForegroundCopies::Shared().WaitIdle()) {
    const size_t i = next_.fetch_add(1);
    if (i >= chunks_.size()) break;
    BulkCopy(chunks_[i].dst, chunks_[i].src, chunks_[i].bytes, stream_);
    Done(1);
  }
}

void PendingCopy::Finish() {
  // Claims every chunk not started: the worker's next fetch_add finds none left.
  const size_t from = std::min(next_.exchange(chunks_.size()), chunks_.size());
  if (from < chunks_.size()) {
    ParallelCopier::Shared().Run(
        std::vector<ParallelCopier::Copy>(chunks_.begin() + from, chunks_.end()));
    Done(chunks_.size() - from);
  }
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(this, &PendingCopy::AllDone));
}

void PendingCopy::Done(size_t chunks) {
  std::vector<std::shared_ptr<Buffer>> release;
  bool last = false;
  {
    absl::MutexLock lock(&mu_);
    last = done_ + chunks == chunks_.size();
    if (last) {
      release = std::move(hold_);
      copied_ = true;
    } else {
      done_ += chunks;
    }
  }
  if (!last) return;
  // The record without this copy's entries is written before the summon's segments may be
  // handed out again (or unlinked), and before anyone sees the copy done.
  if (on_copied_) on_copied_();
  // The buffers go before anyone sees the copy done: a summon that finished it finds the kept
  // buffers unused. A last reference (the kept set dropped one meanwhile) unmaps here, unlocked.
  release.clear();
  absl::MutexLock lock(&mu_);
  done_ += chunks;
}

bool PendingCopy::done() const {
  absl::MutexLock lock(&mu_);
  return AllDone();
}

std::vector<std::shared_ptr<PendingCopy>> PendingCommitted::Of(int32_t rank) const {
  std::vector<std::shared_ptr<PendingCopy>> out;
  for (const auto& [r, copies] : by_rank_) {
    if (rank < 0 || r == rank) out.insert(out.end(), copies.begin(), copies.end());
  }
  return out;
}

std::vector<state::DeferredRecord> PendingCommitted::Recorded() const {
  std::vector<state::DeferredRecord> out;
  for (const auto& [r, copies] : by_rank_) {
    for (const std::shared_ptr<PendingCopy>& c : copies) {
      std::vector<state::DeferredRecord> more = c->Recorded();
      out.insert(out.end(), more.begin(), more.end());
    }
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

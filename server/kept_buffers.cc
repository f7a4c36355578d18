#include "server/kept_buffers.h"

#include <utility>

#include "common/logging.h"

namespace flatshard::server {

KeptBuffers::KeptBuffers(std::shared_ptr<KeptBufferPool> pool, ShardStore* store, Clock* clock)
    : pool_(std::move(pool)), store_(store), clock_(clock) {}

std::shared_ptr<Buffer> KeptBuffers::Claim(const KeptKey& key, Placement placement) {
  absl::MutexLock lock(&mu_);
  for (int copy = 0; copy < kCopies; ++copy) {
    auto it = kept_.find({key, copy});
    if (it == kept_.end()) continue;
    Kept& kept = it->second;
    // Only this map holds it: nobody can take a new reference but under mu_, so it stays
    // unused until we hand it out.
    const bool unused = kept.buffer.use_count() == 1;
    if (unused && kept.buffer->placement() != placement) {
      // offload_to_cpu toggled between summons: the other placement's buffer goes.
      kept_.erase(it);
      continue;
    }
    if (!unused) continue;  // in use: try the other copy
    kept.idle_since = absl::InfiniteFuture();
    return kept.buffer;  // the returned reference marks it in use from now on
  }
  return nullptr;
}

std::shared_ptr<Buffer> KeptBuffers::TryGet(const KeptKey& key, Placement placement) {
  absl::MutexLock lock(&mu_);
  for (int copy = 0; copy < kCopies; ++copy) {
    auto it = kept_.find({key, copy});
    if (it == kept_.end()) continue;
    Kept& kept = it->second;
    if (kept.buffer.use_count() != 1 || kept.buffer->placement() != placement ||
        !kept.buffer->committed()) {
      continue;
    }
    kept.idle_since = absl::InfiniteFuture();
    return kept.buffer;
  }
  return nullptr;
}

void KeptBuffers::Keep(const KeptKey& key, const std::shared_ptr<Buffer>& fresh) {
  absl::MutexLock lock(&mu_);
  for (int copy = 0; copy < kCopies; ++copy) {
    Kept& kept = kept_[{key, copy}];
    if (kept.buffer) continue;
    kept.buffer = fresh;
    kept.idle_since = absl::InfiniteFuture();
    return;
  }
}

absl::StatusOr<std::shared_ptr<Buffer>> KeptBuffers::Get(const KeptKey& key, BufferKind kind,
                                                         int64_t bytes, const std::string& label,
                                                         int64_t owner_uid, Placement placement) {
  if (std::shared_ptr<Buffer> kept = Claim(key, placement)) {
    // Claimed: no other Get hands it out and DecommitIdle leaves it alone (it is in use), so
    // its pages come back here without the cache's lock.
    if (!kept->committed()) {
      absl::Status s = kept->Commit();
      if (absl::IsResourceExhausted(s)) {
        pool_->DecommitIdle(absl::InfiniteFuture());  // make room from idle buffers, then retry
        s = kept->Commit();
      }
      if (!s.ok()) return s;
    }
    return kept;
  }
  absl::StatusOr<std::shared_ptr<Buffer>> fresh =
      store_->Allocate(kind, bytes, label, owner_uid, placement);
  if (absl::IsResourceExhausted(fresh.status())) {
    pool_->DecommitIdle(absl::InfiniteFuture());
    fresh = store_->Allocate(kind, bytes, label, owner_uid, placement);
  }
  if (!fresh.ok()) return fresh.status();
  Keep(key, *fresh);
  return *fresh;
}

void KeptBuffers::Release() {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  for (auto& [key, kept] : kept_) {
    if (kept.buffer.use_count() == 1 && kept.idle_since == absl::InfiniteFuture()) {
      kept.idle_since = now;
    }
  }
}

int KeptBuffers::DecommitIdle(absl::Time now, absl::Duration idle_release) {
  const bool all = now == absl::InfiniteFuture();
  int decommitted = 0;
  absl::MutexLock lock(&mu_);
  for (auto& [key, kept] : kept_) {
    if (kept.buffer.use_count() != 1 || !kept.buffer->committed()) continue;
    if (!all &&
        (kept.idle_since == absl::InfiniteFuture() || now - kept.idle_since < idle_release)) {
      continue;
    }
    // madvise / a device block's return to its pool: quick, no wait on anyone.
    absl::Status s = kept.buffer->Decommit();
    if (!s.ok()) {
      FS_LOG(WARNING) << "decommit of " << kept.buffer->segment_name() << ": " << s;
      continue;
    }
    ++decommitted;
  }
  return decommitted;
}

std::vector<std::shared_ptr<Buffer>> KeptBuffers::TakeAll() {
  std::vector<std::shared_ptr<Buffer>> out;
  absl::MutexLock lock(&mu_);
  for (auto& [key, kept] : kept_) {
    if (kept.buffer) out.push_back(std::move(kept.buffer));
  }
  kept_.clear();
  return out;
}

std::vector<std::pair<KeptKey, std::shared_ptr<Buffer>>> KeptBuffers::HostBuffers() const {
  std::vector<std::pair<KeptKey, std::shared_ptr<Buffer>>> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [key, kept] : kept_) {
    // Also a decommitted one: it may be in use again at the kill (the restart adopts only a
    // segment whose pages are there).
    if (kept.buffer && !kept.buffer->on_device()) {
      out.emplace_back(key.first, kept.buffer);
    }
  }
  return out;
}

int KeptBuffers::size() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [key, kept] : kept_) n += kept.buffer != nullptr;
  return n;
}

KeptBufferPool::KeptBufferPool(ShardStore* store, Clock* clock, absl::Duration idle_release)
    : store_(store),
      clock_(clock != nullptr ? clock : Clock::Real()),
      idle_release_(idle_release) {}

std::shared_ptr<KeptBufferPool> KeptBufferPool::Create(ShardStore* store, Clock* clock,
                                                       absl::Duration idle_release) {
  return std::shared_ptr<KeptBufferPool>(new KeptBufferPool(store, clock, idle_release));
}

std::shared_ptr<KeptBuffers> KeptBufferPool::NewSet() {
  auto set = std::make_shared<KeptBuffers>(shared_from_this(), store_, clock_);
  absl::MutexLock lock(&mu_);
  std::erase_if(sets_, [](const std::weak_ptr<KeptBuffers>& s) { return s.expired(); });
  sets_.push_back(set);
  return set;
}

int KeptBufferPool::DecommitIdle(absl::Time now) {
  std::vector<std::shared_ptr<KeptBuffers>> live;
  {
    absl::MutexLock lock(&mu_);
    std::erase_if(sets_, [](const std::weak_ptr<KeptBuffers>& s) { return s.expired(); });
    for (const auto& s : sets_) {
      if (auto set = s.lock()) live.push_back(std::move(set));
    }
  }
  int decommitted = 0;
  for (const auto& set : live) decommitted += set->DecommitIdle(now, idle_release_);
  return decommitted;
}

}  // namespace flatshard::server

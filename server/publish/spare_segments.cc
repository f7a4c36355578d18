#include "server/publish/spare_segments.h"

#include "common/logging.h"
#include "server/publish/segment_grant.h"
#include "server/shard_store.h"

namespace flatshard::server {

void SpareSegments::Offer(const Key& key, std::shared_ptr<Buffer> buffer, SegmentGrants grants) {
  if (buffer == nullptr || grants.world_readable) return;  // freed by the caller's reference
  Spare old;                                               // freed after the lock
  absl::MutexLock lock(&mu_);
  Spare& s = spares_[key];
  old = std::move(s);
  s = Spare{std::move(buffer), std::move(grants)};
}

std::shared_ptr<Buffer> SpareSegments::Take(const Key& key, int64_t bytes,
                                            const SegmentGrants& grants) {
  Spare s;
  {
    absl::MutexLock lock(&mu_);
    auto it = spares_.find(key);
    if (it == spares_.end()) return nullptr;
    s = std::move(it->second);
    spares_.erase(it);
  }
  if (s.buffer->bytes() != bytes || !(s.grants == grants)) return nullptr;  // s freed here
  if (const int fd = s.buffer->segment_fd(); fd >= 0) {
    if (absl::Status st = Unseal(fd); !st.ok()) {
      FS_LOG(WARNING) << "a spare segment of weights \"" << key.second
                      << "\" is freed, not reused: " << st;
      return nullptr;
    }
  }
  return std::move(s.buffer);
}

void SpareSegments::Forget(const Key& key) {
  Spare gone;
  absl::MutexLock lock(&mu_);
  if (auto it = spares_.find(key); it != spares_.end()) {
    gone = std::move(it->second);
    spares_.erase(it);
  }
}

void SpareSegments::Clear() {
  std::map<Key, Spare> gone;
  absl::MutexLock lock(&mu_);
  gone.swap(spares_);
}

int64_t SpareSegments::spares() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(spares_.size());
}

int64_t SpareSegments::bytes() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [key, s] : spares_) n += s.buffer->bytes();
  return n;
}

}  // namespace flatshard::server

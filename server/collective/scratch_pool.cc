#include "server/collective/scratch_pool.h"

#include <algorithm>
#include <utility>

#include "absl/time/clock.h"

namespace flatshard::collective {

ScratchPool::Scratch& ScratchPool::Scratch::operator=(Scratch&& other) noexcept {
  if (this != &other) {
    GiveBack();
    pool_ = std::move(other.pool_);
    buf_ = std::move(other.buf_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void ScratchPool::Scratch::GiveBack() {
  if (buf_ == nullptr) return;
  // Without a pool (it is gone) the buffer is freed here.
  if (std::shared_ptr<ScratchPool> pool = pool_.lock()) pool->Release(std::move(buf_), bytes_);
  buf_.reset();
  bytes_ = 0;
}

std::shared_ptr<ScratchPool> ScratchPool::Create(std::shared_ptr<DeadlineTimer> timer,
                                                 size_t keep_bytes, absl::Duration idle_release) {
  return std::shared_ptr<ScratchPool>(new ScratchPool(std::move(timer), keep_bytes, idle_release));
}

ScratchPool::ScratchPool(std::shared_ptr<DeadlineTimer> timer, size_t keep_bytes,
                         absl::Duration idle_release)
    : timer_(std::move(timer)), keep_bytes_(keep_bytes), idle_release_(idle_release) {}

ScratchPool::~ScratchPool() {
  if (timer_ != nullptr) timer_->Cancel(sweep_);
}

ScratchPool::Scratch ScratchPool::Acquire(size_t bytes) {
  Scratch s;
  s.pool_ = weak_from_this();
  {
    absl::MutexLock lock(&mu_);
    auto best = idle_.end();
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if (it->bytes >= bytes && (best == idle_.end() || it->bytes < best->bytes)) best = it;
    }
    if (best != idle_.end()) {
      s.buf_ = std::move(best->buf);
      s.bytes_ = best->bytes;
      idle_total_ -= best->bytes;
      idle_.erase(best);
      return s;
    }
  }
  // Default-initialized: no zeroing pass over pages the op overwrites anyway.
  s.buf_.reset(new uint8_t[std::max<size_t>(bytes, 1)]);
  s.bytes_ = bytes;
  return s;
}

void ScratchPool::Release(std::unique_ptr<uint8_t[]> buf, size_t bytes) {
  std::vector<std::unique_ptr<uint8_t[]>> freed;  // freed after the lock
  {
    absl::MutexLock lock(&mu_);
    if (bytes > keep_bytes_) {
      freed.push_back(std::move(buf));
    } else {
      idle_.push_back(Idle{std::move(buf), bytes, absl::Now()});
      idle_total_ += bytes;
      // Over the bound: the oldest idle buffers go first.
      while (idle_total_ > keep_bytes_) {
        idle_total_ -= idle_.front().bytes;
        freed.push_back(std::move(idle_.front().buf));
        idle_.erase(idle_.begin());
      }
    }
    if (timer_ != nullptr && !idle_.empty() && sweep_ == DeadlineTimer::kNoTimer) {
      // The timer's lock is a leaf; scheduling under ours is safe.
      sweep_ = timer_->Schedule(absl::Now() + idle_release_, [weak = weak_from_this()] {
        if (std::shared_ptr<ScratchPool> pool = weak.lock()) pool->ReleaseIdle();
      });
    }
  }
}

void ScratchPool::ReleaseIdle() {
  std::vector<std::unique_ptr<uint8_t[]>> freed;
  absl::MutexLock lock(&mu_);
  sweep_ = DeadlineTimer::kNoTimer;
  const absl::Time now = absl::Now();
  absl::Time oldest_kept = absl::InfiniteFuture();
  for (auto it = idle_.begin(); it != idle_.end();) {
    if (now - it->since >= idle_release_) {
      idle_total_ -= it->bytes;
      freed.push_back(std::move(it->buf));
      it = idle_.erase(it);
    } else {
      oldest_kept = std::min(oldest_kept, it->since);
      ++it;
    }
  }
  if (!idle_.empty()) {
    sweep_ = timer_->Schedule(oldest_kept + idle_release_, [weak = weak_from_this()] {
      if (std::shared_ptr<ScratchPool> pool = weak.lock()) pool->ReleaseIdle();
    });
  }
  // `freed` is destroyed after the lock is released (declared before it).
}

size_t ScratchPool::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  return idle_total_;
}

}  // namespace flatshard::collective

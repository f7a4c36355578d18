#include "server/durable/parallel_copier.h"

#include <algorithm>
#include <cstring>

#include "common/bulk_copy.h"

namespace flatshard::server {

ParallelCopier::ParallelCopier(int helpers, size_t chunk_bytes)
    : chunk_bytes_(std::max<size_t>(chunk_bytes, 1)), helpers_(std::max(helpers, 0)) {
  for (int i = 0; i < helpers_; ++i) threads_.emplace_back([this] { Loop(); });
}

ParallelCopier::~ParallelCopier() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

ParallelCopier& ParallelCopier::Shared() {
  static ParallelCopier* shared = [] {
    const int hardware = static_cast<int>(std::thread::hardware_concurrency());
    return new ParallelCopier(std::max(1, std::min(4, hardware) - 1));
  }();
  return *shared;
}

void ParallelCopier::Work(Batch& batch) {
  size_t copied = 0;
  for (size_t i = batch.next.fetch_add(1); i < batch.chunks.size(); i = batch.next.fetch_add(1)) {
    const Copy& c = batch.chunks[i];
    if (c.also == nullptr) {
      BulkCopy(c.dst, c.src, c.bytes, batch.stream);
    } else {
      // Pieces small enough to stay in L2 between the two copies.
      constexpr size_t kPiece = size_t{256} << 10;
      for (size_t at = 0; at < c.bytes; at += kPiece) {
        const size_t n = std::min(kPiece, c.bytes - at);
        BulkCopy(static_cast<char*>(c.dst) + at, static_cast<const char*>(c.src) + at, n,
                 batch.stream);
        BulkCopy(static_cast<char*>(c.also) + at, static_cast<const char*>(c.src) + at, n,
                 batch.stream);
      }
    }
    ++copied;
  }
  if (copied == 0) return;
  absl::MutexLock lock(&batch.mu);
  batch.done += copied;
}

void ParallelCopier::Run(const std::vector<Copy>& copies) {
  auto batch = std::make_shared<Batch>();
  size_t total = 0;
  for (const Copy& c : copies) {
    total += c.also == nullptr ? c.bytes : 2 * c.bytes;
    for (size_t at = 0; at < c.bytes; at += chunk_bytes_) {
      batch->chunks.push_back(Copy{static_cast<char*>(c.dst) + at,
                                   static_cast<const char*>(c.src) + at,
                                   std::min(chunk_bytes_, c.bytes - at),
                                   c.also == nullptr ? nullptr : static_cast<char*>(c.also) + at});
    }
  }
  batch->stream = BulkShouldStream(total);
  const size_t n = batch->chunks.size();
  if (n >= 2 && helpers_ > 0) {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      for (size_t i = 0; i < std::min<size_t>(helpers_, n - 1); ++i) queue_.push_back(batch);
    }
  }
  Work(*batch);
  // Helpers that took an entry finish the chunks they claimed; later ones find none left.
  absl::MutexLock lock(&batch->mu);
  batch->mu.Await(absl::Condition(batch.get(), &Batch::Finished));
}

void ParallelCopier::Loop() {
  for (;;) {
    std::shared_ptr<Batch> batch;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &ParallelCopier::HasWorkOrStop));
      if (queue_.empty()) return;  // stopping: every Run copies its own leftovers
      batch = std::move(queue_.front());
      queue_.pop_front();
    }
    Work(*batch);
  }
}

}  // namespace flatshard::server

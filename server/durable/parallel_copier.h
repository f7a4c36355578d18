#pragma once
// ParallelCopier: host memcpy of a batch of byte ranges split into chunks that a few threads
// copy at once (the calling thread too), so that a writeback End's copies into the shards and
// the committed copies are not bound by one thread's copy bandwidth (issue 24). Run returns
// once every byte is in place: callers order their records around it exactly as around a
// plain memcpy. Batches from several callers share the threads. Thread-safe.

#include <atomic>
#include <cstddef>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::server {

class ParallelCopier {
 public:
  struct Copy {
    void* dst = nullptr;
    const void* src = nullptr;
    size_t bytes = 0;
    // If set, the same bytes go here too, copied while `src` is still in cache: one read of
    // `src` for two destinations (a writeback into the shard and its committed copy at once).
    void* also = nullptr;
  };

  // `helpers` threads besides each caller; batches under 2 chunks are copied by the caller.
  explicit ParallelCopier(int helpers, size_t chunk_bytes = size_t{4} << 20);
  ~ParallelCopier();
  ParallelCopier(const ParallelCopier&) = delete;
  ParallelCopier& operator=(const ParallelCopier&) = delete;

  // Copies every range (no destination may overlap another or a source) and returns when all
  // are done.
  void Run(const std::vector<Copy>& copies) ABSL_LOCKS_EXCLUDED(mu_);

  // The daemon's: min(4, hardware threads) - 1 helpers, at least 1.
  static ParallelCopier& Shared();

 private:
  struct Batch {
    std::vector<Copy> chunks;
    bool stream = false;  // a large batch: its stores bypass the caches (common/bulk_copy.h)
    std::atomic<size_t> next{0};
    absl::Mutex mu;
    size_t done ABSL_GUARDED_BY(mu) = 0;
    bool Finished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return done == chunks.size(); }
  };
  static void Work(Batch& batch);  // copies chunks until none is left unclaimed
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }

  const size_t chunk_bytes_;
  const int helpers_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // One entry per helper a batch may use: each takes one and works on that batch.
  std::deque<std::shared_ptr<Batch>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace flatshard::server

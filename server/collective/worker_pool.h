#pragma once
// Helper threads for splitting one large local copy or reduction into pieces. The calling
// thread always takes part, so ParallelFor makes progress even when every helper is busy with
// another caller's pieces (no deadlock, no starvation).
//
// Thread safety: ParallelFor may be called from any number of threads concurrently.
// Lifetime: the destructor joins the helpers. REQUIRES: no ParallelFor is running then.

#include <cstddef>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::collective {

class WorkerPool {
 public:
  // `num_helpers` threads besides the callers; 0 runs everything on the caller.
  explicit WorkerPool(int num_helpers);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int num_helpers() const { return static_cast<int>(threads_.size()); }

  // Calls fn(i) exactly once for every i in [0, n), on the caller and on idle helpers, and
  // returns when all calls have returned. `fn` must be safe to call concurrently.
  void ParallelFor(size_t n, absl::FunctionRef<void(size_t)> fn);

 private:
  struct Job;
  void HelperLoop();

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // One entry per helper a job asked for; a helper drains the job's pieces, then moves on.
  std::deque<std::shared_ptr<Job>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace flatshard::collective

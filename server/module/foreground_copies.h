#pragma once
// ForegroundCopies: counts the copies on a writeback End's critical path (its writeback into
// the shards, before it answers) so that the copies Ends leave for later
// (PendingCopy::CopyInBackground, pending_committed.h) wait, chunk by chunk, while any runs:
// the memory bandwidth goes to what a trainer waits for. A thread that needs a pending copy
// done takes its chunks itself (PendingCopy::Finish), so nothing waits behind this gate but the
// background worker. Thread-safe.

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace flatshard::server {

class ForegroundCopies {
 public:
  // The daemon's.
  static ForegroundCopies& Shared() {
    static ForegroundCopies* const shared = new ForegroundCopies();
    return *shared;
  }
  // Brackets one critical-path copy.
  class Scope {
   public:
    explicit Scope(ForegroundCopies& f) : f_(f) {
      absl::MutexLock lock(&f_.mu_);
      ++f_.running_;
    }
    ~Scope() {
      absl::MutexLock lock(&f_.mu_);
      --f_.running_;
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ForegroundCopies& f_;
  };
  // Returns once no critical-path copy runs.
  void WaitIdle() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &ForegroundCopies::Idle));
  }

 private:
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_ == 0; }
  absl::Mutex mu_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace flatshard::server

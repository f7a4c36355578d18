#pragma once
// Copies into a rank's committed copies that a writeback End left to finish after it answered
// (issue 24: no full copy on the End's critical path).
//
// Without a state directory, a host rank's writeback End copies its own range from the summon's
// buffers into its shards, copies the shards' other bytes (other units, padding, optimizer
// state) into the committed copies, and answers; the own range reaches the committed copies
// afterwards (a PendingCopy, run on a worker by Modules::CommitInBackground), read from the same
// summon buffers: the trainer stops using them at End (its views are invalid from then on) and
// the PendingCopy holds them, so no later summon reuses them before it is done, and it never
// reads the shards (the trainer may step its optimizer on them at once).
//
// The worker copies one chunk at a time, each once no End's writeback into the shards runs
// (ForegroundCopies), so that it does not slow the other local ranks' writebacks still on the
// End's critical path. Whoever needs the rank's
// committed copies complete takes the chunks the worker has not started and copies them on the
// copy pool, then waits for the worker's one chunk in flight (PendingCopy::Finish), off the
// group's lock: a Commit and the next writeback End of the rank before they write the committed
// copies, a rollback (a refused commit's or a re-form's) before it reads them, the rank's next
// writeback summon (so that the kept buffers the copy holds are handed out again, not new
// ones). Checkpoints hold the committed copies only once no copy is pending (Checkpoints:
// `still`).
//
// Kills. Without a state directory nothing here is recorded: a killed daemon keeps nothing,
// and a trainer's session ending is a rollback, which finishes the copy first. With a state
// directory (host ranks, Records::EndArrive) the End's records bracket the copies of the
// shards' other bytes, and its "done" record lists the PendingCopy's `records`
// (state::DeferredRecord: which summon segment holds which part of the committed copy), so a
// restart after kill -9 copies them from the segment, never from the shard the trainer may
// have stepped since. Once the copy is complete, `on_copied` writes a record without them
// (they stop being listed, Recorded, from then on), and only then are the summon buffers let
// go: no later summon writes a segment a record still names.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "server/durable/parallel_copier.h"
#include "server/durable/state_dir.h"
#include "server/shard_store.h"

namespace flatshard::server {

// One End's copies into one rank's committed copies, in chunks. Thread-safe.
class PendingCopy {
 public:
  // `hold`: the buffers the copies read and write, kept alive until they are done.
  PendingCopy(const std::vector<ParallelCopier::Copy>& copies,
              std::vector<std::shared_ptr<Buffer>> hold, size_t chunk_bytes = size_t{4} << 20);
  // With a state directory: what the records say of the copy until it is complete, and what
  // runs once it is (before the buffers go; on the thread that copied the last chunk, without
  // locks: it writes the record that drops them). Set before the copy is shared.
  void SetRecorded(std::vector<state::DeferredRecord> records,
                   absl::AnyInvocable<void()> on_copied) {
    records_ = std::move(records);
    on_copied_ = std::move(on_copied);
  }
  // `records` while the copy is not complete; none after.
  std::vector<state::DeferredRecord> Recorded() const ABSL_LOCKS_EXCLUDED(mu_);
  // The worker: copies chunk after chunk on the calling thread until none is left.
  void CopyInBackground() ABSL_LOCKS_EXCLUDED(mu_);
  // Copies every chunk nobody has started (on the copy pool), then waits until all are done.
  void Finish() ABSL_LOCKS_EXCLUDED(mu_);
  bool done() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Done(size_t chunks) ABSL_LOCKS_EXCLUDED(mu_);
  bool AllDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ == chunks_.size(); }

  std::vector<ParallelCopier::Copy> chunks_;  // read-only once made
  bool stream_ = false;  // a large copy: streamed stores (common/bulk_copy.h); set once made
  std::atomic<size_t> next_{0};  // the first chunk nobody has claimed
  mutable absl::Mutex mu_;
  size_t done_ ABSL_GUARDED_BY(mu_) = 0;  // chunks copied
  std::vector<std::shared_ptr<Buffer>> hold_ ABSL_GUARDED_BY(mu_);
  std::vector<state::DeferredRecord> records_;  // read-only once shared
  absl::AnyInvocable<void()> on_copied_;        // run once, by the last chunk's Done
  bool copied_ ABSL_GUARDED_BY(mu_) = false;    // every chunk copied: `records_` are stale
};

// Per module (in Registered, under the group's mu): the PendingCopy of each rank not yet known
// to be done.
class PendingCommitted {
 public:
  void Add(int32_t rank, std::shared_ptr<PendingCopy> copy) {
    by_rank_[rank].push_back(std::move(copy));
  }
  // `rank`'s (every rank's for -1), to Finish after the lock.
  std::vector<std::shared_ptr<PendingCopy>> Of(int32_t rank) const;
  // Forgets the done ones; whether any is left.
  bool Prune();
  // The records of the copies not complete yet (the module's "deferred").
  std::vector<state::DeferredRecord> Recorded() const;

 private:
  std::map<int32_t, std::vector<std::shared_ptr<PendingCopy>>> by_rank_;
};

}  // namespace flatshard::server

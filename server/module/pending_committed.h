#pragma once
// PendingCommitted: per module, the copies into a rank's committed copies that a writeback End
// left running after it answered (issue 24: no full copy on the End's critical path).
//
// Without a state directory, a host rank's writeback End copies its own range from the summon's
// buffers into its shards, copies the shards' other bytes (other units, padding, optimizer
// state) into the committed copies, and answers; the own range reaches the committed copies
// afterwards, on a worker (Modules::CommitInBackground), read from the same summon buffers: the
// trainer stops using them at End (its views are invalid from then on) and the copy holds them,
// so no later summon reuses them before it is done, and it never reads the shards (the trainer
// may step its optimizer on them at once).
//
// Who waits for such a copy: every operation that reads or writes that rank's committed copies
// or would change what they must hold. A Commit, the next writeback End and a refused
// commit's rollback of the rank queue here (Wait) and run again once it is done; the copy also
// holds the module's `busy`, which keeps rollbacks at a re-form (rollback_pending) and
// checkpoint saves and loads (they hold only at busy == 0) out until it is done.
//
// Kills: nothing here is recorded. Without a state directory a killed daemon keeps nothing,
// and a trainer's session ending is a rollback, which waits as above; with a state directory
// the End keeps copying before it answers, bracketed by its records (Records::EndArrive).
//
// Not thread-safe: lives in Registered, under the group's mu.

#include <cstdint>
#include <map>
#include <vector>

#include "absl/functional/any_invocable.h"

namespace flatshard::server {

class PendingCommitted {
 public:
  // Whether a copy into `rank`'s committed copies is still running.
  bool InFlight(int32_t rank) const { return in_flight_.contains(rank); }
  bool Any() const { return !in_flight_.empty(); }
  void Start(int32_t rank) { ++in_flight_[rank]; }
  // Runs `retry` (from Done's caller, after the lock) once a copy finishes; the operation
  // checks again then.
  void Wait(absl::AnyInvocable<void()> retry) { waiting_.push_back(std::move(retry)); }
  // One copy of `rank` finished: returns every waiting operation, to run after the lock.
  std::vector<absl::AnyInvocable<void()>> Done(int32_t rank);

 private:
  std::map<int32_t, int> in_flight_;
  std::vector<absl::AnyInvocable<void()>> waiting_;
};

}  // namespace flatshard::server

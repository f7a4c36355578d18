#pragma once
// Where the calls of a group's local ranks for one op_seq meet, written once for every
// backend whose local ranks meet in memory (inproc: all ranks; NCCL: the ranks of this
// daemon) so that they share one wording of the Communicator contract (backend.h):
// - argument checks: a rank that is not local fails alone (INVALID_ARGUMENT, not sticky); a
//   bad call (ValidateCall, plus the backend's own check) is a sticky INVALID_ARGUMENT;
// - op_seq order per rank (OpSeqOrder, also used by the ring): a sticky INVALID_ARGUMENT;
// - descriptor match: ABORTED "collective mismatch at op_seq N: rank a called X but rank b
//   called Y" (MismatchError), sticky;
// - deadlines: a call still waiting at its OpOptions::deadline fails the group with
//   DEADLINE_EXCEEDED naming the local ranks that did not arrive (MissingRanksError), or, for
//   an op whose ranks all arrived but that the owner has not taken yet, with the owner's
//   `overdue` status;
// - sticky errors: the first error wins and fails every waiting call at once and every later
//   one; calls of an op already handed to the owner are the owner's to complete;
// - the pending-op listing (PendingOps): arrived and missing local ranks, age, running.
//
// The owner gets an op whose local ranks all arrived either from the Arrive call that
// completed it (hand_over_on_arrival: inproc moves the data on that caller's thread) or from
// TakeReady, strictly in op_seq order (NCCL's progress thread, which must launch ops in the
// same order on every daemon). It reports the outcome with Finish.
//
// Thread safety: thread-safe. Callbacks of failed calls never run under the rendezvous' lock,
// so they may call back in. Deadlines run on the given DeadlineTimer's thread.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/collective/backend.h"
#include "server/collective/deadline_timer.h"
#include "server/collective/op_descriptor.h"

namespace flatshard::collective {

// The per-rank op_seq order every Communicator checks: a rank's ops carry increasing op_seqs.
// Costs one entry per rank that issued an op (a world_size nobody joins is free).
// Not thread-safe: the owner's lock guards it.
class OpSeqOrder {
 public:
  // Records `op_seq` as the rank's last; OpSeqOrderError (INVALID_ARGUMENT "rank R issued
  // op_seq N <op> after op_seq L"), recording nothing, when it does not exceed the last.
  absl::Status Next(int rank, uint64_t op_seq, const OpDescriptor& desc);

 private:
  absl::flat_hash_map<int, uint64_t> last_;
};

// One local rank's call.
struct RendezvousCall {
  int rank = 0;
  OpCall call;
  DoneCallback done;
  absl::Time arrived_at;
  absl::Time deadline = absl::InfiniteFuture();
  DeadlineTimer::TimerId timer = DeadlineTimer::kNoTimer;  // the rendezvous' own
};

// An op whose local ranks all arrived, handed to the owner, which runs every call's `done`.
struct RendezvousOp {
  uint64_t op_seq = 0;
  OpDescriptor desc;  // the first arrival's
  std::string name;   // the first arrival's OpOptions::name
  // By position in GroupSpec::local_ranks (for inproc, that is by rank).
  std::vector<RendezvousCall> calls;
  absl::Time deadline = absl::InfiniteFuture();  // the earliest of the calls'
  absl::Duration budget;                         // that call's deadline - its arrival
};

struct LocalRendezvousOptions {
  // Prefix of log lines: "group=g inproc communicator".
  std::string log_name;
  // ValidateCall's `host_only`.
  bool host_only = true;
  // The backend's own check of a call, after ValidateCall; null: none. A non-OK status is a
  // sticky error.
  std::function<absl::Status(const OpCall& call, int rank, uint64_t op_seq)> check_call;
  // Compare each arrival's descriptor with the first arrival's. Off where the backend checks
  // descriptors itself (NCCL's fingerprint exchange, identical on every daemon).
  bool compare_descriptors = true;
  // The arrival that completes an op gets it from Arrive; off: the owner calls TakeReady.
  bool hand_over_on_arrival = true;
  // The status of a deadline that passes while an op whose ranks all arrived waits for
  // TakeReady; null: DEADLINE_EXCEEDED "op_seq N <op>: every local rank arrived but the op
  // did not start within <budget>". Runs under the rendezvous' lock: it must not call back in.
  std::function<absl::Status(uint64_t op_seq, const OpDescriptor& desc, const std::string& name,
                             absl::Duration budget)>
      overdue;
  // Runs the deadlines. REQUIRED.
  std::shared_ptr<DeadlineTimer> timer;
};

class LocalRendezvous : public std::enable_shared_from_this<LocalRendezvous> {
 public:
  // REQUIRES: CheckGroupSpec(spec) is OK, options.timer is set. Make it with make_shared
  // (deadline callbacks hold weak references).
  LocalRendezvous(GroupSpec spec, LocalRendezvousOptions options);
  LocalRendezvous(const LocalRendezvous&) = delete;
  LocalRendezvous& operator=(const LocalRendezvous&) = delete;

  // One rank's call (rank, op_seq, deadline and name from `o`). Either the call waits (its
  // `done` runs later with the op's outcome), or it fails at once (`done` has run when this
  // returns), or it completes an op that is handed over (hand_over_on_arrival): the op is
  // returned and `done` is among its calls.
  std::optional<RendezvousOp> Arrive(OpCall call, const OpOptions& o, DoneCallback done);

  // The first pending op (lowest op_seq) if its local ranks all arrived and nobody took it;
  // it is then running. Cancels its calls' deadlines (the owner enforces op.deadline).
  std::optional<RendezvousOp> TakeReady();

  // Waits until TakeReady has an op, the status is an error, Close was called, or `until`.
  void WaitForWork(absl::Time until) const;

  // The owner finished a running op with `result`: it leaves the pending list. Returns what its
  // calls report: OK, or (when `result` is an error) the sticky status, which `result` becomes
  // if it is the first error.
  absl::Status Finish(uint64_t op_seq, absl::Status result);

  // Makes `reason` the sticky status if it is the first error (an OK reason becomes ABORTED
  // "aborted"), fails every waiting call with the sticky status and returns it. Running ops
  // stay the owner's; `drop_running` forgets them too (the owner fails them itself).
  // `quiet`: no warning unless calls were waiting (the communicator is being destroyed).
  absl::Status Fail(absl::Status reason, bool quiet = false, bool drop_running = false);

  // The communicator is going away: later calls fail with `reason`, and so do pending ones
  // when there are any or `fail` is set (then `reason` becomes the sticky status, quietly).
  void Close(absl::Status reason, bool fail);
  bool closed() const;

  // OK, or the sticky error.
  absl::Status status() const;

  // Ops that have not completed, ascending by op_seq; arrived and missing local ranks.
  std::vector<PendingOpInfo> PendingOps() const;

 private:
  struct Slot {
    OpDescriptor desc;
    int first_rank = 0;
    std::string name;
    absl::Time first_arrival;
    std::vector<std::optional<RendezvousCall>> calls;  // by local index; moved out when taken
    int arrived = 0;
    bool running = false;
  };

  // Position of `rank` in spec_.local_ranks, or -1.
  int LocalIndex(int rank) const;
  int local_count() const { return static_cast<int>(spec_.local_ranks.size()); }
  // Records the first error and moves every waiting call into `out`.
  void SetStickyLocked(absl::Status status, std::vector<RendezvousCall>* out, bool quiet)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the slot running and moves its calls out.
  RendezvousOp TakeLocked(std::map<uint64_t, Slot>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnDeadline(uint64_t op_seq, int index);
  // Runs `calls`' callbacks (outside the lock) with `status`, cancelling their deadlines.
  void FailCalls(std::vector<RendezvousCall> calls, const absl::Status& status);

  const GroupSpec spec_;
  const LocalRendezvousOptions options_;

  mutable absl::Mutex mu_;
  absl::Status sticky_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status closed_reason_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Slot> slots_ ABSL_GUARDED_BY(mu_);
  OpSeqOrder order_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::collective

#pragma once
// CollectiveEngine: the daemon's front door to collectives. It keeps one CollectiveGroup per
// training job; a group numbers each rank's collectives in call order (SPMD: the Nth
// collective a rank submits is op_seq N, starting at 1), hands them to the group's
// Communicator in that order, watches their deadlines and makes errors sticky: after the first
// failure of any op of a group, every pending and every later op of that group fails with the
// same status, and the communicator is aborted.
//
// Callers are gRPC callback reactors: Submit never waits for other ranks, but it may do an
// op's data movement on the calling thread (inproc: the last rank to arrive copies, with the
// backend's helper threads for large ops). `done` runs exactly once, never under an engine or
// backend lock: on the submitting thread before Submit returns (world_size 1, errors, or this
// rank arrived last), on another rank's submitting thread, or on a backend or watchdog
// thread. A callback may Submit again; if it runs inside the same rank's Submit, the new op is
// queued and issued when the callback returns, so long chains of ops do not recurse.
//
// All-reduce: CollectiveOp::AllReduce runs as a ReduceScatter then an AllGather of the reduced
// block over the group's Communicator (op_seqs N and N+1; the ring all-reduce's traffic on ring
// backends), so every backend serves it with the same deadline, sticky-error and mismatch
// semantics as the ops it is made of. The rank's later ops wait until the all-gather has been
// issued (its input is the reduce-scatter's output). A host buffer whose element count is not a
// multiple of world_size is padded with zeros in a scratch copy; a CUDA one must be a multiple
// (the caller pads: INVALID_ARGUMENT otherwise). Mismatches are detected per half: an
// all-reduce of W*S bytes against a reduce-scatter of W*S bytes fails at op_seq N+1.
//
// Deadlines: each op gets `timeout` (or EngineOptions::default_timeout) from submission; the
// backend enforces it (DEADLINE_EXCEEDED naming the ranks that did not arrive). If the backend
// has not completed an op `watchdog_grace` after its deadline, the engine's watchdog aborts
// the group with DEADLINE_EXCEEDED and completes the op itself.
//
// Thread safety: CollectiveEngine and CollectiveGroup are thread-safe.

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/collective/backend.h"
#include "server/collective/buffer.h"
#include "server/collective/deadline_timer.h"

namespace flatshard::collective {

// One rank's collective. Buffers follow the shapes in backend.h (Communicator) and must stay
// valid until `done` runs.
struct CollectiveOp {
  CollectiveKind kind = CollectiveKind::kAllGather;
  int64_t unit = -1;
  // AllGather, ReduceScatter, Gather: this rank's contribution. Broadcast, AllReduce: the
  // same memory as `output`.
  ConstBuffer input;
  // AllGather: the full buffer; ReduceScatter: this rank's shard; Gather: the full buffer on
  // root, empty elsewhere; Broadcast: the buffer (read on root, written elsewhere); AllReduce:
  // the buffer, reduced in place (same bytes on every rank; floating point).
  MutableBuffer output;
  ReduceOp reduce = ReduceOp::kSum;  // ReduceScatter, AllReduce
  int root = 0;                      // Broadcast, Gather
  // From submission; unset: EngineOptions::default_timeout.
  std::optional<absl::Duration> timeout;
  std::string name;  // for logs and `flatshardctl pending`

  static CollectiveOp AllGather(int64_t unit, ConstBuffer shard, MutableBuffer full);
  static CollectiveOp ReduceScatter(int64_t unit, ConstBuffer full, MutableBuffer shard,
                                    ReduceOp op);
  static CollectiveOp Broadcast(int64_t unit, MutableBuffer buf, int root);
  // In place; consumes two op_seqs (see the file comment).
  static CollectiveOp AllReduce(int64_t unit, MutableBuffer buf, ReduceOp op);
  // Non-root ranks pass an empty `full` and allocate nothing (rank0_only summon).
  static CollectiveOp Gather(int64_t unit, ConstBuffer shard, MutableBuffer full, int root);
};

struct EngineOptions {
  absl::Duration default_timeout = absl::Minutes(5);
  // How long after an op's deadline the watchdog steps in for a backend that did not.
  absl::Duration watchdog_grace = absl::Seconds(5);
};

class CollectiveEngine;

// One group's ordered op stream over its Communicator. Created by CollectiveEngine::AddGroup;
// shared by the engine and callers (a group stays usable, failing ops with its sticky status,
// after RemoveGroup).
class CollectiveGroup : public std::enable_shared_from_this<CollectiveGroup> {
 public:
  ~CollectiveGroup();  // aborts the communicator; pending ops fail with ABORTED
  CollectiveGroup(const CollectiveGroup&) = delete;
  CollectiveGroup& operator=(const CollectiveGroup&) = delete;

  const GroupSpec& spec() const { return spec_; }
  // The communicator's Communicator::backend_name(), the `backend` label of its ops' metrics.
  const std::string& backend_name() const { return backend_name_; }

  // Assigns the next op_seq of `rank` and starts the op. Errors reach `done`:
  // INVALID_ARGUMENT for a rank this daemon does not host (not sticky) or bad buffers
  // (sticky), and the backend's codes (ABORTED mismatch, DEADLINE_EXCEEDED, ...).
  void Submit(int rank, CollectiveOp op, DoneCallback done);

  // Fan-in: submits `ops` for `rank` in order (consecutive op_seqs), each with `timeout` from
  // now (negative counts as zero; it replaces CollectiveOp::timeout), and runs `done` exactly
  // once, when the last of them has completed, with the first error in completion order (OK
  // if none). An empty `ops` runs `done` at once with OK. `done` runs where the last op's
  // callback runs (see Submit), never under an engine lock.
  void SubmitAll(int rank, std::vector<CollectiveOp> ops, absl::Duration timeout,
                 DoneCallback done);

  // Sticky: fails pending and later ops with `reason` (OK becomes ABORTED); the first error
  // wins. The group's status changes at once, so later Submits fail immediately; pending ops
  // are failed on the engine's watchdog thread, never on the caller's, so Abort may be called
  // while holding a lock that those ops' callbacks take.
  void Abort(absl::Status reason);

  // OK, or the sticky error.
  absl::Status status() const;

  // The backend's view of ops that have not completed (arrived and missing ranks, age).
  std::vector<PendingOpInfo> PendingOps() const;

  // op_seq of the last op `rank` submitted (0: none). REQUIRES: 0 <= rank < world_size.
  uint64_t last_op_seq(int rank) const;

 private:
  friend class CollectiveEngine;
  struct OpRecord;
  struct RankQueue {
    uint64_t next_seq = 1;
    std::deque<std::shared_ptr<OpRecord>> queue;
    bool dispatching = false;  // a thread is handing this rank's queue to the communicator
  };

  CollectiveGroup(GroupSpec spec, std::unique_ptr<Communicator> comm,
                  std::shared_ptr<DeadlineTimer> timer, EngineOptions options);

  // Records `reason` as the sticky status (if first) and returns the sticky status.
  absl::Status SetSticky(absl::Status reason);
  // Abort that fails pending ops on the calling thread (engine shutdown).
  void AbortNow(absl::Status reason);
  // Hands `rank`'s queued ops to the communicator in op_seq order. REQUIRES: the caller set
  // the rank's `dispatching`; it stays set while an all-reduce holds the queue.
  void Dispatch(int rank);
  void Issue(const std::shared_ptr<OpRecord>& rec);
  // ReduceScatter, then (from its callback) AllGather and Dispatch(rank) again.
  void IssueAllReduce(const std::shared_ptr<OpRecord>& rec);
  void OnDone(const std::shared_ptr<OpRecord>& rec, absl::Status status);
  void OnWatchdog(int rank, uint64_t op_seq);

  const GroupSpec spec_;
  const std::unique_ptr<Communicator> comm_;
  const std::string backend_name_;
  const std::shared_ptr<DeadlineTimer> timer_;
  const EngineOptions options_;

  mutable absl::Mutex mu_;
  absl::Status sticky_ ABSL_GUARDED_BY(mu_);
  // By rank, made on a rank's first Submit: a group costs nothing per rank that never submits
  // (a world_size nobody joins must not cost memory up front).
  absl::flat_hash_map<int, RankQueue> ranks_ ABSL_GUARDED_BY(mu_);
  // Submitted and not yet completed, by (rank, op_seq).
  absl::flat_hash_map<std::pair<int, uint64_t>, std::shared_ptr<OpRecord>> in_flight_
      ABSL_GUARDED_BY(mu_);
};

class CollectiveEngine {
 public:
  explicit CollectiveEngine(EngineOptions options = {});
  // Aborts every group (ABORTED "collective engine shut down"); pending callbacks have run
  // (on this thread) when it returns.
  ~CollectiveEngine();
  CollectiveEngine(const CollectiveEngine&) = delete;
  CollectiveEngine& operator=(const CollectiveEngine&) = delete;

  // Registers a group and takes its communicator (from CollectiveBackend::Connect for `spec`).
  // INVALID_ARGUMENT for a malformed spec or null communicator; ALREADY_EXISTS for a known id.
  absl::StatusOr<std::shared_ptr<CollectiveGroup>> AddGroup(const GroupSpec& spec,
                                                            std::unique_ptr<Communicator> comm);
  // NOT_FOUND for an unknown id.
  absl::StatusOr<std::shared_ptr<CollectiveGroup>> FindGroup(absl::string_view group_id) const;
  // Aborts the group with `reason` (as CollectiveGroup::Abort: callbacks of pending ops do not
  // run on the caller's thread) and forgets it. NOT_FOUND for an unknown id.
  absl::Status RemoveGroup(absl::string_view group_id, absl::Status reason);
  std::vector<std::string> GroupIds() const;

  // FindGroup + CollectiveGroup::Submit; NOT_FOUND reaches `done`.
  void Submit(absl::string_view group_id, int rank, CollectiveOp op, DoneCallback done);

 private:
  const EngineOptions options_;
  const std::shared_ptr<DeadlineTimer> timer_;  // the watchdog thread
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<CollectiveGroup>> groups_ ABSL_GUARDED_BY(mu_);
};

}  // namespace flatshard::collective

#pragma once
// The state of one registered module on this daemon (the module owner's data): its plan,
// every local rank's shards, gradient shards, optimizer state and committed copies, its open
// summons' shared buffers, and the crash-consistency bookkeeping of commits and rollbacks.
//
// Thread safety: none of its own. A Registered lives in its Group (Group::registered) and is
// read and written only under that group's lock (Group::mu); work on its buffers that runs
// without the lock holds shared_ptrs taken under it (DurablePair) and `busy`.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/rpc_types.h"
#include "common/state_spec.h"
#include "server/collective/collective_engine.h"
#include "server/durable/state_dir.h"
#include "server/kept_buffers.h"
#include "server/module/pending_committed.h"
#include "server/shard_store.h"

namespace flatshard::server {

// One rank's memory for one unit.
struct UnitShard {
  int32_t unit = 0;
  std::shared_ptr<Buffer> shard;
  std::shared_ptr<Buffer> grad;  // null until a gradient exists
  // The optimizer state buffers (RegisterState), one per StateSpec of the module in its
  // order, next to the shard (same placement); empty until the rank registered state.
  std::vector<std::shared_ptr<Buffer>> state{};
};

// What one rank sees of one summoned unit.
struct SummonedUnit {
  int32_t unit = 0;
  std::shared_ptr<Buffer> params;  // the full padded buffer; null on ranks != 0 (rank0_only)
  std::shared_ptr<Buffer> grads;   // with_grads and the unit has a gradient; else null
};

// The last summon, end or reduce-scatter of a unit on this daemon.
struct UnitOp {
  std::string op;  // "summon", "end", "reduce_scatter"; empty: none yet
  int32_t rank = -1;
  absl::Time at = absl::InfinitePast();
  bool ok = true;
};

// One durable buffer of a rank (semantics.md §3a): the live buffer trainers write in place and
// its committed copy, which Commit (and an agreed writeback End) fills and a rollback copies
// back. shared_ptrs: a snapshot taken under its group's lock keeps both alive while the copy runs
// without it.
struct DurablePair {
  int32_t unit = 0;
  std::string what;  // "shard", or "state exp_avg": for messages
  std::shared_ptr<Buffer> live;
  std::shared_ptr<Buffer> committed;
};

// The k-th summon of every rank of a module: the buffers its ranks share.
struct SummonSlot {
  std::map<int32_t, std::shared_ptr<Buffer>> shared_params;  // writeback=false: one per node
  std::map<int32_t, std::shared_ptr<Buffer>> shared_grads;
  // rank0_only: rank 0's buffers where rank 0 is local; elsewhere the node's copy of them,
  // received by the writeback broadcast.
  std::map<int32_t, std::shared_ptr<Buffer>> rank0_params;
  std::map<int32_t, std::shared_ptr<Buffer>> rank0_grads;
  int32_t ended = 0;  // local ranks that ended this summon
  // Read-only summons (NodeAssembly): local ranks whose parts of the shared copy are done,
  // the first failure among them, the answers held until every one is, and the deadline of a
  // wait no collective bounds. Guarded by `assembly_mu` (a leaf; not the group's lock: the
  // ops' completions run without it and must not wait for a busy group).
  absl::Mutex assembly_mu;
  std::set<int32_t> assembled ABSL_GUARDED_BY(assembly_mu);
  absl::Status assembly_error ABSL_GUARDED_BY(assembly_mu);
  std::vector<absl::AnyInvocable<void(absl::Status)>> waiting ABSL_GUARDED_BY(assembly_mu);
  collective::DeadlineTimer::TimerId assembly_timer ABSL_GUARDED_BY(assembly_mu) =
      collective::DeadlineTimer::kNoTimer;
  // Read-only summons: node copies (unit, use) a local rank is getting without mu_, and the
  // other local ranks' summons waiting for them (run again, after mu_, once they are made or
  // the maker gave up), so that the node allocates each copy once.
  std::set<std::pair<int32_t, KeptUse>> making;
  std::vector<absl::AnyInvocable<void()>> on_made;
};

struct OpenSummon {
  uint64_t id = 0;
  int32_t rank = 0;
  uint64_t k = 0;
  std::string module;
  SummonOptions options;
  std::vector<int32_t> units;
  std::vector<SummonedUnit> views;  // this rank's buffers, one per unit (null entries allowed)
  std::shared_ptr<SummonSlot> slot;
  // GPU ranks under rank0_only writeback: rank 0's broadcast copy on this rank's device,
  // by (unit, 0 params / 1 grads).
  std::map<std::pair<int32_t, int>, std::shared_ptr<Buffer>> own_rank0;
  // The group's communicator when the summon was opened: a writeback End after the group
  // re-formed cannot agree with the other ranks' summons (they are gone) and fails.
  std::shared_ptr<collective::CollectiveGroup> coll;
  bool ready = false;   // the unshard completed
  bool ending = false;  // EndSummon under way
};

// Host ranks with a state directory (not an init nor rank0_only): a writeback End's own ranges
// reach its committed copies after the answer, from the summon's buffers (`copy`,
// pending_committed.h); before it only the committed copies' other bytes are copied from the
// live buffers (`gaps`). No `copy`: every byte from the live buffers before the answer.
struct DeferredCommit {
  std::shared_ptr<PendingCopy> copy;
  std::vector<ParallelCopier::Copy> gaps;
};

// A local rank's arrival at a writeback End's copies (EndArrive).
struct EndArrival {
  int32_t rank = 0;
  bool applying = false;                          // its agreement passed (else it only counts)
  absl::Status status;                            // its writeback into its shards
  std::vector<DurablePair> durable;               // what its copies commit
  absl::AnyInvocable<void(absl::Status)> finish;  // answers its End
  DeferredCommit deferred;
};

struct Registered {
  Plan plan;
  Manifest manifest;
  std::vector<std::vector<UnitShard>> shards_by_rank;
  std::vector<std::vector<bool>> summoned;  // [rank][unit]
  std::vector<uint64_t> summon_count;       // per rank: k of its last summon
  std::map<uint64_t, std::shared_ptr<SummonSlot>> slots;
  std::map<std::pair<int32_t, int32_t>, std::shared_ptr<Buffer>> grad_staging;  // (rank, unit)
  // The last reduce-scatter of (rank, unit) failed with this status: a repeated finish (a
  // client's retry) answers it instead of "begin the reduce-scatter first".
  std::map<std::pair<int32_t, int32_t>, absl::Status> failed_finishes;
  // Gradient shards allocated by BeginReduceScatter for a unit that has none yet; installed
  // in shards_by_rank only when the reduce-scatter succeeds (a failed one changes nothing).
  std::map<std::pair<int32_t, int32_t>, std::shared_ptr<Buffer>> new_grads;  // (rank, unit)
  // Unsharded and staging buffers kept across summons, decommitted while unused, so a
  // trainer maps each segment once (steady state: no mmap per summon). Null until the first
  // summon or reduce-scatter (KeptOf). shared_ptr: a call that allocates
  // outside mu_ keeps it alive while the module may be dropped.
  std::shared_ptr<KeptBuffers> kept;
  // Kept host buffers adopted at a restart (state::KeptRecord), handed to `kept` when the
  // first summon makes it (Modules::KeptOf); recorded meanwhile as they were.
  std::vector<std::pair<KeptKey, std::shared_ptr<Buffer>>> adopted_kept;
  // Units of one padded size and dtype (Modules::KeptUnit): per unit its class, and per
  // class its units in plan order. Empty until first needed.
  std::vector<int32_t> kept_class;
  std::vector<std::vector<int32_t>> kept_class_units;
  // The session each rank registered or re-attached in; a rank whose session changed (a
  // restarted trainer) may register the same model again to re-attach.
  std::vector<uint64_t> attached_session;
  // Per unit: its last summon, end or reduce-scatter here (`flatshardctl units`).
  std::vector<UnitOp> last_op;

  // ---- Crash consistency (semantics.md §3a) ----
  // A model only once its initial values committed on every rank: kZeros at registration,
  // the FROM_* modes when the init summon's End agreed on every rank. Until then Summon,
  // GetShards and reduce-scatters are refused and registering again re-runs the init.
  bool initialized = false;
  std::string uninitialized_why;  // the init's failure, for the refusals
  // A re-form undid the initialisation (Modules::UndoInitLocked) while an init End was copying
  // here: that End fails instead of initialising it. Cleared by the next registration.
  bool init_undone = false;
  // Per rank: the generation (committed step) its shards hold in `committed`. Commit and
  // every agreed writeback End add one; all ranks of a group move together.
  std::vector<uint64_t> generation;
  // Per rank and unit: the shard as of the last commit; rollbacks copy it back.
  std::vector<std::vector<std::shared_ptr<Buffer>>> committed;
  // Per rank: its shards were rolled back since it last read its views (Register,
  // GetShards); its next Commit or writeback End is refused (and rolls the group back), so
  // in-place writes made on top of a rollback are never committed.
  std::vector<bool> stale;
  // Shard copies (writebacks, commits, rollbacks) running outside the lock. A rollback waits
  // for them (`rollback_pending`), and none starts while one is pending, so a copy never
  // reads or writes a shard another copy is writing.
  int busy = 0;
  bool rollback_pending = false;
  // Copies into committed copies that writeback Ends left to finish after they answered
  // (pending_committed.h); whoever needs those committed copies finishes them first.
  PendingCommitted pending_committed;

  // ---- Optimizer state (RegisterState) ----
  // The spec the first RegisterState fixed on this daemon (the order of UnitShard::state);
  // empty: none yet. Kept while any rank holds state buffers.
  std::vector<StateSpec> state_specs;
  // Per rank and unit: the committed copies of the rank's state buffers (the order of
  // state_specs; empty until the rank registered state). Commit copies the live buffers
  // (shards_by_rank[rank][unit].state) here; rollbacks copy them back (DurableBuffers).
  std::vector<std::vector<std::vector<std::shared_ptr<Buffer>>>> committed_state;
  // Ranks whose state buffers are being allocated (outside mu_) by RegisterState.
  std::set<int32_t> state_allocating;
  // ---- Restarts (server/durable/) ----
  // PlanToJson / ManifestToJson, dumped once for the group's record (empty: not yet).
  std::string plan_json;
  std::string manifest_json;
  // A commit every rank agreed to whose copies into the committed copies are under way here
  // (state::PendingCommit: which ranks' shards hold it, which ranks' copies are done).
  std::optional<state::PendingCommit> pending_commit;
  // The generation of the last "commit" intent known to be on disk: the other local ranks'
  // copies need not write it again (a "commit" intent covers every rank; see
  // server/durable/commit_intents.cc). 0: none.
  uint64_t durable_commit_intent = 0;
  // ---- No module lost to a daemon kill (server/durable/commit_votes.cc) ----
  // Per rank: the generation its shards hold since it voted yes to a Commit (or a writeback
  // End over several daemons) whose outcome it has not learnt (0: none; may be shorter than
  // `generation`). Such a rank is rolled forward (its shards into its committed copy) or back
  // at the next formation, to whichever generation every daemon resolves the module to
  // (internal::PossibleGenerations).
  std::vector<uint64_t> voted;
  // The Commit (or End) generation recorded as voted here ("voted" in the record), before the
  // first local rank's vote went out: after a kill every local rank may hold it. 0: none.
  uint64_t voted_commit = 0;
  // ReconcileModules: the generation every daemon resolved the module to at the last re-form
  // (none: no re-form resolved it); the rollback that follows rolls voted ranks forward to
  // it, and GPU ranks back from their host copy (internal::HostFallback).
  std::optional<uint64_t> resolved_generation;
  // GPU daemons, per rank and unit: host copies of the device committed copies, made at
  // SIGTERM with --keep_shards (KeepDeviceShards), after each commit (DeviceHostCopies), or
  // adopted at start (then copied into fresh device memory; kept, still recorded, when
  // --gpu_host_copies is on, else dropped). Empty otherwise.
  std::vector<std::vector<std::shared_ptr<Buffer>>> host_committed;
  // Host daemons with a state directory: the local ranks' arrivals at the k-th writeback End
  // (EndArrive), by k; the copies into the committed copies start once every local rank is in.
  std::map<uint64_t, std::vector<EndArrival>> end_batches;
  // Host daemons with a state directory, groups over several daemons: the local ranks'
  // writebacks into their shards for the k-th writeback End, by k, before the daemon records
  // its vote for it (Records::EndVoteArrive, server/durable/commit_votes.cc).
  std::map<uint64_t, std::vector<EndArrival>> end_votes;
  // ---- Checkpoints (server/checkpoint/) ----
  // Saves and loads holding the committed copies still. While > 0 no copy into them starts
  // (commits, writeback Ends and a refused commit's rollback queue in `after_ckpt` and run
  // again once the last hold ends); a hold starts only when `busy` is 0.
  int ckpt_hold = 0;
  std::vector<absl::AnyInvocable<void()>> after_ckpt;
  // ---- Restarts of optimizer state (server/durable/) ----
  // GPU daemons, per rank, unit and state (state_specs order): host copies of the device
  // committed state buffers (committed_state), made with host_committed. Empty otherwise.
  std::vector<std::vector<std::vector<std::shared_ptr<Buffer>>>> host_committed_state;
  // GPU daemons keeping a host copy at each commit (server/durable/device_host_copies.h), per
  // rank: the generation host_committed(_state) hold (valid where host_committed is set), and
  // the spare slot the next copy is written into (unrecorded until complete).
  std::vector<uint64_t> host_generation;
  std::vector<std::vector<std::shared_ptr<Buffer>>> host_spare;
  std::vector<std::vector<std::vector<std::shared_ptr<Buffer>>>> host_spare_state;
  // Per rank: the generation the spare slot still holds completely (the copy recorded before
  // the current one), -1 when none (being written, or of other buffers). A re-form may roll
  // the rank back to it (internal::HostFallback) when another daemon's host copy is behind.
  std::vector<int64_t> host_spare_generation;

  void NoteOp(const std::vector<int32_t>& units, const char* op, int32_t rank, bool ok,
              absl::Time now) {
    last_op.resize(plan.units.size());
    for (int32_t u : units) {
      if (u >= 0 && u < static_cast<int32_t>(last_op.size()))
        last_op[u] = UnitOp{op, rank, now, ok};
    }
  }
};

namespace internal {
using ::flatshard::server::DurablePair;
}  // namespace internal

}  // namespace flatshard::server

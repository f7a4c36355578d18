#pragma once
// Modules: the registered modules of every group on this daemon and every operation on them:
// registration and re-attach, summon and End (writeback, rank0_only), Commit and rollback,
// reduce-scatter of gradients, optimizer state, and the per-unit views for operators. The
// public calls are documented on GroupManager (server/group_manager.h), which routes them
// here.
//
// State: each module's state is a Registered (server/module/module.h) inside its Group, under
// that group's lock; Modules itself keeps none. Work on buffers (copies, allocation) runs
// without the lock, on the caller's thread or RankDevices' workers; every continuation finds
// its group again (GroupTable::FindOrGone) and checks what may have changed in the gap.
// Thread-safe.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/after_unlock.h"
#include "common/clock.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "common/rpc_types.h"
#include "common/state_spec.h"
#include "server/collective/collective_engine.h"
#include "server/durable/blocking_workers.h"
#include "server/durable/parallel_copier.h"
#include "server/gpu/device_context.h"
#include "server/group/group.h"
#include "server/group/group_table.h"
#include "server/kept_buffers.h"
#include "server/module/module.h"
#include "server/module/node_assembly.h"
#include "server/rank_devices.h"
#include "server/shard_store.h"

namespace flatshard::server {

class Records;

struct SummonResult {
  uint64_t summon = 0;
  std::vector<int32_t> units;       // selected units (every rank)
  std::vector<SummonedUnit> views;  // empty on ranks != 0 under rank0_only
  std::string note;
  // GPU ranks: recorded on the rank's device after the views' bytes are in place (id 0: none).
  gpu::IpcEventRef ready;
};

struct RegisterResult {
  Plan plan;
  std::vector<UnitShard> shards;  // the caller's rank, one per unit
  // INIT_MODE_FROM_EVERY_RANK / FROM_RANK0: an open summon (writeback on) the client fills
  // with the initial values and ends; on ranks != 0 under FROM_RANK0 it has no views.
  std::optional<SummonResult> init_summon;
  // The committed step the shards hold (0: the initial values; see Commit).
  uint64_t generation = 0;
  // The module's optimizer state spec (RegisterState; the order of UnitShard::state), empty
  // when none was registered.
  std::vector<StateSpec> state_specs{};
};

// RegisterState's answer: the caller's shards with their state buffers.
struct RegisterStateResult {
  std::vector<UnitShard> shards;  // one per unit; UnitShard::state in the order of `specs`
  std::vector<StateSpec> specs;
  uint64_t generation = 0;  // the committed generation shards and state hold
  bool created = false;     // this call allocated the rank's state (zeros); false: re-attach
};

using SummonCallback = absl::AnyInvocable<void(absl::StatusOr<SummonResult>)>;
using StatusCallback = absl::AnyInvocable<void(absl::Status)>;
using RegisterCallback = absl::AnyInvocable<void(absl::StatusOr<RegisterResult>)>;
using CommitCallback = absl::AnyInvocable<void(absl::StatusOr<uint64_t>)>;

// One group's registered modules unit by unit and local rank by rank (`flatshardctl units`).
struct UnitRankInfo {
  int32_t rank = 0;
  bool summoned = false;
  int64_t shard_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t unsharded_bytes = 0;  // full buffers this rank's open summons hold for the unit
  int64_t state_bytes = 0;      // optimizer state buffers (RegisterState), live copies only
};
struct UnitInfo {
  int32_t unit = 0;
  std::string module;  // the unit's module path in the model
  std::vector<UnitRankInfo> ranks;
  UnitOp last_op;
};
struct ModuleUnits {
  std::string module;  // the registered path
  std::vector<UnitInfo> units;
  bool initialized = false;
  uint64_t generation = 0;  // the committed generation (lowest over the local ranks)
};

namespace internal {
struct AgreeRecord;
}  // namespace internal

struct ModulesOptions {
  ShardStore* store = nullptr;
  RankDevices* devices = nullptr;
  Clock* clock = nullptr;
  std::vector<std::shared_ptr<gpu::DeviceContext>> gpus;
  std::shared_ptr<KeptBufferPool> kept_pool;
  GroupTable* table = nullptr;
  Records* records = nullptr;
  const std::atomic<bool>* shutdown = nullptr;  // the daemon is shutting down
};

class Modules {
 public:
  explicit Modules(ModulesOptions options);
  Modules(const Modules&) = delete;
  Modules& operator=(const Modules&) = delete;

  // ---- The calls of GroupManager (documented there) ----
  void Register(const Caller& caller, const std::string& module,
                const absl::StatusOr<Manifest>& manifest, const absl::StatusOr<Policy>& policy,
                InitMode init, absl::Time deadline, RegisterCallback done);
  void Summon(const Caller& caller, const std::string& module, const std::string& path,
              const SummonOptions& options, absl::Time deadline, SummonCallback done,
              const gpu::IpcEventRef& written = {});
  void EndSummon(const Caller& caller, uint64_t summon, absl::Time deadline, StatusCallback done,
                 const gpu::IpcEventRef& written = {});
  absl::StatusOr<std::shared_ptr<Buffer>> BeginReduceScatter(const Caller& caller,
                                                             const std::string& module,
                                                             int32_t unit,
                                                             bool may_allocate = true);
  void FinishReduceScatter(const Caller& caller, const std::string& module, int32_t unit,
                           ReduceOp op, bool accumulate, absl::Time deadline, StatusCallback done,
                           const gpu::IpcEventRef& written = {});
  gpu::IpcEventRef RecordReady(int32_t rank);
  absl::StatusOr<RegisterResult> GetShards(const Caller& caller, const std::string& module);
  absl::StatusOr<std::string> ModuleOfSummon(const Caller& caller, uint64_t summon) const;
  absl::StatusOr<uint64_t> Generation(const Caller& caller, const std::string& module) const;
  absl::StatusOr<int64_t> SummonBytes(const Caller& caller, const std::string& module,
                                      const std::string& path, const SummonOptions& options) const;
  absl::StatusOr<int64_t> OpenSummonBytes(const Caller& caller, uint64_t summon,
                                          bool* writeback) const;
  void Commit(const Caller& caller, const std::string& module, absl::Time deadline,
              CommitCallback done, const gpu::IpcEventRef& written = {});
  absl::StatusOr<RegisterStateResult> RegisterState(const Caller& caller, const std::string& module,
                                                    const std::vector<StateSpec>& specs);
  absl::StatusOr<std::vector<ModuleUnits>> ListUnits(
      const std::string& group, const std::optional<std::string>& module) const;

  // ---- For the other owners, under the group's lock ----
  // Ends every open summon of `rank` in `g` without writeback (lease ended, leave).
  // Their buffers go through `run`, after the lock.
  void DropSummons(Group& g, int32_t rank, AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // The group re-formed after a failure: roll every initialised module's local shards back
  // to their committed generation (now, or when the copies in flight are done).
  void StartRollback(Group& g, AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // A new table of a multi-daemon group: a registered module some rank's daemon no longer
  // holds (it restarted) is dropped here too and remembered as lost, so every daemon agrees
  // that it must be registered afresh (never half re-attached, never a collective mismatch).
  // Except one a daemon killed during its initialisation left initialised on some daemons
  // only: that initialisation is undone everywhere (UndoInitLocked), nothing is lost.
  void ReconcileModules(Group& g, const peer::PeerTable& table, AfterUnlock* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Releases one `busy` of `reg` and starts a pending rollback when none is left.
  void DoneCopying(Group& g, Registered& reg, AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // FAILED_PRECONDITION naming why `reg` is not initialised; UNAVAILABLE while it rolls back.
  absl::Status CheckUsable(const Group& g, const std::string& module, const Registered& reg) const
      ABSL_SHARED_LOCKS_REQUIRED(g.mu);
  // `module`'s registration in `g` once it is initialised: NOT_FOUND for an unregistered one,
  // CheckUsable's error for one whose initial values did not commit.
  absl::StatusOr<Registered*> InitializedModule(Group& g, const std::string& module)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);

 private:
  struct RegisterExchange;
  // The steps of a summon (summon.cc tells the order and the lock invariants).
  struct ViewNeed;
  struct SummonDecision;
  struct SummonStart;
  using ViewBuffers = std::map<std::pair<int32_t, KeptUse>, std::shared_ptr<Buffer>>;

  // Register's checks under the group's lock: a re-attach (the rank's buffers, in
  // `reattached`), a re-run of an initialisation that never committed (its void init summon
  // freed through `after`), or a new registration (marked in Group::registering).
  absl::Status StartRegisterLocked(Group& g, const Caller& caller, const std::string& module,
                                   const absl::StatusOr<Plan>& plan,
                                   std::optional<RegisterResult>* reattached, AfterUnlock* after)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Commits (or drops) a registration once its agreement (server/registration.h) ended.
  // (--testing_pause_register_install may delay a rank's install: init_undo.h.)
  void FinishRegister(std::shared_ptr<RegisterExchange> x, absl::Status status);
  void InstallRegistration(std::shared_ptr<RegisterExchange> x, absl::Status status);
  // The kept-buffer cache of `reg` (made on first use).
  // REQUIRES: the lock of `reg`'s group (KeptOf, ReleaseKept).
  std::shared_ptr<KeptBuffers> KeptOf(Registered& reg);
  // The unit whose kept buffers `unit` uses when it is the `nth` unit of its size among the
  // units one call needs at once: the nth unit of the plan with the same padded size and
  // dtype. Units of one size (a transformer's blocks) summoned one at a time share a few
  // buffers, which a training step passes from unit to unit, instead of keeping a whole
  // model's worth resident: memory as FSDP's (a few units unsharded), still without an mmap
  // or a page fault per summon; a summon of many units still finds one kept buffer each.
  // REQUIRES: the lock of `reg`'s group; `nth` below the number of units of that size.
  static int32_t KeptUnit(Registered& reg, int32_t unit, int nth = 0);
  // Marks kept buffers nobody uses any more as idle from now.
  void ReleaseKept(Registered& reg);
  // Drops `open`'s references to its buffers: at once where another reference remains (the
  // kept set's, so ReleaseKept then sees them unused), else through `after`, after the lock.
  static void ReleaseBuffers(OpenSummon& open, AfterUnlock* after);
  void FinishEnd(const Caller& caller, uint64_t summon, absl::Status status, StatusCallback done);
  void RollbackNow(Group& g, const std::string& module, Registered& reg, AfterUnlock* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // ReconcileModules: a daemon was killed during `module`'s initialisation and not every
  // daemon holds its initial values (internal::InitUndoneEverywhere): it is not initialised
  // here any more (`why`), so every rank's next Register runs the init again; its record goes.
  // An init End still copying here fails when it finishes (Registered::init_undone).
  void UndoInitLocked(Group& g, const std::string& module, const std::string& why, AfterUnlock* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // A refused agreement with a stale rank: rolls the caller's shards of `module` back.
  void RollbackRank(const Caller& caller, const std::string& module);
  // Runs the agreement all-gather of a writeback End or a Commit; `done` gets OK when every
  // rank's record says ok, else the first refusal (and whether a stale rank refused).
  void Agree(const std::shared_ptr<collective::CollectiveGroup>& coll, const Caller& caller,
             const internal::AgreeRecord& mine, int32_t world_size, int64_t unit,
             const std::string& what, absl::Time deadline,
             absl::AnyInvocable<void(absl::Status, bool stale)> done);
  // Where `rank`'s buffers go (host, or its GPU).
  Placement PlacementOf(int32_t rank) const { return devices_.PlacementOf(rank); }
  // The public collective calls continue here once the trainer's `written` event was reached
  // (RankDevices::AfterTrainerWrites; `local` is that wait's status where a failure is the
  // rank's "no" in an agreement).
  // Summon: `unwaited` is the trainer's event not waited for yet (--gpu_device_ordering: a
  // stream wait where the summon's work is all on the rank's stream, else a host wait).
  void SummonWritten(const Caller& caller, const std::string& module, const std::string& path,
                     const SummonOptions& options, absl::Time deadline, SummonCallback done,
                     const gpu::IpcEventRef& unwaited = {});
  // A decided summon's copies and casts (on the rank's device worker), then StartUnshard.
  void UnshardWritten(const Caller& caller, absl::Time deadline, std::shared_ptr<SummonStart> start,
                      SummonCallback done);
  absl::Status DecideSummon(Group& g, const Caller& caller, const std::string& module,
                            const std::string& path, const SummonOptions& options,
                            SummonDecision* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  void OpenSummonLocked(Group& g, const Caller& caller, const std::string& module,
                        const std::string& path, const SummonOptions& options,
                        const SummonDecision& d, const ViewBuffers& got, SummonStart* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  void StartUnshard(const Caller& caller, absl::Time deadline, std::shared_ptr<SummonStart> start,
                    SummonCallback done);
  // Drops the node-copy marks a summon set in `slot` (SummonSlot::making) and hands the
  // summons that waited for them to `waiting` (run after the lock).
  void UnmarkMaking(std::shared_ptr<SummonSlot> slot,
                    std::vector<std::pair<int32_t, KeptUse>>* marked,
                    AfterUnlock* waiting);  // REQUIRES: the lock of the slot's group
  // rank0_only writeback End: gets the buffers rank 0's broadcast lands in (without the lock)
  // and builds the broadcasts; UNAVAILABLE when the summon was dropped meanwhile.
  absl::Status PrepareRank0Broadcast(const Caller& caller, uint64_t summon, const Plan& plan,
                                     const std::vector<UnitShard>& shards,
                                     const std::shared_ptr<KeptBuffers>& kept,
                                     const std::vector<ViewNeed>& needs, int64_t owner_uid,
                                     OpenSummon* copy,
                                     std::vector<collective::CollectiveOp>* broadcasts);
  // RegisterState's steps (optimizer_state.cc): the checks and what to allocate (or the
  // existing buffers of a re-attach) under the lock, the allocation without it, and the
  // buffers installed under it again.
  struct StateAllocation;
  absl::Status StartStateLocked(Group& g, const Caller& caller, const std::string& module,
                                const std::vector<StateSpec>& specs, StateAllocation* alloc,
                                std::optional<RegisterStateResult>* attached)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  absl::Status AllocateState(const Caller& caller, const std::string& module,
                             const std::vector<StateSpec>& specs, StateAllocation* alloc);
  absl::StatusOr<RegisterStateResult> InstallStateLocked(Group& g, const Caller& caller,
                                                         const std::string& module,
                                                         const std::vector<StateSpec>& specs,
                                                         const absl::Status& allocated,
                                                         StateAllocation* alloc)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  void EndSummonWritten(const Caller& caller, uint64_t summon, absl::Time deadline,
                        StatusCallback done, absl::Status local);
  // The steps of a writeback End (end.cc): the checks and snapshot under the group's lock,
  // the agreement every rank reaches, the copies into this rank's shards and committed copies
  // (after any checkpoint holding them), and the answer.
  struct EndStart;
  struct WritebackEnd;
  absl::Status StartEndLocked(Group& g, const Caller& caller, uint64_t summon,
                              const absl::Status& local, EndStart* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  void AgreeEnd(std::shared_ptr<const WritebackEnd> end,
                std::shared_ptr<collective::CollectiveGroup> coll,
                const internal::AgreeRecord& record, int32_t world_size, absl::Time deadline,
                std::unique_ptr<OpenSummon> owned, StatusCallback done);
  void ApplyEnd(std::shared_ptr<const WritebackEnd> end, std::unique_ptr<OpenSummon> owned,
                StatusCallback done);
  // `deferral` (batched Ends, host ranks): receives the own ranges' copy into the committed
  // copies when it can be deferred (DeferredCommit).
  absl::Status WriteBack(const WritebackEnd& end, std::unique_ptr<OpenSummon> copy,
                         DeferredCommit* deferral = nullptr);
  void FinishAppliedEnd(const WritebackEnd& end, absl::Status s, StatusCallback done);
  // Without a state directory, after `end` wrote its own range into its shards: copies it into
  // its committed copies too (`later`: from the summon's buffers `sources`, held till then) on
  // background_, while the End answers (server/module/pending_committed.h).
  void CommitInBackground(const WritebackEnd& end, std::vector<ParallelCopier::Copy> later,
                          std::vector<std::shared_ptr<Buffer>> sources);
  // Runs `copy` (already in the module's pending_committed) on background_; `generation`
  // (a recorded one's): --testing_pause_end_vote=deferred_copy:G pauses it first.
  void RunPendingInBackground(const Caller& caller, const std::string& module,
                              std::shared_ptr<PendingCopy> copy, uint64_t generation = 0);
  // Runs (or waits for) the copies into `rank`'s committed copies of `module` that writeback
  // Ends left pending (every local rank's for -1). Without the group's lock.
  void FinishPendingCopies(const std::string& group, const std::string& module, int32_t rank);
  // A writeback End over several daemons (end_vote.cc): once every local rank wrote back
  // (`written`: this rank's), the daemon records its vote and the ranks exchange votes;
  // EndVoted copies (all voted yes) or answers `finish` with the failure.
  void VoteEnd(std::shared_ptr<const WritebackEnd> end, absl::Status written,
               absl::AnyInvocable<void(absl::Status)> finish, DeferredCommit deferred);
  void EndVoted(std::shared_ptr<const WritebackEnd> end, absl::Status s,
                absl::AnyInvocable<void(absl::Status)> finish, DeferredCommit deferred);
  void FinishReduceScatterWritten(const Caller& caller, const std::string& module, int32_t unit,
                                  ReduceOp op, bool accumulate, absl::Time deadline,
                                  StatusCallback done);
  // FinishReduceScatterWritten's steps (reduce_scatter.cc): takes the rank's staging buffer
  // and gradient shard under the lock; records the outcome (the new gradient shard, the
  // failure a repeated finish answers) under it again.
  struct GradFinish;
  absl::Status TakeGradStagingLocked(Group& g, const Caller& caller, const std::string& module,
                                     int32_t unit, GradFinish* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  void SettleReduceScatter(const Caller& caller, const std::string& module, int32_t unit,
                           const std::shared_ptr<Buffer>& grad, bool fresh, const absl::Status& s);
  void CommitWritten(const Caller& caller, const std::string& module, absl::Time deadline,
                     CommitCallback done, absl::Status local);
  // The copies into `rank`'s committed copies and the records around them (`work`), then
  // `done`: on the rank's GPU worker (RankDevices::RunBlocking), on the durable worker for a
  // host rank of a daemon keeping records (Records::RunDurable: fsyncs never on a reactor or
  // a completion thread), else at once (memory copies only).
  void RunDurableWork(const Caller& caller, absl::AnyInvocable<absl::Status()> work,
                      absl::AnyInvocable<void(absl::Status)> done);
  // Every rank agreed to commit: copies the caller's shards into its committed copies (after
  // any checkpoint holding them) and answers the new generation.
  void CommitAgreed(const Caller& caller, const std::string& module, uint64_t generation,
                    CommitCallback done);

  ShardStore* const store_;
  RankDevices& devices_;
  Clock* const clock_;
  const std::vector<std::shared_ptr<gpu::DeviceContext>> gpus_;
  const std::shared_ptr<KeptBufferPool> kept_pool_;
  NodeAssembly assembly_;  // read-only summons' node copies (summon.cc)
  GroupTable& table_;
  Records& records_;
  const std::atomic<bool>& shutdown_;
  // CommitInBackground's copies, one strand per group and rank. Last: destroyed first, running
  // the copies still queued while the rest is whole.
  BlockingWorkers background_{2};
};

}  // namespace flatshard::server

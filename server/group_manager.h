#pragma once
// GroupManager: the groups a daemon hosts, their membership, sessions and registered models.
//
// A group is one training job: `world_size` ranks, an id and a token. Either every rank joins
// this daemon (a local group: collectives move bytes by memcpy), or the ranks are spread over
// several daemons (a multi-daemon group: each rank's join names the group's coordinator; the
// daemons meet there through PeerClient, learn the peer table and connect the remote backend,
// UCX). Join, RegisterModule, Summon, EndSummon and FinishReduceScatter are collective: a call
// waits (asynchronously, through its callback) until every rank made the matching call or its
// deadline passes. RegisterModule agrees through an exchange over the group's collectives (plan
// fingerprints, init mode, allocation outcome), so the same rules hold on one daemon or many.
// Shards are allocated in the ShardStore when a registration completes and outlive the trainer
// sessions that made them: a restarted trainer joins the same rank again and re-attaches.
//
// Failures of a multi-daemon group's collectives are reported to its coordinator, which tells
// the other daemons (PeerEvents); they fail every pending and later op of the group with one
// sticky status until every rank joins again and the group re-forms at a new epoch.
//
// The work is done by owners, each in its own folder with its own state and lock: membership
// (groups, joins, sessions, leases, connect: server/group/), modules (registration, summon,
// End, Commit, rollback, reduce-scatter, optimizer state: server/module/), durability
// (records, commit intents, adoption: server/durable/) and checkpoints (server/checkpoint/).
// GroupManager builds them and routes each call to its owner.
//
// Thread-safe. Every group has its own lock: two groups never wait on each other. Callbacks
// run exactly once, never under a lock, on the calling thread, a worker or the deadline
// thread.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/after_unlock.h"
#include "common/checkpoint/checkpoint.h"
#include "common/clock.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "common/rpc_types.h"
#include "common/state_spec.h"
#include "server/checkpoint/checkpoints.h"
#include "server/collective/collective_engine.h"
#include "server/collective/communicator_factory.h"
#include "server/collective/staging/staging_communicator.h"
#include "server/durable/records.h"
#include "server/durable/state_dir.h"
#include "server/gpu/device_context.h"
#include "server/group/group.h"
#include "server/group/group_table.h"
#include "server/group/membership.h"
#include "server/group/trainer_collectives.h"
#include "server/kept_buffers.h"
#include "server/module/module.h"
#include "server/module/modules.h"
#include "server/peer/peer_client.h"
#include "server/rank_devices.h"
#include "server/shard_store.h"

namespace flatshard::server {

class CheckpointPeerClient;

// The RPC-level values (Caller, InitMode, SummonOptions, ReduceOp, IpcEvent) have their one
// home in common/rpc_types.h, their wire mapping in common/proto_convert.h.

struct GroupManagerOptions {
  // This daemon as peers see it. An empty `self.peer_address` refuses multi-daemon groups;
  // `self.backend_address` is filled in from `remote_backend`.
  peer::DaemonIdentity self;
  peer::PeerOptions peer;
  // Moves bytes between daemons (UCX). Required for multi-daemon groups.
  std::unique_ptr<collective::CollectiveBackend> remote_backend;
  // GPU daemons (--gpus): rank r of every group lives on gpus[r % gpus.size()] (its shards,
  // gradients and unsharded buffers are device memory there; the ShardStore has the same
  // contexts' pools). Empty: host memory only (the default).
  std::vector<std::shared_ptr<gpu::DeviceContext>> gpus;
  // RankDevices' device_ordering (flatshardd --gpu_device_ordering).
  bool gpu_device_ordering = false;
  // NCCL for groups whose local ranks are each on their own GPU; null (no NCCL build, or
  // --gpu_collectives=host): device groups move bytes over the host path, staged.
  std::unique_ptr<collective::CollectiveBackend> nccl_backend;
  // Host <-> device copies for staging; required with `gpus`.
  std::shared_ptr<collective::DeviceCopier> copier;
  // A rank whose join completed must open its lease (AttachLease) within this, or its session
  // ends as if its lease had closed (--lease_timeout).
  absl::Duration lease_timeout = absl::Seconds(10);

  // A group in which no rank has had a session (nor a join under way) for this long is
  // removed with its registered modules and memory, and that is logged (flatshardd
  // --group_idle_timeout). Zero or infinite: never.
  absl::Duration group_idle_timeout = kDefaultGroupIdleTimeout;
  // Groups one uid may have on this daemon at a time (its first JoinGroup creates one):
  // RESOURCE_EXHAUSTED naming the uid, the quota and its groups beyond (--max_groups_per_uid).
  // 0: no quota.
  int32_t max_groups_per_uid = kDefaultMaxGroupsPerUid;
  // What the manager's deadlines (joins, leases, idle groups, deferred failures, kept
  // buffers) are read against; null: Clock::Real(). Unit tests pass a FakeClock.
  Clock* clock = nullptr;
  // Where the in-process backend ("inproc") of local groups comes from; null: a registry of
  // the built-in backends. Must outlive the manager's construction. Tests pass one with a
  // backend of their own (e.g. one whose Connect is slow).
  const collective::BackendRegistry* backend_registry = nullptr;

  // Restarts (README "Restarts"): where the groups' records go (--state_dir); null: nothing
  // is recorded and a restart loses the shards. Must outlive the manager.
  state::StateDir* state_dir = nullptr;
  // Testing only (--testing_commit_copy_pause): every commit copy copies unit 0, logs
  // "testing: commit copy ... paused" and sleeps this long before the rest, so a test can
  // kill the daemon while a committed copy is torn. Zero: off.
  absl::Duration testing_commit_copy_pause = absl::ZeroDuration();

  static constexpr absl::Duration kDefaultGroupIdleTimeout = absl::Hours(1);
  static constexpr int32_t kDefaultMaxGroupsPerUid = 64;
};

class GroupManager : public peer::PeerEvents {
 public:
  explicit GroupManager(ShardStore* store, GroupManagerOptions options = {});
  // Fails every pending wait with UNAVAILABLE.
  ~GroupManager() override;
  GroupManager(const GroupManager&) = delete;
  GroupManager& operator=(const GroupManager&) = delete;

  // Joins `args.rank`; `done` runs when all ranks are joined (OK with a new session) or at
  // `deadline` (DEADLINE_EXCEEDED naming the missing ranks). The first joiner creates the
  // group; later ones must agree on world_size (INVALID_ARGUMENT) and token
  // (PERMISSION_DENIED). A rank with a live session cannot join twice (ALREADY_EXISTS).
  void Join(const JoinArgs& args, absl::Time deadline, JoinCallback done);

  // The session's lease stream opened: from now on its end (EndSession) ends the session.
  // CheckCaller's errors; ALREADY_EXISTS when the session already has a lease (a second
  // stream with the same caller is refused, so its closing cannot end the session).
  absl::Status AttachLease(const Caller& caller);

  // OK when `caller` names a joined rank of an existing group with the right token and its
  // current session. NOT_FOUND (group), PERMISSION_DENIED (token), FAILED_PRECONDITION
  // (stale or unknown session), INVALID_ARGUMENT (rank out of range).
  absl::Status CheckCaller(const Caller& caller) const;

  // Collective over the group's ranks. Each rank plans `manifest` under `policy`; when all
  // ranks arrived, their plans must be equal (else every rank gets INVALID_ARGUMENT naming
  // the first differing unit and the ranks), then every rank's shards are allocated (zeros)
  // and, for the FROM_* init modes, an init summon is opened on every rank.
  // ALREADY_EXISTS for a path already registered; INVALID_ARGUMENT for a path nested in (or
  // containing) a registered one ("already has flatshard applied").
  // A refused manifest or policy still arrives, so the other ranks fail at once too.
  void Register(const Caller& caller, const std::string& module,
                const absl::StatusOr<Manifest>& manifest, const absl::StatusOr<Policy>& policy,
                InitMode init, absl::Time deadline, RegisterCallback done);

  // Collective: unshards the units of `module` selected by `path` and `options` (all-gather,
  // or gather to rank 0 under rank0_only) and returns the buffers this rank may map. Units
  // already summoned by this rank: FAILED_PRECONDITION with FSDP's wording. With
  // writeback=false and rank0_only=false all local ranks share one read-only copy per unit.
  // `written` (GPU ranks): the trainer's event after its last write to its shards; the
  // daemon waits for it before the all-gather reads them (EndSummon and FinishReduceScatter
  // alike for the views and the full gradient).
  void Summon(const Caller& caller, const std::string& module, const std::string& path,
              const SummonOptions& options, absl::Time deadline, SummonCallback done,
              const gpu::IpcEventRef& written = {});
  // Ends summon `summon` of the caller's rank: writes back its own unpadded range (from rank
  // 0's buffer under rank0_only, after rank 0 ended) when the summon asked for it, then
  // frees the buffers and returns the units to IDLE.
  // Crash consistency (semantics.md §3a): a writeback End is collective and atomic. Every
  // rank's End first joins an agreement (an all-gather of one small record per rank); only
  // when every rank of the summon arrived and can apply does any rank write back, and then
  // every rank does. A rank whose session ended (UNAVAILABLE naming it, at once) or that
  // missed the deadline (DEADLINE_EXCEEDED naming it) fails every rank's End and no shard
  // changes. An agreed writeback End also commits the module's shards (as Commit). An End
  // repeated after a failure answers the same status. A read-only End waits for nobody.
  void EndSummon(const Caller& caller, uint64_t summon, absl::Time deadline, StatusCallback done,
                 const gpu::IpcEventRef& written = {});

  // Phase 1 of ReduceScatterGrads: a private buffer the caller writes the unit's full padded
  // gradient into. Without `may_allocate`: null (and nothing changed) where a buffer would
  // have to be allocated (a thread that must not block asks; the steady state needs none).
  absl::StatusOr<std::shared_ptr<Buffer>> BeginReduceScatter(const Caller& caller,
                                                             const std::string& module,
                                                             int32_t unit,
                                                             bool may_allocate = true);
  // Phase 2 (collective): reduce-scatters what was written; each rank's gradient shard gets
  // its slice (SUM or AVG), added to it when `accumulate`, else replacing it.
  void FinishReduceScatter(const Caller& caller, const std::string& module, int32_t unit,
                           ReduceOp op, bool accumulate, absl::Time deadline, StatusCallback done,
                           const gpu::IpcEventRef& written = {});
  // GPU ranks: an event recorded on `rank`'s device now (after its gradient shard update, for
  // the reply of FinishReduceScatter). id 0 for host ranks.
  gpu::IpcEventRef RecordReady(int32_t rank);

  // The caller's shards of a registered model (re-attach, optimizer step), with the
  // generation they hold. Also marks the caller's views fresh after a rollback (see Commit).
  // While the group has failed and waits to re-form, the shards may still hold an
  // uncommitted step (they roll back at the re-form; a Commit from views read before it is
  // refused). FAILED_PRECONDITION for a module whose initialisation did not commit (naming
  // why); UNAVAILABLE while its shards are being rolled back.
  absl::StatusOr<RegisterResult> GetShards(const Caller& caller, const std::string& module);
  // Read-only lookups for EndSummon's answer: the module of the caller's open summon
  // `summon`, and the committed generation the caller's shards of `module` hold now.
  // NOT_FOUND for an unknown group, summon or module.
  absl::StatusOr<std::string> ModuleOfSummon(const Caller& caller, uint64_t summon) const;
  absl::StatusOr<uint64_t> Generation(const Caller& caller, const std::string& module) const;
  // Read-only lookups for where ShardService runs a Summon or an End (its RPC thread only for
  // small ones): the bytes of the unsharded views a Summon of `path` in `module` with
  // `options` makes, and of the caller's open summon `summon`'s views (and whether its End
  // writes back). NOT_FOUND as above.
  absl::StatusOr<int64_t> SummonBytes(const Caller& caller, const std::string& module,
                                      const std::string& path, const SummonOptions& options) const;
  absl::StatusOr<int64_t> OpenSummonBytes(const Caller& caller, uint64_t summon,
                                          bool* writeback) const;

  // Collective: closes the current step of `module`. Trainers update shards in place (the
  // optimizer); when every rank has called Commit (an agreement all-gather, as EndSummon),
  // each rank's shards are copied into its committed copy and the generation goes up by one;
  // `done` gets the new generation. Rollback rule: whenever the group's collectives failed
  // (a rank's session ended, a deadline, a mismatch, a daemon lost) the group re-forms once
  // every rank has joined again, and at that re-form every daemon copies each of its ranks'
  // committed shards back (parameters; gradient shards are not rolled back: the next
  // reduce-scatter overwrites them). So after any failure, every rank resumes from the last
  // committed generation, never from a mix of two steps. A rank must read its views again
  // (Register or GetShards) after a rollback before it commits: a Commit (or writeback End)
  // from a rank that did not is refused on every rank (FAILED_PRECONDITION naming it) and
  // rolls every rank's shards back, since its in-place writes may straddle the rollback.
  // Errors: as EndSummon's agreement (UNAVAILABLE / DEADLINE_EXCEEDED / ABORTED naming the
  // rank); NOT_FOUND for an unregistered module; FAILED_PRECONDITION for an uninitialised
  // one.
  // `written` (GPU ranks): the trainer's event after its last write to its shards.
  void Commit(const Caller& caller, const std::string& module, absl::Time deadline,
              CommitCallback done, const gpu::IpcEventRef& written = {});

  // Local (per rank): the optimizer state buffers of `module` for the caller's rank: per unit
  // and spec, a buffer next to the rank's shard (same placement; SHARD: shard_numel elements,
  // SCALAR: one), zero-filled when new, and its committed copy. They live as long as the
  // shards and are part of every commit and rollback exactly like them (Commit): a Commit
  // before the rank registered state commits none of it; state registered after the last
  // commit rolls back to zeros. The first call for a module on this daemon fixes its spec; the
  // same spec again returns the existing buffers (a restarted trainer re-attaches). Unlike
  // GetShards it does not mark the caller's views fresh after a rollback (see Commit). Errors:
  // INVALID_ARGUMENT naming the bad field (ValidateStateSpecs); FAILED_PRECONDITION naming the
  // first differing state and field for another spec, or a rank that holds no shards; GetShards'
  // errors for the module; the ShardStore's (RESOURCE_EXHAUSTED) when the buffers cannot be
  // allocated (nothing is kept).
  absl::StatusOr<RegisterStateResult> RegisterState(const Caller& caller, const std::string& module,
                                                    const std::vector<StateSpec>& specs);

  // Collective small values and bytes over the group's ranks (TrainerCollectives, documented
  // there): `done` runs once every rank's call completed, or with the error.
  void AllReduceValues(const Caller& caller, ValuesType type, ValuesOp op, std::string values,
                       absl::Time deadline, TrainerCollectives::BytesCallback done) {
    collectives_.AllReduce(caller, type, op, std::move(values), deadline, std::move(done));
  }
  void BroadcastBytes(const Caller& caller, int32_t root, std::string data, absl::Time deadline,
                      TrainerCollectives::BytesCallback done) {
    collectives_.Broadcast(caller, root, std::move(data), deadline, std::move(done));
  }

  // Ends the caller's session; its rank can join again. Shards stay. Fail fast: the group's
  // collectives fail from now on with UNAVAILABLE naming the rank (on every daemon, through
  // the coordinator), after the ops the rank had already submitted complete (at most
  // kDeferFailureAtMost), until every rank has joined again; the re-form then rolls every
  // rank back to the last committed generation (see Commit).
  absl::Status Leave(const Caller& caller);
  // The session's lease ended (stream closed, client died): as Leave, without a caller check.
  void EndSession(const std::string& group, uint64_t session);

  // Fails every pending wait with UNAVAILABLE and refuses new work; idempotent.
  void Shutdown();

  // Removes group `group` from this daemon with everything it holds here (registered modules,
  // shards, gradients, kept buffers; their segments go once no client maps them), for an
  // operator (AdminService.DeleteGroup). `uid`: the caller's (-1 remote); `privileged`: root
  // or the daemon's uid, who may delete any group. Errors: NOT_FOUND (no such group here),
  // PERMISSION_DENIED (another uid's group), FAILED_PRECONDITION naming the ranks still
  // joined or joining (they must Leave first; their sessions are not ended for them).
  using DeletedGroup = server::DeletedGroup;

  absl::StatusOr<DeletedGroup> DeleteGroup(const std::string& group, int64_t uid, bool privileged);

  // Groups and their joined ranks, for status output and tests.
  using GroupInfo = server::GroupInfo;

  std::vector<GroupInfo> ListGroups() const;

  // Each group's collectives that have not completed (for `flatshardctl pending`).
  using GroupCollectives = server::GroupCollectives;

  std::vector<GroupCollectives> ListCollectives(const std::string& group) const;

  // From now on Join fails with UNAVAILABLE "flatshardd is draining": no new groups, no new
  // or returning ranks. Everything else goes on. Idempotent; lasts until StopDrain.
  void StartDrain();
  // Ends a drain: joins are accepted again. Whether it was draining (false: nothing changed).
  bool StopDrain();

  // Counts over every group (`flatshardctl status`, drain progress).
  using Stats = server::GroupStats;

  Stats GetStats() const;

  // One group's registered modules unit by unit and local rank by rank (`flatshardctl units`).
  using UnitRankInfo = server::UnitRankInfo;

  using UnitOp = server::UnitOp;
  using UnitInfo = server::UnitInfo;

  using ModuleUnits = server::ModuleUnits;

  // NOT_FOUND for an unknown group, or an unregistered `module` when one is given.
  absl::StatusOr<std::vector<ModuleUnits>> ListUnits(
      const std::string& group, const std::optional<std::string>& module) const;

  // ---- Restarts (server/durable/; README "Restarts") ----
  // At start, before serving: takes over the groups of `records` (GroupManagerOptions::
  // state_dir's LoadAll) with their shards, gradient shards and committed copies, whose
  // segments the previous daemon left. Per group, every buffer must adopt (ShardStore::Adopt:
  // the segment exists, has the recorded size and owner) and every module's plan and manifest
  // must parse and match the buffers' sizes; otherwise the group is refused (logged, naming
  // the record and the failed check) and its segments are left alone. Commits that were under
  // way are finished or not as their record says (a torn committed copy is never used), then
  // every rank's shards are restored from its committed copy (a writeback may have torn them).
  // Adopted groups have no sessions: ranks join and re-attach as after a trainer crash.
  using AdoptSummary = server::AdoptSummary;
  AdoptSummary AdoptGroups(const std::vector<state::GroupRecord>& records);
  // Removes every group's record and records nothing from now on (SIGTERM without
  // --keep_shards: the segments go, so the records must too).
  void ForgetState();
  // GPU daemons, SIGTERM with --keep_shards (before ShardStore::Shutdown): device memory dies
  // with the process, so each local rank's committed device shards of every initialised
  // module with no commit under way are copied into host segments (role host_committed) and
  // recorded; the next daemon copies them into fresh device buffers (shards and committed
  // copies at that generation; gradient shards are not kept). Logs what it kept.
  void KeepDeviceShards();

  // peer::PeerEvents (called by the PeerClient's threads).
  void OnTable(const std::string& coordinator, const peer::PeerTable& table) override;
  void OnGroupFailed(const std::string& coordinator, const std::string& group, uint64_t epoch,
                     const absl::Status& status) override;
  void OnCoordinatorLost(const std::string& coordinator, const absl::Status& status) override;

  // ---- Checkpoints (server/checkpoint/; README "Checkpoints") ----
  // Progress of a save or load, read by another thread while it runs.
  using CheckpointProgress = server::CheckpointProgress;
  using CheckpointArgs = server::CheckpointArgs;
  using CheckpointResult = server::CheckpointResult;
  // Writes the committed shards of `args.module` (one generation on every rank) to
  // `args.dir` in flatshard.checkpoint/1: one file per rank in parallel, metadata.json last.
  // Commits that would overwrite the committed copies wait until the data files are written.
  // Blocking (file I/O): never call on a gRPC reactor thread. Errors: NOT_FOUND,
  // PERMISSION_DENIED (another uid's group), FAILED_PRECONDITION (uninitialised module, a rank
  // without shards), DEADLINE_EXCEEDED (copies in flight past `wait`),
  // INTERNAL naming the file and call that failed. Multi-daemon groups: the other daemons
  // write their ranks (CheckpointPeerService) into the same directory, a shared file system;
  // ABORTED when their generations kept differing (commits landing between their holds).
  absl::StatusOr<CheckpointResult> SaveCheckpoint(const CheckpointArgs& args,
                                                  CheckpointProgress* progress);

  // Loads a checkpoint directory or a safetensors file into the registered, initialised
  // module (resharding by FQN and element range). Checks everything before any shard changes;
  // then writes every local rank's shards and committed copies (a committed step). The
  // module's generation becomes the checkpoint's (a safetensors import: the current one + 1),
  // and every rank must read its views again before its next commit (`stale`).
  // FAILED_PRECONDITION while a summon of the module is open, for a source that does not fit
  // the module (naming the FQN), for an incomplete or corrupt checkpoint (naming the file and
  // the check); otherwise as SaveCheckpoint.
  absl::StatusOr<CheckpointResult> LoadCheckpoint(const CheckpointArgs& args,
                                                  CheckpointProgress* progress);

  // ---- Published weights (server/publish/; README "Publishing weights") ----
  // What the publisher needs to know of a publishing rank's group: CheckCaller's errors.
  struct PublisherGroup {
    int32_t world_size = 0;
    bool multi = false;       // its ranks join through several daemons
    int64_t owner_uid = -1;   // the group's uid
    int32_t local_ranks = 0;  // of this daemon
    // Multi-daemon groups: the peer address of rank 0's daemon (the publish leader; empty
    // when that is this daemon) and the group's token (for calls to the other daemons).
    std::string leader;
    std::string token;
  };
  absl::StatusOr<PublisherGroup> CheckPublisher(const Caller& caller) const;
  // Checkpoints::ReadCommitted (documented there).
  absl::Status ReadCommitted(const CheckpointArgs& args,
                             const std::function<absl::Status(const CommittedCopies&)>& read);

 private:
  ShardStore* const store_;
  const std::vector<std::shared_ptr<gpu::DeviceContext>> gpus_;
  Clock* const clock_;
  // Placement and copies of each rank's memory; host waits on devices run on its workers.
  // Declared before the engine: it outlives the engine's callbacks (stopped in the destructor).
  RankDevices devices_;
  std::unique_ptr<collective::CommunicatorFactory> comms_;
  collective::CollectiveEngine engine_;
  // Every registered module's kept buffers (Registered::kept), decommitted when idle.
  const std::shared_ptr<KeptBufferPool> kept_pool_;
  // Set once by Shutdown (Membership), read by every owner: no new work once it is.
  std::atomic<bool> shutting_down_{false};
  // The owners, each with its own state and lock (see each header); they find each group in
  // the table and work under the group's own lock.
  GroupTable table_;
  TrainerCollectives collectives_{&table_, clock_, &shutting_down_};
  Records records_;
  std::unique_ptr<Modules> modules_;
  std::unique_ptr<Membership> membership_;
  std::unique_ptr<CheckpointPeerClient> checkpoint_peers_;
  std::unique_ptr<Checkpoints> checkpoints_;
  // Last: destroyed first, so no PeerEvents arrive while the rest is torn down.
  std::unique_ptr<peer::PeerClient> peer_;
};

}  // namespace flatshard::server

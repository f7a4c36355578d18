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
// Thread-safe. Callbacks run exactly once, never under the manager's lock, on the calling
// thread or on the manager's deadline thread.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/checkpoint/checkpoint.h"
#include "common/clock.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"
#include "common/rpc_types.h"
#include "common/state_spec.h"
#include "server/collective/collective_engine.h"
#include "server/collective/communicator_factory.h"
#include "server/collective/staging/staging_communicator.h"
#include "server/gpu/device_context.h"
#include "server/kept_buffers.h"
#include "server/peer/peer_client.h"
#include "server/rank_devices.h"
#include "server/shard_store.h"
#include "server/durable/state_dir.h"

namespace flatshard::server {

// The RPC-level values (Caller, InitMode, SummonOptions, ReduceOp, IpcEvent) have their one
// home in common/rpc_types.h, their wire mapping in common/proto_convert.h.

// The reduce op of FinishReduceScatter was GroupManager's own enum; it is the RPC-level one now
// (the same type as collective::ReduceOp). The old name stays for existing callers.
using GradReduce = ReduceOp;

namespace internal {
struct AgreeRecord;
struct DurablePair;
}  // namespace internal

struct JoinArgs {
  std::string group;
  int32_t world_size = 0;
  int32_t rank = 0;
  std::string token;
  std::string coordinator;  // peer address of the coordinator; empty: a local group
  int64_t uid = -1;          // as Caller::uid; the first joiner's uid owns a new group
  // True once the caller went away (its JoinGroup call was cancelled: the trainer died or gave
  // up); a pending join is then withdrawn, never completed for it. Called under the manager's
  // lock while the join is pending, never after its callback ran. Empty: never gone.
  std::function<bool()> caller_gone;
};

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

struct JoinResult {
  uint64_t session = 0;
  std::vector<std::string> registered_modules;  // re-attach targets
  // Multi-daemon groups re-formed after a daemon lost its shards (it restarted): one line per
  // module that was dropped on every daemon, naming the ranks and daemons whose shards are
  // gone. Such a module must be registered afresh.
  std::vector<std::string> lost_modules;
};

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

using JoinCallback = absl::AnyInvocable<void(absl::StatusOr<JoinResult>)>;
using SummonCallback = absl::AnyInvocable<void(absl::StatusOr<SummonResult>)>;
using StatusCallback = absl::AnyInvocable<void(absl::Status)>;
using RegisterCallback = absl::AnyInvocable<void(absl::StatusOr<RegisterResult>)>;
using CommitCallback = absl::AnyInvocable<void(absl::StatusOr<uint64_t>)>;

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
  // gradient into.
  absl::StatusOr<std::shared_ptr<Buffer>> BeginReduceScatter(const Caller& caller,
                                                             const std::string& module,
                                                             int32_t unit);
  // Phase 2 (collective): reduce-scatters what was written; each rank's gradient shard gets
  // its slice (SUM or AVG), added to it when `accumulate`, else replacing it.
  void FinishReduceScatter(const Caller& caller, const std::string& module, int32_t unit,
                           ReduceOp op, bool accumulate, absl::Time deadline,
                           StatusCallback done, const gpu::IpcEventRef& written = {});
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
  // GetShards it does not mark the caller's views fresh after a rollback (see Commit). Errors: INVALID_ARGUMENT naming the bad field
  // (ValidateStateSpecs); FAILED_PRECONDITION naming the first differing state and field for
  // another spec, or a rank that holds no shards; GetShards' errors for the module; the
  // ShardStore's (RESOURCE_EXHAUSTED) when the buffers cannot be allocated (nothing is kept).
  absl::StatusOr<RegisterStateResult> RegisterState(const Caller& caller,
                                                    const std::string& module,
                                                    const std::vector<StateSpec>& specs);

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
  struct DeletedGroup {
    std::string group;
    std::vector<std::string> modules;
    int64_t freed_bytes = 0;    // of the buffers the group held (host and device)
    int64_t freed_buffers = 0;
  };
  absl::StatusOr<DeletedGroup> DeleteGroup(const std::string& group, int64_t uid,
                                           bool privileged);

  // Groups and their joined ranks, for status output and tests.
  struct GroupInfo {
    std::string group;
    int32_t world_size = 0;
    std::vector<int32_t> joined_ranks;
    std::vector<std::string> registered_modules;
    uint64_t epoch = 0;
    std::string coordinator;  // empty: a local group
    std::vector<int32_t> local_ranks;
    absl::Status status;  // the sticky error of the group's collectives, if any
  };
  std::vector<GroupInfo> ListGroups() const;

  // Each group's collectives that have not completed (for `flatshardctl pending`).
  struct GroupCollectives {
    std::string group;
    int32_t world_size = 0;
    uint64_t epoch = 0;
    std::vector<int32_t> local_ranks;
    absl::Status status;  // the sticky error, if any
    std::vector<collective::PendingOpInfo> pending;
  };
  std::vector<GroupCollectives> ListCollectives(const std::string& group) const;

  // From now on Join fails with UNAVAILABLE "flatshardd is draining": no new groups, no new
  // or returning ranks. Everything else goes on. Idempotent; lasts as long as the manager.
  void StartDrain();

  // Counts over every group (`flatshardctl status`, drain progress).
  struct Stats {
    int32_t groups = 0;
    int32_t sessions = 0;  // ranks with a live session
    int32_t open_summons = 0;
    int32_t pending_joins = 0;
    int32_t pending_collectives = 0;
    bool draining = false;
    bool shutting_down = false;
  };
  Stats GetStats() const;

  // One group's registered modules unit by unit and local rank by rank (`flatshardctl units`).
  struct UnitRankInfo {
    int32_t rank = 0;
    bool summoned = false;
    int64_t shard_bytes = 0;
    int64_t grad_bytes = 0;
    int64_t unsharded_bytes = 0;  // full buffers this rank's open summons hold for the unit
    int64_t state_bytes = 0;      // optimizer state buffers (RegisterState), live copies only
  };
  // The last summon, end or reduce-scatter of a unit on this daemon.
  struct UnitOp {
    std::string op;  // "summon", "end", "reduce_scatter"; empty: none yet
    int32_t rank = -1;
    absl::Time at = absl::InfinitePast();
    bool ok = true;
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
  // NOT_FOUND for an unknown group, or an unregistered `module` when one is given.
  absl::StatusOr<std::vector<ModuleUnits>> ListUnits(
      const std::string& group, const std::optional<std::string>& module) const;

  // ---- Restarts (group_manager_state.cc, README "Restarts") ----
  // At start, before serving: takes over the groups of `records` (GroupManagerOptions::
  // state_dir's LoadAll) with their shards, gradient shards and committed copies, whose
  // segments the previous daemon left. Per group, every buffer must adopt (ShardStore::Adopt:
  // the segment exists, has the recorded size and owner) and every module's plan and manifest
  // must parse and match the buffers' sizes; otherwise the group is refused (logged, naming
  // the record and the failed check) and its segments are left alone. Commits that were under
  // way are finished or not as their record says (a torn committed copy is never used), then
  // every rank's shards are restored from its committed copy (a writeback may have torn them).
  // Adopted groups have no sessions: ranks join and re-attach as after a trainer crash.
  struct AdoptSummary {
    int32_t groups = 0;
    int32_t refused_groups = 0;
    int32_t modules = 0;
    int32_t lost_modules = 0;  // local ranks at different generations
    int64_t bytes = 0;
    int64_t buffers = 0;
  };
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

  // ---- Checkpoints (group_manager_checkpoint.cc; README "Checkpoints") ----
  // Progress of a save or load, read by another thread while it runs.
  struct CheckpointProgress {
    enum Phase : int { kWaiting = 0, kVerifying = 1, kWriting = 2, kLoading = 3, kDone = 4 };
    std::atomic<int> phase{kWaiting};
    std::atomic<int64_t> done_bytes{0};
    std::atomic<int64_t> total_bytes{0};
  };
  struct CheckpointArgs {
    std::string group;
    std::string module;
    std::string dir;          // save: the directory; load: a checkpoint directory, or
    std::string safetensors;  // load: a safetensors file
    int64_t uid = -1;         // the caller's (-1 remote); `privileged`: root or the daemon's
    bool privileged = false;
    // How long to wait for copies of the committed shards in flight to finish.
    absl::Duration wait = absl::Seconds(30);
    // Multi-daemon groups: another daemon asks for this daemon's ranks' part (the group's
    // token instead of a uid; no metadata written, no other daemon asked).
    bool from_peer = false;
    std::string token;
  };
  struct CheckpointResult {
    uint64_t generation = 0;
    int64_t bytes = 0;
    int32_t files = 0;
    int32_t ranks = 0;
    int64_t unused_tensors = 0;
    // A save for a peer: the files and tensors this daemon wrote.
    std::vector<checkpoint::FileEntry> written_files;
    std::vector<checkpoint::TensorEntry> written_tensors;
  };
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
                                                  CheckpointProgress* progress)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Loads a checkpoint directory or a safetensors file into the registered, initialised
  // module (resharding by FQN and element range). Checks everything before any shard changes;
  // then writes every local rank's shards and committed copies (a committed step). The
  // module's generation becomes the checkpoint's (a safetensors import: the current one + 1),
  // and every rank must read its views again before its next commit (`stale`).
  // FAILED_PRECONDITION while a summon of the module is open, for a source that does not fit
  // the module (naming the FQN), for an incomplete or corrupt checkpoint (naming the file and
  // the check); otherwise as SaveCheckpoint.
  absl::StatusOr<CheckpointResult> LoadCheckpoint(const CheckpointArgs& args,
                                                  CheckpointProgress* progress)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Group;
  struct PendingJoin;
  struct RegisterExchange;
  struct Registered;
  struct EndArrival;
  struct OpenSummon;
  struct SummonSlot;

  void DeadlineLoop();
  // Withdraws pending joins whose caller went away (JoinArgs::caller_gone), freeing the rank.
  void DropGoneJoins(Group& g, std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends sessions whose join completed over lease_timeout_ ago without a lease.
  void ExpireUnleased(Group& g, absl::Time now, std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes the group's pending joins if every rank is joined, first (re)connecting the
  // group's communicator when it has none or a failed one (StartConnect).
  void MaybeCompleteJoins(Group& g, std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers every pending join of a local group whose communicator is connected and sound.
  void CompleteJoins(Group& g, std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A multi-daemon rank's rendezvous ended: connect (or re-form) and finish its join.
  void OnRendezvous(const std::string& group, int32_t rank, uint64_t session,
                    absl::StatusOr<peer::PeerTable> table);
  // True when `g` already runs `table` (its epoch or a newer one, sound): nothing to connect.
  bool TableApplied(const Group& g, const peer::PeerTable& table) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Decides under mu_ how the group's communicator is (re)connected and starts the connect
  // through `run` (after mu_ is released; on the factory's thread when it may block).
  // `table`: a multi-daemon group's peer table (null: a local group). Its outcome goes to
  // FinishConnect with the ticket stored in the group.
  void StartConnect(Group& g, const peer::PeerTable* table, bool from_table,
                    std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Re-takes mu_ to commit a connect StartConnect began (or to drop it when the group went,
  // the daemon shuts down or a newer connect superseded it) and answers the joins it served.
  void FinishConnect(const std::string& group, uint64_t ticket,
                     absl::StatusOr<collective::ConnectedCommunicator> connected)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Installs `connected` for multi-daemon group `g` at `table`'s epoch (engine, local ranks,
  // ReconcileModules, the rollback a re-form owes).
  absl::Status ApplyTable(Group& g, const peer::PeerTable& table,
                          collective::ConnectedCommunicator connected) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Answers multi-daemon join `j` of `g` (now formed at an epoch its rendezvous reached).
  void AnswerRendezvousJoin(Group& g, PendingJoin& j, std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new table of a multi-daemon group: a registered module some rank's daemon no longer
  // holds (it restarted) is dropped here too and remembered as lost, so every daemon agrees
  // that it must be registered afresh (never half re-attached, never a collective mismatch).
  void ReconcileModules(Group& g, const peer::PeerTable& table) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `g` if nothing uses it any more.
  void MaybeRemoveGroup(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes group `id` for good (DeleteGroup, idle reclaim): its collectives, modules and
  // buffers. REQUIRES: no rank joined or joining. The freed buffers are returned so that the
  // caller drops them after the lock (unmap and unlink are syscalls).
  DeletedGroup RemoveGroupLocked(const std::string& id, const absl::Status& reason,
                                 std::vector<std::shared_ptr<Buffer>>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes groups unused for group_idle_timeout (DeadlineLoop).
  void ReclaimIdleGroups(absl::Time now, std::vector<std::shared_ptr<Buffer>>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when `uid` may not create another group (max_groups_per_uid).
  absl::Status CheckGroupQuota(int64_t uid, const std::string& group) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Commits (or drops) a registration once its agreement (server/registration.h) ended.
  void FinishRegister(std::shared_ptr<RegisterExchange> x, absl::Status status);
  absl::Status CheckCallerLocked(const Caller& caller) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  // The kept-buffer cache of `reg` (made on first use).
  std::shared_ptr<KeptBuffers> KeptOf(Registered& reg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks kept buffers nobody uses any more as idle from now.
  void ReleaseKept(Registered& reg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The rank's session is over here (leave, lease ended); tells the coordinator.
  void EndRank(Group& g, int32_t rank, std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends every open summon of `rank` in `g` without writeback (lease ended, leave).
  void DropSummons(Group& g, int32_t rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishEnd(const Caller& caller, uint64_t summon, absl::Status status, StatusCallback done);
  // Copies `rank`'s shards of `reg` into its committed copies (`to_committed`) or back (a
  // rollback). REQUIRES: the caller took `reg.busy` for it (under mu_), and releases it with
  // DoneCopying; runs without mu_ (the copies are as large as the shards).
  // `durable`: internal::DurableBuffers(reg, rank), taken under mu_ (shards and optimizer
  // state alike).
  absl::Status CopyCommitted(int32_t rank, const std::vector<internal::DurablePair>& durable,
                             bool to_committed) const;
  // Releases one `busy` of `reg` and starts a pending rollback when none is left.
  void DoneCopying(Group& g, Registered& reg, std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The group re-formed after a failure: roll every initialised module's local shards back
  // to their committed generation (now, or when the copies in flight are done).
  void StartRollback(Group& g, std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RollbackNow(Group& g, const std::string& module, Registered& reg,
                   std::vector<absl::AnyInvocable<void()>>* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A refused agreement with a stale rank: rolls the caller's shards of `module` back.
  void RollbackRank(const Caller& caller, const std::string& module);
  // FAILED_PRECONDITION naming why `reg` is not initialised; UNAVAILABLE while it rolls back.
  // `module`'s registration in `g` once it is initialised: NOT_FOUND for an unregistered one,
  // CheckUsable's error for one whose initial values did not commit.
  absl::StatusOr<Registered*> InitializedModule(Group& g, const std::string& module)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckUsable(const Group& g, const std::string& module, const Registered& reg) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The session of `rank` ended (`why`; REQUIRES: EndRank ran): collectives that need it fail
  // at once from now on (after the ops it had already submitted, see FailDeferred).
  void FailForRank(Group& g, int32_t rank, absl::string_view why,
                   std::vector<absl::AnyInvocable<void()>>* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails the group with its deferred failure once no op a departed rank had submitted can
  // still complete (or now, when `now`).
  // Multi-daemon groups: the failure goes to the coordinator through `run` (after mu_).
  void FailDeferred(Group& g, bool now, std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs the agreement all-gather of a writeback End or a Commit; `done` gets OK when every
  // rank's record says ok, else the first refusal (and whether a stale rank refused).
  void Agree(const std::shared_ptr<collective::CollectiveGroup>& coll, const Caller& caller,
             const internal::AgreeRecord& mine, int32_t world_size, int64_t unit,
             const std::string& what,
             absl::Time deadline, absl::AnyInvocable<void(absl::Status, bool stale)> done);

  // GPU daemons: the context rank `rank` lives on; null for host-memory daemons.
  gpu::DeviceContext* DeviceOf(int32_t rank) const { return devices_.DeviceOf(rank); }
  // Where `rank`'s buffers go (host, or its GPU).
  Placement PlacementOf(int32_t rank) const { return devices_.PlacementOf(rank); }
  // The public collective calls continue here once the trainer's `written` event was reached
  // (RankDevices::AfterTrainerWrites; `local` is that wait's status where a failure is the
  // rank's "no" in an agreement).
  void SummonWritten(const Caller& caller, const std::string& module, const std::string& path,
                     const SummonOptions& options, absl::Time deadline, SummonCallback done);
  // The steps of a summon (group_manager_summon.cc tells the order and the lock invariants).
  struct ViewNeed;
  struct SummonDecision;
  struct SummonStart;
  using ViewBuffers = std::map<std::pair<int32_t, KeptUse>, std::shared_ptr<Buffer>>;
  absl::Status DecideSummon(const Caller& caller, const std::string& module,
                            const std::string& path, const SummonOptions& options,
                            SummonDecision* d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OpenSummonLocked(const Caller& caller, const std::string& module, const std::string& path,
                        const SummonOptions& options, const SummonDecision& d,
                        const ViewBuffers& got, SummonStart* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartUnshard(const Caller& caller, absl::Time deadline, std::shared_ptr<SummonStart> start,
                    SummonCallback done);
  // Drops the node-copy marks a summon set in `slot` (SummonSlot::making) and hands the
  // summons that waited for them to `waiting` (run after mu_).
  void UnmarkMaking(std::shared_ptr<SummonSlot> slot,
                    std::vector<std::pair<int32_t, KeptUse>>* marked,
                    std::vector<absl::AnyInvocable<void()>>* waiting)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // rank0_only writeback End: gets the buffers rank 0's broadcast lands in (without mu_) and
  // builds the broadcasts; UNAVAILABLE when the summon was dropped meanwhile.
  absl::Status PrepareRank0Broadcast(const Caller& caller, uint64_t summon, const Plan& plan,
                                     const std::vector<UnitShard>& shards,
                                     const std::shared_ptr<KeptBuffers>& kept,
                                     const std::vector<ViewNeed>& needs,
                                     int64_t owner_uid, OpenSummon* copy,
                                     std::vector<collective::CollectiveOp>* broadcasts)
      ABSL_LOCKS_EXCLUDED(mu_);
  void EndSummonWritten(const Caller& caller, uint64_t summon, absl::Time deadline,
                        StatusCallback done, absl::Status local);
  void FinishReduceScatterWritten(const Caller& caller, const std::string& module, int32_t unit,
                                  GradReduce op, bool accumulate, absl::Time deadline,
                                  StatusCallback done);
  void CommitWritten(const Caller& caller, const std::string& module, absl::Time deadline,
                     CommitCallback done, absl::Status local);
  // Every rank agreed to commit: copies the caller's shards into its committed copies (after
  // any checkpoint holding them) and answers the new generation.
  void CommitAgreed(const Caller& caller, const std::string& module, uint64_t generation,
                    CommitCallback done);
  // The request for `g`'s communicator over `spec` (local devices filled in on GPU daemons).
  collective::CommunicatorRequest RequestFor(collective::GroupSpec spec, bool nccl_agreed) const;

  // ---- Restarts (group_manager_state.cc) ----
  // Every durable buffer of `rank`'s unit `unit` of `reg`, with its role in the record
  // (state::kRole*). The one place that lists them: adding a role (optimizer state) is a line
  // here and one in InstallDurable.
  static std::vector<std::pair<std::string, std::shared_ptr<Buffer>>> RecordedBuffers(
      const Registered& reg, int32_t rank, int32_t unit);
  // Puts an adopted buffer of `role` in place; false for a role this daemon does not know.
  static bool InstallDurable(Registered& reg, int32_t rank, int32_t unit, const std::string& role,
                             std::shared_ptr<Buffer> buffer);
  // Adoption (group_manager_state.cc): refuses a rank holding some but not all of its
  // optimizer state buffers, naming the missing ones; `where` starts the message.
  static absl::Status CheckStateComplete(Registered& reg, int32_t rank, const std::string& where);
  // GPU daemons: fresh device state buffers (live and committed) of `rank` from the host
  // copies a SIGTERM made (KeepDeviceShards).
  absl::Status StateFromHost(Registered& reg, const state::GroupRecord& rec,
                             const std::string& module, int32_t rank);
  // Checkpoint loads (group_manager_checkpoint.cc): before the copies into the committed
  // copies, records a "load" intent to `generation` for the hold's ranks (their shards hold
  // the loaded values completely) and writes the record; then, at the hold's release, drops
  // the intent and queues the record's write into `run` (`changed`: the load set the
  // generation).
  void NoteLoadCopying(const std::string& group, const std::string& module,
                       std::vector<int32_t> ranks, uint64_t generation) ABSL_LOCKS_EXCLUDED(mu_);
  void LoadRecordedLocked(Group& g, Registered& reg, bool changed,
                          std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The ShardStore kind a role's buffers are allocated as.
  static BufferKind KindOfRole(const std::string& role);
  // The group's record as of now; `sequence` from state_sequence_.
  state::GroupRecord SnapshotLocked(Group& g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues the write of `g`'s record (a snapshot taken now) into `run`, to run after mu_.
  void PersistLater(Group& g, std::vector<absl::AnyInvocable<void()>>* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes a snapshot (or removes the record when it holds no module); a failed write
  // removes the record (the group is then not kept across a restart) and is logged.
  bool WriteRecord(const state::GroupRecord& record) ABSL_LOCKS_EXCLUDED(mu_);
  // `group`'s registration of `module` (and the group in `*g` when not null); null when either
  // is gone.
  Registered* FindModuleLocked(const std::string& group, const std::string& module,
                               Group** g = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under mu_, runs `edit` on `group`'s registration of `module` (nothing when either is gone);
  // when it returns true and the daemon keeps records, snapshots the group and writes its
  // record once mu_ is released. Returns whether a record was written.
  bool EditAndRecord(const std::string& group, const std::string& module,
                     absl::FunctionRef<bool(Registered&)> edit) ABSL_LOCKS_EXCLUDED(mu_);
  // A commit of `module` to `generation` that every rank agreed to: this rank's shards hold
  // it completely and its copy into the committed copy starts now. Records that durably
  // first (the copy may be torn by a kill). `kind`: "commit", "end" or "init".
  void CommitReady(const Caller& caller, const std::string& module, uint64_t generation,
                   const char* kind) ABSL_LOCKS_EXCLUDED(mu_);
  // This rank's committed copy holds `generation` completely; recorded before the caller
  // answers (the trainer's next writes would otherwise be taken for that generation).
  void CommitDone(const Caller& caller, const std::string& module, uint64_t generation)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every rank agreed to commit `module` to `generation` (before any copy): the module
  // reports that generation at rendezvous (internal::HeldGeneration) from now on.
  static void NoteCommitAgreed(Registered& reg, uint64_t generation, const char* kind);
  // Restarts, host daemons with a state directory: a writeback End's rank `caller` wrote back
  // into its shards (`status`) after every rank agreed; its copy into its committed copy and
  // its answer (`finish`) wait until every local rank of the module has arrived for the k-th
  // summon, then one record says all are ready, the copies run, one record says all are done,
  // and every arrival is answered. So a kill during the copies finds every rank's shards
  // complete: the restart finishes them all, never a mix (group_manager_state.cc).
  void EndArrive(const Caller& caller, const std::string& module, uint64_t k, uint64_t target,
                 const char* kind, absl::Status status,
                 std::vector<internal::DurablePair> durable,
                 absl::AnyInvocable<void(absl::Status)> finish) ABSL_LOCKS_EXCLUDED(mu_);
  // The rank's End agreement failed: it counts as arrived (it applies nothing).
  void EndNotApplied(const Caller& caller, const std::string& module, uint64_t k)
      ABSL_LOCKS_EXCLUDED(mu_);
  void ProcessEndBatch(const std::string& group, const std::string& module, uint64_t target,
                       const char* kind, std::vector<EndArrival> batch)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Under mu_: `rank`'s committed copy holds `generation` (the pending commit's done ranks).
  static void MarkCommitDoneLocked(Registered& reg, int32_t rank, uint64_t generation);
  // GroupManagerOptions::testing_commit_copy_pause.
  void TestingPauseMidCopy(int32_t rank,
                           const std::vector<internal::DurablePair>& durable) const;
  // Checkpoints: the committed shards of a module held still for a save or a load.
  struct CheckpointHold;
  absl::StatusOr<CheckpointHold> HoldForCheckpoint(const CheckpointArgs& args, bool load,
                                                   CheckpointProgress* progress)
      ABSL_LOCKS_EXCLUDED(mu_);
  // GPU ranks: host staging buffers of `buffers`' sizes (filled from them when `copy_in`);
  // host ranks: `buffers` themselves. Blocking on the device: not on a reactor thread.
  absl::StatusOr<std::vector<std::shared_ptr<Buffer>>> HostCopies(
      int32_t rank, const std::vector<std::shared_ptr<Buffer>>& buffers, bool copy_in) const;
  // Multi-daemon groups: asks every other daemon of `hold`'s group to write (or load) its
  // ranks' part; runs the calls in parallel, on threads of its own, and waits for them.
  std::vector<absl::StatusOr<CheckpointResult>> AskPeers(const CheckpointHold& hold,
                                                         const CheckpointArgs& args, bool load);
  // Ends a hold; a load sets `generation` and marks the local ranks stale.
  void ReleaseCheckpointHold(const CheckpointHold& hold, bool load,
                             std::optional<uint64_t> generation) ABSL_LOCKS_EXCLUDED(mu_);
  // A load of a checkpoint with optimizer state into a module without any: allocates the
  // state buffers (and committed copies) of `specs` for the hold's ranks, installs them in the
  // module and in `hold` (README "Checkpoints").
  absl::Status AllocateStateForLoad(CheckpointHold& hold, const std::vector<StateSpec>& specs)
      ABSL_LOCKS_EXCLUDED(mu_);

  ShardStore* const store_;
  const absl::Duration lease_timeout_;
  peer::DaemonIdentity self_;
  const std::vector<std::shared_ptr<gpu::DeviceContext>> gpus_;
  const std::shared_ptr<collective::DeviceCopier> copier_;
  // Placement and copies of each rank's memory; host waits on devices run on its workers.
  // Declared before engine_: it outlives the engine's callbacks (stopped in the destructor).
  RankDevices devices_;
  // Chooses and connects the groups' backends (inproc, UCX, NCCL; staged on GPU daemons).
  // Never called under mu_ but for Choose (no I/O).
  std::unique_ptr<collective::CommunicatorFactory> comms_;
  collective::CollectiveEngine engine_;
  const absl::Duration group_idle_timeout_;
  const int32_t max_groups_per_uid_;
  Clock* const clock_;
  // Every registered module's kept buffers (Registered::kept), decommitted when idle.
  const std::shared_ptr<KeptBufferPool> kept_pool_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Group>> groups_ ABSL_GUARDED_BY(mu_);
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  // Tickets of StartConnect (unique over every group, so a removed and re-created group never
  // takes an old connect for its own).
  uint64_t next_connect_ ABSL_GUARDED_BY(mu_) = 1;
  // Coordinators whose last group went away, and since when (DeadlineLoop unwatches them).
  std::map<std::string, absl::Time> coordinator_idle_since_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  // Restarts: the state directory (null: none) and the sequence of the next record written;
  // records removed by RemoveGroupLocked wait here for the caller to drop the lock.
  state::StateDir* const state_dir_;
  const absl::Duration testing_commit_copy_pause_;
  bool state_forgotten_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t state_sequence_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<std::string, uint64_t>> removed_records_ ABSL_GUARDED_BY(mu_);
  void FlushRemovedRecords() ABSL_LOCKS_EXCLUDED(mu_);
  std::thread deadline_thread_;
  // Checkpoints of multi-daemon groups: how this daemon reaches the others' peer ports.
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials_;
  // Last: destroyed first, so no PeerEvents arrive while the rest is torn down.
  std::unique_ptr<peer::PeerClient> peer_;
};

}  // namespace flatshard::server

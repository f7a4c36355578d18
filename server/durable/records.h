#pragma once
// Records: the durability owner. It keeps each group's crash-consistent record in the state
// directory (--state_dir; server/durable/record_codec.h has the format): snapshots of a group's
// durable buffers and commit intents, written after the group's lock in the order they were
// taken; the commit intents of Commit, writeback Ends and checkpoint loads (a torn committed
// copy is never adopted); the copies into the committed copies; adoption of the records a
// previous daemon left; and what a GPU daemon keeps at SIGTERM. The restart rules are in the
// README ("Restarts").
//
// State: the state directory, the sequence of record snapshots, the records of removed groups
// still to delete and whether records are kept at all, under its own lock (a leaf). Module
// state it edits (intents, generations) lives in the group's Registered, under the group's
// lock, like every owner's. Thread-safe.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/after_unlock.h"
#include "common/clock.h"
#include "server/durable/blocking_workers.h"
#include "server/durable/device_host_copies.h"
#include "server/durable/state_dir.h"
#include "server/gpu/device_context.h"
#include "server/group/group.h"
#include "server/group/group_table.h"
#include "server/module/module.h"
#include "server/rank_devices.h"
#include "server/shard_store.h"

namespace flatshard::server {

// What AdoptGroups took over.
struct AdoptSummary {
  int32_t groups = 0;
  int32_t refused_groups = 0;
  int32_t modules = 0;
  int32_t lost_modules = 0;  // local ranks at different generations
  int64_t bytes = 0;
  int64_t buffers = 0;
};

struct RecordsOptions {
  state::StateDir* state_dir = nullptr;  // null: nothing is recorded
  ShardStore* store = nullptr;
  RankDevices* devices = nullptr;
  Clock* clock = nullptr;
  std::vector<std::shared_ptr<gpu::DeviceContext>> gpus;
  GroupTable* table = nullptr;
  // GroupManagerOptions::testing_commit_copy_pause.
  absl::Duration testing_commit_copy_pause = absl::ZeroDuration();
};

class Records {
 public:
  explicit Records(RecordsOptions options);
  Records(const Records&) = delete;
  Records& operator=(const Records&) = delete;

  // Whether this daemon keeps records (a state directory).
  bool enabled() const { return state_dir_ != nullptr; }
  // Runs `job`, which writes records (fsync) or the copies they bracket: on a worker of its
  // own when records are kept (never on a gRPC reactor or a collective's completion thread),
  // else at once on the caller's thread (memory copies only, as the collectives'). The jobs of
  // one group run one at a time, in order (BlockingWorkers strands): its local ranks' commits
  // then share one intent record (CommitReady) as when one thread ran them; groups run in
  // parallel.
  void RunDurable(const std::string& group, absl::AnyInvocable<void()> job);

  // ---- Records of groups ----
  // Queues the write of `g`'s record (a snapshot taken now) into `run`, to run after the lock.
  void PersistLater(Group& g, AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // The same for one module of `g` (and the group's fields): a journal append of that module
  // alone (StateDir::WriteModules), whatever the number of modules.
  void PersistModuleLater(Group& g, const std::string& module, AfterUnlock* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Under the group's lock, runs `edit` on `group`'s registration of `module` (nothing when
  // either is gone); when it returns true and the daemon keeps records, snapshots the group
  // and writes its record once the lock is released. Returns whether a record was written.
  // `sync` false: written without an fsync (StateDir::WriteModules).
  bool EditAndRecord(const std::string& group, const std::string& module,
                     absl::FunctionRef<bool(Registered&)> edit, bool sync = true);
  // Group `id` was removed (under its lock): its record goes at the next FlushRemoved.
  void NoteRemoved(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Deletes the records of removed groups; call after the group's lock.
  void FlushRemoved() ABSL_LOCKS_EXCLUDED(mu_);
  // GroupManager::ForgetState.
  void Forget() ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Commit intents and the copies into the committed copies ----
  // A commit of `module` to `generation` that every rank agreed to: this rank's shards hold
  // it completely and its copy into the committed copy starts now. Records that durably
  // first (the copy may be torn by a kill). `kind`: "commit", "end" or "init".
  void CommitReady(const Caller& caller, const std::string& module, uint64_t generation,
                   const char* kind);
  // This rank's committed copy holds `generation` completely; recorded before the caller
  // answers (the trainer's next writes would otherwise be taken for that generation).
  void CommitDone(const Caller& caller, const std::string& module, uint64_t generation);
  // Every rank agreed to commit `module` to `generation` (before any copy): the module
  // reports that generation at rendezvous (internal::HeldGeneration) from now on.
  static void NoteCommitAgreed(Registered& reg, uint64_t generation, const char* kind);
  // Under the group's lock: `rank`'s committed copy holds `generation` (the pending commit's
  // done ranks).
  static void MarkCommitDoneLocked(Registered& reg, int32_t rank, uint64_t generation);
  // Host daemons with a state directory: a writeback End's rank `caller` wrote back into its
  // shards (`status`) after every rank agreed; its copy into its committed copy and its
  // answer (`finish`) wait until every local rank of the module has arrived for the k-th
  // summon, then one record says all are ready, the copies run, one record says all are
  // done, and every arrival is answered. So a kill during the copies finds every rank's
  // shards complete: the restart finishes them all, never a mix. The records, the copies and
  // the answers run on the durable worker (RunDurable), after EndArrive returns.
  // With `deferred.copy` (issue 24) only `deferred.gaps` are copied before the answer; the
  // "done" record lists the copy's entries (state::DeferredRecord) and the copy joins the
  // module's pending_committed, for the caller to run once `finish` gets OK.
  void EndArrive(const Caller& caller, const std::string& module, uint64_t k, uint64_t target,
                 const char* kind, absl::Status status, std::vector<DurablePair> durable,
                 absl::AnyInvocable<void(absl::Status)> finish, DeferredCommit deferred = {});
  // The rank's End agreement failed: it counts as arrived (it applies nothing). As
  // EndArrive, a batch it completes is processed on the durable worker.
  void EndNotApplied(const Caller& caller, const std::string& module, uint64_t k);
  // Copies `rank`'s durable buffers into their committed copies (`to_committed`) or back (a
  // rollback). REQUIRES: the caller took `reg.busy` for it (under the group's lock), and
  // releases it with Modules::DoneCopying; runs without the lock (the copies are as large as
  // the shards). `durable`: internal::DurableBuffers(reg, rank), taken under the lock.
  absl::Status CopyCommitted(int32_t rank, const std::vector<DurablePair>& durable,
                             bool to_committed) const;
  // GroupManagerOptions::testing_commit_copy_pause.
  // `deferred`: the rank's own ranges are a DeferredCommit's, so nothing is torn.
  void TestingPauseMidCopy(int32_t rank, const std::vector<DurablePair>& durable,
                           bool deferred = false) const;
  // Also holds (twice as long) the copies a writeback End leaves running without a state
  // directory (Modules::CommitInBackground), so tests see the operations after it finish them.
  absl::Duration testing_commit_copy_pause() const { return testing_commit_copy_pause_; }

  // ---- Votes: no module lost to a daemon kill (commit_votes.cc) ----
  // `caller` votes yes to committing `module` to `generation` (its shards hold it): the
  // module's record says so ("voted", written without an fsync) before `then` sends the
  // vote, so that a restart knows its ranks' shards may hold it. On the durable worker when
  // records are kept, else at once.
  void RecordVote(const Caller& caller, const std::string& module, uint64_t generation,
                  absl::AnyInvocable<void()> then);
  // `caller`'s vote was refused (the Commit was not committed on any rank): forgets it, in
  // the record too, before `then` answers.
  void VoteRefused(const Caller& caller, const std::string& module,
                   absl::AnyInvocable<void()> then);
  // Under the group's lock: `rank` no longer holds a vote; true when that cleared the
  // module's recorded vote (Registered::voted_commit).
  static bool ClearVoteLocked(Registered& reg, int32_t rank);
  // The re-form resolved `module` to `target` (Modules::RollbackNow): each rank of `forward`
  // voted for it and its shards hold it; they are copied into the committed copies,
  // bracketed by a "commit" intent (the ranks of `at_target` already hold it: done), as a
  // Commit's copies. REQUIRES: the caller holds `busy`; runs without the lock.
  absl::Status RollForward(const std::string& group, const std::string& module, uint64_t target,
                           const std::vector<std::pair<int32_t, std::vector<DurablePair>>>& forward,
                           const std::vector<int32_t>& at_target);

  // --testing_pause_before_commit_intent (commit_votes.cc): sleeps when it names `generation`.
  static void TestingPauseBeforeIntent(uint64_t generation);

  // A writeback End of a group over several daemons (Modules::VoteEnd): its shards are
  // written after the first agreement, so the daemon votes once they are. Rank `caller`
  // wrote back into its shards for the module's k-th summon (`status`; `applying` false: its
  // agreement failed, it wrote nothing). Once every local rank of the module has arrived,
  // and only when all wrote back, one record says they voted for `generation` ("voted", as a
  // Commit's vote), then each arrival's `vote` runs with the rank's vote (OK: yes; else
  // why not). On the durable worker, after EndVoteArrive returns.
  void EndVoteArrive(const Caller& caller, const std::string& module, uint64_t k,
                     uint64_t generation, bool applying, absl::Status status,
                     absl::AnyInvocable<void(absl::Status)> vote);
  // --testing_pause_end_vote (commit_votes.cc): sleeps when it names `point` ("before_vote",
  // "after_vote", "before_intent", "deferred_copy") and `generation`.
  static void TestingPauseEndVote(const char* point, uint64_t generation);

  // ---- Checkpoint loads ----
  // A load stages the loaded values in the committed copies of `ranks`, then copies them into
  // the shards (server/checkpoint/load.cc). Before the committed copies change, records a
  // "load" intent to `generation`, the generation their shards hold completely, and writes the
  // record: a daemon killed while they are written finishes (restores) them from the shards at
  // restart. At the hold's release, LoadRecordedLocked drops an intent left (a failed load) and
  // queues the record's write into `run` (`changed`: the load set the generation).
  void NoteLoadCopying(const std::string& group, const std::string& module,
                       std::vector<int32_t> ranks, uint64_t generation);
  // The committed copies of `ranks` hold the loaded values (`generation`) completely, before
  // the shards are written from them: drops the load intent and records `generation` as the
  // ranks' committed generation, so a daemon killed while the shards are written restores them
  // from the committed copies at restart, as after any commit.
  void NoteLoadStaged(const std::string& group, const std::string& module,
                      const std::vector<int32_t>& ranks, uint64_t generation);
  void LoadRecordedLocked(Group& g, Registered& reg, bool changed, AfterUnlock* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);

  // ---- GPU daemons: a host copy at each commit (device_host_copies.h) ----
  // Under the group's lock, once no copy into `reg`'s committed copies is in flight
  // (Modules::DoneCopying): queues the host copy of its committed generation if due.
  void NoteCopiesDoneLocked(Group& g, const std::string& module, Registered& reg)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu) {
    if (host_copies_ != nullptr) host_copies_->NoteCopiesDoneLocked(g, module, reg);
  }

  // Whether adopted host copies stay as the recorded ones (--gpu_host_copies).
  bool KeepsHostCopies() const { return host_copies_ != nullptr && host_copies_->enabled(); }
  // The re-form resolved `module` to `target`, one below what `ranks` (GPU ranks) hold
  // (Modules::RollbackNow): DeviceHostCopies::RollBack.
  absl::Status RollBackFromHost(const std::string& group, const std::string& module,
                                uint64_t target, const std::vector<int32_t>& ranks);

  // ---- Restarts ----
  // GroupManager::AdoptGroups.
  AdoptSummary AdoptGroups(const std::vector<state::GroupRecord>& records);
  // GroupManager::KeepDeviceShards.
  void KeepDeviceShards();

 private:
  // Every durable buffer of `rank`'s unit `unit` of `reg`, with its role in the record
  // (state::kRole*). The one place that lists them: adding a role (optimizer state) is a line
  // here and one in InstallDurable.
  static std::vector<std::pair<std::string, std::shared_ptr<Buffer>>> RecordedBuffers(
      const Registered& reg, int32_t rank, int32_t unit);
  // Puts an adopted buffer of `role` in place; false for a role this daemon does not know.
  static bool InstallDurable(Registered& reg, int32_t rank, int32_t unit, const std::string& role,
                             std::shared_ptr<Buffer> buffer);
  // Adoption: refuses a rank holding some but not all of its optimizer state buffers, naming
  // the missing ones; `where` starts the message.
  static absl::Status CheckStateComplete(Registered& reg, int32_t rank, const std::string& where);
  // Adoption of one group's record: the group goes into the table, or the record is refused
  // as a whole (its segments left alone) and counted in `summary`.
  void AdoptGroup(const state::GroupRecord& rec, AdoptSummary* summary);
  // One module of `rec` into `g` (adopted, dropped as lost, or skipped when its initialisation
  // never finished); an error refuses the whole record. `adopted` collects every buffer taken
  // over, `lines` the log line of an adopted module.
  absl::Status AdoptModule(const state::GroupRecord& rec, const state::ModuleRecord& m, Group& g,
                           std::vector<std::shared_ptr<Buffer>>* adopted,
                           std::vector<std::string>* lines, AdoptSummary* summary)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Takes over the recorded segments of one rank of a module into `reg`, checking each against
  // the plan and the state spec; `where` starts the messages.
  absl::Status AdoptRankBuffers(const state::GroupRecord& rec, const state::ModuleRecord& m,
                                const state::RankRecord& rr, const std::string& where,
                                Registered& reg, std::vector<std::shared_ptr<Buffer>>* adopted);
  // Copies the parts of committed copies a writeback End left in summon segments (the
  // module's "deferred", state::DeferredRecord) into `reg`'s adopted committed copies; an
  // error (a segment gone or resized) says why the module is lost. Segments not kept go with
  // `adopted`.
  absl::Status FinishDeferredCopies(const state::GroupRecord& rec, const state::ModuleRecord& m,
                                    Registered& reg, std::vector<std::shared_ptr<Buffer>>* adopted);
  // Takes over the module's recorded kept summon buffers (state::KeptRecord) into
  // `reg.adopted_kept`; one that cannot be is skipped (logged), never a refusal.
  void AdoptKeptBuffers(const state::GroupRecord& rec, const state::ModuleRecord& m,
                        Registered& reg, std::vector<std::shared_ptr<Buffer>>* adopted);
  // A recorded buffer's size against what the plan (a shard) or the state spec (an optimizer
  // state buffer) says it holds; `bw` names the buffer.
  static absl::Status CheckRecordedSize(const Registered& reg, int32_t unit,
                                        const state::BufferRecord& b, const std::string& bw);
  // GPU daemons: fresh device shards and committed copies from the host copies a SIGTERM made;
  // `from_host` gets the ranks so restored.
  absl::Status DeviceCopiesFromHost(const state::GroupRecord& rec, const state::ModuleRecord& m,
                                    const std::string& where, Registered& reg,
                                    std::set<int32_t>* from_host);
  // Finishes (from the shards) the copies of a commit, load or init that was under way at the
  // kill; false when an initialisation did not reach every rank (the module is not adopted).
  static bool FinishCommitUnderWay(const state::GroupRecord& rec, const state::ModuleRecord& m,
                                   const std::vector<int32_t>& ranks, Registered& reg);
  // KeepDeviceShards: what to copy (under each group's lock), and one rank's copies (without).
  struct KeepJob;
  std::vector<KeepJob> CollectKeepJobs();
  absl::Status CopyToHost(KeepJob& job, int64_t* bytes);
  // GPU daemons: fresh device state buffers (live and committed) of `rank` from the host
  // copies a SIGTERM made (KeepDeviceShards).
  absl::Status StateFromHost(Registered& reg, const state::GroupRecord& rec,
                             const std::string& module, int32_t rank);
  // The index of the state named after `prefix` in `role` within `specs`; -1 when `role`
  // does not start with `prefix` or names no state of the spec.
  static int StateIndex(const std::string& role, absl::string_view prefix,
                        const std::vector<StateSpec>& specs);
  // The ShardStore kind a role's buffers are allocated as.
  static BufferKind KindOfRole(const std::string& role);
  // The group's record as of now, with the next sequence.
  state::GroupRecord SnapshotLocked(Group& g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // The group's fields (no module), with the next sequence.
  state::GroupRecord FieldsLocked(Group& g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // The group's fields and `module` (none when it is not recorded), with the next sequence.
  state::GroupRecord SnapshotModuleLocked(Group& g, const std::string& module)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // `reg`'s record; none when it holds nothing a restart keeps (not initialised and no
  // commit under way, or device buffers without host copies).
  static std::optional<state::ModuleRecord> ModuleSnapshot(const std::string& name,
                                                           Registered& reg);
  // Writes `module` of a SnapshotModuleLocked (dropping it when the snapshot lacks it); a
  // failed write removes the group's record, as WriteRecord.
  bool WriteModule(const state::GroupRecord& record, const std::string& module, bool sync = true);
  // Writes a snapshot (or removes the record when it holds no module); a failed write
  // removes the record (the group is then not kept across a restart) and is logged.
  bool WriteRecord(const state::GroupRecord& record);
  // `g`'s registration of `module`; null when either is gone.
  static Registered* FindModuleLocked(Group& g, const std::string& module)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  void ProcessEndVotes(const std::string& group, const std::string& module, uint64_t generation,
                       std::vector<EndArrival> batch);
  void ProcessEndBatch(const std::string& group, const std::string& module, uint64_t target,
                       const char* kind, std::vector<EndArrival> batch);
  bool StateForgotten() const ABSL_LOCKS_EXCLUDED(mu_);

  state::StateDir* const state_dir_;
  ShardStore* const store_;
  RankDevices& devices_;
  Clock* const clock_;
  const std::vector<std::shared_ptr<gpu::DeviceContext>> gpus_;
  GroupTable& table_;
  const absl::Duration testing_commit_copy_pause_;

  mutable absl::Mutex mu_;  // a leaf, like the table's
  bool state_forgotten_ ABSL_GUARDED_BY(mu_) = false;
  // The sequence of the next snapshot: a stale snapshot never overwrites a newer record.
  std::atomic<uint64_t> state_sequence_{0};
  std::vector<std::pair<std::string, uint64_t>> removed_records_ ABSL_GUARDED_BY(mu_);
  // RunDurable's threads; null without a state directory. Joined before the fields above.
  std::unique_ptr<BlockingWorkers> workers_;
  // GPU daemons with a state directory: the host copies at each commit. Last: stopped first.
  std::unique_ptr<DeviceHostCopies> host_copies_;
  // AdoptGroups: every segment the records name as a shard, committed copy or state buffer.
  // A kept record naming one is stale (its name was reused by a later daemon of the same pid)
  // and is never adopted nor unlinked.
  std::set<std::string> recorded_segments_;
};

}  // namespace flatshard::server

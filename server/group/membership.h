#pragma once
// Membership: the membership owner. It makes and removes this daemon's groups (GroupTable),
// joins ranks (locally, or through a coordinator for a multi-daemon group), keeps their
// sessions and leases, connects and re-forms each group's communicator, fails a group's
// collectives fast when a rank goes away, and runs the deadline loop (expired joins and
// leases, deferred failures, idle groups, unused coordinators). The public calls are
// documented on GroupManager (server/group_manager.h), which routes them here.
//
// State: each group's membership (Group, server/group/group.h) under that group's lock; its
// own counters and flags are atomics; the coordinators' idle times under a leaf lock of its
// own. Thread-safe.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/after_unlock.h"
#include "common/clock.h"
#include "common/rpc_types.h"
#include "server/collective/collective_engine.h"
#include "server/collective/communicator_factory.h"
#include "server/gpu/device_context.h"
#include "server/group/group.h"
#include "server/group/group_table.h"
#include "server/kept_buffers.h"
#include "server/peer/peer_client.h"
#include "server/rank_devices.h"

namespace flatshard::server {

class Modules;
class Records;

// GroupManager::DeleteGroup's answer.
struct DeletedGroup {
  std::string group;
  std::vector<std::string> modules;
  int64_t freed_bytes = 0;  // of the buffers the group held (host and device)
  int64_t freed_buffers = 0;
};
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
  // Local ranks joined now or whose session ended (Group::departed), ascending, with their
  // state: "joined", "left" or "lost".
  std::vector<std::pair<int32_t, std::string>> rank_states;
};
// Each group's collectives that have not completed (for `flatshardctl pending`).
struct GroupCollectives {
  std::string group;
  int32_t world_size = 0;
  uint64_t epoch = 0;
  std::vector<int32_t> local_ranks;
  absl::Status status;  // the sticky error, if any
  std::vector<collective::PendingOpInfo> pending;
};
// Counts over every group (`flatshardctl status`, drain progress).
struct GroupStats {
  int32_t groups = 0;
  int32_t sessions = 0;  // ranks with a live session
  int32_t open_summons = 0;
  int32_t pending_joins = 0;
  int32_t pending_collectives = 0;
  bool draining = false;
  bool shutting_down = false;
};

struct MembershipOptions {
  peer::DaemonIdentity self;
  absl::Duration lease_timeout;
  absl::Duration group_idle_timeout;
  int32_t max_groups_per_uid = 0;
  Clock* clock = nullptr;
  std::vector<std::shared_ptr<gpu::DeviceContext>> gpus;
  RankDevices* devices = nullptr;
  collective::CommunicatorFactory* comms = nullptr;
  collective::CollectiveEngine* engine = nullptr;
  std::shared_ptr<KeptBufferPool> kept_pool;
  GroupTable* table = nullptr;
  Modules* modules = nullptr;
  Records* records = nullptr;
  std::atomic<bool>* shutdown = nullptr;  // set by Shutdown; read by the other owners
};

class Membership {
 public:
  explicit Membership(MembershipOptions options);
  // REQUIRES: Shutdown ran (the deadline loop is joined there).
  ~Membership();
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;

  // Multi-daemon groups: how this daemon reaches coordinators (null: none). Set once, before
  // the first Join. Starts the deadline loop.
  void Start(peer::PeerClient* peer);

  // ---- The calls of GroupManager (documented there) ----
  void Join(const JoinArgs& args, absl::Time deadline, JoinCallback done);
  absl::Status AttachLease(const Caller& caller);
  absl::Status CheckCaller(const Caller& caller) const;
  absl::Status Leave(const Caller& caller);
  void EndSession(const std::string& group, uint64_t session);
  // Fails every pending join with UNAVAILABLE, aborts every group's collectives and stops the
  // deadline loop; idempotent.
  void Shutdown();
  void StartDrain();
  // Accepts joins again; whether it was draining.
  bool StopDrain();
  absl::StatusOr<DeletedGroup> DeleteGroup(const std::string& group, int64_t uid, bool privileged);
  std::vector<GroupInfo> ListGroups() const;
  std::vector<GroupCollectives> ListCollectives(const std::string& group) const;
  GroupStats GetStats() const;
  // peer::PeerEvents, forwarded by GroupManager.
  void OnTable(const std::string& coordinator, const peer::PeerTable& table);
  void OnGroupFailed(const std::string& coordinator, const std::string& group, uint64_t epoch,
                     const absl::Status& status);
  void OnCoordinatorLost(const std::string& coordinator, const absl::Status& status);

 private:
  // Join's steps: the arguments alone, the group's admission of the rank (uid, token, world
  // size, coordinator, a rank already joined), and a multi-daemon group's rendezvous at its
  // coordinator.
  absl::Status CheckJoinArgs(const JoinArgs& args) const;
  absl::Status AdmitJoinLocked(Group& g, const JoinArgs& args) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  void StartRendezvous(const JoinArgs& args, absl::Time deadline, uint64_t session,
                       uint64_t failed_epoch, std::vector<std::string> held_modules);
  void DeadlineLoop();
  // Withdraws pending joins whose caller went away (JoinArgs::caller_gone), freeing the rank.
  void DropGoneJoins(Group& g, AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Ends sessions whose join completed over lease_timeout_ ago without a lease.
  void ExpireUnleased(Group& g, absl::Time now, AfterUnlock* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Completes the group's pending joins if every rank is joined, first (re)connecting the
  // group's communicator when it has none or a failed one (StartConnect).
  void MaybeCompleteJoins(Group& g, AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Answers every pending join of a local group whose communicator is connected and sound.
  void CompleteJoins(Group& g, AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // A multi-daemon rank's rendezvous ended: connect (or re-form) and finish its join.
  void OnRendezvous(const std::string& group, int32_t rank, uint64_t session,
                    absl::StatusOr<peer::PeerTable> table);
  // True when `g` already runs `table` (its epoch or a newer one, sound): nothing to connect.
  bool TableApplied(const Group& g, const peer::PeerTable& table) const
      ABSL_SHARED_LOCKS_REQUIRED(g.mu);
  // Decides under the group's lock how its communicator is (re)connected and starts the
  // connect through `run` (after the lock; on the factory's thread when it may block).
  // `table`: a multi-daemon group's peer table (null: a local group). Its outcome goes to
  // FinishConnect with the ticket stored in the group.
  void StartConnect(Group& g, const peer::PeerTable* table, bool from_table, AfterUnlock* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Re-takes the group's lock to commit a connect StartConnect began (or to drop it when the
  // group went, the daemon shuts down or a newer connect superseded it) and answers the joins
  // it served.
  void FinishConnect(const std::string& group, uint64_t ticket,
                     absl::StatusOr<collective::ConnectedCommunicator> connected);
  // FinishConnect's two kinds: a local group takes its new communicator and completes its
  // joins; a multi-daemon group applies the coordinator's table and answers the joins that
  // waited for its epoch. What neither takes of `connected` stays in it (destroyed after the
  // lock).
  void InstallLocalCommunicatorLocked(Group& g,
                                      absl::StatusOr<collective::ConnectedCommunicator>& connected,
                                      AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  void InstallPeerTableLocked(Group& g, const peer::PeerTable& table, bool from_table,
                              absl::StatusOr<collective::ConnectedCommunicator>& connected,
                              AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Installs `connected` for multi-daemon group `g` at `table`'s epoch (engine, local ranks,
  // ReconcileModules, the rollback a re-form owes).
  absl::Status ApplyTable(Group& g, const peer::PeerTable& table,
                          collective::ConnectedCommunicator connected, AfterUnlock* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Answers multi-daemon join `j` of `g` (now formed at an epoch its rendezvous reached).
  void AnswerRendezvousJoin(Group& g, PendingJoin& j, AfterUnlock* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Removes `g` if nothing uses it any more (marks it removed and drops it from the table; the
  // caller's reference keeps it alive until after its lock).
  void MaybeRemoveGroup(Group& g) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Removes `g` for good (DeleteGroup, idle reclaim): its collectives, modules and buffers.
  // REQUIRES: no rank joined or joining. The freed buffers are returned so that the caller
  // drops them after the lock (unmap and unlink are syscalls).
  DeletedGroup RemoveGroupLocked(Group& g, const absl::Status& reason,
                                 std::vector<std::shared_ptr<Buffer>>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Removes `g` once unused for group_idle_timeout (DeadlineLoop).
  void ReclaimIfIdle(Group& g, absl::Time now, std::vector<std::shared_ptr<Buffer>>* freed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // RESOURCE_EXHAUSTED when `uid` may not create another group (max_groups_per_uid), given
  // the table's groups.
  absl::Status CheckGroupQuota(int64_t uid, const std::string& group,
                               const GroupTable::Map& groups) const;
  // The group's coordinator is no longer used by it: its watch stream may close later.
  void NoteCoordinatorIdle(const std::string& coordinator) ABSL_LOCKS_EXCLUDED(idle_mu_);
  // The rank's session is over here (leave, lease ended); tells the coordinator.
  void EndRank(Group& g, int32_t rank, AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // The session of `rank` ended (`why`; REQUIRES: EndRank ran): collectives that need it fail
  // at once from now on (after the ops it had already submitted, see FailDeferred).
  void FailForRank(Group& g, int32_t rank, absl::string_view why, AfterUnlock* run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // Fails the group with its deferred failure once no op a departed rank had submitted can
  // still complete (or now, when `now`). Multi-daemon groups: the failure goes to the
  // coordinator through `run` (after the lock).
  void FailDeferred(Group& g, bool now, AfterUnlock* run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu);
  // GPU daemons: the context rank `rank` lives on; null for host-memory daemons.
  gpu::DeviceContext* DeviceOf(int32_t rank) const { return devices_.DeviceOf(rank); }
  // The request for a communicator over `spec` (local devices filled in on GPU daemons).
  collective::CommunicatorRequest RequestFor(collective::GroupSpec spec, bool nccl_agreed) const;

  const absl::Duration lease_timeout_;
  peer::DaemonIdentity self_;
  const std::vector<std::shared_ptr<gpu::DeviceContext>> gpus_;
  RankDevices& devices_;
  // Chooses and connects the groups' backends (inproc, UCX, NCCL; staged on GPU daemons).
  // Never called under a group's lock but for Choose (no I/O).
  collective::CommunicatorFactory& comms_;
  collective::CollectiveEngine& engine_;
  const absl::Duration group_idle_timeout_;
  const int32_t max_groups_per_uid_;
  Clock* const clock_;
  const std::shared_ptr<KeptBufferPool> kept_pool_;
  GroupTable& table_;
  Modules& modules_;
  Records& records_;
  peer::PeerClient* peer_ = nullptr;  // set by Start

  std::atomic<uint64_t> next_session_{1};
  // Tickets of StartConnect (unique over every group, so a removed and re-created group never
  // takes an old connect for its own).
  std::atomic<uint64_t> next_connect_{1};
  // Set once (Shutdown; draining_: StartDrain, cleared by StopDrain); read under any lock. Shutdown
  // sets it before it visits each group under that group's lock, so a join that takes a group's
  // lock after the visit sees it, and one before is failed by the visit.
  std::atomic<bool>& shutdown_;
  std::atomic<bool> draining_{false};
  // Coordinators whose last group went away, and since when (DeadlineLoop unwatches them).
  absl::Mutex idle_mu_;  // a leaf
  std::map<std::string, absl::Time> coordinator_idle_since_ ABSL_GUARDED_BY(idle_mu_);
  absl::Mutex loop_mu_;  // the deadline loop's sleep, woken by Shutdown
  bool loop_stop_ ABSL_GUARDED_BY(loop_mu_) = false;
  std::thread deadline_thread_;
};

}  // namespace flatshard::server

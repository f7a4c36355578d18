// GroupManager: groups, joins (local and through a coordinator), sessions, peer events,
// the deadline loop. Registration, summons and operator views live in group_manager_*.cc.

#include "server/group_manager.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/planner.h"
#include "common/status_macros.h"

#include "server/group_manager_internal.h"

namespace flatshard::server {

using internal::CheckUid;
using internal::Display;
using internal::kUnwatchAfter;
using internal::TokensEqual;

namespace {

std::shared_ptr<Group> MakeGoneGroup() {
  auto g = std::make_shared<Group>();
  absl::MutexLock lock(&g->mu);
  g->removed = true;
  return g;
}

}  // namespace

GroupManager::GroupManager(ShardStore* store, GroupManagerOptions options)
    : store_(store),
      lease_timeout_(options.lease_timeout),
      self_(std::move(options.self)),
      gpus_(std::move(options.gpus)),
      copier_(options.copier),
      devices_(gpus_),
      group_idle_timeout_(options.group_idle_timeout),
      max_groups_per_uid_(options.max_groups_per_uid),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()),
      kept_pool_(KeptBufferPool::Create(store, clock_)),
      gone_(MakeGoneGroup()),
      state_dir_(options.state_dir),
      testing_commit_copy_pause_(options.testing_commit_copy_pause) {
  if (state_dir_ != nullptr) state_sequence_ = state_dir_->max_loaded_sequence();
  FS_CHECK(gpus_.empty() || copier_ != nullptr) << "a GPU daemon needs a DeviceCopier";
  collective::CommunicatorFactoryOptions factory;
  factory.remote = std::move(options.remote_backend);
  factory.nccl = std::move(options.nccl_backend);
  factory.copier = copier_;
  factory.registry = options.backend_registry;
  absl::StatusOr<std::unique_ptr<collective::CommunicatorFactory>> comms =
      collective::CommunicatorFactory::Create(std::move(factory));
  FS_CHECK(comms.ok()) << comms.status();
  comms_ = *std::move(comms);
  if (!self_.peer_address.empty() && comms_->has_remote()) {
    self_.backend_address = comms_->RemoteAddress();
    self_.nccl = comms_->has_nccl();
    peer_credentials_ = options.peer.credentials;
    peer_ = std::make_unique<peer::PeerClient>(self_, std::move(options.peer), this);
  }
  deadline_thread_ = std::thread([this] { DeadlineLoop(); });
}

GroupManager::~GroupManager() {
  Shutdown();
  deadline_thread_.join();
  peer_.reset();  // its pending rendezvous fail now, while the manager is whole
  // Connects still queued finish (FinishConnect drops them: shutdown_); then no thread but
  // the callers' can enter the manager.
  comms_.reset();
  devices_.Stop();  // the device waits still queued end now, while the manager is whole
  // Shutdown aborted every group's collectives, but their ops fail on the engine's watchdog
  // thread, and a completion may be running on a backend thread: callbacks that lock mu_ and
  // read groups_. Wait for them before any member goes. Invariant: a callback of an op of
  // group G runs only while G's CollectiveGroup is alive (the engine holds it across OnDone,
  // an abort across the abort), and the manager's own references (Group::coll,
  // OpenSummon::coll) are dropped here; the others (op callbacks, the engine's map) go once
  // the aborted ops failed. So once none is left, no callback of this manager runs.
  std::vector<std::weak_ptr<collective::CollectiveGroup>> colls;
  for (const std::shared_ptr<Group>& held : AllGroups()) {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.coll == nullptr) continue;
    colls.push_back(g.coll);
    engine_.RemoveGroup(g.id, absl::UnavailableError("flatshardd is shutting down")).IgnoreError();
    g.coll = nullptr;
    for (auto& [summon, open] : g.open_summons) open.coll = nullptr;
  }
  const absl::Time until = absl::Now() + absl::Seconds(10);
  for (const std::weak_ptr<collective::CollectiveGroup>& c : colls) {
    while (!c.expired() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
    if (!c.expired()) {
      FS_LOG(ERROR) << "a group's collectives were still referenced 10s after shutdown";
      break;
    }
  }
}

void GroupManager::Shutdown() {
  AfterUnlock run;
  if (shutdown_.exchange(true)) return;
  {
    absl::MutexLock lock(&loop_mu_);
    loop_stop_ = true;
  }
  // Every group is visited under its lock after the flag is set (see shutdown_).
  const absl::Status down = absl::UnavailableError("flatshardd is shutting down");
  for (const std::shared_ptr<Group>& held : AllGroups()) {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    for (PendingJoin& j : g.pending_joins) {
      run.Call([done = std::move(j.done), down]() mutable { done(down); });
    }
    g.pending_joins.clear();
    // Pending collectives (registrations, summons) fail on the engine's thread.
    if (g.coll) g.coll->Abort(down);
  }
  run.Run();
}

std::shared_ptr<GroupManager::Group> GroupManager::FindGroup(const std::string& id) const {
  absl::MutexLock lock(&table_mu_);
  auto it = groups_.find(id);
  return it == groups_.end() ? nullptr : it->second;
}

std::shared_ptr<GroupManager::Group> GroupManager::GroupOrGone(const std::string& id) const {
  std::shared_ptr<Group> g = FindGroup(id);
  return g != nullptr ? g : gone_;
}

std::vector<std::shared_ptr<GroupManager::Group>> GroupManager::AllGroups() const {
  absl::MutexLock lock(&table_mu_);
  std::vector<std::shared_ptr<Group>> all;
  all.reserve(groups_.size());
  for (const auto& [id, g] : groups_) all.push_back(g);
  return all;
}

void GroupManager::Join(const JoinArgs& args, absl::Time deadline, JoinCallback done) {
  AfterUnlock run;
  absl::Status error;
  uint64_t session = 0;
  uint64_t failed_epoch = 0;
  std::vector<std::string> held_modules;  // what this daemon holds of the group (ReconcileModules)
  if (shutdown_) {
    error = absl::UnavailableError("flatshardd is shutting down");
  } else if (draining_) {
    error = absl::UnavailableError("flatshardd is draining");
  } else if (args.group.empty()) {
    error = absl::InvalidArgumentError("group id must not be empty");
  } else if (args.world_size < 1 || args.world_size > kMaxWorldSize) {
    error = absl::InvalidArgumentError(absl::StrCat("group ", args.group,
                                                    ": world_size must be in [1, ", kMaxWorldSize,
                                                    "], got ", args.world_size));
  } else if (args.rank < 0 || args.rank >= args.world_size) {
    error = absl::InvalidArgumentError(absl::StrCat("group ", args.group, ": rank ", args.rank,
                                                    " is out of range [0, ", args.world_size, ")"));
  } else if (!args.coordinator.empty() && peer_ == nullptr) {
    error = absl::FailedPreconditionError(absl::StrCat(
        "group ", args.group, ": rank ", args.rank, " names coordinator ", args.coordinator,
        ", but this daemon serves no multi-daemon groups (start flatshardd with --peer_address",
        !comms_->has_remote() ? " and a UCX build" : "", ")"));
  }
  // The group, found or made under the table's lock, then this join under the group's own. A
  // group removed between the two (its last rank left) is looked up (or made) again.
  std::shared_ptr<Group> held;
  while (error.ok()) {
    {
      absl::MutexLock lock(&table_mu_);
      auto it = groups_.find(args.group);
      if (it != groups_.end()) {
        held = it->second;
      } else if (error = CheckGroupQuota(args.uid, args.group); error.ok()) {
        held = std::make_shared<Group>();
        held->id = args.group;
        held->world_size = args.world_size;
        held->token = args.token;
        held->owner_uid = args.uid;
        held->coordinator = args.coordinator;
        groups_[args.group] = held;
        // A local group's communicator (and its list of local ranks) is made once every rank
        // has joined (MaybeCompleteJoins): a world_size nobody joins costs nothing per rank.
        FS_LOG(INFO) << "group=" << args.group << " created, world_size=" << args.world_size
                     << (held->multi() ? absl::StrCat(", coordinator=", args.coordinator) : "");
      }
    }
    if (!error.ok()) break;
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) continue;
    if (shutdown_) {
      // Shutdown visited this group before this join reached it (see shutdown_).
      error = absl::UnavailableError("flatshardd is shutting down");
    } else if (absl::Status s = CheckUid(g, args.uid); !s.ok()) {
      error = std::move(s);
    } else if (!TokensEqual(g.token, args.token)) {
      error = absl::PermissionDeniedError(absl::StrCat("group ", g.id, ": wrong token"));
    } else if (g.world_size != args.world_size) {
      error = absl::InvalidArgumentError(absl::StrCat(
          "group ", g.id, " has world_size ", g.world_size, ", rank ", args.rank,
          " joined with world_size ", args.world_size));
    } else if (g.coordinator != args.coordinator) {
      error = absl::InvalidArgumentError(absl::StrCat(
          "group ", g.id, " has coordinator \"", g.coordinator, "\", rank ", args.rank,
          " joined with coordinator \"", args.coordinator, "\""));
    } else if (g.session_of_rank[args.rank] != 0) {
      error = absl::AlreadyExistsError(absl::StrCat("group ", g.id, ": rank ", args.rank,
                                                    " is already joined (session ",
                                                    g.session_of_rank[args.rank], ")"));
    } else {
      // A returning rank: the failure its departure left pending happens now, so the group
      // re-forms (and rolls back) instead of running on with a stale op stream.
      FailDeferred(g, /*now=*/true, &run);
      session = next_session_++;
      g.session_of_rank[args.rank] = session;
      g.pending_joins.push_back(
          PendingJoin{args.rank, session, deadline, std::move(done), args.caller_gone});
      FS_LOG(INFO) << "group=" << g.id << " rank=" << args.rank << " joined, session=" << session;
      if (!g.multi()) MaybeCompleteJoins(g, &run);
      if (g.multi() && g.coll && !g.coll->status().ok()) failed_epoch = g.epoch;
      if (g.multi()) held_modules = internal::HeldModules(g.registered, &g.lost);
    }
    if (!error.ok()) MaybeRemoveGroup(g);
    break;
  }
  held = nullptr;
  if (!error.ok()) {
    run.Run();
    done(error);
    return;
  }
  run.Run();
  if (!args.coordinator.empty()) {
    // The daemons meet at the coordinator; the join completes when every rank arrived there.
    // GPU ranks say where they live; rank 0 brings a fresh NCCL id for this round.
    const gpu::DeviceContext* device = DeviceOf(args.rank);
    std::string nccl_id;
    if (comms_->has_nccl() && args.rank == 0) {
      absl::StatusOr<std::string> id = comms_->NcclUniqueId();
      if (id.ok()) {
        nccl_id = *std::move(id);
      } else {
        FS_LOG(WARNING) << "group=" << args.group << ": no NCCL unique id (" << id.status()
                        << "): device memory will be staged through the host path";
      }
    }
    peer_->Rendezvous(args.coordinator, args.group, args.token, args.world_size, args.rank,
                      deadline,
                      [this, group = args.group, rank = args.rank,
                       session](absl::StatusOr<peer::PeerTable> table) {
                        OnRendezvous(group, rank, session, std::move(table));
                      },
                      failed_epoch, device == nullptr ? std::string() : device->uuid(), nccl_id,
                      held_modules);
  }
}

void GroupManager::OnRendezvous(const std::string& group, int32_t rank, uint64_t session,
                                absl::StatusOr<peer::PeerTable> table) {
  AfterUnlock run;
  std::shared_ptr<Group> held = FindGroup(group);
  if (held == nullptr) return;
  {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) return;
    auto j = std::find_if(g.pending_joins.begin(), g.pending_joins.end(),
                          [&](const PendingJoin& p) { return p.session == session; });
    if (j == g.pending_joins.end()) return;  // failed already (deadline, shutdown)
    absl::Status s = table.status();
    if (s.ok() && (static_cast<int32_t>(table->rank_daemons.size()) != g.world_size ||
                   table->rank_daemons[rank].daemon_id != self_.daemon_id)) {
      s = absl::InternalError(absl::StrCat("group ", g.id, ": the coordinator's peer table does not "
                                           "place rank ", rank, " on this daemon"));
    }
    if (s.ok() && TableApplied(g, *table)) {
      // Another local rank's rendezvous (or OnTable) connected this epoch already.
      if (g.rollback_due) {
        g.rollback_due = false;
        StartRollback(g, &run);  // queued before the join's answer
      }
      AnswerRendezvousJoin(g, *j, &run);
      g.pending_joins.erase(j);
    } else if (s.ok()) {
      // The communicator for this epoch is connected outside the lock; FinishConnect answers
      // this join (and the other local ranks' joins that reached the same epoch).
      j->ready_epoch = table->epoch;
      StartConnect(g, &*table, /*from_table=*/false, &run);
    } else {
      g.session_of_rank[rank] = 0;  // a failed join leaves no trace
      run.Call([done = std::move(j->done), s]() mutable { done(s); });
      g.pending_joins.erase(j);
      MaybeRemoveGroup(g);
    }
  }
  held = nullptr;
  run.Run();
}

void GroupManager::AnswerRendezvousJoin(Group& g, PendingJoin& j,
                                        AfterUnlock* run) {
  std::vector<std::string> modules;
  for (const auto& [module, r] : g.registered) modules.push_back(module);
  if (!g.leased.contains(j.rank) || g.leased.at(j.rank) != j.session) {
    g.lease_due[j.rank] = clock_->Now() + lease_timeout_;
  }
  std::vector<std::string> lost;
  for (const auto& [module, why] : g.lost) {
    if (!g.registered.contains(module)) lost.push_back(why);
  }
  run->Call([done = std::move(j.done),
                  result = JoinResult{j.session, modules, std::move(lost)}]() mutable {
    done(std::move(result));
  });
}

bool GroupManager::TableApplied(const Group& g, const peer::PeerTable& table) const {
  if (g.coll == nullptr) return false;
  if (g.epoch >= table.epoch && g.coll->status().ok()) return true;
  return g.epoch > table.epoch;  // a stale table: the group already runs a newer epoch
}

collective::CommunicatorRequest GroupManager::RequestFor(collective::GroupSpec spec,
                                                         bool nccl_agreed) const {
  collective::CommunicatorRequest request;
  request.spec = std::move(spec);
  request.nccl_agreed = nccl_agreed;
  if (!gpus_.empty()) {
    for (int r : request.spec.local_ranks) {
      request.spec.local_devices.push_back(DeviceOf(r)->device());
    }
  }
  return request;
}

void GroupManager::StartConnect(Group& g, const peer::PeerTable* table, bool from_table,
                                AfterUnlock* run) {
  if (g.connecting != 0 && (table == nullptr || g.connecting_epoch >= table->epoch)) {
    // A connect for this epoch (or a newer one) is under way: its FinishConnect answers every
    // join waiting for it, this one included.
    g.connect_from_table = g.connect_from_table || from_table;
    return;
  }
  collective::GroupSpec spec;
  if (table == nullptr) {
    spec = collective::GroupSpec::AllLocal(g.id, g.world_size);
    if (g.coll != nullptr) {
      FS_LOG(INFO) << "group=" << g.id << " re-forms its communicator after: "
                   << g.coll->status();
    }
  } else {
    spec.group_id = g.id;
    spec.world_size = g.world_size;
    spec.epoch = table->epoch;
    for (int32_t r = 0; r < g.world_size; ++r) {
      const peer::DaemonIdentity& d = table->rank_daemons[r];
      if (d.daemon_id == self_.daemon_id) spec.local_ranks.push_back(r);
      spec.rank_addresses.push_back(d.backend_address);
    }
    spec.nccl_unique_id = table->nccl_unique_id;  // the factory keeps it for NCCL only
  }
  collective::CommunicatorRequest request =
      RequestFor(std::move(spec), table != nullptr && table->device_transport == "nccl");
  // Invariant (FinishConnect): `g.connecting` holds the ticket of the one connect whose
  // outcome the group takes. A newer connect (a newer epoch) replaces the ticket, and a
  // removed group takes none, so a connect that finishes late is dropped, never installed
  // over a newer communicator.
  const uint64_t ticket = next_connect_++;
  g.connect_from_table = (g.connecting != 0 && g.connect_from_table) || from_table;
  g.connecting = ticket;
  g.connecting_epoch = table == nullptr ? 0 : table->epoch;
  g.connecting_table = table == nullptr ? peer::PeerTable{} : *table;
  // Choose does no I/O; a connect that may block (UCX round trips, NCCL device queries) runs
  // on the factory's thread, never on the caller's (a gRPC thread). Either way after mu_.
  absl::StatusOr<collective::BackendChoice> choice = comms_->Choose(request);
  const bool may_block = choice.ok() && collective::CommunicatorFactory::MayBlock(*choice);
  run->Call([this, id = g.id, ticket, may_block, request = std::move(request)]() mutable {
    if (may_block) {
      comms_->ConnectAsync(std::move(request),
                           [this, id, ticket](
                               absl::StatusOr<collective::ConnectedCommunicator> c) mutable {
                             FinishConnect(id, ticket, std::move(c));
                           });
    } else {
      FinishConnect(id, ticket, comms_->Connect(std::move(request)));
    }
  });
}

void GroupManager::FinishConnect(const std::string& group, uint64_t ticket,
                                 absl::StatusOr<collective::ConnectedCommunicator> connected) {
  AfterUnlock run;
  // A communicator nobody takes, destroyed after mu_ (its teardown may wait for the backend).
  std::unique_ptr<collective::Communicator> unused;
  auto drop = [&] {
    if (connected.ok()) unused = std::move(connected->comm);
  };
  std::shared_ptr<Group> held = FindGroup(group);
  if (held == nullptr) {
    drop();
  } else {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    // Re-checked after the gap: the group may be gone (removed, perhaps re-created under the
    // same id: tickets are never reused), a newer connect may have started, the daemon may be
    // shutting down (which answered every pending join already).
    if (g.removed || g.connecting != ticket) {
      drop();
    } else {
      g.connecting = 0;
      const bool from_table = std::exchange(g.connect_from_table, false);
      const peer::PeerTable table = std::exchange(g.connecting_table, peer::PeerTable{});
      if (shutdown_) {
        drop();
      } else if (!g.multi()) {
        absl::Status s = connected.status();
        DropGoneJoins(g, &run);  // a join whose caller went away must not complete for it
        if (s.ok() && !g.AllJoined()) {
          // A rank's join was withdrawn or expired in the gap: the others wait on; the next
          // complete join connects afresh.
          drop();
        } else {
          if (s.ok()) {
            const bool reform = g.coll != nullptr;
            if (reform) {
              engine_.RemoveGroup(g.id, absl::AbortedError("communicator re-formed")).IgnoreError();
              g.coll = nullptr;
            }
            const std::string backend = connected->backend_name();
            absl::StatusOr<std::shared_ptr<collective::CollectiveGroup>> added =
                engine_.AddGroup(connected->spec, std::move(connected->comm));
            s = added.status();
            if (s.ok()) {
              g.coll = *std::move(added);
              g.local_ranks.clear();
              for (int32_t r = 0; r < g.world_size; ++r) g.local_ranks.push_back(r);
              if (!gpus_.empty()) {
                FS_LOG(INFO) << "group=" << g.id << " moves device memory "
                             << (backend == "inproc" ? "by staged copies between its ranks"
                                                     : absl::StrCat("over ", backend));
              }
              // Every rank resumes from the last committed generation (before any join
              // completes).
              // An adopted group (restart) owes one too: a trainer that missed the kill may
              // have written into the adopted shards (rollback_due, set by AdoptGroups).
              if (reform || g.rollback_due) {
                g.rollback_due = false;
                StartRollback(g, &run);
              }
              CompleteJoins(g, &run);
            }
          }
          if (!s.ok()) {
            for (PendingJoin& j : g.pending_joins) {
              g.session_of_rank[j.rank] = 0;
              run.Call([done = std::move(j.done), s]() mutable { done(s); });
            }
            g.pending_joins.clear();
            MaybeRemoveGroup(g);
          }
        }
      } else {
        absl::Status s = connected.status();
        if (s.ok() && TableApplied(g, table)) {
          drop();
        } else if (s.ok()) {
          s = ApplyTable(g, table, *std::move(connected), &run);
          // Restarts: the epoch, the local ranks and modules dropped as lost.
          if (s.ok()) PersistLater(g, &run);
        }
        if (!s.ok() && from_table && g.coll != nullptr) {
          FS_LOG(WARNING) << "group=" << g.id << " could not re-form at epoch " << table.epoch
                          << ": " << s;
          g.coll->Abort(s);
        }
        if (s.ok() && g.rollback_due) {
          g.rollback_due = false;
          StartRollback(g, &run);  // queued before the joins' answers
        }
        // The joins whose rendezvous reached this epoch (or an older one) waited for it.
        bool failed_join = false;
        for (auto j = g.pending_joins.begin(); j != g.pending_joins.end();) {
          if (j->ready_epoch == 0 || j->ready_epoch > table.epoch) {
            ++j;
            continue;
          }
          if (s.ok()) {
            AnswerRendezvousJoin(g, *j, &run);
          } else {
            g.session_of_rank[j->rank] = 0;  // a failed join leaves no trace
            run.Call([done = std::move(j->done), s]() mutable { done(s); });
            failed_join = true;
          }
          j = g.pending_joins.erase(j);
        }
        if (failed_join) MaybeRemoveGroup(g);
      }
    }
  }
  held = nullptr;
  unused.reset();
  run.Run();
}

absl::Status GroupManager::ApplyTable(Group& g, const peer::PeerTable& table,
                                      collective::ConnectedCommunicator connected,
                                      AfterUnlock* run) {
  const bool reform = g.coll != nullptr;
  if (g.coll) {
    engine_.RemoveGroup(g.id, absl::AbortedError(absl::StrCat(
                                  "group ", g.id, " re-formed at epoch ", table.epoch)))
        .IgnoreError();
  }
  const std::string backend = connected.backend_name();
  const bool staged = connected.choice.staged;
  const std::vector<int> local_ranks = connected.spec.local_ranks;
  FS_ASSIGN_OR_RETURN(g.coll, engine_.AddGroup(connected.spec, std::move(connected.comm)));
  g.epoch = table.epoch;
  g.table = table;  // checkpoints find the other daemons here
  g.local_ranks.assign(local_ranks.begin(), local_ranks.end());
  ReconcileModules(g, table, run);

  // A re-form follows a failure: every daemon rolls its ranks back to the last committed
  // generation (StartRollback, by the caller).
  if (reform) g.rollback_due = true;
  FS_LOG(INFO) << "group=" << g.id << " epoch=" << g.epoch << " formed over " << g.world_size
               << " ranks, local ranks " << absl::StrJoin(g.local_ranks, ",") << ", backend "
               << backend
               << (gpus_.empty() ? "" : backend == "nccl" ? ", device memory over NCCL"
                                   : staged ? ", device memory staged over the host path"
                                            : "");
  return absl::OkStatus();
}

void GroupManager::MaybeRemoveGroup(Group& g) {
  if (g.removed || !g.Idle()) return;
  g.removed = true;
  engine_.RemoveGroup(g.id, absl::AbortedError("group removed")).IgnoreError();
  absl::MutexLock lock(&table_mu_);
  auto it = groups_.find(g.id);
  if (it != groups_.end() && it->second.get() == &g) groups_.erase(it);  // the caller holds g
  // Its coordinator's watch stream is closed by DeadlineLoop once no group has used it for a
  // while: a job that leaves and joins again (or a refused join followed by a good one) keeps
  // the stream instead of racing its close.
  if (!g.coordinator.empty()) coordinator_idle_since_.try_emplace(g.coordinator, clock_->Now());
}

gpu::IpcEventRef GroupManager::RecordReady(int32_t rank) { return devices_.RecordReady(rank); }

void GroupManager::MaybeCompleteJoins(Group& g, AfterUnlock* run) {
  DropGoneJoins(g, run);  // a join whose caller went away must not complete for it
  if (!g.AllJoined()) return;
  if (g.coll != nullptr && g.coll->status().ok()) {
    CompleteJoins(g, run);
    return;
  }
  // The first complete join of a local group, or every rank is back after a failure (start
  // the op sequence afresh): connect outside the lock; FinishConnect answers the joins.
  StartConnect(g, /*table=*/nullptr, /*from_table=*/false, run);
}

void GroupManager::CompleteJoins(Group& g, AfterUnlock* run) {
  std::vector<std::string> modules;
  for (const auto& [module, r] : g.registered) modules.push_back(module);
  const absl::Time lease_due = clock_->Now() + lease_timeout_;
  for (PendingJoin& j : g.pending_joins) {
    if (!g.leased.contains(j.rank) || g.leased.at(j.rank) != j.session) {
      g.lease_due[j.rank] = lease_due;
    }
    // Restarts: a module an adopting daemon had to drop (its ranks at different
    // generations) is named to every rank, as in multi-daemon groups.
    std::vector<std::string> lost;
    for (const auto& [module, why] : g.lost) {
      if (!g.registered.contains(module)) lost.push_back(why);
    }
    JoinResult result{j.session, modules, std::move(lost)};
    run->Call([done = std::move(j.done), result = std::move(result)]() mutable {
      done(std::move(result));
    });
  }
  g.pending_joins.clear();
}

void GroupManager::OnTable(const std::string& coordinator, const peer::PeerTable& table) {
  AfterUnlock run;
  if (shutdown_) return;
  std::shared_ptr<Group> held = FindGroup(table.group);
  if (held == nullptr || held->coordinator != coordinator) return;
  {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed || shutdown_) return;
    if (g.coll == nullptr || table.epoch <= g.epoch) return;  // joins in flight apply it
    if (static_cast<int32_t>(table.rank_daemons.size()) != g.world_size) return;
    // Connected outside the lock; FinishConnect installs it (or aborts the group's
    // collectives with the failure) and starts the rollback a re-form owes.
    StartConnect(g, &table, /*from_table=*/true, &run);
  }
  run.Run();
}

void GroupManager::OnGroupFailed(const std::string& coordinator, const std::string& group,
                                 uint64_t epoch, const absl::Status& status) {
  std::shared_ptr<Group> held = FindGroup(group);
  if (held == nullptr || held->coordinator != coordinator) return;
  Group& g = *held;
  absl::MutexLock lock(&g.mu);
  if (g.removed || g.coll == nullptr || g.epoch != epoch) return;
  FS_LOG(WARNING) << "group=" << g.id << " epoch=" << epoch << " failed elsewhere: " << status;
  g.reported_epoch = epoch;  // the coordinator knows
  if (absl::IsUnavailable(status) &&
      absl::StrContains(status.message(), internal::kSessionEndedMarker)) {
    // A rank's session ended on another daemon: this daemon's running ops (its part of an
    // agreement the departed rank had joined) complete first, as they do there, so every
    // daemon reaches the same verdict; then the group fails (FailDeferred, DeadlineLoop).
    if (g.deferred_failure.ok()) {
      g.deferred_failure = status;
      g.deferred_since = clock_->Now();
    }
    AfterUnlock none;
    FailDeferred(g, /*now=*/false, &none);  // reported_epoch is current: nothing to report
    return;
  }
  g.coll->Abort(status);
}

void GroupManager::OnCoordinatorLost(const std::string& coordinator, const absl::Status& status) {
  for (const std::shared_ptr<Group>& held : AllGroups()) {
    Group& g = *held;
    if (g.coordinator != coordinator) continue;
    absl::MutexLock lock(&g.mu);
    if (g.removed || g.coll == nullptr) continue;
    FS_LOG(WARNING) << "group=" << g.id << " lost its coordinator " << coordinator << ": "
                    << status;
    g.reported_epoch = g.epoch;
    g.coll->Abort(absl::UnavailableError(absl::StrCat("group ", g.id, ": coordinator ",
                                                      coordinator, " lost: ", status.message())));
  }
}

void GroupManager::DropGoneJoins(Group& g, AfterUnlock* run) {
  for (auto j = g.pending_joins.begin(); j != g.pending_joins.end();) {
    if (!j->caller_gone || !j->caller_gone()) {
      ++j;
      continue;
    }
    FS_LOG(WARNING) << "group=" << g.id << " rank=" << j->rank << " session=" << j->session
                    << ": its JoinGroup call was cancelled (the caller went away); the join is "
                       "withdrawn and the rank is free";
    EndRank(g, j->rank, run);
    run->Call([done = std::move(j->done), rank = j->rank, id = g.id]() mutable {
      done(absl::CancelledError(absl::StrCat("group ", id, ": rank ", rank,
                                             "'s JoinGroup was cancelled by its caller")));
    });
    j = g.pending_joins.erase(j);
  }
}

void GroupManager::ExpireUnleased(Group& g, absl::Time now,
                                  AfterUnlock* run) {
  for (auto it = g.lease_due.begin(); it != g.lease_due.end();) {
    const int32_t rank = it->first;
    const uint64_t session = g.session_of_rank[rank];
    const auto leased = g.leased.find(rank);
    if (session == 0 || (leased != g.leased.end() && leased->second == session)) {
      it = g.lease_due.erase(it);  // ended, or leased since
      continue;
    }
    if (it->second > now) {
      ++it;
      continue;
    }
    it = g.lease_due.erase(it);
    const absl::Status why = absl::UnavailableError(absl::StrCat(
        "group ", g.id, ": rank ", rank, "'s session ", session, " opened no lease within ",
        absl::FormatDuration(lease_timeout_), " of its join (the trainer went away)"));
    FS_LOG(WARNING) << why.message() << "; the session ends";
    // As when a lease closes (EndSession): its summons end without writeback, and the
    // group's collectives fail fast from now on, naming the rank, until it joins again
    // (before, only collectives already pending failed; later ones waited for their deadline).
    DropSummons(g, rank, run);
    EndRank(g, rank, run);
    FailForRank(g, rank,
                absl::StrCat("opened no lease within ", absl::FormatDuration(lease_timeout_),
                             " of its join (the trainer went away)"),
                run);  // after EndRank: the rank counts as gone
  }
}

absl::Status GroupManager::AttachLease(const Caller& caller) {
  std::shared_ptr<Group> held = FindGroup(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  Group& g = *held;
  absl::MutexLock lock(&g.mu);
  FS_RETURN_IF_ERROR(CheckCallerLocked(g, caller));
  auto [it, inserted] = g.leased.try_emplace(caller.rank, caller.session);
  if (!inserted && it->second == caller.session) {
    return absl::AlreadyExistsError(absl::StrCat(
        "group ", g.id, " rank ", caller.rank, ": session ", caller.session,
        " already has its lease; a second Lease stream for it is refused"));
  }
  it->second = caller.session;
  g.lease_due.erase(caller.rank);
  return absl::OkStatus();
}

absl::Status GroupManager::CheckCaller(const Caller& caller) const {
  std::shared_ptr<Group> held = FindGroup(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  absl::ReaderMutexLock lock(&held->mu);
  return CheckCallerLocked(*held, caller);
}

absl::Status GroupManager::CheckCallerLocked(const Group& g, const Caller& caller) const {
  if (g.removed) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  FS_RETURN_IF_ERROR(CheckUid(g, caller.uid));
  if (!TokensEqual(g.token, caller.token)) {
    return absl::PermissionDeniedError(absl::StrCat("group ", g.id, ": wrong token"));
  }
  if (caller.rank < 0 || caller.rank >= g.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("group ", g.id, ": rank ", caller.rank,
                                                   " is out of range [0, ", g.world_size, ")"));
  }
  if (caller.session == 0 || g.session_of_rank[caller.rank] != caller.session) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", g.id, " rank ", caller.rank, ": session ", caller.session,
        " is not the rank's current session (join first)"));
  }
  if (g.coll == nullptr) {
    // A session of a join still pending (the group forms once every rank has joined).
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", g.id, " rank ", caller.rank, ": the group has not formed yet (its join is "
        "still waiting for the other ranks)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RegisterResult> GroupManager::GetShards(const Caller& caller,
                                                       const std::string& module) {
  std::shared_ptr<Group> held = FindGroup(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  Group& g = *held;
  absl::MutexLock lock(&g.mu);
  FS_RETURN_IF_ERROR(CheckCallerLocked(g, caller));
  auto it = g.registered.find(module);
  if (it == g.registered.end()) {
    if (auto lost = g.lost.find(module); lost != g.lost.end()) {
      return absl::FailedPreconditionError(lost->second);
    }
    return absl::NotFoundError(
        absl::StrCat("group ", g.id, ": module ", Display(module), " is not registered"));
  }
  Registered& reg = it->second;
  // Never zeros as the model, never shards about to be rolled back.
  FS_RETURN_IF_ERROR(CheckUsable(g, module, reg));
  if (!reg.shards_by_rank[caller.rank].empty()) reg.stale[caller.rank] = false;
  RegisterResult result{reg.plan, reg.shards_by_rank[caller.rank], std::nullopt,
                        reg.generation[caller.rank]};
  result.state_specs = reg.state_specs;
  return result;
}

absl::Status GroupManager::Leave(const Caller& caller) {
  AfterUnlock run;
  std::shared_ptr<Group> held = FindGroup(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    FS_RETURN_IF_ERROR(CheckCallerLocked(g, caller));
    DropSummons(g, caller.rank, &run);
    EndRank(g, caller.rank, &run);
    FailForRank(g, caller.rank, "left the group", &run);  // after EndRank: the rank counts as gone
    FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " left";
    MaybeRemoveGroup(g);
  }
  held = nullptr;
  run.Run();
  return absl::OkStatus();
}

void GroupManager::EndSession(const std::string& group, uint64_t session) {
  AfterUnlock run;
  std::shared_ptr<Group> held = FindGroup(group);
  if (held == nullptr) return;
  {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) return;
    for (int32_t r : g.session_of_rank.Joined()) {  // sparse: never O(world_size)
      if (g.session_of_rank[r] != session) continue;
      // Its summons end without writeback; collectives waiting for it fail now rather than
      // at their deadline (the communicator re-forms once every rank joined again).
      DropSummons(g, r, &run);
      EndRank(g, r, &run);
      FailForRank(g, r, "ended (its lease closed: the client is gone)", &run);
      FS_LOG(INFO) << "group=" << g.id << " rank=" << r << " lease ended (session=" << session
                   << ")";
    }
    MaybeRemoveGroup(g);
  }
  held = nullptr;
  run.Run();
}

void GroupManager::FailForRank(Group& g, int32_t rank, absl::string_view why,
                               AfterUnlock* run) {
  // Fail fast (semantics.md §3a): every collective needs every rank, so from now on each one
  // fails at once with this cause (sticky) instead of waiting for its deadline, on every
  // daemon of the group (DeadlineLoop reports it to the coordinator). The group re-forms,
  // rolling back to the last committed generation, once every rank has joined again.
  if (g.coll == nullptr) return;
  if (g.deferred_failure.ok()) {
    g.deferred_failure = absl::UnavailableError(
        absl::StrCat("group ", g.id, ": rank ", rank, internal::kSessionEndedMarker, why));
    g.deferred_since = clock_->Now();
  }
  FailDeferred(g, /*now=*/false, run);
}

void GroupManager::FailDeferred(Group& g, bool now, AfterUnlock* run) {
  if (g.deferred_failure.ok() || g.coll == nullptr) return;
  if (!now && clock_->Now() - g.deferred_since < internal::kDeferFailureAtMost) {
    // An op a departed rank already submitted, and no departed rank still missing from it,
    // completes (its other ranks are alive): let it, so that an agreement that reached some
    // daemons reaches all of them (no daemon applies a writeback or commit the others
    // refused). Anything else cannot complete: fail now.
    // The analysis does not follow lambdas: this one runs only here, under g.mu.
    auto departed = [&](int r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return r >= 0 && r < g.world_size && g.session_of_rank[r] == 0 &&
             std::find(g.local_ranks.begin(), g.local_ranks.end(), r) != g.local_ranks.end();
    };
    // An op every rank arrived at (running) completes without anyone's help; so does one a
    // departed rank had submitted while no departed rank is missing from it.
    for (const collective::PendingOpInfo& op : g.coll->PendingOps()) {
      const bool submitted = std::any_of(op.arrived_ranks.begin(), op.arrived_ranks.end(), departed);
      const bool stuck = std::any_of(op.missing_ranks.begin(), op.missing_ranks.end(), departed);
      const bool completes = op.running || (submitted && !stuck);
      FS_VLOG(1) << "group=" << g.id << " op_seq=" << op.op_seq << " arrived "
                 << absl::StrJoin(op.arrived_ranks, ",") << " missing "
                 << absl::StrJoin(op.missing_ranks, ",") << (completes ? ": completes first" : "");
      if (completes) return;  // DeadlineLoop checks again
    }
  }
  g.coll->Abort(g.deferred_failure);
  g.deferred_failure = absl::OkStatus();
  g.deferred_since = absl::InfiniteFuture();
  if (g.multi() && g.reported_epoch != g.epoch) {
    // The other daemons fail at once too (the coordinator forwards it); reported now, since a
    // group left idle by the departure is removed before DeadlineLoop would report it.
    g.reported_epoch = g.epoch;
    run->Call([this, coordinator = g.coordinator, group = g.id, token = g.token,
                    epoch = g.epoch, status = g.coll->status()] {
      peer_->ReportFailure(coordinator, group, token, epoch, status);
    });
  }
}

void GroupManager::EndRank(Group& g, int32_t rank, AfterUnlock* run) {
  g.session_of_rank[rank] = 0;
  g.lease_due.erase(rank);
  g.leased.erase(rank);
  if (g.multi()) {
    run->Call([this, coordinator = g.coordinator, group = g.id, token = g.token, rank] {
      peer_->Depart(coordinator, group, token, rank);
    });
  }
}

void GroupManager::DeadlineLoop() {
  for (;;) {
    {
      // Wake at least every 20 ms; deadlines are in seconds, so this costs nothing.
      absl::MutexLock lock(&loop_mu_);
      loop_mu_.AwaitWithTimeout(absl::Condition(&loop_stop_), absl::Milliseconds(20));
      if (loop_stop_) return;
    }
    AfterUnlock run;
    // Buffers of reclaimed groups, dropped after the locks (munmap, unlink).
    std::vector<std::shared_ptr<Buffer>> freed;
    const absl::Time now = clock_->Now();
    // One group at a time, each under its own lock: a group busy elsewhere delays only itself.
    for (const std::shared_ptr<Group>& held : AllGroups()) {
      Group& g = *held;
      absl::MutexLock lock(&g.mu);
      if (g.removed) continue;
      DropGoneJoins(g, &run);
      ExpireUnleased(g, now, &run);
      // The ranks missing when the first join expired: every join that expires in this pass
      // names the same ranks (not the ones whose joins expired before it in the pass).
      // Computed only when a join expires (O(world_size)).
      std::optional<std::string> missing;
      for (auto j = g.pending_joins.begin(); j != g.pending_joins.end();) {
        // A multi-daemon join ends with the coordinator's answer (which names the missing
        // ranks); this is only the backstop for a coordinator that never answers.
        const absl::Time expiry = g.multi() ? j->deadline + absl::Seconds(2) : j->deadline;
        if (expiry > now) {
          ++j;
          continue;
        }
        if (!g.multi() && !missing) missing = internal::RankListText(g.MissingRanks());
        absl::Status s = absl::DeadlineExceededError(
            g.multi() ? absl::StrCat("group ", g.id, ": the coordinator ", g.coordinator,
                                     " did not answer rank ", j->rank, "'s rendezvous")
                      : absl::StrCat("group ", g.id, ": ", *missing, " of ", g.world_size,
                                     " did not join before the deadline"));
        g.session_of_rank[j->rank] = 0;  // a failed join leaves no trace
        run.Call([done = std::move(j->done), s]() mutable { done(s); });
        j = g.pending_joins.erase(j);
      }
      FailDeferred(g, /*now=*/false, &run);
      // A multi-daemon group that failed here tells its coordinator, which tells the other
      // daemons (they fail at once instead of at their deadlines) and re-forms the group at
      // the next complete rendezvous.
      if (g.multi() && g.coll && !g.coll->status().ok() && g.reported_epoch != g.epoch) {
        g.reported_epoch = g.epoch;
        run.Call([this, coordinator = g.coordinator, group = g.id, token = g.token,
                  epoch = g.epoch, status = g.coll->status()] {
          peer_->ReportFailure(coordinator, group, token, epoch, status);
        });
      }
      MaybeRemoveGroup(g);
      ReclaimIfIdle(g, now, &freed);
    }
    {
      absl::MutexLock lock(&table_mu_);
      for (auto c = coordinator_idle_since_.begin(); c != coordinator_idle_since_.end();) {
        const std::string& coordinator = c->first;
        const bool used = std::any_of(groups_.begin(), groups_.end(), [&](const auto& g) {
          return g.second->coordinator == coordinator;
        });
        if (used) {
          c = coordinator_idle_since_.erase(c);
        } else if (now - c->second >= kUnwatchAfter) {
          run.Call([this, coordinator] { peer_->Unwatch(coordinator); });
          c = coordinator_idle_since_.erase(c);
        } else {
          ++c;
        }
      }
    }
    // Kept buffers idle for a while give their pages back (the caches' own locks, not mu_).
    kept_pool_->DecommitIdle(clock_->Now());
    run.Run();
    freed.clear();
    FlushRemovedRecords();
  }
}

}  // namespace flatshard::server

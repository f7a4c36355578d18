// Membership: connecting and re-forming a group's communicator, locally or at the epoch a
// coordinator's peer table names, and the coordinator's events.

#include "server/group/membership.h"

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
#include "server/durable/records.h"
#include "server/group/access.h"
#include "server/group/daemon_agreement.h"
#include "server/group/group.h"
#include "server/messages.h"
#include "server/module/modules.h"

namespace flatshard::server {

using internal::CheckUid;
using internal::Display;
using internal::kUnwatchAfter;
using internal::TokensEqual;

void Membership::OnRendezvous(const std::string& group, int32_t rank, uint64_t session,
                              absl::StatusOr<peer::PeerTable> table) {
  AfterUnlock run;
  std::shared_ptr<Group> held = table_.Find(group);
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
      s = absl::InternalError(absl::StrCat("group ", g.id,
                                           ": the coordinator's peer table does not "
                                           "place rank ",
                                           rank, " on this daemon"));
    }
    if (s.ok()) s = CheckDaemonsAgree(*table);  // every daemon's joins fail alike
    if (s.ok() && TableApplied(g, *table)) {
      // Another local rank's rendezvous (or OnTable) connected this epoch already.
      if (g.rollback_due) {
        g.rollback_due = false;
        modules_.StartRollback(g, &run);  // queued before the join's answer
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

void Membership::AnswerRendezvousJoin(Group& g, PendingJoin& j, AfterUnlock* run) {
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

bool Membership::TableApplied(const Group& g, const peer::PeerTable& table) const {
  if (g.coll == nullptr) return false;
  if (g.epoch >= table.epoch && g.coll->status().ok()) return true;
  return g.epoch > table.epoch;  // a stale table: the group already runs a newer epoch
}

collective::CommunicatorRequest Membership::RequestFor(collective::GroupSpec spec,
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

void Membership::StartConnect(Group& g, const peer::PeerTable* table, bool from_table,
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
      FS_LOG(INFO) << "group=" << g.id << " re-forms its communicator after: " << g.coll->status();
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
  absl::StatusOr<collective::BackendChoice> choice = comms_.Choose(request);
  const bool may_block = choice.ok() && collective::CommunicatorFactory::MayBlock(*choice);
  run->Call([this, id = g.id, ticket, may_block, request = std::move(request)]() mutable {
    if (may_block) {
      comms_.ConnectAsync(
          std::move(request),
          [this, id, ticket](absl::StatusOr<collective::ConnectedCommunicator> c) mutable {
            FinishConnect(id, ticket, std::move(c));
          });
    } else {
      FinishConnect(id, ticket, comms_.Connect(std::move(request)));
    }
  });
}

void Membership::FinishConnect(const std::string& group, uint64_t ticket,
                               absl::StatusOr<collective::ConnectedCommunicator> connected) {
  AfterUnlock run;
  // A communicator nobody takes, destroyed after the lock (its teardown may wait for the
  // backend).
  std::unique_ptr<collective::Communicator> unused;
  std::shared_ptr<Group> held = table_.Find(group);
  if (held != nullptr) {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    // Re-checked after the gap: the group may be gone (removed, perhaps re-created under the
    // same id: tickets are never reused), a newer connect may have started, the daemon may be
    // shutting down (which answered every pending join already).
    if (!g.removed && g.connecting == ticket) {
      g.connecting = 0;
      const bool from_table = std::exchange(g.connect_from_table, false);
      const peer::PeerTable table = std::exchange(g.connecting_table, peer::PeerTable{});
      if (shutdown_) {
        // dropped below
      } else if (!g.multi()) {
        InstallLocalCommunicatorLocked(g, connected, &run);
      } else {
        InstallPeerTableLocked(g, table, from_table, connected, &run);
      }
    }
  }
  if (connected.ok()) unused = std::move(connected->comm);  // nobody took it
  held = nullptr;
  unused.reset();
  run.Run();
}

void Membership::InstallLocalCommunicatorLocked(
    Group& g, absl::StatusOr<collective::ConnectedCommunicator>& connected, AfterUnlock* run) {
  absl::Status s = connected.status();
  DropGoneJoins(g, run);  // a join whose caller went away must not complete for it
  if (s.ok() && !g.AllJoined()) {
    // A rank's join was withdrawn or expired in the gap: the others wait on; the next
    // complete join connects afresh.
    return;
  }
  if (s.ok()) {
    const bool reform = g.coll != nullptr;
    if (reform) {
      engine_.RemoveGroup(g.id, absl::AbortedError("communicator re-formed")).IgnoreError();
      run->Destroy(std::move(g.coll));  // its teardown after the lock
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
      // Every rank resumes from the last committed generation (before any join completes).
      // An adopted group (restart) owes one too: a trainer that missed the kill may have
      // written into the adopted shards (rollback_due, set by AdoptGroups).
      if (reform || g.rollback_due) {
        g.rollback_due = false;
        modules_.StartRollback(g, run);
      }
      CompleteJoins(g, run);
      return;
    }
  }
  for (PendingJoin& j : g.pending_joins) {
    g.session_of_rank[j.rank] = 0;
    run->Call([done = std::move(j.done), s]() mutable { done(s); });
  }
  g.pending_joins.clear();
  MaybeRemoveGroup(g);
}

void Membership::InstallPeerTableLocked(
    Group& g, const peer::PeerTable& table, bool from_table,
    absl::StatusOr<collective::ConnectedCommunicator>& connected, AfterUnlock* run) {
  absl::Status s = connected.status();
  if (s.ok() && !TableApplied(g, table)) {
    s = ApplyTable(g, table, *std::move(connected), run);
    // Restarts: the epoch, the local ranks and modules dropped as lost.
    if (s.ok()) records_.PersistLater(g, run);
  }
  if (!s.ok() && from_table && g.coll != nullptr) {
    FS_LOG(WARNING) << "group=" << g.id << " could not re-form at epoch " << table.epoch << ": "
                    << s;
    g.coll->Abort(s);
  }
  if (s.ok() && g.rollback_due) {
    g.rollback_due = false;
    modules_.StartRollback(g, run);  // queued before the joins' answers
  }
  // The joins whose rendezvous reached this epoch (or an older one) waited for it.
  bool failed_join = false;
  for (auto j = g.pending_joins.begin(); j != g.pending_joins.end();) {
    if (j->ready_epoch == 0 || j->ready_epoch > table.epoch) {
      ++j;
      continue;
    }
    if (s.ok()) {
      AnswerRendezvousJoin(g, *j, run);
    } else {
      g.session_of_rank[j->rank] = 0;  // a failed join leaves no trace
      run->Call([done = std::move(j->done), s]() mutable { done(s); });
      failed_join = true;
    }
    j = g.pending_joins.erase(j);
  }
  if (failed_join) MaybeRemoveGroup(g);
}

absl::Status Membership::ApplyTable(Group& g, const peer::PeerTable& table,
                                    collective::ConnectedCommunicator connected, AfterUnlock* run) {
  const bool reform = g.coll != nullptr;
  if (g.coll) {
    engine_
        .RemoveGroup(g.id, absl::AbortedError(
                               absl::StrCat("group ", g.id, " re-formed at epoch ", table.epoch)))
        .IgnoreError();
  }
  const std::string backend = connected.backend_name();
  const bool staged = connected.choice.staged;
  const std::vector<int> local_ranks = connected.spec.local_ranks;
  absl::StatusOr<std::shared_ptr<collective::CollectiveGroup>> added =
      engine_.AddGroup(connected.spec, std::move(connected.comm));
  if (!added.ok()) return added.status();
  run->Destroy(std::exchange(g.coll, *std::move(added)));  // the old one's teardown after the lock
  g.epoch = table.epoch;
  g.table = table;  // checkpoints find the other daemons here
  g.local_ranks.assign(local_ranks.begin(), local_ranks.end());
  modules_.ReconcileModules(g, table, run);

  // A re-form follows a failure: every daemon rolls its ranks back to the last committed
  // generation (StartRollback, by the caller).
  if (reform) g.rollback_due = true;
  FS_LOG(INFO) << "group=" << g.id << " epoch=" << g.epoch << " formed over " << g.world_size
               << " ranks, local ranks " << absl::StrJoin(g.local_ranks, ",") << ", backend "
               << backend
               << (gpus_.empty()       ? ""
                   : backend == "nccl" ? ", device memory over NCCL"
                   : staged            ? ", device memory staged over the host path"
                                       : "");
  return absl::OkStatus();
}

void Membership::OnTable(const std::string& coordinator, const peer::PeerTable& table) {
  AfterUnlock run;
  if (shutdown_) return;
  std::shared_ptr<Group> held = table_.Find(table.group);
  if (held == nullptr || held->coordinator != coordinator) return;
  {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed || shutdown_) return;
    if (g.coll == nullptr || table.epoch <= g.epoch) return;  // joins in flight apply it
    if (static_cast<int32_t>(table.rank_daemons.size()) != g.world_size) return;
    if (absl::Status s = CheckDaemonsAgree(table); !s.ok()) {
      // A daemon of the group restarted with other settings: the group cannot re-form.
      FS_LOG(WARNING) << "group=" << g.id << " cannot re-form at epoch " << table.epoch << ": "
                      << s;
      g.coll->Abort(s);
      return;
    }
    // Connected outside the lock; FinishConnect installs it (or aborts the group's
    // collectives with the failure) and starts the rollback a re-form owes.
    StartConnect(g, &table, /*from_table=*/true, &run);
  }
  run.Run();
}

void Membership::OnGroupFailed(const std::string& coordinator, const std::string& group,
                               uint64_t epoch, const absl::Status& status) {
  std::shared_ptr<Group> held = table_.Find(group);
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

void Membership::OnCoordinatorLost(const std::string& coordinator, const absl::Status& status) {
  for (const std::shared_ptr<Group>& held : table_.All()) {
    Group& g = *held;
    if (g.coordinator != coordinator) continue;
    absl::MutexLock lock(&g.mu);
    if (g.removed || g.coll == nullptr) continue;
    FS_LOG(WARNING) << "group=" << g.id << " lost its coordinator " << coordinator << ": "
                    << status;
    g.reported_epoch = g.epoch;
    g.coll->Abort(absl::UnavailableError(
        absl::StrCat("group ", g.id, ": coordinator ", coordinator, " lost: ", status.message())));
  }
}

}  // namespace flatshard::server

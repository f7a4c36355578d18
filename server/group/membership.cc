// Membership: joins, sessions and leases, fail-fast departures, the deadline loop.

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
#include "server/group/group.h"
#include "server/messages.h"
#include "server/module/generations.h"
#include "server/module/modules.h"

namespace flatshard::server {

using internal::CheckUid;
using internal::Display;
using internal::kUnwatchAfter;
using internal::TokensEqual;

Membership::Membership(MembershipOptions options)
    : lease_timeout_(options.lease_timeout),
      self_(std::move(options.self)),
      gpus_(std::move(options.gpus)),
      devices_(*options.devices),
      comms_(*options.comms),
      engine_(*options.engine),
      group_idle_timeout_(options.group_idle_timeout),
      max_groups_per_uid_(options.max_groups_per_uid),
      clock_(options.clock),
      kept_pool_(std::move(options.kept_pool)),
      table_(*options.table),
      modules_(*options.modules),
      records_(*options.records),
      shutdown_(*options.shutdown) {}

Membership::~Membership() {
  if (deadline_thread_.joinable()) deadline_thread_.join();
}

void Membership::Start(peer::PeerClient* peer) {
  peer_ = peer;
  deadline_thread_ = std::thread([this] { DeadlineLoop(); });
}

void Membership::Shutdown() {
  AfterUnlock run;
  if (shutdown_.exchange(true)) return;
  {
    absl::MutexLock lock(&loop_mu_);
    loop_stop_ = true;
  }
  // Every group is visited under its lock after the flag is set (see shutdown_).
  const absl::Status down = absl::UnavailableError("flatshardd is shutting down");
  for (const std::shared_ptr<Group>& held : table_.All()) {
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
  if (deadline_thread_.joinable()) deadline_thread_.join();
}

void Membership::Join(const JoinArgs& args, absl::Time deadline, JoinCallback done) {
  AfterUnlock run;
  absl::Status error = CheckJoinArgs(args);
  uint64_t session = 0;
  uint64_t failed_epoch = 0;
  std::vector<std::string> held_modules;  // what this daemon holds of the group (ReconcileModules)
  // The group, found or made under the table's lock, then this join under the group's own. A
  // group removed between the two (its last rank left) is looked up (or made) again.
  std::shared_ptr<Group> held;
  while (error.ok()) {
    absl::StatusOr<std::shared_ptr<Group>> found = table_.FindOrMake(
        args.group, [&](const GroupTable::Map& groups) -> absl::StatusOr<std::shared_ptr<Group>> {
          FS_RETURN_IF_ERROR(CheckGroupQuota(args.uid, args.group, groups));
          auto made = std::make_shared<Group>();
          made->id = args.group;
          made->world_size = args.world_size;
          made->token = args.token;
          made->owner_uid = args.uid;
          made->coordinator = args.coordinator;
          // A local group's communicator (and its list of local ranks) is made once every
          // rank has joined (MaybeCompleteJoins): a world_size nobody joins costs nothing per
          // rank.
          FS_LOG(INFO) << "group=" << args.group << " created, world_size=" << args.world_size
                       << (made->multi() ? absl::StrCat(", coordinator=", args.coordinator) : "");
          return made;
        });
    if (!found.ok()) {
      error = found.status();
      break;
    }
    held = *std::move(found);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) continue;
    error = AdmitJoinLocked(g, args);
    if (error.ok()) {
      // A returning rank: the failure its departure left pending happens now, so the group
      // re-forms (and rolls back) instead of running on with a stale op stream.
      FailDeferred(g, /*now=*/true, &run);
      session = next_session_++;
      g.session_of_rank[args.rank] = session;
      g.departed.erase(args.rank);
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
    StartRendezvous(args, deadline, session, failed_epoch, std::move(held_modules));
  }
}

absl::Status Membership::CheckJoinArgs(const JoinArgs& args) const {
  if (shutdown_) {
    return absl::UnavailableError("flatshardd is shutting down");
  }
  if (draining_) {
    return absl::UnavailableError("flatshardd is draining");
  }
  if (args.group.empty()) {
    return absl::InvalidArgumentError("group id must not be empty");
  }
  if (args.world_size < 1 || args.world_size > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("group ", args.group,
                                                   ": world_size must be in [1, ", kMaxWorldSize,
                                                   "], got ", args.world_size));
  }
  if (args.rank < 0 || args.rank >= args.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("group ", args.group, ": rank ", args.rank,
                                                   " is out of range [0, ", args.world_size, ")"));
  }
  if (!args.coordinator.empty() && peer_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", args.group, ": rank ", args.rank, " names coordinator ", args.coordinator,
        ", but this daemon serves no multi-daemon groups (start flatshardd with --peer_address",
        !comms_.has_remote() ? " and a UCX build" : "", ")"));
  }
  return absl::OkStatus();
}

absl::Status Membership::AdmitJoinLocked(Group& g, const JoinArgs& args) {
  if (shutdown_) {
    // Shutdown visited this group before this join reached it (see shutdown_).
    return absl::UnavailableError("flatshardd is shutting down");
  }
  FS_RETURN_IF_ERROR(CheckUid(g, args.uid));
  if (!TokensEqual(g.token, args.token)) {
    return absl::PermissionDeniedError(absl::StrCat("group ", g.id, ": wrong token"));
  }
  if (g.world_size != args.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("group ", g.id, " has world_size ", g.world_size,
                                                   ", rank ", args.rank, " joined with world_size ",
                                                   args.world_size));
  }
  if (g.coordinator != args.coordinator) {
    return absl::InvalidArgumentError(
        absl::StrCat("group ", g.id, " has coordinator \"", g.coordinator, "\", rank ", args.rank,
                     " joined with coordinator \"", args.coordinator, "\""));
  }
  if (g.session_of_rank[args.rank] != 0) {
    return absl::AlreadyExistsError(absl::StrCat("group ", g.id, ": rank ", args.rank,
                                                 " is already joined (session ",
                                                 g.session_of_rank[args.rank], ")"));
  }
  return absl::OkStatus();
}

void Membership::StartRendezvous(const JoinArgs& args, absl::Time deadline, uint64_t session,
                                 uint64_t failed_epoch, std::vector<std::string> held_modules) {
  // The daemons meet at the coordinator; the join completes when every rank arrived there.
  // GPU ranks say where they live; rank 0 brings a fresh NCCL id for this round.
  const gpu::DeviceContext* device = DeviceOf(args.rank);
  std::string nccl_id;
  if (comms_.has_nccl() && args.rank == 0) {
    absl::StatusOr<std::string> id = comms_.NcclUniqueId();
    if (id.ok()) {
      nccl_id = *std::move(id);
    } else {
      FS_LOG(WARNING) << "group=" << args.group << ": no NCCL unique id (" << id.status()
                      << "): device memory will be staged through the host path";
    }
  }
  peer_->Rendezvous(
      args.coordinator, args.group, args.token, args.world_size, args.rank, deadline,
      [this, group = args.group, rank = args.rank, session](absl::StatusOr<peer::PeerTable> table) {
        OnRendezvous(group, rank, session, std::move(table));
      },
      failed_epoch, device == nullptr ? std::string() : device->uuid(), nccl_id,
      std::move(held_modules));
}

void Membership::MaybeRemoveGroup(Group& g) {
  if (g.removed || !g.Idle()) return;
  g.removed = true;
  engine_.RemoveGroup(g.id, absl::AbortedError("group removed")).IgnoreError();
  table_.Erase(g);  // the caller holds g
  // Its coordinator's watch stream is closed by DeadlineLoop once no group has used it for a
  // while: a job that leaves and joins again (or a refused join followed by a good one) keeps
  // the stream instead of racing its close.
  if (!g.coordinator.empty()) NoteCoordinatorIdle(g.coordinator);
}

void Membership::MaybeCompleteJoins(Group& g, AfterUnlock* run) {
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

void Membership::CompleteJoins(Group& g, AfterUnlock* run) {
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

void Membership::DropGoneJoins(Group& g, AfterUnlock* run) {
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
      done(absl::CancelledError(
          absl::StrCat("group ", id, ": rank ", rank, "'s JoinGroup was cancelled by its caller")));
    });
    j = g.pending_joins.erase(j);
  }
}

void Membership::ExpireUnleased(Group& g, absl::Time now, AfterUnlock* run) {
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
    modules_.DropSummons(g, rank, run);
    EndRank(g, rank, run);
    g.departed[rank] = "lost";
    FailForRank(g, rank,
                absl::StrCat("opened no lease within ", absl::FormatDuration(lease_timeout_),
                             " of its join (the trainer went away)"),
                run);  // after EndRank: the rank counts as gone
  }
}

absl::Status Membership::AttachLease(const Caller& caller) {
  std::shared_ptr<Group> held = table_.Find(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  Group& g = *held;
  absl::MutexLock lock(&g.mu);
  FS_RETURN_IF_ERROR(CheckCallerLocked(g, caller));
  auto [it, inserted] = g.leased.try_emplace(caller.rank, caller.session);
  if (!inserted && it->second == caller.session) {
    return absl::AlreadyExistsError(
        absl::StrCat("group ", g.id, " rank ", caller.rank, ": session ", caller.session,
                     " already has its lease; a second Lease stream for it is refused"));
  }
  it->second = caller.session;
  g.lease_due.erase(caller.rank);
  return absl::OkStatus();
}

absl::Status Membership::CheckCaller(const Caller& caller) const {
  std::shared_ptr<Group> held = table_.Find(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  absl::ReaderMutexLock lock(&held->mu);
  return CheckCallerLocked(*held, caller);
}

absl::Status Membership::Leave(const Caller& caller) {
  AfterUnlock run;
  std::shared_ptr<Group> held = table_.Find(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    FS_RETURN_IF_ERROR(CheckCallerLocked(g, caller));
    modules_.DropSummons(g, caller.rank, &run);
    EndRank(g, caller.rank, &run);
    g.departed[caller.rank] = "left";
    // After EndRank: the rank counts as gone.
    FailForRank(g, caller.rank, internal::kLeftTheGroup, &run);
    FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " left";
    MaybeRemoveGroup(g);
  }
  held = nullptr;
  run.Run();
  return absl::OkStatus();
}

void Membership::EndSession(const std::string& group, uint64_t session) {
  AfterUnlock run;
  std::shared_ptr<Group> held = table_.Find(group);
  if (held == nullptr) return;
  {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) return;
    for (int32_t r : g.session_of_rank.Joined()) {  // sparse: never O(world_size)
      if (g.session_of_rank[r] != session) continue;
      // Its summons end without writeback; collectives waiting for it fail now rather than
      // at their deadline (the communicator re-forms once every rank joined again).
      modules_.DropSummons(g, r, &run);
      EndRank(g, r, &run);
      g.departed[r] = "lost";
      FailForRank(g, r, "ended (its lease closed: the client is gone)", &run);
      FS_LOG(INFO) << "group=" << g.id << " rank=" << r << " lease ended (session=" << session
                   << ")";
    }
    MaybeRemoveGroup(g);
  }
  held = nullptr;
  run.Run();
}

void Membership::FailForRank(Group& g, int32_t rank, absl::string_view why, AfterUnlock* run) {
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

void Membership::FailDeferred(Group& g, bool now, AfterUnlock* run) {
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
      const bool submitted =
          std::any_of(op.arrived_ranks.begin(), op.arrived_ranks.end(), departed);
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
    run->Call([this, coordinator = g.coordinator, group = g.id, token = g.token, epoch = g.epoch,
               status = g.coll->status()] {
      peer_->ReportFailure(coordinator, group, token, epoch, status);
    });
  }
}

void Membership::EndRank(Group& g, int32_t rank, AfterUnlock* run) {
  g.session_of_rank[rank] = 0;
  g.lease_due.erase(rank);
  g.leased.erase(rank);
  if (g.multi()) {
    run->Call([this, coordinator = g.coordinator, group = g.id, token = g.token, rank] {
      peer_->Depart(coordinator, group, token, rank);
    });
  }
}

void Membership::DeadlineLoop() {
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
    for (const std::shared_ptr<Group>& held : table_.All()) {
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
        run.Call([this, coordinator = g.coordinator, group = g.id, token = g.token, epoch = g.epoch,
                  status = g.coll->status()] {
          peer_->ReportFailure(coordinator, group, token, epoch, status);
        });
      }
      MaybeRemoveGroup(g);
      ReclaimIfIdle(g, now, &freed);
    }
    {
      absl::MutexLock lock(&idle_mu_);
      for (auto c = coordinator_idle_since_.begin(); c != coordinator_idle_since_.end();) {
        const std::string& coordinator = c->first;
        if (table_.AnyWithCoordinator(coordinator)) {
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
    records_.FlushRemoved();
  }
}

}  // namespace flatshard::server

namespace flatshard::server {

void Membership::NoteCoordinatorIdle(const std::string& coordinator) {
  absl::MutexLock lock(&idle_mu_);
  coordinator_idle_since_.try_emplace(coordinator, clock_->Now());
}

}  // namespace flatshard::server

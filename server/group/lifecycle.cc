// Membership: views for operators, drain, DeleteGroup, idle reclaim and the per-uid group quota.

#include "server/group/membership.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/durable/records.h"
#include "server/group/access.h"
#include "server/messages.h"
#include "server/module/modules.h"

namespace flatshard::server {

using internal::Display;
using internal::Short;

namespace {

std::string UidText(int64_t uid) { return uid < 0 ? std::string("(remote)") : absl::StrCat(uid); }

}  // namespace

std::vector<GroupCollectives> Membership::ListCollectives(const std::string& group) const {
  std::vector<std::pair<GroupCollectives, std::shared_ptr<collective::CollectiveGroup>>> found;
  for (const std::shared_ptr<Group>& held : table_.All()) {
    const Group& g = *held;
    if (!group.empty() && g.id != group) continue;
    absl::ReaderMutexLock lock(&g.mu);
    if (g.removed) continue;
    GroupCollectives info;
    info.group = g.id;
    info.world_size = g.world_size;
    info.epoch = g.epoch;
    info.local_ranks = g.local_ranks;
    found.emplace_back(std::move(info), g.coll);
  }
  // Asked outside the manager's lock: the backend takes its own.
  std::vector<GroupCollectives> out;
  for (auto& [info, coll] : found) {
    if (coll) {
      info.status = coll->status();
      info.pending = coll->PendingOps();
    }
    out.push_back(std::move(info));
  }
  return out;
}

std::vector<GroupInfo> Membership::ListGroups() const {
  std::vector<std::pair<GroupInfo, std::shared_ptr<collective::CollectiveGroup>>> found;
  for (const std::shared_ptr<Group>& held : table_.All()) {
    const Group& g = *held;
    absl::ReaderMutexLock lock(&g.mu);
    if (g.removed) continue;
    GroupInfo info;
    info.group = g.id;
    info.world_size = g.world_size;
    info.epoch = g.epoch;
    info.coordinator = g.coordinator;
    info.local_ranks = g.local_ranks;
    // Joined ranks are local ones (a session is this daemon's); the sparse map keeps this
    // O(joined), not O(world_size).
    info.joined_ranks = g.session_of_rank.Joined();
    std::map<int32_t, std::string> states(g.departed.begin(), g.departed.end());
    for (int32_t r : info.joined_ranks) states[r] = "joined";
    info.rank_states.assign(states.begin(), states.end());
    for (const auto& [module, reg] : g.registered) info.registered_modules.push_back(module);
    found.emplace_back(std::move(info), g.coll);
  }
  std::vector<GroupInfo> out;
  for (auto& [info, coll] : found) {
    if (coll) info.status = coll->status();  // outside the manager's lock, as ListCollectives
    out.push_back(std::move(info));
  }
  return out;
}

void Membership::StartDrain() {
  if (!draining_.exchange(true)) {
    FS_LOG(INFO) << "draining: new groups and joins are refused from now on";
  }
}

bool Membership::StopDrain() {
  const bool was_draining = draining_.exchange(false);
  if (was_draining) FS_LOG(INFO) << "undrained: new groups and joins are accepted again";
  return was_draining;
}

GroupStats Membership::GetStats() const {
  GroupStats stats;
  std::vector<std::shared_ptr<collective::CollectiveGroup>> colls;
  stats.draining = draining_;
  stats.shutting_down = shutdown_;
  for (const std::shared_ptr<Group>& held : table_.All()) {
    const Group& g = *held;
    absl::ReaderMutexLock lock(&g.mu);
    if (g.removed) continue;
    ++stats.groups;
    stats.sessions += g.session_of_rank.joined_count();
    stats.open_summons += static_cast<int32_t>(g.open_summons.size());
    stats.pending_joins += static_cast<int32_t>(g.pending_joins.size());
    if (g.coll) colls.push_back(g.coll);
  }
  for (const auto& coll : colls) {
    stats.pending_collectives += static_cast<int32_t>(coll->PendingOps().size());
  }
  return stats;
}

absl::Status Membership::CheckGroupQuota(int64_t uid, const std::string& group,
                                         const GroupTable::Map& groups) const {
  if (max_groups_per_uid_ <= 0) return absl::OkStatus();
  std::vector<std::string> owned;
  for (const auto& [id, g] : groups) {
    if (g->owner_uid == uid) owned.push_back(Short(id));
  }
  if (static_cast<int32_t>(owned.size()) < max_groups_per_uid_) return absl::OkStatus();
  if (owned.size() > 8) {
    const size_t more = owned.size() - 8;
    owned.resize(8);
    owned.push_back(absl::StrCat("... (", more, " more)"));
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "uid ", UidText(uid), " cannot create group ", Short(group), ": its group quota is ",
      max_groups_per_uid_, " (--max_groups_per_uid) and it has ", max_groups_per_uid_,
      " groups on this daemon (", absl::StrJoin(owned, ", "),
      "); delete one (flatshardctl delete-group) or let idle ones be reclaimed"));
}

DeletedGroup Membership::RemoveGroupLocked(Group& g, const absl::Status& reason,
                                           std::vector<std::shared_ptr<Buffer>>* freed) {
  DeletedGroup out;
  if (g.removed) return out;
  const std::string& id = g.id;
  out.group = id;
  // Every buffer the group holds moves to `freed` (dropped by the caller after the lock);
  // counted once each, however many structures share it.
  std::set<const Buffer*> seen;
  auto take = [&](std::shared_ptr<Buffer>& b) {
    if (b == nullptr) return;
    if (seen.insert(b.get()).second) {
      out.freed_bytes += b->bytes();
      ++out.freed_buffers;
    }
    freed->push_back(std::move(b));
  };
  for (auto& [module, reg] : g.registered) {
    out.modules.push_back(module);
    for (std::vector<UnitShard>& shards : reg.shards_by_rank) {
      for (UnitShard& s : shards) {
        take(s.shard);
        take(s.grad);
        for (std::shared_ptr<Buffer>& b : s.state) take(b);  // optimizer state
      }
    }
    for (auto& per_rank : reg.committed_state) {
      for (auto& per_unit : per_rank) {
        for (std::shared_ptr<Buffer>& b : per_unit) take(b);
      }
    }
    for (std::vector<std::shared_ptr<Buffer>>& committed : reg.committed) {
      for (std::shared_ptr<Buffer>& b : committed) take(b);  // the last commit's copies
    }
    for (auto& [key, b] : reg.grad_staging) take(b);
    for (auto& [key, b] : reg.new_grads) take(b);
    if (reg.kept) {
      for (std::shared_ptr<Buffer>& b : reg.kept->TakeAll()) take(b);
    }
    for (auto& [k, slot] : reg.slots) {
      for (auto* m :
           {&slot->shared_params, &slot->shared_grads, &slot->rank0_params, &slot->rank0_grads}) {
        for (auto& [rank, b] : *m) take(b);
      }
    }
  }
  records_.NoteRemoved(id);
  engine_.RemoveGroup(id, reason).IgnoreError();
  g.removed = true;
  table_.Erase(g);  // the caller holds g
  if (!g.coordinator.empty()) NoteCoordinatorIdle(g.coordinator);
  return out;
}

absl::StatusOr<DeletedGroup> Membership::DeleteGroup(const std::string& group, int64_t uid,
                                                     bool privileged) {
  std::vector<std::shared_ptr<Buffer>> freed;
  DeletedGroup out;
  std::shared_ptr<Group> held = table_.Find(group);
  if (held == nullptr) {
    return absl::NotFoundError(absl::StrCat("this daemon hosts no group ", Short(group)));
  }
  {
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    if (g.removed) {
      return absl::NotFoundError(absl::StrCat("this daemon hosts no group ", Short(group)));
    }
    if (!privileged) FS_RETURN_IF_ERROR(internal::CheckUid(g, uid));
    std::vector<int32_t> busy = g.session_of_rank.Joined();
    for (const PendingJoin& j : g.pending_joins) busy.push_back(j.rank);
    std::sort(busy.begin(), busy.end());
    busy.erase(std::unique(busy.begin(), busy.end()), busy.end());
    if (!busy.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("group ", Short(group), ": ", internal::RankListText(busy),
                       busy.size() == 1 ? " is" : " are",
                       " still joined; every rank must leave before the group can be deleted"));
    }
    if (!g.Unused()) {
      return absl::FailedPreconditionError(
          absl::StrCat("group ", Short(group), ": a registration or summon is still under way"));
    }
    out = RemoveGroupLocked(
        g, absl::AbortedError(absl::StrCat("group ", Short(group), " was deleted")), &freed);
    FS_LOG(INFO) << "group=" << Short(group) << " deleted by uid " << UidText(uid) << ": "
                 << out.modules.size() << " registered modules, " << out.freed_buffers
                 << " buffers, " << out.freed_bytes << " bytes freed";
  }
  held = nullptr;
  freed.clear();  // unmap and unlink outside the lock
  records_.FlushRemoved();
  return out;
}

void Membership::ReclaimIfIdle(Group& g, absl::Time now,
                               std::vector<std::shared_ptr<Buffer>>* freed) {
  if (g.removed) return;
  const bool enabled =
      group_idle_timeout_ > absl::ZeroDuration() && group_idle_timeout_ != absl::InfiniteDuration();
  if (!g.Unused()) {
    g.idle_since = absl::InfiniteFuture();
    return;
  }
  if (g.idle_since == absl::InfiniteFuture()) {
    g.idle_since = now;
    return;
  }
  if (!enabled || now - g.idle_since < group_idle_timeout_) return;
  const absl::Duration idle = now - g.idle_since;
  const std::string id = g.id;
  DeletedGroup d = RemoveGroupLocked(
      g,
      absl::AbortedError(absl::StrCat("group ", Short(id), " was reclaimed after ",
                                      absl::FormatDuration(idle), " without a session")),
      freed);
  FS_LOG(INFO) << "group=" << Short(id) << " reclaimed: no session for "
               << absl::FormatDuration(idle)
               << " (--group_idle_timeout=" << absl::FormatDuration(group_idle_timeout_) << "); "
               << d.modules.size() << " registered modules, " << d.freed_buffers << " buffers, "
               << d.freed_bytes << " bytes freed";
}

}  // namespace flatshard::server

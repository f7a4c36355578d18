// GroupManager: read-only views for operators (admin RPCs) and drain.

#include "server/group_manager.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"

#include "server/group_manager_internal.h"

namespace flatshard::server {

using internal::Display;

std::vector<GroupManager::GroupCollectives> GroupManager::ListCollectives(
    const std::string& group) const {
  std::vector<std::pair<GroupCollectives, std::shared_ptr<collective::CollectiveGroup>>> found;
  for (const std::shared_ptr<Group>& held : AllGroups()) {
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

std::vector<GroupManager::GroupInfo> GroupManager::ListGroups() const {
  std::vector<std::pair<GroupInfo, std::shared_ptr<collective::CollectiveGroup>>> found;
  for (const std::shared_ptr<Group>& held : AllGroups()) {
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

void GroupManager::StartDrain() {
  if (!draining_.exchange(true)) {
    FS_LOG(INFO) << "draining: new groups and joins are refused from now on";
  }
}

GroupManager::Stats GroupManager::GetStats() const {
  Stats stats;
  std::vector<std::shared_ptr<collective::CollectiveGroup>> colls;
  stats.draining = draining_;
  stats.shutting_down = shutdown_;
  for (const std::shared_ptr<Group>& held : AllGroups()) {
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

absl::StatusOr<std::vector<GroupManager::ModuleUnits>> GroupManager::ListUnits(
    const std::string& group, const std::optional<std::string>& module) const {
  std::shared_ptr<Group> held = FindGroup(group);
  if (held == nullptr) {
    return absl::NotFoundError(absl::StrCat("this daemon hosts no group ", group));
  }
  const Group& g = *held;
  absl::ReaderMutexLock lock(&g.mu);
  if (g.removed) return absl::NotFoundError(absl::StrCat("this daemon hosts no group ", group));
  if (module && !g.registered.contains(*module)) {
    return absl::NotFoundError(
        absl::StrCat("group ", g.id, ": module ", Display(*module), " is not registered"));
  }
  std::vector<ModuleUnits> out;
  for (const auto& [path, reg] : g.registered) {
    if (module && path != *module) continue;
    ModuleUnits m;
    m.module = path;
    m.initialized = reg.initialized;
    bool any = false;
    for (int32_t r : g.local_ranks) {
      if (r >= static_cast<int32_t>(reg.shards_by_rank.size()) || reg.shards_by_rank[r].empty()) {
        continue;
      }
      m.generation = any ? std::min(m.generation, reg.generation[r]) : reg.generation[r];
      any = true;
    }
    for (const PlanUnit& pu : reg.plan.units) {
      const int32_t u = pu.index;
      UnitInfo info;
      info.unit = u;
      info.module = pu.module;
      if (u < static_cast<int32_t>(reg.last_op.size())) info.last_op = reg.last_op[u];
      for (int32_t r : g.local_ranks) {
        UnitRankInfo ri;
        ri.rank = r;
        if (r < static_cast<int32_t>(reg.summoned.size()) &&
            u < static_cast<int32_t>(reg.summoned[r].size())) {
          ri.summoned = reg.summoned[r][u];
        }
        if (r < static_cast<int32_t>(reg.shards_by_rank.size()) &&
            u < static_cast<int32_t>(reg.shards_by_rank[r].size())) {
          const UnitShard& shard = reg.shards_by_rank[r][u];
          if (shard.shard) ri.shard_bytes = shard.shard->bytes();
          if (shard.grad) ri.grad_bytes = shard.grad->bytes();
          for (const auto& b : shard.state) {
            if (b) ri.state_bytes += b->bytes();
          }
        }
        for (const auto& [id, open] : g.open_summons) {
          if (open.rank != r || open.module != path) continue;
          for (size_t i = 0; i < open.units.size() && i < open.views.size(); ++i) {
            if (open.units[i] != u) continue;
            if (open.views[i].params) ri.unsharded_bytes += open.views[i].params->bytes();
            if (open.views[i].grads) ri.unsharded_bytes += open.views[i].grads->bytes();
          }
        }
        info.ranks.push_back(ri);
      }
      m.units.push_back(std::move(info));
    }
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace flatshard::server

// ---- Lifecycle: DeleteGroup, idle reclaim, the per-uid group quota ----

namespace flatshard::server {
namespace {

std::string UidText(int64_t uid) {
  return uid < 0 ? std::string("(remote)") : absl::StrCat(uid);
}

// At most 64 characters of a caller-given name, for messages.
std::string Short(const std::string& name) {
  return name.size() <= 64 ? name : absl::StrCat(name.substr(0, 61), "...");
}

}  // namespace

absl::Status GroupManager::CheckGroupQuota(int64_t uid, const std::string& group) const {
  if (max_groups_per_uid_ <= 0) return absl::OkStatus();
  std::vector<std::string> owned;
  for (const auto& [id, g] : groups_) {
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

GroupManager::DeletedGroup GroupManager::RemoveGroupLocked(
    Group& g, const absl::Status& reason, std::vector<std::shared_ptr<Buffer>>* freed) {
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
      for (auto* m : {&slot->shared_params, &slot->shared_grads, &slot->rank0_params,
                      &slot->rank0_grads}) {
        for (auto& [rank, b] : *m) take(b);
      }
    }
  }
  if (state_dir_ != nullptr) {
    absl::MutexLock lock(&records_mu_);
    removed_records_.emplace_back(id, ++state_sequence_);
  }
  engine_.RemoveGroup(id, reason).IgnoreError();
  g.removed = true;
  absl::MutexLock lock(&table_mu_);
  auto it = groups_.find(id);
  if (it != groups_.end() && it->second.get() == &g) groups_.erase(it);  // the caller holds g
  if (!g.coordinator.empty()) coordinator_idle_since_.try_emplace(g.coordinator, clock_->Now());
  return out;
}

absl::StatusOr<GroupManager::DeletedGroup> GroupManager::DeleteGroup(const std::string& group,
                                                                     int64_t uid,
                                                                     bool privileged) {
  std::vector<std::shared_ptr<Buffer>> freed;
  DeletedGroup out;
  std::shared_ptr<Group> held = FindGroup(group);
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
      return absl::FailedPreconditionError(absl::StrCat(
          "group ", Short(group), ": ", internal::RankListText(busy),
          busy.size() == 1 ? " is" : " are",
          " still joined; every rank must leave before the group can be deleted"));
    }
    if (!g.Unused()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "group ", Short(group), ": a registration or summon is still under way"));
    }
    out = RemoveGroupLocked(g, absl::AbortedError(absl::StrCat("group ", Short(group),
                                                                   " was deleted")),
                            &freed);
    FS_LOG(INFO) << "group=" << Short(group) << " deleted by uid " << UidText(uid) << ": "
                 << out.modules.size() << " registered modules, " << out.freed_buffers
                 << " buffers, " << out.freed_bytes << " bytes freed";
  }
  held = nullptr;
  freed.clear();  // unmap and unlink outside the lock
  FlushRemovedRecords();
  return out;
}

void GroupManager::ReclaimIfIdle(Group& g, absl::Time now,
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
               << absl::FormatDuration(idle) << " (--group_idle_timeout="
               << absl::FormatDuration(group_idle_timeout_) << "); " << d.modules.size()
               << " registered modules, " << d.freed_buffers << " buffers, " << d.freed_bytes
               << " bytes freed";
}

}  // namespace flatshard::server

namespace flatshard::server {

void GroupManager::ReconcileModules(Group& g, const peer::PeerTable& table, AfterUnlock* run) {
  if (static_cast<int32_t>(table.rank_modules.size()) != g.world_size) return;
  // What each rank's daemon holds, for the ranks known this round: this daemon's own ranks
  // (its state now) and every rank that reported at the rendezvous that made the table.
  const std::vector<std::string> mine = internal::HeldModules(g.registered);
  std::map<int32_t, const std::vector<std::string>*> known;
  for (int32_t r = 0; r < g.world_size; ++r) {
    if (table.rank_modules[r].has_value()) known[r] = &*table.rank_modules[r];
  }
  for (int32_t r : g.local_ranks) known[r] = &mine;
  std::set<std::string> keys;
  for (const auto& [r, held] : known) keys.insert(held->begin(), held->end());
  for (const std::string& key : keys) {
    std::vector<int32_t> lacking, holding;
    for (const auto& [r, held] : known) {
      (std::find(held->begin(), held->end(), key) != held->end() ? holding : lacking).push_back(r);
    }
    if (lacking.empty()) continue;
    const std::string module = key.substr(0, key.find('\x1f'));
    std::set<std::string> daemons;
    for (int32_t r : lacking) {
      if (r < static_cast<int32_t>(table.rank_daemons.size())) {
        daemons.insert(table.rank_daemons[r].node);
      }
    }
    // Restarts: every rank's daemon holds the module with the same plan, at different
    // committed generations (HeldKey): name who holds which.
    const std::string fingerprint_prefix = key.substr(0, key.rfind('\x1f') + 1);
    std::map<std::string, std::vector<std::string>> by_generation;  // generation -> "rank r (node)"
    bool all_hold = key.find('\x1f') != key.rfind('\x1f');
    for (const auto& [r, held] : known) {
      if (!all_hold) break;
      auto it = std::find_if(held->begin(), held->end(), [&](const std::string& k) {
        return k.compare(0, fingerprint_prefix.size(), fingerprint_prefix) == 0;
      });
      if (it == held->end()) {
        all_hold = false;
        break;
      }
      const std::string node = r < static_cast<int32_t>(table.rank_daemons.size())
                                   ? table.rank_daemons[r].node
                                   : std::string("?");
      by_generation[it->substr(fingerprint_prefix.size())].push_back(
          absl::StrCat("rank ", r, " (daemon ", node, ")"));
    }
    if (all_hold && by_generation.size() > 1) {
      std::vector<std::string> parts;
      for (const auto& [gen, who] : by_generation) {
        parts.push_back(absl::StrCat("generation ", gen, ": ", absl::StrJoin(who, ", ")));
      }
      std::string why = absl::StrCat(
          "group ", Short(g.id), ": module ", Display(module),
          " lost: its daemons hold different committed generations (", absl::StrJoin(parts, "; "),
          "): a daemon died between the daemons' copies of one commit, and no generation is "
          "held by every daemon; it was dropped on every daemon at epoch ", table.epoch,
          ": register it afresh on every rank (or restore it)");
      if (auto it = g.registered.find(module); it != g.registered.end()) {
        run->Destroy(g.registered.extract(it));  // its buffers go after the lock
      }
      FS_LOG(WARNING) << why;
      g.lost[module] = std::move(why);
      continue;
    }
    std::string why = absl::StrCat(
        "group ", Short(g.id), ": module ", Display(module), " lost the shards of ",
        internal::RankListText(lacking), " (daemon", daemons.size() == 1 ? " " : "s ",
        absl::StrJoin(daemons, ", "),
        ": restarted without them, deleted or reclaimed the group, or registered another "
        "plan) while ",
        internal::RankListText(holding), " still held theirs; it was dropped on every daemon at "
        "epoch ", table.epoch, ": register it afresh on every rank (or restore it)");
    if (auto it = g.registered.find(module);
        it != g.registered.end() && internal::HeldKey(module, it->second) == key) {
      run->Destroy(g.registered.extract(it));  // its buffers go after the lock
    }
    FS_LOG(WARNING) << why;
    g.lost[module] = std::move(why);
  }
  // A module whose ranks on this daemon hold different generations (with one daemon, no
  // other daemon's report shows it): dropped too, never rolled back into a mix.
  internal::DropMixedModules(g, absl::StrCat("at the re-form at epoch ", table.epoch), run);
}

}  // namespace flatshard::server

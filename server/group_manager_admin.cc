// GroupManager: read-only views for operators (admin RPCs) and drain.

#include "server/group_manager.h"

#include <algorithm>
#include <cstring>
#include <memory>
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
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, g] : groups_) {
      if (!group.empty() && id != group) continue;
      GroupCollectives info;
      info.group = id;
      info.world_size = g->world_size;
      info.epoch = g->epoch;
      info.local_ranks = g->local_ranks;
      found.emplace_back(std::move(info), g->coll);
    }
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
  {
    absl::ReaderMutexLock lock(&mu_);
    for (const auto& [id, g] : groups_) {
      GroupInfo info;
      info.group = id;
      info.world_size = g->world_size;
      info.epoch = g->epoch;
      info.coordinator = g->coordinator;
      info.local_ranks = g->local_ranks;
      for (int32_t r : g->local_ranks) {
        if (r < static_cast<int32_t>(g->session_of_rank.size()) && g->session_of_rank[r] != 0) {
          info.joined_ranks.push_back(r);
        }
      }
      for (const auto& [module, reg] : g->registered) info.registered_modules.push_back(module);
      found.emplace_back(std::move(info), g->coll);
    }
  }
  std::vector<GroupInfo> out;
  for (auto& [info, coll] : found) {
    if (coll) info.status = coll->status();  // outside the manager's lock, as ListCollectives
    out.push_back(std::move(info));
  }
  return out;
}

void GroupManager::StartDrain() {
  absl::MutexLock lock(&mu_);
  if (!draining_) FS_LOG(INFO) << "draining: new groups and joins are refused from now on";
  draining_ = true;
}

GroupManager::Stats GroupManager::GetStats() const {
  Stats stats;
  std::vector<std::shared_ptr<collective::CollectiveGroup>> colls;
  {
    absl::ReaderMutexLock lock(&mu_);
    stats.draining = draining_;
    stats.shutting_down = shutdown_;
    stats.groups = static_cast<int32_t>(groups_.size());
    for (const auto& [id, g] : groups_) {
      for (uint64_t s : g->session_of_rank) stats.sessions += s != 0;
      stats.open_summons += static_cast<int32_t>(g->open_summons.size());
      stats.pending_joins += static_cast<int32_t>(g->pending_joins.size());
      if (g->coll) colls.push_back(g->coll);
    }
  }
  for (const auto& coll : colls) {
    stats.pending_collectives += static_cast<int32_t>(coll->PendingOps().size());
  }
  return stats;
}

absl::StatusOr<std::vector<GroupManager::ModuleUnits>> GroupManager::ListUnits(
    const std::string& group, const std::optional<std::string>& module) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = groups_.find(group);
  if (it == groups_.end()) {
    return absl::NotFoundError(absl::StrCat("this daemon hosts no group ", group));
  }
  const Group& g = *it->second;
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

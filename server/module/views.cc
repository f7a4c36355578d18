// Modules: what a rank and an operator see of registered modules (GetShards, ListUnits), and
// what survives a multi-daemon group's re-form (ReconcileModules).

#include "server/module/modules.h"

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
#include "server/module/unit_ops.h"

namespace flatshard::server {

using internal::CheckUid;
using internal::Display;
using internal::kUnwatchAfter;
using internal::Short;
using internal::TokensEqual;

absl::StatusOr<RegisterResult> Modules::GetShards(const Caller& caller, const std::string& module) {
  std::shared_ptr<Group> held = table_.Find(caller.group);
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

namespace {

// `caller`'s open summon `summon` in `g` (under g.mu), or NOT_FOUND naming it.
absl::StatusOr<const OpenSummon*> FindOpenSummonLocked(const Group& g, const Caller& caller,
                                                       uint64_t summon)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(g.mu) {
  auto it = g.open_summons.find(summon);
  if (it == g.open_summons.end() || it->second.rank != caller.rank) {
    return absl::NotFoundError(
        absl::StrCat("group ", caller.group, " rank ", caller.rank, ": no open summon ", summon));
  }
  return &it->second;
}

}  // namespace

absl::StatusOr<std::string> Modules::ModuleOfSummon(const Caller& caller, uint64_t summon) const {
  std::shared_ptr<Group> held = table_.Find(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  absl::MutexLock lock(&held->mu);
  FS_ASSIGN_OR_RETURN(const OpenSummon* open, FindOpenSummonLocked(*held, caller, summon));
  return open->module;
}

absl::StatusOr<int64_t> Modules::SummonBytes(const Caller& caller, const std::string& module,
                                             const std::string& path,
                                             const SummonOptions& options) const {
  std::shared_ptr<Group> held = table_.Find(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  absl::MutexLock lock(&held->mu);
  auto it = held->registered.find(module);
  if (it == held->registered.end()) {
    return absl::NotFoundError(
        absl::StrCat("group ", caller.group, ": module ", Display(module), " is not registered"));
  }
  const Plan& plan = it->second.plan;
  int64_t bytes = 0;
  for (int32_t u : internal::SelectUnits(plan, path, options.recurse)) {
    const PlanUnit& unit = plan.units[u];
    bytes += unit.padded_numel * ItemSize(unit.dtype) * (options.with_grads ? 2 : 1);
  }
  return bytes;
}

absl::StatusOr<int64_t> Modules::OpenSummonBytes(const Caller& caller, uint64_t summon,
                                                 bool* writeback) const {
  std::shared_ptr<Group> held = table_.Find(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  absl::MutexLock lock(&held->mu);
  FS_ASSIGN_OR_RETURN(const OpenSummon* open, FindOpenSummonLocked(*held, caller, summon));
  *writeback = open->options.writeback;
  int64_t bytes = 0;
  for (const SummonedUnit& v : open->views) {
    if (v.params) bytes += v.params->bytes();
    if (v.grads) bytes += v.grads->bytes();
  }
  return bytes;
}

absl::StatusOr<uint64_t> Modules::Generation(const Caller& caller,
                                             const std::string& module) const {
  std::shared_ptr<Group> held = table_.Find(caller.group);
  if (held == nullptr) return absl::NotFoundError(absl::StrCat("unknown group ", caller.group));
  absl::MutexLock lock(&held->mu);
  auto it = held->registered.find(module);
  if (it == held->registered.end() || caller.rank < 0 ||
      caller.rank >= static_cast<int32_t>(it->second.generation.size())) {
    return absl::NotFoundError(
        absl::StrCat("group ", caller.group, ": module ", Display(module), " is not registered"));
  }
  return it->second.generation[caller.rank];
}

absl::StatusOr<std::vector<ModuleUnits>> Modules::ListUnits(
    const std::string& group, const std::optional<std::string>& module) const {
  std::shared_ptr<Group> held = table_.Find(group);
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

void Modules::ReconcileModules(Group& g, const peer::PeerTable& table, AfterUnlock* run) {
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
  std::set<std::string> undone;  // modules whose initialisation this re-form undid
  for (const std::string& key : keys) {
    std::vector<int32_t> lacking, holding;
    for (const auto& [r, held] : known) {
      (std::find(held->begin(), held->end(), key) != held->end() ? holding : lacking).push_back(r);
    }
    if (lacking.empty()) continue;
    const std::string module = key.substr(0, key.find('\x1f'));
    if (undone.contains(module)) continue;
    std::vector<const std::vector<std::string>*> reports;
    for (const auto& [r, held] : known) reports.push_back(held);
    if (internal::InitUndoneEverywhere(module, reports)) {
      // A daemon killed during the module's initialisation: undone on every daemon.
      undone.insert(module);
      UndoInitLocked(
          g, module,
          absl::StrCat("its initialisation was undone at the re-form at epoch ", table.epoch,
                       ": a daemon was killed during it and not every daemon held "
                       "its initial values"),
          run);
      continue;
    }
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
      // A Commit that reached some daemons while others' ranks only voted for it (a daemon
      // killed between its agreement and its intent, or an agreement torn by the kill): one
      // generation every daemon can end at, the voted ranks rolled forward or back to it by
      // the rollback that follows (RollbackNow).
      std::vector<std::string> generations;
      for (const auto& [gen, who] : by_generation) generations.push_back(gen);
      if (std::optional<uint64_t> to = internal::ResolveHeld(generations)) {
        if (auto it = g.registered.find(module); it != g.registered.end()) {
          it->second.resolved_generation = *to;
        }
        FS_LOG(INFO) << "group=" << Short(g.id) << " module=" << Display(module)
                     << " resolved to generation " << *to << " at epoch " << table.epoch
                     << " (its daemons held " << absl::StrJoin(generations, ", ") << ")";
        continue;
      }
      std::vector<std::string> parts;
      for (const auto& [gen, who] : by_generation) {
        parts.push_back(absl::StrCat("generation ", gen, ": ", absl::StrJoin(who, ", ")));
      }
      std::string why = absl::StrCat(
          "group ", Short(g.id), ": module ", Display(module),
          " lost: its daemons hold different committed generations (", absl::StrJoin(parts, "; "),
          "): a daemon died between the daemons' copies of one commit, and no generation is "
          "held by every daemon; it was dropped on every daemon at epoch ",
          table.epoch, ": register it afresh on every rank (or restore it)");
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
        internal::RankListText(holding),
        " still held theirs; it was dropped on every daemon at "
        "epoch ",
        table.epoch, ": register it afresh on every rank (or restore it)");
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

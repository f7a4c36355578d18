// Modules: optimizer state buffers next to each shard (RegisterState).

#include "server/module/modules.h"

#include <memory>
#include <string>
#include <vector>
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/durable/records.h"
#include "server/group_manager_internal.h"

namespace flatshard::server {

using internal::Display;

namespace {

bool HasState(const std::vector<UnitShard>& shards) {
  for (const UnitShard& s : shards) {
    if (!s.state.empty()) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<RegisterStateResult> Modules::RegisterState(const Caller& caller,
                                                           const std::string& module,
                                                           const std::vector<StateSpec>& specs) {
  FS_RETURN_IF_ERROR(ValidateStateSpecs(specs));
  // What to allocate, decided under the lock.
  struct UnitNeed {
    int32_t unit;
    int64_t shard_numel;
  };
  std::vector<UnitNeed> needs;
  Placement placement;
  bool fixed_here = false;  // this call fixed the module's spec
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    FS_RETURN_IF_ERROR(shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                                 : CheckCallerLocked(g, caller));
    if (auto lost = g.lost.find(module); lost != g.lost.end() && !g.registered.contains(module)) {
      return absl::FailedPreconditionError(lost->second);
    }
    FS_ASSIGN_OR_RETURN(Registered * found, InitializedModule(g, module));
    Registered& reg = *found;
    FS_RETURN_IF_ERROR(CheckUsable(g, module, reg));
    const std::vector<UnitShard>& shards = reg.shards_by_rank[caller.rank];
    if (shards.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("group ", g.id, " rank ", caller.rank,
                                                        " holds no shards of module ",
                                                        Display(module), " (register it first)"));
    }
    if (!reg.state_specs.empty()) {
      const std::string diff = StateSpecDifference(reg.state_specs, specs);
      if (!diff.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("group ", g.id, " rank ", caller.rank, ": module ", Display(module),
                         " has another optimizer state spec: ", diff));
      }
    } else {
      reg.state_specs = specs;
      fixed_here = true;
      FS_LOG(INFO) << "group=" << g.id << " module=" << Display(module)
                   << " optimizer state spec fixed by rank " << caller.rank << ": " << specs.size()
                   << " state(s), first \"" << specs.front().name << "\"";
    }
    if (HasState(shards)) {
      // Re-attach (a restarted trainer, or a second call): the existing buffers. This does
      // not count as reading the views after a rollback (Register and GetShards do): the
      // trainer's in-place writes may straddle it.
      return RegisterStateResult{shards, reg.state_specs, reg.generation[caller.rank], false};
    }
    if (reg.state_allocating.contains(caller.rank)) {
      return absl::FailedPreconditionError(
          absl::StrCat("group ", g.id, " rank ", caller.rank,
                       " is already registering the optimizer state of module ", Display(module)));
    }
    reg.state_allocating.insert(caller.rank);
    for (const UnitShard& s : shards) {
      needs.push_back({s.unit, reg.plan.units[s.unit].shard_numel});
    }
    placement = PlacementOf(caller.rank);
  }

  // Allocation (shm creation, device memory) runs without the lock. `state_allocating` keeps a
  // second call of this rank out; the module cannot be dropped while the rank is joined
  // except by a re-form that lost it (checked again below).
  std::vector<std::vector<std::shared_ptr<Buffer>>> live(needs.size()), kept(needs.size());
  absl::Status status;
  for (size_t i = 0; i < needs.size() && status.ok(); ++i) {
    for (const StateSpec& spec : specs) {
      const int64_t bytes = spec.Numel(needs[i].shard_numel) * ItemSize(spec.dtype);
      for (auto* out : {&live[i], &kept[i]}) {
        absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Allocate(
            BufferKind::kShard, bytes,
            absl::StrCat("group=", caller.group, " module=", module, " unit=", needs[i].unit,
                         " rank=", caller.rank, " state=", spec.name,
                         out == &kept[i] ? " committed" : ""),
            caller.uid, placement);
        if (!b.ok()) {
          status = absl::Status(b.status().code(),
                                absl::StrCat("group ", caller.group, " rank ", caller.rank,
                                             ": could not allocate optimizer state \"", spec.name,
                                             "\" of unit ", needs[i].unit, " of module ",
                                             Display(module), ": ", b.status().message()));
          break;
        }
        out->push_back(*std::move(b));
      }
      if (!status.ok()) break;
    }
  }

  absl::StatusOr<RegisterStateResult> result = absl::InternalError("unset");
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    Registered* found = nullptr;
    if (!g.removed) {
      auto rit = g.registered.find(module);
      if (rit != g.registered.end()) found = &rit->second;
    }
    if (found == nullptr) {
      result = absl::UnavailableError(
          absl::StrCat("group ", caller.group, ": module ", Display(module),
                       " was dropped while its optimizer state was being allocated"));
    } else {
      Registered& reg = *found;
      reg.state_allocating.erase(caller.rank);
      if (!status.ok()) {
        // Nothing is kept; a spec no rank holds buffers of is not fixed.
        bool any = false;
        for (const auto& shards : reg.shards_by_rank) any = any || HasState(shards);
        if (fixed_here && !any && reg.state_allocating.empty()) reg.state_specs.clear();
        FS_LOG(WARNING) << status;
        result = status;
      } else {
        std::vector<UnitShard>& shards = reg.shards_by_rank[caller.rank];
        reg.committed_state.resize(g.world_size);
        auto& committed = reg.committed_state[caller.rank];
        committed.assign(shards.size(), {});
        for (size_t i = 0; i < needs.size() && i < shards.size(); ++i) {
          shards[i].state = std::move(live[i]);
          committed[i] = std::move(kept[i]);
        }
        FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " module=" << Display(module)
                     << ": optimizer state allocated (" << specs.size() << " state(s) x "
                     << shards.size() << " unit(s), zeros)";
        absl::Status usable = CheckUsable(g, module, reg);
        if (!usable.ok()) {
          result = usable;
        } else {
          result = RegisterStateResult{shards, reg.state_specs, reg.generation[caller.rank], true};
        }
      }
    }
  }
  // Buffers of a refused or dropped allocation go here, after the lock (munmap, unlink).
  live.clear();
  kept.clear();
  return result;
}

}  // namespace flatshard::server

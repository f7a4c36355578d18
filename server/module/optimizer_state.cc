// Modules: optimizer state buffers next to each shard (RegisterState).

#include "server/module/modules.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "server/durable/records.h"
#include "server/messages.h"

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

// A rank's optimizer state being registered: what to allocate (decided under the lock) and
// the buffers allocated without it.
struct Modules::StateAllocation {
  struct UnitNeed {
    int32_t unit;
    int64_t shard_numel;
  };
  std::vector<UnitNeed> needs;
  Placement placement;
  bool fixed_here = false;  // this call fixed the module's spec
  std::vector<std::vector<std::shared_ptr<Buffer>>> live, kept;  // per need, per spec
};

absl::StatusOr<RegisterStateResult> Modules::RegisterState(const Caller& caller,
                                                           const std::string& module,
                                                           const std::vector<StateSpec>& specs) {
  FS_RETURN_IF_ERROR(ValidateStateSpecs(specs));
  StateAllocation alloc;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    FS_RETURN_IF_ERROR(shutdown_ ? absl::UnavailableError("flatshardd is shutting down")
                                 : CheckCallerLocked(g, caller));
    std::optional<RegisterStateResult> attached;
    FS_RETURN_IF_ERROR(StartStateLocked(g, caller, module, specs, &alloc, &attached));
    if (attached.has_value()) return *std::move(attached);
  }
  // Allocation (shm creation, device memory) runs without the lock. `state_allocating` keeps a
  // second call of this rank out; the module cannot be dropped while the rank is joined
  // except by a re-form that lost it (checked again below).
  const absl::Status allocated = AllocateState(caller, module, specs, &alloc);
  absl::StatusOr<RegisterStateResult> result;
  {
    std::shared_ptr<Group> held = table_.FindOrGone(caller.group);
    Group& g = *held;
    absl::MutexLock lock(&g.mu);
    result = InstallStateLocked(g, caller, module, specs, allocated, &alloc);
  }
  // Buffers of a refused or dropped allocation go here, after the lock (munmap, unlink).
  alloc.live.clear();
  alloc.kept.clear();
  return result;
}

absl::Status Modules::StartStateLocked(Group& g, const Caller& caller, const std::string& module,
                                       const std::vector<StateSpec>& specs, StateAllocation* alloc,
                                       std::optional<RegisterStateResult>* attached) {
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
    alloc->fixed_here = true;
    FS_LOG(INFO) << "group=" << g.id << " module=" << Display(module)
                 << " optimizer state spec fixed by rank " << caller.rank << ": " << specs.size()
                 << " state(s), first \"" << specs.front().name << "\"";
  }
  if (HasState(shards)) {
    // Re-attach (a restarted trainer, or a second call): the existing buffers. This does
    // not count as reading the views after a rollback (Register and GetShards do): the
    // trainer's in-place writes may straddle it.
    *attached = RegisterStateResult{shards, reg.state_specs, reg.generation[caller.rank], false};
    return absl::OkStatus();
  }
  if (reg.state_allocating.contains(caller.rank)) {
    return absl::FailedPreconditionError(
        absl::StrCat("group ", g.id, " rank ", caller.rank,
                     " is already registering the optimizer state of module ", Display(module)));
  }
  reg.state_allocating.insert(caller.rank);
  for (const UnitShard& s : shards) {
    alloc->needs.push_back({s.unit, reg.plan.units[s.unit].shard_numel});
  }
  alloc->placement = PlacementOf(caller.rank);
  return absl::OkStatus();
}

absl::Status Modules::AllocateState(const Caller& caller, const std::string& module,
                                    const std::vector<StateSpec>& specs, StateAllocation* alloc) {
  alloc->live.resize(alloc->needs.size());
  alloc->kept.resize(alloc->needs.size());
  for (size_t i = 0; i < alloc->needs.size(); ++i) {
    for (const StateSpec& spec : specs) {
      const int64_t bytes = spec.Numel(alloc->needs[i].shard_numel) * ItemSize(spec.dtype);
      for (auto* out : {&alloc->live[i], &alloc->kept[i]}) {
        absl::StatusOr<std::shared_ptr<Buffer>> b = store_->Allocate(
            BufferKind::kShard, bytes,
            absl::StrCat("group=", caller.group, " module=", module, " unit=", alloc->needs[i].unit,
                         " rank=", caller.rank, " state=", spec.name,
                         out == &alloc->kept[i] ? " committed" : ""),
            caller.uid, alloc->placement);
        if (!b.ok()) {
          return absl::Status(b.status().code(),
                              absl::StrCat("group ", caller.group, " rank ", caller.rank,
                                           ": could not allocate optimizer state \"", spec.name,
                                           "\" of unit ", alloc->needs[i].unit, " of module ",
                                           Display(module), ": ", b.status().message()));
        }
        out->push_back(*std::move(b));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RegisterStateResult> Modules::InstallStateLocked(Group& g, const Caller& caller,
                                                                const std::string& module,
                                                                const std::vector<StateSpec>& specs,
                                                                const absl::Status& allocated,
                                                                StateAllocation* alloc) {
  Registered* found = nullptr;
  if (!g.removed) {
    auto rit = g.registered.find(module);
    if (rit != g.registered.end()) found = &rit->second;
  }
  if (found == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("group ", caller.group, ": module ", Display(module),
                     " was dropped while its optimizer state was being allocated"));
  }
  Registered& reg = *found;
  reg.state_allocating.erase(caller.rank);
  if (!allocated.ok()) {
    // Nothing is kept; a spec no rank holds buffers of is not fixed.
    bool any = false;
    for (const auto& shards : reg.shards_by_rank) any = any || HasState(shards);
    if (alloc->fixed_here && !any && reg.state_allocating.empty()) reg.state_specs.clear();
    FS_LOG(WARNING) << allocated;
    return allocated;
  }
  std::vector<UnitShard>& shards = reg.shards_by_rank[caller.rank];
  reg.committed_state.resize(g.world_size);
  auto& committed = reg.committed_state[caller.rank];
  committed.assign(shards.size(), {});
  for (size_t i = 0; i < alloc->needs.size() && i < shards.size(); ++i) {
    shards[i].state = std::move(alloc->live[i]);
    committed[i] = std::move(alloc->kept[i]);
  }
  FS_LOG(INFO) << "group=" << g.id << " rank=" << caller.rank << " module=" << Display(module)
               << ": optimizer state allocated (" << specs.size() << " state(s) x " << shards.size()
               << " unit(s), zeros)";
  FS_RETURN_IF_ERROR(CheckUsable(g, module, reg));
  return RegisterStateResult{shards, reg.state_specs, reg.generation[caller.rank], true};
}

}  // namespace flatshard::server

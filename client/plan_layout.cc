#include "client/plan_layout.h"

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/flat_layout.h"
#include "common/status_macros.h"

namespace flatshard::client::internal {

absl::StatusOr<PlanLayout> MakePlanLayout(const Plan& plan, int32_t rank) {
  if (rank < 0 || rank >= plan.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the plan's world of ", plan.world_size));
  }
  PlanLayout out;
  out.world_size = plan.world_size;
  out.sharding_strategy = std::string(ShardingStrategyName(plan.sharding_strategy));
  out.shard_world_size = plan.shard_world_size;
  out.use_orig_params = plan.use_orig_params;
  out.rank = rank;
  out.shard_rank = plan.ShardRank(rank);
  out.ignored_params = plan.ignored_params;
  out.warnings = plan.warnings;
  out.fingerprint = plan.fingerprint;
  out.units.reserve(plan.units.size());
  for (const PlanUnit& unit : plan.units) {
    // The shard ranges come from the same FlatLayout the daemon allocates shards with, so
    // they cannot drift from what ShardViews hand out.
    absl::StatusOr<FlatLayout> flat = UnitLayout(plan, unit);
    if (!flat.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unit ", unit.index, " (module \"", unit.module, "\"): ", flat.status().message()));
    }
    PlanLayout::Unit& u = out.units.emplace_back();
    u.index = unit.index;
    u.module = unit.module;
    u.module_type = unit.module_type;
    u.dtype = unit.dtype;
    u.requires_grad = unit.requires_grad;
    u.numel = unit.numel;
    u.padded_numel = unit.padded_numel;
    u.shard_numel = unit.shard_numel;
    u.params.reserve(unit.params.size());
    for (const PlanParam& p : unit.params) {
      u.params.push_back(PlanLayout::Param{p.fqn, p.shape, unit.dtype, p.offset, p.numel});
    }
    for (const SharedParam& s : unit.shared) u.shared.push_back({s.fqn, s.same_as});
    u.shard_ranges.reserve(flat->shard_world_size());
    for (int r = 0; r < flat->shard_world_size(); ++r) {
      const ElementRange range = flat->ShardRange(r);
      u.shard_ranges.push_back({range.begin, range.end});
    }
    if (out.shard_rank >= static_cast<int32_t>(u.shard_ranges.size())) {
      return absl::InvalidArgumentError(absl::StrCat("unit ", unit.index, ": shard rank ",
                                                     out.shard_rank, " of a unit split ",
                                                     u.shard_ranges.size(), " ways"));
    }
    u.local_shard = u.shard_ranges[out.shard_rank];
  }
  return out;
}

}  // namespace flatshard::client::internal

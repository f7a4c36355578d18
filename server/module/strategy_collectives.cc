#include "server/module/strategy_collectives.h"

#include "absl/strings/str_cat.h"
#include "common/policy.h"

namespace flatshard::server::strategy {

absl::Status CheckServed(const Plan& plan, const char* what) {
  if (plan.shard_world_size > 1 && plan.shard_world_size < plan.world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, " of a ", ShardingStrategyName(plan.sharding_strategy), " model over ",
        plan.shard_world_size, " of ", plan.world_size,
        " ranks per shard group needs shard and replica sub-groups, which this daemon does not "
        "serve yet"));
  }
  return absl::OkStatus();
}

GradReduction GradReductionOf(const Plan& plan) {
  return plan.shard_world_size == 1 && plan.world_size > 1 ? GradReduction::kAllReduce
                                                           : GradReduction::kReduceScatter;
}

int64_t AllReduceElements(int64_t numel, int32_t world_size) {
  return (numel + world_size - 1) / world_size * world_size;
}

}  // namespace flatshard::server::strategy

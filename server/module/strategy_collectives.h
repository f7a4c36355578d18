#pragma once
// StrategyCollectives: which collectives a sharding strategy runs, so that summon and gradient
// reduction (summon.cc, reduce_scatter.cc) ask one place instead of switching on the strategy:
//
//   strategy                       summon (unshard)    gradients
//   FULL_SHARD, SHARD_GRAD_OP      all-gather (world)  reduce-scatter (world)
//   NO_SHARD                       copy                all-reduce (world), whole unit
//   HYBRID_SHARD, _HYBRID_SHARD_ZERO2 over shard groups of s ranks:
//     s = world_size               as FULL_SHARD (one node)
//     s = 1                        as NO_SHARD (one rank per node)
//     1 < s < world_size           all-gather (shard)  reduce-scatter (shard) + all-reduce
//                                                      (replica): not served yet (refused)
//
// Thread-safe: pure functions of the plan.

#include <cstdint>

#include "absl/status/status.h"
#include "common/plan.h"

namespace flatshard::server::strategy {

enum class GradReduction {
  kReduceScatter,  // every rank gets its shard of the reduction
  kAllReduce,      // every rank gets the whole reduction (NO_SHARD: the shard is the unit)
};

// OK when this daemon runs `plan`'s collectives over the group's one communicator;
// FAILED_PRECONDITION naming the strategy and the shard group size otherwise (`what`: "summon",
// "gradient reduction").
absl::Status CheckServed(const Plan& plan, const char* what);
GradReduction GradReductionOf(const Plan& plan);

// Elements of an all-reduce buffer for `numel` elements over `world_size` ranks: rounded up to
// a multiple of world_size (device buffers must be; the padding is reduced and dropped).
int64_t AllReduceElements(int64_t numel, int32_t world_size);

}  // namespace flatshard::server::strategy

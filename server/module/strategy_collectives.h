#pragma once
// StrategyCollectives: which collectives a sharding strategy runs, so that registration,
// summon and gradient reduction (register.cc, summon.cc, reduce_scatter.cc) ask one place
// instead of switching on the strategy:
//
//   strategy                       summon (unshard)        gradients
//   FULL_SHARD, SHARD_GRAD_OP      all-gather (world)      reduce-scatter (world)
//   NO_SHARD                       copy                    all-reduce (world), whole unit
//   HYBRID_SHARD, _HYBRID_SHARD_ZERO2 over shard groups of s = ranks per node (RanksPerNode):
//     s = world_size               as FULL_SHARD (one node)
//     s = 1                        as NO_SHARD (one rank per node)
//     1 < s < world_size           read-only host summons: each local rank copies its shard
//                                  into its block of the node's one copy (kShardGroupGather:
//                                  the shard group is the daemon's ranks, no collective, 0
//                                  bytes between daemons); writeback, rank0_only and GPU
//                                  summons: all-gather (world) into world/s copies of the
//                                  unit, the rank's shard group's copy kept (kRegroup)
//                                                          all-reduce (world) of the whole
//                                                          unit, the rank's shard kept
//
// The 1 < s < world rows run over the group's one (world) communicator: no shard or replica
// sub-communicators. Shard group n is daemon n's ranks (RanksPerNode refuses any other
// placement), so its all-gather needs no network: kShardGroupGather assembles the node copy
// the way one daemon's summons share theirs (Modules' NodeAssembly answers every local rank
// once all of them copied). Replicas hold identical shards (their gradients come from one
// all-reduce, bit for bit the same on every rank), so the world all-gather's copies are
// equal; each rank still takes its own shard group's. The gradient of shard k is the sum over
// every rank of its gradient restricted to shard k, exactly FSDP's reduce-scatter within the
// shard group then all-reduce across replicas; AVG divides that sum by world_size once. On
// UCX with --ucx_hierarchical (the default) the all-reduce is hierarchical (its reduce-scatter
// and all-gather halves, hierarchical_algorithms.h): each daemon sends 2*(N-1)/N of the
// padded unit to the other N-1 daemons, what FSDP's replica all-reduce of the s shards sends.
//
// Thread-safe: pure functions of their arguments.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/plan.h"
#include "common/policy.h"

namespace flatshard::server::strategy {

enum class GradReduction {
  kReduceScatter,  // every rank gets its shard of the reduction
  kAllReduce,      // every rank gets the whole reduction and keeps its shard (ReducedOffset)
};
enum class Unshard {
  kCopy,       // NO_SHARD: the shard is the unit
  kAllGather,  // the shard group is the world
  kRegroup,    // HYBRID_* with 1 < s < world: world all-gather into a scratch (RegroupScratch)
  kShardGroupGather,  // HYBRID_* with 1 < s < world, node copy: own shard into its block
};

// The ranks per node a plan of `strategy` shards over (PlanOptions::ranks_per_node; 0 for
// every strategy but HYBRID_*). `rank_nodes[r]` names the node (daemon) hosting rank r; empty:
// a local group, one node. HYBRID_*: every node must host the same number of ranks, and
// consecutive ones (FSDP's device mesh: shard group n is ranks [n*s, (n+1)*s)); otherwise
// FAILED_PRECONDITION naming the group, the nodes and their ranks.
absl::StatusOr<int32_t> RanksPerNode(const std::string& group, ShardingStrategy strategy,
                                     int32_t world_size,
                                     const std::vector<std::string>& rank_nodes);

GradReduction GradReductionOf(const Plan& plan);
// `node_copy`: the summon's view is the node's one read-only copy (host memory, no writeback,
// not rank0_only), which HYBRID_* with 1 < s < world assembles locally (kShardGroupGather).
Unshard UnshardOf(const Plan& plan, bool node_copy);

// Elements of an all-reduce buffer for `numel` elements over `world_size` ranks: rounded up to
// a multiple of world_size (device buffers must be; the padding is reduced and dropped).
int64_t AllReduceElements(int64_t numel, int32_t world_size);
// kAllReduce: the element of the reduced whole unit where `rank`'s shard starts (0 for
// NO_SHARD).
int64_t ReducedOffset(const Plan& plan, const PlanUnit& unit, int32_t rank);
// kRegroup: elements of the world all-gather's output (world_size shards), and the element
// where `rank`'s shard group's copy of the unit starts in it.
int64_t RegroupScratchElements(const Plan& plan, const PlanUnit& unit);
int64_t RegroupOffset(const Plan& plan, const PlanUnit& unit, int32_t rank);

}  // namespace flatshard::server::strategy

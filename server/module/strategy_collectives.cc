#include "server/module/strategy_collectives.h"

#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace flatshard::server::strategy {
namespace {

bool Hybrid(ShardingStrategy s) {
  return s == ShardingStrategy::kHybridShard || s == ShardingStrategy::kHybridShardZero2;
}

bool Regroups(const Plan& plan) {
  return plan.shard_world_size > 1 && plan.shard_world_size < plan.world_size;
}

// "node0: ranks 0, 2; node1: ranks 1, 3" (node names in order of their first rank).
std::string NodesText(const std::vector<std::string>& rank_nodes) {
  std::vector<std::string> order;
  std::map<std::string, std::vector<int32_t>> ranks;
  for (int32_t r = 0; r < static_cast<int32_t>(rank_nodes.size()); ++r) {
    auto [it, fresh] = ranks.try_emplace(rank_nodes[r]);
    if (fresh) order.push_back(rank_nodes[r]);
    it->second.push_back(r);
  }
  std::vector<std::string> parts;
  for (const std::string& n : order) {
    parts.push_back(absl::StrCat(n, ": ranks ", absl::StrJoin(ranks[n], ", ")));
  }
  return absl::StrJoin(parts, "; ");
}

}  // namespace

absl::StatusOr<int32_t> RanksPerNode(const std::string& group, ShardingStrategy strategy,
                                     int32_t world_size,
                                     const std::vector<std::string>& rank_nodes) {
  if (!Hybrid(strategy) || rank_nodes.empty()) return 0;  // 0: the planner's one node
  if (static_cast<int32_t>(rank_nodes.size()) != world_size) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", group, ": ", ShardingStrategyName(strategy), " needs the node of ",
        "every rank; the group's peer table names ", rank_nodes.size(), " of ", world_size));
  }
  // Node n hosts ranks [n*s, (n+1)*s): s is the first node's run, every run must match it and
  // no node may come back after another one started.
  int32_t per_node = 1;
  while (per_node < world_size && rank_nodes[per_node] == rank_nodes[0]) ++per_node;
  bool uniform = world_size % per_node == 0;
  std::set<std::string> seen;  // the nodes of the blocks before
  for (int32_t r = 0; uniform && r < world_size; ++r) {
    uniform =
        r % per_node == 0 ? seen.insert(rank_nodes[r]).second : rank_nodes[r] == rank_nodes[r - 1];
  }
  if (!uniform) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", group, ": ", ShardingStrategyName(strategy),
        " shards within a node's ranks, so every daemon must host the same number of ranks and "
        "consecutive ones (node n ranks [n*s, (n+1)*s)); this group has ",
        NodesText(rank_nodes)));
  }
  return per_node;
}

GradReduction GradReductionOf(const Plan& plan) {
  return plan.world_size > 1 && plan.shard_world_size < plan.world_size
             ? GradReduction::kAllReduce
             : GradReduction::kReduceScatter;
}

Unshard UnshardOf(const Plan& plan, bool node_copy) {
  if (plan.shard_world_size == 1) return Unshard::kCopy;
  if (!Regroups(plan)) return Unshard::kAllGather;
  return node_copy ? Unshard::kShardGroupGather : Unshard::kRegroup;
}

int64_t AllReduceElements(int64_t numel, int32_t world_size) {
  return (numel + world_size - 1) / world_size * world_size;
}

int64_t ReducedOffset(const Plan& plan, const PlanUnit& unit, int32_t rank) {
  return int64_t{plan.ShardRank(rank)} * unit.shard_numel;
}

int64_t RegroupScratchElements(const Plan& plan, const PlanUnit& unit) {
  return int64_t{plan.world_size} * unit.shard_numel;
}

int64_t RegroupOffset(const Plan& plan, const PlanUnit& unit, int32_t rank) {
  return int64_t{rank / plan.shard_world_size} * plan.shard_world_size * unit.shard_numel;
}

}  // namespace flatshard::server::strategy

#pragma once
// How a module tree is cut into units (formats.md "Policy"): the auto-wrap policy, ignored
// modules and parameters, and the FSDP options that change planning.
// Thread-safe for concurrent reads.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/json_util.h"

namespace flatshard {

inline constexpr absl::string_view kPolicyFormat = "flatshard.policy/1";

enum class AutoWrapKind { kNone, kAlways, kSizeBased, kModuleTypes, kExplicit, kAny };

// One auto-wrap policy; which fields matter depends on `kind` (formats.md table).
struct AutoWrapPolicy {
  AutoWrapKind kind = AutoWrapKind::kNone;
  // kSizeBased (defaults as torch.distributed.fsdp.wrap.size_based_auto_wrap_policy).
  int64_t min_num_params = 100000000;
  std::vector<std::string> force_leaf_types = {"MultiheadAttention"};
  std::vector<std::string> exclude_wrap_types = {"ModuleList", "ModuleDict"};
  // kModuleTypes.
  std::vector<std::string> types;
  // kExplicit: module FQNs.
  std::vector<std::string> paths;
  // kAny.
  std::vector<AutoWrapPolicy> policies;

  friend bool operator==(const AutoWrapPolicy&, const AutoWrapPolicy&) = default;
};

// kHybridShardZero2 (FSDP's _HYBRID_SHARD_ZERO2) is kHybridShard for the daemon (shard within a
// node's ranks, replicate across nodes); for the trainer it means "keep the unit unsharded
// between its forward and its backward", as SHARD_GRAD_OP is to FULL_SHARD.
enum class ShardingStrategy { kFullShard, kShardGradOp, kNoShard, kHybridShard, kHybridShardZero2 };

// HYBRID_SHARD or _HYBRID_SHARD_ZERO2: sharded over a node's ranks, replicated across nodes.
inline bool IsHybrid(ShardingStrategy s) {
  return s == ShardingStrategy::kHybridShard || s == ShardingStrategy::kHybridShardZero2;
}

struct MixedPrecision {
  std::optional<DType> param_dtype;
  std::optional<DType> reduce_dtype;
  std::optional<DType> buffer_dtype;
  // FSDP's MixedPrecision._module_classes_to_ignore default: (_BatchNorm,).
  std::vector<std::string> module_types_to_ignore = {"_BatchNorm"};
  friend bool operator==(const MixedPrecision&, const MixedPrecision&) = default;
};

struct Policy {
  AutoWrapPolicy auto_wrap;
  std::vector<std::string> ignored_modules;  // module FQNs; whole subtrees
  std::vector<std::string> ignored_params;   // parameter FQNs
  bool use_orig_params = false;
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  std::optional<MixedPrecision> mixed_precision;
  friend bool operator==(const Policy&, const Policy&) = default;
};

absl::string_view AutoWrapKindName(AutoWrapKind kind);
std::optional<AutoWrapKind> ParseAutoWrapKind(absl::string_view name);
absl::string_view ShardingStrategyName(ShardingStrategy strategy);
std::optional<ShardingStrategy> ParseShardingStrategy(absl::string_view name);

// Parses a policy document. INVALID_ARGUMENT names the JSON path and rule. Module paths are
// only checked against a manifest by the planner.
absl::StatusOr<Policy> PolicyFromJson(absl::string_view text);
absl::StatusOr<Policy> PolicyFromJsonValue(const Json& doc);
// Writes the JSON form with every field explicit.
Json PolicyToJson(const Policy& policy);

}  // namespace flatshard

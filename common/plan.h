#pragma once
// The planner's output (formats.md "Plan"): units in pre-order of their wrapped modules, each
// with its parameters' offsets in one flat buffer and its shard size.
// Thread-safe for concurrent reads.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/flat_layout.h"
#include "common/json_util.h"
#include "common/policy.h"

namespace flatshard {

inline constexpr absl::string_view kPlanFormat = "flatshard.plan/1";

struct PlanParam {
  std::string fqn;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // elements from the start of the unsharded flat buffer
  friend bool operator==(const PlanParam&, const PlanParam&) = default;
};

// A later FQN of a parameter that occurs more than once in a unit; it aliases `same_as`.
struct SharedParam {
  std::string fqn;
  std::string same_as;
  friend bool operator==(const SharedParam&, const SharedParam&) = default;
};

struct PlanUnit {
  int32_t index = 0;
  std::string module;  // FQN of the wrapped module; "" for the root
  std::string module_type;
  DType dtype = DType::kFloat32;  // of the shards, gradient shards and full-precision summons
  // Mixed precision (policy "mixed_precision"; unset: `dtype`): the dtype a summon for
  // compute (SummonOptions::compute_precision) hands out, the daemon casting each shard before
  // the all-gather, and the dtype of the gradient a reduce-scatter takes and reduces in.
  // Units of module_types_to_ignore keep `dtype` for both.
  std::optional<DType> compute_dtype;
  std::optional<DType> reduce_dtype;
  bool requires_grad = true;
  std::vector<PlanParam> params;  // flat order
  std::vector<SharedParam> shared;
  int64_t numel = 0;
  int64_t padded_numel = 0;
  int64_t shard_numel = 0;

  int64_t padding_numel() const { return padded_numel - numel; }
  DType ComputeDType() const { return compute_dtype.value_or(dtype); }
  DType ReduceDType() const { return reduce_dtype.value_or(dtype); }
  friend bool operator==(const PlanUnit&, const PlanUnit&) = default;
};

struct Plan {
  int32_t world_size = 1;
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  // Ranks a unit is sharded over: world_size, 1 for NO_SHARD, ranks per node for HYBRID_SHARD.
  int32_t shard_world_size = 1;
  bool use_orig_params = false;
  std::vector<PlanUnit> units;
  std::vector<std::string> ignored_params;  // every FQN of every ignored tensor, pre-order
  std::vector<std::string> warnings;
  std::string fingerprint;  // Fingerprint(*this) once built

  // The rank inside the unit's shard group that global `rank` is. REQUIRES: 0 <= rank < world.
  int32_t ShardRank(int32_t rank) const;
  friend bool operator==(const Plan&, const Plan&) = default;
};

// Per-rank memory of a plan, in bytes.
struct PlanMemory {
  int64_t shard_bytes = 0;      // every unit's shard: what a rank holds between summons
  int64_t unsharded_bytes = 0;  // every unit's padded full buffer
  // A summon of the root with recurse=true: the shards plus every unsharded buffer at once
  // (NO_SHARD summons in place and adds nothing).
  int64_t peak_summon_bytes = 0;
};
PlanMemory SummarizeMemory(const Plan& plan);

// Recomputes a unit's flat layout (offsets, padding, shard ranges) from its params.
absl::StatusOr<FlatLayout> UnitLayout(const Plan& plan, const PlanUnit& unit);

// SHA-256 over a canonical serialization of everything but `warnings` and `fingerprint`.
std::string Fingerprint(const Plan& plan);

// The JSON document of formats.md, keys in the documented order.
nlohmann::ordered_json PlanToJson(const Plan& plan);
// Parses a plan document and checks that it is self-consistent (offsets, sizes, fingerprint).
absl::StatusOr<Plan> PlanFromJson(absl::string_view text);
absl::StatusOr<Plan> PlanFromJsonValue(const Json& doc);

}  // namespace flatshard

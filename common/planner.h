#pragma once
// The Planner: manifest + policy -> plan, exactly as PyTorch FSDP's auto-wrap and
// FlatParamHandle would cut and lay out the same module tree (semantics.md §1–2).
//
// Planning is deterministic: equal inputs give equal plans and fingerprints on every rank.
// Thread-safe: a pure function of its arguments.

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/manifest.h"
#include "common/plan.h"
#include "common/policy.h"

namespace flatshard {

// The largest group anything in flatshard accepts (planner, daemon, coordinator): per-rank
// state is sized by it, so a bad request must not make it allocate gigabytes.
inline constexpr int32_t kMaxWorldSize = 1 << 20;

struct PlanOptions {
  // Ranks of the group, in [1, kMaxWorldSize].
  int32_t world_size = 1;
  // HYBRID_SHARD only: ranks per node, the group a unit is sharded over (must divide
  // world_size). 0 means world_size (one node).
  int32_t ranks_per_node = 0;
  // Refuse manifests whose module tree, with every shared instance expanded at each path it is
  // registered at, has more module paths than this (refs can make that exponential).
  int64_t max_module_paths = 1'000'000;
  // Likewise for the bytes of all module paths and of all parameter FQNs the plan would hold
  // (long names times many paths).
  int64_t max_name_bytes = int64_t{256} << 20;
};

// Plans `manifest` under `policy`. Errors (INVALID_ARGUMENT) name the module, parameters and
// rule: unknown paths in the policy, integer or mixed dtypes in a unit, mixed requires_grad
// with use_orig_params=false, a bad world size.
absl::StatusOr<Plan> BuildPlan(const Manifest& manifest, const Policy& policy,
                               const PlanOptions& options);

}  // namespace flatshard

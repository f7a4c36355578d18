#pragma once
// Converts the daemon's plan (common/plan.h, C++20, internal) into the public PlanLayout
// (<flatshard/plan.h>, C++17) of one rank. Thread-safe: a pure function.

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/plan.h"
#include "flatshard/plan.h"

namespace flatshard::client::internal {

// The layout of `plan` as rank `rank` sees it: every unit's parameters, aliases, sizes and
// shard ranges, and `rank`'s shard of each unit.
// Errors: INVALID_ARGUMENT when `rank` is outside [0, world_size) or a unit's flat layout
// cannot be recomputed from its parameters (the message names the unit).
absl::StatusOr<PlanLayout> MakePlanLayout(const Plan& plan, int32_t rank);

}  // namespace flatshard::client::internal

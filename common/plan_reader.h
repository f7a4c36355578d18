#pragma once
// The fast path of PlanFromJson: reads a plan document's fields in one pass, without building
// a DOM (the DOM parse was ~90% of PlanFromJson's time on 10,000-module plans).
//
// ScanPlan checks what a field alone decides (keys, types, ranges, floating dtypes) and
// returns nullopt for anything else than such a document, and for valid spellings it does not
// read itself (json_scanner.h); PlanFromJson then checks the plan as a whole (strategy, layout,
// fingerprint) with the rules of the DOM path, and gives the document to the DOM path, whose
// error messages are the contract, when either step fails. Thread-safe: a pure function.

#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "common/plan.h"

namespace flatshard {

struct ScannedPlan {
  // Every field as written; sharding_strategy and shard_world_size are left at their
  // defaults here and given below.
  Plan plan;
  std::optional<std::string> sharding_strategy;
  std::optional<int64_t> shard_world_size;
};

std::optional<ScannedPlan> ScanPlan(absl::string_view text);

}  // namespace flatshard

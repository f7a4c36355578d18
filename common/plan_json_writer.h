#pragma once
// The plan document (formats.md) as compact text, written straight from the Plan.

#include <string>

#include "common/plan.h"

namespace flatshard {

// Byte for byte PlanToJson(plan).dump(), without building the ordered_json tree (several times
// faster on large plans).
std::string PlanToJsonText(const Plan& plan);

}  // namespace flatshard

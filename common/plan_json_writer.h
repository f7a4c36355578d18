#pragma once
// The plan document (formats.md) as compact text, written straight from the Plan.

#include <string>

#include "common/plan.h"

namespace flatshard {

// Byte for byte PlanToJson(plan).dump(-1, ' ', false, on_invalid_utf8), without building the
// ordered_json tree (several times faster on large plans). With the default, strings that are
// not valid UTF-8 throw as dump() does; `replace` writes U+FFFD for them and never throws.
std::string PlanToJsonText(const Plan& plan, nlohmann::detail::error_handler_t on_invalid_utf8 =
                                                 nlohmann::detail::error_handler_t::strict);

}  // namespace flatshard

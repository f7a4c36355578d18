#pragma once
// `flatshardctl plan`: prints the plan of a manifest under a policy (JSON or a table).

#include <string>
#include <vector>

#include "common/plan.h"

namespace flatshard::cli {

// Runs the subcommand with the arguments after "plan". Returns the process exit code:
// 0 success, 2 refused input (one line on stderr, nothing on stdout).
int RunPlanCommand(const std::vector<std::string>& args);

// The human summary: one row per unit, totals, and the peak per-rank memory of a full summon.
std::string FormatPlanTable(const Plan& plan);

}  // namespace flatshard::cli

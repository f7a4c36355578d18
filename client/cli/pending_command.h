#pragma once
// `flatshardctl pending [GROUP]`: each group's collectives that have not completed, with the
// ranks that arrived and those still missing (AdminService.ListPendingCollectives).

#include <string>
#include <vector>

namespace flatshard::cli {

// Returns the process exit status: 0 on success, 1 when the daemon cannot be reached or
// answers with an error, 2 for bad flags.
int RunPendingCommand(const std::vector<std::string>& args);

}  // namespace flatshard::cli

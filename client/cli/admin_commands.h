#pragma once
// flatshardctl's daemon commands besides `pending` (pending_command.h), over AdminService.
// Each runs with the arguments after its name and returns the process exit status: 0 success,
// 1 the daemon cannot be reached or refuses (drain: or did not finish in time), 2 bad flags.

#include <string>
#include <vector>

namespace flatshard::cli {

// `flatshardctl status`: version, uptime, backends, memory in use and limit, groups, clients.
int RunStatusCommand(const std::vector<std::string>& args);
// `flatshardctl groups`: the groups the daemon hosts.
int RunGroupsCommand(const std::vector<std::string>& args);
// `flatshardctl units GROUP [--module M]`: per unit and local rank: state, bytes, last op.
int RunUnitsCommand(const std::vector<std::string>& args);
// `flatshardctl drain [--timeout-ms N]`: refuse new joins; wait for in-flight work.
int RunDrainCommand(const std::vector<std::string>& args);
// `flatshardctl undrain`: accept new groups and joins again after a drain.
int RunUndrainCommand(const std::vector<std::string>& args);
// `flatshardctl log-level [LEVEL]`: set (or show) the daemon's log level.
int RunLogLevelCommand(const std::vector<std::string>& args);
// `flatshardctl delete-group GROUP`: remove a group every rank has left, with its shards.
int RunDeleteGroupCommand(const std::vector<std::string>& args);
// `flatshardctl checkpoint save|load|import|inspect|export` (checkpoint_command.cc).
int RunCheckpointCommand(const std::vector<std::string>& args);
// `flatshardctl weights list|inspect|drop` (weights_command.cc): published weights.
int RunWeightsCommand(const std::vector<std::string>& args);

}  // namespace flatshard::cli

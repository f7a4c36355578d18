// flatshardctl: the command-line tool of flatshard. Each subcommand lives in its own file.

#include <iostream>
#include <string>
#include <vector>

#include "client/cli/admin_commands.h"
#include "client/cli/pending_command.h"
#include "client/cli/plan_command.h"
#include "common/config.h"

namespace {

constexpr char kUsage[] =
    "Usage: flatshardctl [--help] [--version] COMMAND [FLAGS]\n"
    "\n"
    "Commands:\n"
    "  plan       cut a module tree into flat-parameter units as PyTorch FSDP would; print the "
    "plan\n"
    "\n"
    "Commands that ask a running flatshardd (--socket PATH, default\n"
    "/run/flatshard/flatshardd.sock, or --address HOST:PORT; --json for JSON):\n"
    "  status     version, uptime, backends, memory in use and limit, groups, clients, draining\n"
    "  groups     the groups it hosts: world size, epoch, ranks, registered modules, errors\n"
    "  units      a group's units per rank: state, shard/gradient/unsharded bytes, last op\n"
    "  pending    its collectives that have not completed, with missing ranks\n"
    "  drain      refuse new groups and joins, wait for in-flight work (or a timeout)\n"
    "  undrain    accept new groups and joins again after a drain\n"
    "  log-level  set or show its log level\n"
    "  delete-group  remove a group every rank has left, with its shards\n"
    "  checkpoint save|load|import  write or load a module's checkpoint, import safetensors\n"
    "  weights list|inspect|drop  published weights: versions, their tensors, drop one\n"
    "\n"
    "Offline: checkpoint inspect|export  check a checkpoint directory, export safetensors\n"
    "\n"
    "Run 'flatshardctl COMMAND --help' for a command's flags.\n";

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << kUsage;
    return 2;
  }
  const std::string command = args.front();
  args.erase(args.begin());
  if (command == "--help" || command == "-h" || command == "help") {
    std::cout << kUsage;
    return 0;
  }
  if (command == "--version") {
    std::cout << "flatshardctl " << FS_VERSION_STRING << "\n";
    return 0;
  }
  if (command == "plan") return flatshard::cli::RunPlanCommand(args);
  if (command == "pending") return flatshard::cli::RunPendingCommand(args);
  if (command == "status") return flatshard::cli::RunStatusCommand(args);
  if (command == "groups") return flatshard::cli::RunGroupsCommand(args);
  if (command == "units") return flatshard::cli::RunUnitsCommand(args);
  if (command == "drain") return flatshard::cli::RunDrainCommand(args);
  if (command == "undrain") return flatshard::cli::RunUndrainCommand(args);
  if (command == "log-level") return flatshard::cli::RunLogLevelCommand(args);
  if (command == "delete-group") return flatshard::cli::RunDeleteGroupCommand(args);
  if (command == "checkpoint") return flatshard::cli::RunCheckpointCommand(args);
  if (command == "weights") return flatshard::cli::RunWeightsCommand(args);
  std::string shown = command;
  for (char& c : shown) {
    if (c == '\n' || c == '\r') c = ' ';  // errors stay on one line
  }
  std::cerr << "flatshardctl: unknown command '" << shown << "' (see flatshardctl --help)\n";
  return 2;
}

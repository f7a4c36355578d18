// `flatshardctl status`: the daemon as a whole.

#include <iostream>

#include <nlohmann/json.hpp>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/admin_command.h"
#include "client/cli/admin_commands.h"

namespace flatshard::cli {
namespace {

std::string Duration(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds);
  if (s < 60) return absl::StrFormat("%.1fs", seconds);
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm%02ds", s / 3600, s / 60 % 60, s % 60);
}

void PrintStatus(const v1::GetStatusResponse& r) {
  std::vector<std::vector<std::string>> rows = {
      {"version", r.version()},
      {"pid", absl::StrCat(r.pid())},
      {"node", r.node()},
      {"uptime", Duration(r.uptime_seconds())},
      {"backends", r.backends().empty() ? "-" : absl::StrJoin(r.backends(), ", ")},
      {"peer address", r.peer_address().empty() ? "- (local groups only)" : r.peer_address()},
      {"state dir",
       r.state_dir().empty() ? "- (ephemeral: a restart keeps nothing)" : r.state_dir()},
      {"draining", r.draining() ? "yes" : "no"},
      {"groups", absl::StrCat(r.groups())},
      {"clients", absl::StrCat(r.clients())},
      {"memory", absl::StrCat(HumanBytes(r.memory_total_bytes()), " of ",
                              r.memory_limit_bytes() < 0 ? std::string("no limit")
                                                         : HumanBytes(r.memory_limit_bytes()),
                              " in ", r.buffers(), " buffers")},
  };
  for (const v1::MemoryKindUsage& m : r.memory()) {
    rows.push_back({"  " + m.kind(), absl::StrCat(m.bytes(), " B")});
  }
  for (const v1::GpuMemory& g : r.gpus()) {
    rows.push_back(
        {absl::StrCat("gpu ", g.device()),
         absl::StrCat(HumanBytes(g.in_use_bytes()), " in ", g.buffers(), " buffers; ",
                      HumanBytes(g.reserved_bytes()), " reserved in ", g.slabs(), " slabs of ",
                      g.limit_bytes() < 0 ? std::string("no limit") : HumanBytes(g.limit_bytes()),
                      " (", g.uuid(), ")")});
  }
  std::cout << FormatTable(rows);
}

nlohmann::json StatusJson(const v1::GetStatusResponse& r) {
  nlohmann::json by_kind = nlohmann::json::object();
  for (const v1::MemoryKindUsage& m : r.memory()) by_kind[m.kind()] = m.bytes();
  nlohmann::json gpus = nlohmann::json::array();
  for (const v1::GpuMemory& g : r.gpus()) {
    gpus.push_back({{"device", g.device()},
                    {"uuid", g.uuid()},
                    {"reserved_bytes", g.reserved_bytes()},
                    {"in_use_bytes", g.in_use_bytes()},
                    {"limit_bytes", g.limit_bytes() < 0 ? nlohmann::json(nullptr)
                                                        : nlohmann::json(g.limit_bytes())},
                    {"slabs", g.slabs()},
                    {"buffers", g.buffers()}});
  }
  return {{"gpus", gpus},
          {"version", r.version()},
          {"pid", r.pid()},
          {"node", r.node()},
          {"uptime_seconds", r.uptime_seconds()},
          {"backends", std::vector<std::string>(r.backends().begin(), r.backends().end())},
          {"peer_address", r.peer_address()},
          {"state_dir",
           r.state_dir().empty() ? nlohmann::json(nullptr) : nlohmann::json(r.state_dir())},
          {"draining", r.draining()},
          {"groups", r.groups()},
          {"clients", r.clients()},
          {"memory",
           {{"total_bytes", r.memory_total_bytes()},
            {"limit_bytes", r.memory_limit_bytes() < 0 ? nlohmann::json(nullptr)
                                                       : nlohmann::json(r.memory_limit_bytes())},
            {"buffers", r.buffers()},
            {"by_kind", by_kind}}}};
}

}  // namespace

int RunStatusCommand(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "status";
  spec.description =
      "Shows the daemon: version, pid, node, uptime, the collective backends this build has,\n"
      "its peer address, whether it is draining, how many groups and clients (live trainer\n"
      "sessions) it has, its shared memory in use by kind against its limit, and with\n"
      "--gpus each GPU's device-memory pool (in use, reserved, limit).\n";
  return RunAdminCommand(spec, args, [](AdminCall& call) {
    return CallAndPrint(call, &v1::AdminService::Stub::GetStatus, v1::GetStatusRequest(),
                        StatusJson, PrintStatus);
  });
}

}  // namespace flatshard::cli

#include "client/cli/pending_command.h"

#include <iostream>

#include <grpcpp/grpcpp.h>
#include <nlohmann/json.hpp>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli/admin_command.h"
#include "flatshard/v1/admin_service.grpc.pb.h"

namespace flatshard::cli {
namespace {

std::string Ranks(const google::protobuf::RepeatedField<int32_t>& ranks) {
  return ranks.empty() ? "-" : absl::StrJoin(ranks, ",");
}

void PrintTable(const v1::ListPendingCollectivesResponse& response) {
  if (response.groups().empty()) {
    std::cout << "no groups\n";
    return;
  }
  for (const v1::GroupCollectives& g : response.groups()) {
    std::cout << absl::StrFormat("group %s  world_size %d  epoch %d  local ranks %s  status %s\n",
                                 g.group(), g.world_size(), g.epoch(), Ranks(g.local_ranks()),
                                 g.status());
    if (g.pending().empty()) {
      std::cout << "  no pending collectives\n";
      continue;
    }
    std::cout << absl::StrFormat("  %8s  %-13s  %6s  %12s  %-10s  %-12s  %-12s  %8s\n", "OP_SEQ",
                                 "KIND", "UNIT", "BYTES", "NAME", "ARRIVED", "MISSING", "AGE");
    for (const v1::PendingCollective& p : g.pending()) {
      std::cout << absl::StrFormat("  %8d  %-13s  %6s  %12d  %-10s  %-12s  %-12s  %7.1fs%s\n",
                                   p.op_seq(), p.kind(),
                                   p.unit() < 0 ? "-" : absl::StrCat(p.unit()), p.bytes(), p.name(),
                                   Ranks(p.arrived_ranks()), Ranks(p.missing_ranks()),
                                   p.age_seconds(), p.running() ? "  (moving data)" : "");
    }
  }
}

nlohmann::json PendingJson(const v1::ListPendingCollectivesResponse& response) {
  nlohmann::json groups = nlohmann::json::array();
  for (const v1::GroupCollectives& g : response.groups()) {
    nlohmann::json pending = nlohmann::json::array();
    for (const v1::PendingCollective& p : g.pending()) {
      pending.push_back(
          {{"op_seq", p.op_seq()},
           {"kind", p.kind()},
           {"unit", p.unit()},
           {"bytes", p.bytes()},
           {"name", p.name()},
           {"arrived_ranks", std::vector<int>(p.arrived_ranks().begin(), p.arrived_ranks().end())},
           {"missing_ranks", std::vector<int>(p.missing_ranks().begin(), p.missing_ranks().end())},
           {"age_seconds", p.age_seconds()},
           {"running", p.running()}});
    }
    groups.push_back(
        {{"group", g.group()},
         {"world_size", g.world_size()},
         {"epoch", g.epoch()},
         {"local_ranks", std::vector<int>(g.local_ranks().begin(), g.local_ranks().end())},
         {"status", g.status()},
         {"pending", pending}});
  }
  return nlohmann::json{{"groups", groups}};
}

}  // namespace

int RunPendingCommand(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "pending";
  spec.synopsis = "[GROUP]";
  spec.description =
      "Lists each group's collectives that have not completed on this daemon: op sequence,\n"
      "kind, unit, bytes, the ranks that arrived and those still missing, and the age. A group\n"
      "whose collectives failed shows its sticky error.\n";
  spec.max_args = 1;
  spec.args_name = "GROUP";
  return RunAdminCommand(spec, args, [](AdminCall& call) {
    v1::ListPendingCollectivesRequest request;
    if (!call.args().empty()) request.set_group(call.args()[0]);
    return CallAndPrint(call, &v1::AdminService::Stub::ListPendingCollectives, request, PendingJson,
                        PrintTable);
  });
}

}  // namespace flatshard::cli

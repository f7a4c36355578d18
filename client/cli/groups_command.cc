// `flatshardctl groups`: the groups a daemon hosts.

#include <iostream>

#include <nlohmann/json.hpp>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/admin_command.h"
#include "client/cli/admin_commands.h"

namespace flatshard::cli {
namespace {

std::vector<int32_t> Ints(const google::protobuf::RepeatedField<int32_t>& v) {
  return std::vector<int32_t>(v.begin(), v.end());
}

// Ranks whose session ended, "1 left,2 lost"; "-" when none.
std::string Departed(const v1::GroupInfo& g) {
  std::vector<std::string> departed;
  for (const v1::RankState& r : g.ranks()) {
    if (r.state() != "joined") departed.push_back(absl::StrCat(r.rank(), " ", r.state()));
  }
  return departed.empty() ? "-" : absl::StrJoin(departed, ",");
}

void PrintGroups(const v1::ListGroupsResponse& r) {
  if (r.groups().empty()) {
    std::cout << "no groups\n";
    return;
  }
  std::vector<std::vector<std::string>> rows = {{"GROUP", "WORLD", "EPOCH", "COORDINATOR",
                                                 "LOCAL_RANKS", "JOINED", "DEPARTED", "MODULES",
                                                 "STATUS"}};
  for (const v1::GroupInfo& g : r.groups()) {
    std::vector<std::string> modules;
    for (const std::string& m : g.registered_modules()) modules.push_back(ModuleName(m));
    rows.push_back({g.group(), absl::StrCat(g.world_size()), absl::StrCat(g.epoch()),
                    g.coordinator().empty() ? "-" : g.coordinator(),
                    JoinOrDash(Ints(g.local_ranks())), JoinOrDash(Ints(g.joined_ranks())),
                    Departed(g), modules.empty() ? "-" : absl::StrJoin(modules, ","), g.status()});
  }
  std::cout << FormatTable(rows);
}

nlohmann::json GroupsJson(const v1::ListGroupsResponse& r) {
  nlohmann::json groups = nlohmann::json::array();
  for (const v1::GroupInfo& g : r.groups()) {
    nlohmann::json ranks = nlohmann::json::array();
    for (const v1::RankState& rank : g.ranks()) {
      ranks.push_back({{"rank", rank.rank()}, {"state", rank.state()}});
    }
    groups.push_back(
        {{"group", g.group()},
         {"world_size", g.world_size()},
         {"epoch", g.epoch()},
         {"coordinator", g.coordinator()},
         {"local_ranks", Ints(g.local_ranks())},
         {"joined_ranks", Ints(g.joined_ranks())},
         {"registered_modules",
          std::vector<std::string>(g.registered_modules().begin(), g.registered_modules().end())},
         {"ranks", ranks},
         {"status", g.status()}});
  }
  return {{"groups", groups}};
}

}  // namespace

int RunGroupsCommand(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "groups";
  spec.description =
      "Lists the groups the daemon hosts: world size, epoch, coordinator (multi-daemon\n"
      "groups), the ranks it hosts and those joined now, those whose session ended (DEPARTED:\n"
      "'left' called Leave, 'lost' lost its lease: the trainer went away), registered modules,\n"
      "and the status: OK, LEFT while a rank that left has not joined again (collectives fail\n"
      "until it does), or the sticky error of a group whose collectives failed.\n"
      "JSON: each group's \"ranks\" lists {rank, state} with state joined, left or lost.\n";
  return RunAdminCommand(spec, args, [](AdminCall& call) {
    return CallAndPrint(call, &v1::AdminService::Stub::ListGroups, v1::ListGroupsRequest(),
                        GroupsJson, PrintGroups);
  });
}

}  // namespace flatshard::cli

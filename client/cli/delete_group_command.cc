// `flatshardctl delete-group GROUP`: removes a group the daemon hosts, with its shards.

#include <iostream>

#include <nlohmann/json.hpp>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/admin_command.h"
#include "client/cli/admin_commands.h"

namespace flatshard::cli {
namespace {

void PrintDeleted(const v1::DeleteGroupResponse& r) {
  std::vector<std::string> modules;
  for (const std::string& m : r.modules()) modules.push_back(ModuleName(m));
  std::cout << "deleted group " << r.group() << ": "
            << (modules.empty() ? std::string("no registered modules")
                                : absl::StrCat("modules ", absl::StrJoin(modules, ",")))
            << ", " << r.freed_buffers() << " buffers, " << HumanBytes(r.freed_bytes())
            << " freed\n";
}

nlohmann::json DeletedJson(const v1::DeleteGroupResponse& r) {
  return {{"group", r.group()},
          {"modules", std::vector<std::string>(r.modules().begin(), r.modules().end())},
          {"freed_bytes", r.freed_bytes()},
          {"freed_buffers", r.freed_buffers()}};
}

}  // namespace

int RunDeleteGroupCommand(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "delete-group";
  spec.synopsis = "GROUP";
  spec.description =
      "Removes GROUP from the daemon with everything it holds there: registered modules,\n"
      "shards, gradient shards and kept buffers (their shared-memory segments go once no\n"
      "process maps them). Every rank must have left first; otherwise nothing changes and\n"
      "the error names the ranks still joined. Only the uid that owns the group, root or the\n"
      "daemon's uid may delete it. A group spread over several daemons is removed from the\n"
      "daemon asked: run it against each. Idle groups are also removed by the daemon itself\n"
      "after flatshardd --group_idle_timeout (1h by default).\n";
  spec.min_args = 1;
  spec.max_args = 1;
  spec.args_name = "GROUP";
  return RunAdminCommand(spec, args, [](AdminCall& call) {
    v1::DeleteGroupRequest request;
    request.set_group(call.args()[0]);
    return CallAndPrint(call, &v1::AdminService::Stub::DeleteGroup, request, DeletedJson,
                        PrintDeleted);
  });
}

}  // namespace flatshard::cli

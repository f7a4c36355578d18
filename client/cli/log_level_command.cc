// `flatshardctl log-level [LEVEL]`: set or show the daemon's log level.

#include <iostream>
#include <regex>

#include <nlohmann/json.hpp>
#include "absl/strings/str_cat.h"
#include "client/cli/admin_command.h"
#include "client/cli/admin_commands.h"

namespace flatshard::cli {

int RunLogLevelCommand(const std::vector<std::string>& args) {
  AdminCommandSpec spec;
  spec.name = "log-level";
  spec.synopsis = "[LEVEL]";
  spec.description =
      "Sets the daemon's log level from now on: error, warning, info, debug (info and\n"
      "verbose level 1) or v0..v9 (info and that verbose level). Without LEVEL, shows it.\n";
  spec.max_args = 1;
  spec.args_name = "LEVEL";
  auto validate = [](const AdminCall& call) -> std::string {
    static const std::regex kLevel("error|warning|warn|info|debug|v[0-9]", std::regex::icase);
    if (call.args().empty() || std::regex_match(call.args()[0], kLevel)) return "";
    return absl::StrCat("LEVEL must be error, warning, info, debug or v0..v9, got '",
                        call.args()[0], "'");
  };
  return RunAdminCommand(
      spec, args,
      [](AdminCall& call) {
        v1::SetLogLevelRequest request;
        if (!call.args().empty()) request.set_level(call.args()[0]);
        return CallAndPrint(
            call, &v1::AdminService::Stub::SetLogLevel, request,
            [](const v1::SetLogLevelResponse& r) -> nlohmann::json {
              return {{"previous", r.previous()}, {"level", r.level()}};
            },
            [&request](const v1::SetLogLevelResponse& r) {
              std::cout << "log level "
                        << (request.level().empty() ? r.level()
                                                    : absl::StrCat(r.previous(), " -> ", r.level()))
                        << "\n";
            });
      },
      validate);
}

}  // namespace flatshard::cli
